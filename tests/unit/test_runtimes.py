"""bcd.runtimes: what each container runtime release reads, the probe, and which holds each can use (tables)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from bcd.runtimes import (
    CDI_LIBRARIES,
    DEFAULT_SPEC_DIRS,
    NO_CDI,
    RUNTIME_NAMES,
    CdiReader,
    FakeRuntimes,
    HoldFiles,
    HoldUse,
    HostRuntimes,
    RuntimeFacts,
    cdi_reader,
    containerd_config,
    crio_config,
    docker_config,
    hold_use,
    hold_uses,
    parse_version,
    podman_config,
    run_version_command,
    same_dirs_of,
    upgrade_text,
)

# ---------------------------------------------------------------------------- cdi_reader

#: (runtime, version, CDI library ("" no CDI), highest cdiVersion read): both sides of every breakpoint.
READERS = [
    ("podman", "3.1.2", "", ""),
    ("podman", "3.2.0", "pre-release", "0.2.0"),
    ("podman", "4.0.3", "pre-release", "0.2.0"),
    ("podman", "4.1.0", "v0.4", "0.4.0"),
    ("podman", "4.2.1", "v0.4", "0.4.0"),
    ("podman", "4.3.0", "v0.5", "0.5.0"),
    ("podman", "4.6.2", "v0.5", "0.5.0"),
    ("podman", "4.7.0", "v0.6", "0.6.0"),
    ("podman", "5.0.3", "v0.6", "0.6.0"),
    ("podman", "5.1.0", "v0.7", "0.7.0"),
    ("podman", "5.1.2", "v0.7", "0.7.0"),
    ("podman", "5.2.0", "v0.8", "0.8.0"),
    ("podman", "5.4.2", "v0.8", "0.8.0"),
    ("podman", "5.5.0", "v1.0", "1.0.0"),
    ("podman", "5.6.1", "v1.0", "1.0.0"),
    ("docker", "24.0.9", "", ""),
    ("docker", "25.0.0", "v0.6", "0.6.0"),
    ("docker", "25.0.16", "v0.6", "0.6.0"),
    ("docker", "25.0.17", "v0.8", "0.8.0"),
    ("docker", "25.0.18", "v0.8", "0.8.0"),
    ("docker", "26.0.0", "v0.6", "0.6.0"),
    ("docker", "26.0.2", "v0.6", "0.6.0"),
    ("docker", "26.1.0", "v0.7", "0.7.0"),
    ("docker", "27.3.1", "v0.7", "0.7.0"),
    ("docker", "27.4.0", "v0.8", "0.8.0"),
    ("docker", "28.0.4", "v0.8", "0.8.0"),
    ("docker", "28.1.0", "v1.0", "1.0.0"),
    ("docker", "28.5.1", "v1.0", "1.0.0"),
    ("containerd", "1.6.20", "", ""),
    ("containerd", "1.7.0", "v0.5", "0.5.0"),
    ("containerd", "1.7.11", "v0.5", "0.5.0"),
    ("containerd", "1.7.12", "v0.6", "0.6.0"),
    ("containerd", "1.7.15", "v0.6", "0.6.0"),
    ("containerd", "1.7.16", "v0.7", "0.7.0"),
    ("containerd", "1.7.26", "v0.7", "0.7.0"),
    ("containerd", "1.7.27", "v0.8", "0.8.0"),
    ("containerd", "1.7.28", "v0.8", "0.8.0"),
    ("containerd", "2.0.0", "v0.8", "0.8.0"),
    ("containerd", "2.0.4", "v0.8", "0.8.0"),
    ("containerd", "2.0.5", "v1.0", "1.0.0"),
    ("containerd", "2.2.0", "v1.0", "1.0.0"),
    ("containerd", "2.2.1", "v1.1", "1.1.0"),
    ("crio", "1.23.5", "", ""),
    ("crio", "1.24.0", "v0.3", "0.3.0"),
    ("crio", "1.24.6", "v0.3", "0.3.0"),
    ("crio", "1.25.0", "v0.5", "0.5.0"),
    ("crio", "1.27.8", "v0.5", "0.5.0"),
    ("crio", "1.28.0", "v0.6", "0.6.0"),
    ("crio", "1.29.9", "v0.6", "0.6.0"),
    ("crio", "1.30.0", "v0.7", "0.7.0"),
    ("crio", "1.30.12", "v0.7", "0.7.0"),
    ("crio", "1.31.0", "v0.8", "0.8.0"),
    ("crio", "1.32.5", "v0.8", "0.8.0"),
    ("crio", "1.33.0", "v1.0", "1.0.0"),
    ("crio", "1.34.2", "v1.0", "1.0.0"),
    ("crio", "1.35.0", "v1.1", "1.1.0"),
]


@pytest.mark.parametrize(("runtime", "version", "library", "highest"), READERS, ids=[f"{r}-{v}" for r, v, _, _ in READERS])
def test_cdi_reader(runtime, version, library, highest):
    reader = cdi_reader(runtime, version)
    assert (reader.library, reader.highest) == (library, highest)
    assert reader.has_cdi == bool(library)
    if highest:
        assert reader.reads(highest) and not reader.reads(_next_minor(highest))
    assert not reader.reads(None) and not reader.reads("0.6") and not reader.reads("junk")


def _next_minor(v: str) -> str:
    major, minor, _ = (int(p) for p in v.split("."))
    return f"{major}.{minor + 1}.0"


def test_every_breakpoint_is_tested_from_both_sides():
    rows = {(r, v): lib for r, v, lib, _ in READERS}
    for runtime, table in CDI_LIBRARIES.items():
        previous = ""
        for first, lib in table:
            assert rows.get((runtime, first)) == lib, (runtime, first)
            below = [v for (r, v), got in rows.items() if r == runtime and parse_version(v) < parse_version(first)]
            last_below = max(below, key=parse_version)
            assert rows[(runtime, last_below)] == previous, (runtime, first, last_below)
            previous = lib
    assert set(CDI_LIBRARIES) == set(RUNTIME_NAMES)


def test_cdi_reader_texts_and_refusals():
    assert cdi_reader("podman", "4.3.1").text == "CDI library v0.5: reads cdiVersion <= 0.5.0"
    assert cdi_reader("podman", "3.4.4").text == "a pre-release CDI library: reads cdiVersion 0.1.0 and 0.2.0 only"
    assert cdi_reader("docker", "20.10.24") == NO_CDI and NO_CDI.text == "no CDI"
    # a pre-release library reads what bcd never writes
    assert not cdi_reader("podman", "4.0.0").reads("0.3.0") and cdi_reader("podman", "4.0.0").reads("0.2.0")
    with pytest.raises(ValueError, match="unknown runtime 'lxc'"):
        cdi_reader("lxc", "5.0.0")
    with pytest.raises(ValueError, match="not a version"):
        cdi_reader("podman", "latest")


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("podman version 4.3.1", (4, 3, 1)),
        ("20.10.24+dfsg1\n", (20, 10, 24)),
        ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3", (1, 6, 20)),
        ("containerd github.com/containerd/containerd/v2 v2.0.5 fb4c30d4", (2, 0, 5)),
        ("crio version 1.28.1\nVersion:  1.28.1\nGoVersion: go1.20.10", (1, 28, 1)),
        ("28.2", (28, 2, 0)),
        ("no version here", None),
        ("", None),
    ],
)
def test_parse_version(text, version):
    assert parse_version(text) == version


@pytest.mark.parametrize(
    ("runtime", "current", "cdi_version", "text"),
    [
        ("podman", "4.3.1", "0.6.0", "upgrade podman to 4.7.0 or later"),
        ("podman", "3.4.4", "0.3.0", "upgrade podman to 4.1.0 or later"),
        ("podman", "4.3.1", "0.7.0", "upgrade podman to 5.1.0 or later"),
        ("docker", "20.10.24", "0.3.0", "upgrade docker to 25.0.0 or later"),
        # docker 25.0.17 took v0.8, 26.0 went back to v0.6: the 25.0 line and the steady one
        ("docker", "25.0.5", "0.7.0", "upgrade docker to 25.0.17 (or 26.1.0 or later)"),
        ("docker", "25.0.5", "0.8.0", "upgrade docker to 25.0.17 (or 27.4.0 or later)"),
        ("docker", "26.0.1", "0.7.0", "upgrade docker to 26.1.0 or later"),
        ("containerd", "1.6.20", "0.3.0", "upgrade containerd to 1.7.0 or later"),
        ("containerd", "2.0.0", "1.1.0", "upgrade containerd to 2.2.1 or later"),
        ("crio", "1.24.0", "0.5.0", "upgrade crio to 1.25.0 or later"),
        ("podman", "5.5.0", "1.1.0", "no podman release reads cdiVersion 1.1.0 (from 5.5.0 on it reads <= 1.0.0)"),
    ],
)
def test_upgrade_text(runtime, current, cdi_version, text):
    assert upgrade_text(runtime, current, cdi_version) == text


# ---------------------------------------------------------------------------- config files


def test_docker_config():
    off = docker_config(None, "25.0.0")
    assert (off.cdi_enabled, off.spec_dirs, off.error) == (False, DEFAULT_SPEC_DIRS, "")
    assert off.cdi_switch == 'set "features": {"cdi": true} in /etc/docker/daemon.json'
    assert off.spec_dirs_setting == '"cdi-spec-dirs" in /etc/docker/daemon.json'
    assert docker_config(b'{"features": {"cdi": true}}', "25.0.0").cdi_enabled
    assert not docker_config(b'{"features": {"cdi": "yes"}}', "28.1.9").cdi_enabled
    # from 28.2 on it is on unless turned off
    assert docker_config(None, "28.2.0").cdi_enabled and docker_config(b"{}", "28.2.0").cdi_enabled
    assert not docker_config(b'{"features": {"cdi": false}}', "28.2.0").cdi_enabled
    assert docker_config(b'{"cdi-spec-dirs": ["/opt/cdi"]}', "28.2.0").spec_dirs == ("/opt/cdi",)
    bad = docker_config(b"{not json", "28.2.0")
    assert bad.error.startswith("/etc/docker/daemon.json: not JSON") and bad.spec_dirs == DEFAULT_SPEC_DIRS and bad.cdi_enabled
    assert docker_config(b"[]", "27.0.0").error == "/etc/docker/daemon.json: not a JSON object"


GRPC = '[plugins."io.containerd.grpc.v1.cri"]'
CRI_V1 = '[plugins."io.containerd.cri.v1.runtime"]'


def test_containerd_config():
    c17 = containerd_config(None, "1.7.12")
    assert (c17.cdi_enabled, c17.spec_dirs) == (False, DEFAULT_SPEC_DIRS)
    assert c17.cdi_switch == f"set enable_cdi = true under {GRPC} in /etc/containerd/config.toml"
    on = containerd_config(f'version = 2\n{GRPC}\n  enable_cdi = true\n  cdi_spec_dirs = ["/etc/cdi"]\n'.encode(), "1.7.12")
    assert (on.cdi_enabled, on.spec_dirs) == (True, ("/etc/cdi",))
    assert on.spec_dirs_setting == f"cdi_spec_dirs under {GRPC} in /etc/containerd/config.toml"
    # 2.x: on by default, its section is cri.v1.runtime (config version 3)
    c20 = containerd_config(None, "2.0.0")
    assert c20.cdi_enabled and c20.cdi_switch == f"set enable_cdi = true under {CRI_V1} in /etc/containerd/config.toml"
    assert not containerd_config(f"version = 3\n{CRI_V1}\n  enable_cdi = false\n".encode(), "2.1.0").cdi_enabled
    # a version 2 file on containerd 2: the old section, still read
    assert not containerd_config(f"version = 2\n{GRPC}\n  enable_cdi = false\n".encode(), "2.0.0").cdi_enabled
    # this host's Debian file: a CRI section without enable_cdi
    debian = f'version = 2\n[plugins]\n  {GRPC}\n    [plugins."io.containerd.grpc.v1.cri".cni]\n      bin_dir = "/usr/lib/cni"\n'
    assert not containerd_config(debian.encode(), "1.7.0").cdi_enabled
    assert containerd_config(b"version = [", "1.7.0").error.startswith("/etc/containerd/config.toml: not TOML")


def test_crio_config_drop_ins_override():
    assert crio_config([]).spec_dirs == DEFAULT_SPEC_DIRS
    files = [
        ("/etc/crio/crio.conf", b'[crio.runtime]\ncdi_spec_dirs = ["/etc/cdi"]\n'),
        ("/etc/crio/crio.conf.d/10-bcd.conf", b'[crio.runtime]\ncdi_spec_dirs = ["/etc/cdi", "/var/run/cdi", "/opt/cdi"]\n'),
        ("/etc/crio/crio.conf.d/20-other.conf", b"[crio.runtime]\nlog_level = 'info'\n"),
        ("/etc/crio/crio.conf.d/30-bad.conf", b"[crio"),
    ]
    c = crio_config(files)
    assert c.spec_dirs == ("/etc/cdi", "/var/run/cdi", "/opt/cdi") and c.cdi_enabled and c.cdi_switch == ""
    assert c.spec_dirs_setting == "cdi_spec_dirs under [crio.runtime] in /etc/crio/crio.conf.d/10-bcd.conf"
    assert c.error.startswith("/etc/crio/crio.conf.d/30-bad.conf: not TOML")


def test_podman_reads_cdi_spec_dirs_from_containers_conf_only_from_5_3():
    files = [("/etc/containers/containers.conf", b'[engine]\ncdi_spec_dirs = ["/opt/cdi"]\n')]
    old = podman_config(files, "5.2.5")
    assert (old.spec_dirs, old.spec_dirs_setting, old.cdi_enabled) == (DEFAULT_SPEC_DIRS, "", True)
    new = podman_config(files, "5.3.0")
    assert new.spec_dirs == ("/opt/cdi",)
    assert new.spec_dirs_setting == "cdi_spec_dirs under [engine] in /etc/containers/containers.conf"
    assert podman_config([], "5.3.0").spec_dirs == DEFAULT_SPEC_DIRS


# ---------------------------------------------------------------------------- which holds each can use

ETC, RUN = DEFAULT_SPEC_DIRS
DAEMON_JSON = '"cdi-spec-dirs" in /etc/docker/daemon.json'
DOCKER_ON = 'set "features": {"cdi": true} in /etc/docker/daemon.json'
CONTAINERD_ON = f"set enable_cdi = true under {GRPC} in /etc/containerd/config.toml"
CRIO_DIRS = "cdi_spec_dirs under [crio.runtime] in /etc/crio/crio.conf"
PODMAN_DIRS = "cdi_spec_dirs under [engine] in /etc/containers/containers.conf"


def podman(version: str = "4.3.1", **kw) -> RuntimeFacts:
    if parse_version(version) >= (5, 3, 0):
        kw.setdefault("spec_dirs_setting", PODMAN_DIRS)
    return RuntimeFacts("podman", "/usr/bin/podman", version, **kw)


def docker(version: str = "28.2.0", **kw) -> RuntimeFacts:
    return RuntimeFacts("docker", "/usr/bin/docker", version, spec_dirs_setting=DAEMON_JSON, cdi_switch=DOCKER_ON, **kw)


def containerd(version: str = "2.0.0", **kw) -> RuntimeFacts:
    return RuntimeFacts(
        "containerd", "/usr/bin/containerd", version, spec_dirs_setting=f"cdi_spec_dirs under {GRPC} in /etc/containerd/config.toml", cdi_switch=CONTAINERD_ON, **kw
    )


def crio(version: str = "1.28.0", **kw) -> RuntimeFacts:
    return RuntimeFacts("crio", "/usr/bin/crio", version, spec_dirs_setting=CRIO_DIRS, **kw)


def files(spec: str = "0.6.0", copy: str | None = "0.3.0", spec_dir: str = ETC, copy_dir: str | None = RUN) -> HoldFiles:
    return HoldFiles(
        allocation_id="a1",
        spec_file=f"{spec_dir}/bcd-a1.json",
        spec_version=spec,
        copy_file=f"{copy_dir}/bcd-a1.json" if copy_dir else "",
        copy_version=copy if copy_dir else None,
    )


SPEC_FILE, COPY_FILE = f"{ETC}/bcd-a1.json", f"{RUN}/bcd-a1.json"
MISSING = f"its consumer copy {COPY_FILE} is missing (the converger writes it beside the hold spec: is it running this bcd?)"
NO_COPIES = (
    "the node wrote no consumer copy of it (its node.json names no cdi_consumer_dir: a node from before them; "
    "restart it with this bcd) so {rt} sees only /etc/cdi/bcd-a1.json (cdiVersion 0.6.0)"
)
MAKE_RUN = (
    "the node's CDI dirs (state/cdi, state/run/cdi) are not dirs {rt} reads (/etc/cdi, /var/run/cdi{only}); "
    "`make run` keeps them under state/: run the converger with --cdi-dir /etc/cdi --cdi-consumer-dir /var/run/cdi"
)

#: (name, runtime, hold files, usable, file it takes the devices from, what to do)
USES = [
    # the copy is for exactly this: a v0.5 library skips the hold spec (0.6.0) and reads the copy
    ("podman-4.3-reads-the-copy", podman(), files(), True, COPY_FILE, ""),
    # both parse: /var/run/cdi ranks above /etc/cdi, so the copy's devices win
    ("podman-5.5-both-parse-the-copy-wins", podman("5.5.0"), files(), True, COPY_FILE, ""),
    # a runtime that ranks /etc/cdi higher takes the hold spec when it parses it ...
    ("reversed-dirs-spec-wins", containerd(spec_dirs=(RUN, ETC)), files(), True, SPEC_FILE, ""),
    # ... and the copy when it cannot: a file that fails to parse is skipped, the others still load
    ("reversed-dirs-old-library", containerd("1.7.0", cdi_enabled=True, spec_dirs=(RUN, ETC)), files(), True, COPY_FILE, ""),
    ("crio-1.28-reads-the-spec-in-etc-only", crio(spec_dirs=(ETC,)), files(), True, SPEC_FILE, ""),
    ("hostPath-copy-0.5.0", crio("1.25.0"), files(copy="0.5.0"), True, COPY_FILE, ""),
    ("hostPath-copy-on-a-v0.3-library", crio("1.24.0"), files(copy="0.5.0"), False, "", "upgrade crio to 1.25.0 or later"),
    ("podman-4.3-copy-missing", podman(), files(copy=None), False, "", f"{MISSING}; or upgrade podman to 4.7.0 or later"),
    ("podman-4.3-node-from-before-copies", podman(), files(copy_dir=None), False, "", NO_COPIES.format(rt="podman 4.3.1") + "; or upgrade podman to 4.7.0 or later"),
    # additionalGids: both files need 0.7.0
    ("additional-gids-needs-0.7", podman(), files(spec="0.7.0", copy="0.7.0"), False, "", "upgrade podman to 5.1.0 or later"),
    ("podman-pre-release-library", podman("3.4.4"), files(), False, "", "upgrade podman to 4.1.0 or later"),
    ("podman-without-cdi", podman("3.1.0"), files(), False, "", "podman 3.1.0 has no CDI: upgrade podman to 4.1.0 or later"),
    ("docker-20-no-cdi", docker("20.10.24", cdi_enabled=False), files(), False, "", f"docker 20.10.24 has no CDI: upgrade docker to 25.0.0 or later and {DOCKER_ON}"),
    ("containerd-1.6-no-cdi", containerd("1.6.20", cdi_enabled=False), files(), False, "", f"containerd 1.6.20 has no CDI: upgrade containerd to 1.7.0 or later and {CONTAINERD_ON}"),
    ("docker-25-cdi-off", docker("25.0.3", cdi_enabled=False), files(), False, "", f"CDI is off in docker 25.0.3: {DOCKER_ON} and restart dockerd"),
    ("containerd-1.7-cdi-off", containerd("1.7.12", cdi_enabled=False), files(), False, "", f"CDI is off in containerd 1.7.12: {CONTAINERD_ON} and restart containerd"),
    ("crio-1.25-copy-dir-not-read", crio("1.25.0", spec_dirs=(ETC,)), files(), False, "", f"add /var/run/cdi to {CRIO_DIRS} and restart crio; or upgrade crio to 1.28.0 or later"),
    ("docker-neither-dir-read", docker(spec_dirs=("/opt/cdi",)), files(), False, "", f"add /var/run/cdi to {DAEMON_JSON} and restart dockerd"),
    ("podman-5.3-neither-dir-read", podman("5.3.0", spec_dirs=("/opt/cdi",)), files(), False, "", f"add /var/run/cdi to {PODMAN_DIRS}"),
    (
        "make-run-podman-4.3",
        podman(),
        files(spec_dir="state/cdi", copy_dir="state/run/cdi"),
        False,
        "",
        MAKE_RUN.format(rt="podman 4.3.1", only="; before 5.3.0 podman reads no others"),
    ),
    (
        "make-run-docker",
        docker(),
        files(spec_dir="state/cdi", copy_dir="state/run/cdi"),
        False,
        "",
        MAKE_RUN.format(rt="docker 28.2.0", only="") + f", or add state/run/cdi to {DAEMON_JSON} and restart dockerd",
    ),
    (
        "version-unknown",
        RuntimeFacts("docker", "/usr/bin/docker", error="`docker version` failed (exit 1): Cannot connect to the Docker daemon"),
        files(),
        None,
        "",
        "cannot tell whether docker can use it: `docker version` failed (exit 1): Cannot connect to the Docker daemon",
    ),
]


@pytest.mark.parametrize(("name", "rt", "hold", "usable", "file", "todo"), USES, ids=[u[0] for u in USES])
def test_hold_use(name, rt, hold, usable, file, todo):
    assert hold_use(rt, hold) == HoldUse(rt.name, "a1", usable, file=file, todo=todo)


def test_nothing_to_do_every_runtime_uses_every_hold():
    runtimes = [podman("5.5.0"), podman(), docker(), docker("25.0.0", cdi_enabled=True), containerd(), containerd("1.7.0", cdi_enabled=True), crio(), crio("1.25.0")]
    holds = [
        files(),
        files(copy="0.5.0"),  # a vendor device node with hostPath
        HoldFiles("a2", f"{ETC}/bcd-a2.json", "0.6.0", f"{RUN}/bcd-a2.json", "0.3.0"),
    ]
    uses = hold_uses(runtimes, holds)
    assert len(uses) == len(runtimes) * len(holds)
    assert [u for u in uses if not u.usable] == []
    assert all(u.todo == "" and u.file for u in uses)


def test_two_spellings_of_one_dir_match_through_same_dirs():
    rt = containerd(spec_dirs=("/etc/cdi", "/run/cdi"))
    hold = files(copy="0.3.0")
    assert hold_use(rt, hold).file == SPEC_FILE  # /var/run/cdi is not /run/cdi by name
    same = {"/var/run/cdi": "/run/cdi", "/run/cdi": "/run/cdi", "/etc/cdi": "/etc/cdi"}
    assert hold_use(rt, hold, same).file == COPY_FILE


def test_same_dirs_of_resolves_symlinks(tmp_path: Path):
    (tmp_path / "run" / "cdi").mkdir(parents=True)
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to(tmp_path / "run")
    rt = RuntimeFacts("podman", version="4.3.1", spec_dirs=(str(tmp_path / "run" / "cdi"),))
    hold = HoldFiles("a1", f"{tmp_path}/etc/bcd-a1.json", "0.6.0", f"{tmp_path}/var/run/cdi/bcd-a1.json", "0.3.0")
    same = same_dirs_of([rt], [hold])
    assert same[str(tmp_path / "var" / "run" / "cdi")] == os.path.realpath(tmp_path / "run" / "cdi")
    assert hold_use(rt, hold, same).usable is True
    assert hold_use(rt, hold).usable is False


def test_describe():
    assert podman().describe() == "podman 4.3.1 (CDI library v0.5: reads cdiVersion <= 0.5.0; dirs /etc/cdi, /var/run/cdi)"
    assert docker("20.10.24").describe() == "docker 20.10.24 (no CDI: it came in docker 25.0.0)"
    assert docker("25.0.1", cdi_enabled=False).describe() == "docker 25.0.1 (CDI library v0.6: reads cdiVersion <= 0.6.0; CDI is off; dirs /etc/cdi, /var/run/cdi)"
    assert RuntimeFacts("crio", error="why").describe() == "crio (version unknown: why)"
    assert FakeRuntimes([podman()]).find() == [podman()]
    assert isinstance(podman().reader, CdiReader)


# ---------------------------------------------------------------------------- the real probe, on fake executables


def executable(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_host_runtimes_on_fake_executables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CONTAINERS_CONF", raising=False)
    bin_dir, root = tmp_path / "bin", tmp_path / "root"
    bin_dir.mkdir()
    executable(bin_dir, "podman", 'echo "podman version 5.4.0"')
    executable(bin_dir, "docker", 'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2; exit 1')
    executable(bin_dir, "containerd", 'echo "containerd github.com/containerd/containerd/v2 v2.0.5 fb4c30d4"')
    # never answers, and a child of it holds the pipe too: killed whole after the timeout
    executable(bin_dir, "crio", "tail -f /dev/null &\nwait")
    (root / "etc" / "containers" / "containers.conf.d").mkdir(parents=True)
    (root / "etc" / "containers" / "containers.conf").write_text('[engine]\ncdi_spec_dirs = ["/etc/cdi"]\n')
    (root / "etc" / "containers" / "containers.conf.d" / "bcd.conf").write_text('[engine]\ncdi_spec_dirs = ["/etc/cdi", "/var/run/cdi", "/opt/cdi"]\n')
    (root / "etc" / "containerd").mkdir(parents=True)
    (root / "etc" / "containerd" / "config.toml").write_text(f"version = 3\n{CRI_V1}\n  enable_cdi = false\n")
    found = {r.name: r for r in HostRuntimes(path=str(bin_dir), root=root, timeout_s=0.5).find()}
    assert list(found) == ["podman", "docker", "containerd", "crio"]
    pm = found["podman"]
    assert (pm.path, pm.version, pm.error) == (str(bin_dir / "podman"), "5.4.0", "")
    assert pm.spec_dirs == ("/etc/cdi", "/var/run/cdi", "/opt/cdi")
    assert pm.spec_dirs_setting == "cdi_spec_dirs under [engine] in /etc/containers/containers.conf.d/bcd.conf"
    dk = found["docker"]
    assert dk.version == "" and dk.error == (
        f"`{bin_dir / 'docker'} version --format '{{{{.Server.Version}}}}'` failed (exit 1): "
        "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
    )
    ctd = found["containerd"]
    assert (ctd.version, ctd.cdi_enabled) == ("2.0.5", False)
    assert found["crio"].version == "" and found["crio"].error == f"`{bin_dir / 'crio'} --version` did not answer within 0.5 s"


def test_host_runtimes_finds_nothing_on_an_empty_path(tmp_path: Path):
    assert HostRuntimes(path=str(tmp_path), root=tmp_path).find() == []


def test_a_version_command_that_says_no_version(tmp_path: Path):
    executable(tmp_path, "podman", 'echo "hello"')
    (rt,) = HostRuntimes(path=str(tmp_path), root=tmp_path).find()
    assert rt.version == "" and rt.error == f"`{tmp_path / 'podman'} --version` said 'hello': no version in it"
    assert run_version_command([str(tmp_path / "missing")])[1].startswith(f"`{tmp_path / 'missing'}` could not start")


# ---------------------------------------------------------------------------- the real podman


def test_the_real_podman():
    """This host's podman (4.3.1 here: CDI library v0.5, reads <= 0.5.0, only /etc/cdi and /var/run/cdi)."""
    exe = shutil.which("podman")
    if exe is None:
        if os.environ.get("BCD_PODMAN_REQUIRED") == "1":
            pytest.fail("BCD_PODMAN_REQUIRED=1 but no podman on PATH")
        pytest.skip("no podman on PATH (set BCD_PODMAN_REQUIRED=1 to make this a failure)")
    said = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", said)
    assert m is not None, said
    found = {r.name: r for r in HostRuntimes().find()}
    pm = found["podman"]
    assert (pm.path, pm.error, pm.version) == (exe, "", m[0])
    assert pm.cdi_enabled
    if parse_version(pm.version) < (5, 3, 0):
        assert pm.spec_dirs == ("/etc/cdi", "/var/run/cdi") and pm.spec_dirs_setting == ""
    if pm.version != "4.3.1":
        assert pm.reader == cdi_reader("podman", m[0])
        return
    # this project's host: the podman the consumer copy is for
    assert (pm.reader.library, pm.reader.highest) == ("v0.5", "0.5.0")
    manager = subprocess.run([exe, "info", "--format", "{{.Host.CgroupManager}}"], capture_output=True, text=True, timeout=60).stdout.strip()
    assert pm.cgroup_manager == manager
    assert pm.describe() == f"podman 4.3.1 (CDI library v0.5: reads cdiVersion <= 0.5.0; dirs /etc/cdi, /var/run/cdi; cgroup manager {manager})"
    assert hold_use(pm, files()) == HoldUse("podman", "a1", True, file=COPY_FILE)
    assert hold_use(pm, files(copy=None)).usable is False
