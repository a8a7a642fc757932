"""The env file survives its consumers: every line of `<run_dir>/allocations/<id>.env`
is read to the same value by

* a shell sourcing it: `. file` in sh (dash here) and bash, run for real;
* `docker run --env-file`: run for real against the machine's Docker engine with an
  image built here from a static binary (skipped, with the reason, without an engine
  or a C compiler); and, everywhere, a port of the docker CLI's parser
  (github.com/docker/cli pkg/kvfile/kvfile.go `parseKeyValueFile`, formerly
  opts/envfile.go: leading whitespace and `#` lines skipped, the value is what
  follows the first `=`, kept as written; newer releases also drop one pair of
  matching surrounding quotes, `trimQuotes`: both variants are checked);
* systemd's `EnvironmentFile=`: a port of `parse_env_file_internal` and
  `load_env_file_push` (github.com/systemd/systemd src/basic/env-file.c), the
  parser PID 1 uses for it; no systemd is started for this.

The three disagree on quotes, backslashes, `$` and whitespace, so bcd writes no value
holding them (shared.schemas.common.env_value_problem): its own values are ids, the
slice name (a `-` of the id spelled `.`), uuids and a path, and a spec's env value
with one of them is refused when the spec is decoded. The tests below show both
halves: what bcd writes reads alike everywhere, and each refused character really is
read differently by at least one consumer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid as uuidlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.holdfiles import HoldContent, HoldDevice, env_lines, render_env_file
from shared.schemas import NODE_SPEC_CODEC, BadMessage, Limits
from shared.schemas.common import ENV_VALUE_SPECIAL, env_value_problem
from shared.slices import legacy_slice_name, slice_name

SHELLS = [s for s in ("sh", "dash", "bash") if shutil.which(s)]

# ------------------------------------------------------------------ docker's parser, ported


def docker_env_file(data: bytes, *, trim_quotes: bool = False) -> dict[str, str]:
    """docker/cli `parseKeyValueFile` (no lookup function): KEY=VALUE per line, the value as is."""
    text = data.decode("utf-8")  # docker refuses a file that is not UTF-8
    out: dict[str, str] = {}
    for n, raw in enumerate(text.split("\n")):  # bufio.ScanLines: split on \n, drop one trailing \r
        raw = raw.removesuffix("\r")
        if n == 0:
            raw = raw.removeprefix("\ufeff")
        line = raw.lstrip()  # strings.TrimLeftFunc(line, unicode.IsSpace)
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not key:
            raise ValueError(f"no variable name on line {line!r}")
        if " " in key or "\t" in key:
            raise ValueError(f"variable {key!r} contains whitespaces")
        if not sep:
            continue  # looked up in the caller's environment: not ours
        if trim_quotes and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


# ------------------------------------------------------------------ systemd's parser, ported

_WHITESPACE = " \t\n\r"
_NEWLINE = "\n\r"
_COMMENTS = "#;"
_SHELL_NEED_ESCAPE = '"\\`$'


def systemd_env_file(data: bytes) -> dict[str, str]:
    """src/basic/env-file.c `parse_env_file_internal` + `load_env_file_push` (what
    `EnvironmentFile=` gets): the state machine character by character."""
    text = data.decode("utf-8", errors="surrogateescape")
    out: dict[str, str] = {}
    state = "PRE_KEY"
    key: list[str] = []
    value: list[str] | None = None
    last_key_ws: int | None = None
    last_value_ws: int | None = None

    def push() -> None:
        k = "".join(key[:last_key_ws] if last_key_ws is not None else key)
        v = "" if value is None else "".join(value)
        try:
            (k + v).encode("utf-8")
        except UnicodeEncodeError:
            return  # "invalid UTF-8 ..., ignoring"
        out[k] = v  # strv_env_replace_consume: a later line wins

    for c in text:
        if state == "PRE_KEY":
            if c in _COMMENTS:
                state = "COMMENT"
            elif c not in _WHITESPACE:
                state, last_key_ws, key = "KEY", None, [c]
        elif state == "KEY":
            if c in _NEWLINE:
                state, key = "PRE_KEY", []
            elif c == "=":
                state, last_value_ws = "PRE_VALUE", None
            else:
                if c not in _WHITESPACE:
                    last_key_ws = None
                elif last_key_ws is None:
                    last_key_ws = len(key)
                key.append(c)
        elif state == "PRE_VALUE":
            if c in _NEWLINE:
                push()
                state, key, value = "PRE_KEY", [], None
            elif c == "'":
                state = "SINGLE_QUOTE_VALUE"
            elif c == '"':
                state = "DOUBLE_QUOTE_VALUE"
            elif c == "\\":
                state = "VALUE_ESCAPE"
            elif c not in _WHITESPACE:
                state = "VALUE"
                value = (value or []) + [c]
        elif state == "VALUE":
            if c in _NEWLINE:
                if last_value_ws is not None and value is not None:
                    del value[last_value_ws:]  # chomp trailing whitespace
                push()
                state, key, value = "PRE_KEY", [], None
            elif c == "\\":
                state, last_value_ws = "VALUE_ESCAPE", None
            else:
                if c not in _WHITESPACE:
                    last_value_ws = None
                elif last_value_ws is None:
                    last_value_ws = len(value or [])
                value = (value or []) + [c]
        elif state == "VALUE_ESCAPE":
            state = "VALUE"
            if c not in _NEWLINE:
                value = (value or []) + [c]
        elif state == "SINGLE_QUOTE_VALUE":
            if c == "'":
                state = "PRE_VALUE"
            else:
                value = (value or []) + [c]
        elif state == "DOUBLE_QUOTE_VALUE":
            if c == '"':
                state = "PRE_VALUE"
            elif c == "\\":
                state = "DOUBLE_QUOTE_VALUE_ESCAPE"
            else:
                value = (value or []) + [c]
        elif state == "DOUBLE_QUOTE_VALUE_ESCAPE":
            state = "DOUBLE_QUOTE_VALUE"
            if c in _SHELL_NEED_ESCAPE:
                value = (value or []) + [c]
            elif c != "\n":
                value = (value or []) + ["\\", c]
        elif state == "COMMENT":
            if c == "\\":
                state = "COMMENT_ESCAPE"
            elif c in _NEWLINE:
                state = "PRE_KEY"
        elif state == "COMMENT_ESCAPE":
            state = "PRE_KEY" if c in _NEWLINE else "COMMENT"
    if state in ("PRE_VALUE", "VALUE", "VALUE_ESCAPE", "SINGLE_QUOTE_VALUE", "DOUBLE_QUOTE_VALUE", "DOUBLE_QUOTE_VALUE_ESCAPE"):
        if state == "VALUE" and last_value_ws is not None and value is not None:
            del value[last_value_ws:]
        push()
    return out


def test_the_ports_read_as_their_sources_say() -> None:
    """The behaviour each port was written from, so a slip in a port shows here."""
    data = b'A=plain\nB="x y"\nC=\'q\'\nD=a\\x2d\nE= lead and trail  \n# c\n;c\nF=\nG=#h\n'
    assert systemd_env_file(data) == {"A": "plain", "B": "x y", "C": "q", "D": "ax2d", "E": "lead and trail", "F": "", "G": "#h"}
    # docker: ";c" has no "=" (looked up in the caller's environment, not ours)
    assert docker_env_file(data) == {"A": "plain", "B": '"x y"', "C": "'q'", "D": "a\\x2d", "E": " lead and trail  ", "F": "", "G": "#h"}
    assert docker_env_file(data, trim_quotes=True)["B"] == "x y"
    assert systemd_env_file(b'A="a\\$b\\qc"\n') == {"A": "a$b\\qc"}


# ------------------------------------------------------------------ the real consumers


def shell_env_file(shell: str, path: Path, keys: list[str]) -> dict[str, str]:
    """`. file` in `shell`, then each key's value, NUL-separated (a value may hold anything)."""
    script = '. "$1"; shift; for k in "$@"; do eval "printf \'%s\\0\' \\"\\${$k}\\""; done'
    # in the file's directory, with nothing on PATH (printf and eval are builtins): a refused
    # value such as `a>b` makes the shell create `b`, and `a;b` would run a command `b`
    out = subprocess.run(
        [shutil.which(shell) or shell, "-c", script, shell, str(path), *keys],
        capture_output=True, timeout=20, cwd=path.parent, env={"PATH": str(path.parent), "HOME": "/nonexistent-home"},
    )
    assert out.returncode == 0, out.stderr
    values = out.stdout.decode("utf-8", errors="surrogateescape").split("\0")[:-1]
    return dict(zip(keys, values, strict=True))


PRINTENV_C = r"""
#include <stdio.h>
extern char **environ;
int main(void) { for (char **e = environ; *e; e++) { fputs(*e, stdout); putchar(0); } return 0; }
"""


@pytest.fixture(scope="module")
def docker_image(tmp_path_factory) -> str:
    """A one-binary image built here (static printenv), as DESIGN 9 wants images built on the machine."""
    docker, cc = shutil.which("docker"), shutil.which("cc") or shutil.which("gcc")
    if docker is None:
        pytest.skip("no docker client: docker run --env-file is checked through the port of its parser only")
    if cc is None:
        pytest.skip("no C compiler to build the static probe binary for the image")
    try:
        info = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.skip("the Docker engine does not answer")
    if info.returncode != 0:
        pytest.skip(f"no Docker engine: {info.stderr.strip()[:200]}")
    d = tmp_path_factory.mktemp("envprobe")
    (d / "printenv.c").write_text(PRINTENV_C)
    build = subprocess.run([cc, "-static", "-O2", "-o", str(d / "printenv"), str(d / "printenv.c")], capture_output=True, text=True, timeout=120)
    if build.returncode != 0:
        pytest.skip(f"cannot build a static binary (no static libc?): {build.stderr.strip()[:200]}")
    subprocess.run(["tar", "-C", str(d), "-cf", str(d / "rootfs.tar"), "printenv"], check=True, timeout=30)
    tag = f"bcd-envprobe:{uuidlib.uuid4().hex[:12]}"
    subprocess.run([docker, "import", str(d / "rootfs.tar"), tag], check=True, capture_output=True, timeout=60)
    yield tag
    subprocess.run([docker, "rmi", "-f", tag], capture_output=True, timeout=60)


def docker_run_env_file(image: str, path: Path) -> dict[str, str]:
    out = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--env-file", str(path), image, "/printenv"],
        capture_output=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    pairs = [e.split("=", 1) for e in out.stdout.decode().split("\0") if e]
    return {k: v for k, v in pairs if k not in ("PATH", "HOSTNAME", "HOME")}


# ------------------------------------------------------------------ what bcd writes

GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
SPEC_ENV = ("JOB_NAME=train-01", "MIXED=ünïcode,#hash,a~b,x=y:z/@%+^!*?[]{}", "HASH=#not-a-comment", "EMPTY=", "URL=https://h:8/~u/p?q=1")


def holds() -> list[HoldContent]:
    sliced = HoldContent(
        allocation_id="train-01", reservation_id="rsv-train-01", generation=3, binding="BINDING_HOLD",
        devices=(HoldDevice.for_gpu(GPU0, 0),), cgroup_parent=slice_name("train-01"), env=SPEC_ENV,
        limits=Limits(cpus="0-15", memory_bytes=1 << 30),
    )
    slots = HoldContent(
        allocation_id="infer--slots-", reservation_id="rsv_infer", generation=1, binding="BINDING_KUBERNETES",
        devices=(HoldDevice.for_slot(GPU0, 0, 0), HoldDevice.for_slot(GPU0, 0, 1)), mps_pipe_dir="/run/nvidia-mps/pipe_0",
    )
    return [sliced, slots]


def expected(hold: HoldContent) -> dict[str, str]:
    return dict(line.split("=", 1) for line in env_lines(hold))


@pytest.mark.parametrize("hold", holds(), ids=lambda h: h.allocation_id)
def test_every_line_reads_the_same_to_the_ports(hold: HoldContent) -> None:
    data = render_env_file(hold)
    want = expected(hold)
    assert systemd_env_file(data) == want
    assert docker_env_file(data) == want
    assert docker_env_file(data, trim_quotes=True) == want
    if hold.cgroup_parent:
        assert want["BCD_CGROUP_PARENT"] == "bcd-alloc-train.01.slice"


@pytest.mark.skipif(not SHELLS, reason="no POSIX shell on this machine")
@pytest.mark.parametrize("hold", holds(), ids=lambda h: h.allocation_id)
@pytest.mark.parametrize("shell", SHELLS or ["sh"])
def test_every_line_reads_the_same_to_a_shell_sourcing_it(tmp_path: Path, hold: HoldContent, shell: str) -> None:
    path = tmp_path / f"{hold.allocation_id}.env"
    path.write_bytes(render_env_file(hold))
    want = expected(hold)
    assert shell_env_file(shell, path, list(want)) == want


@pytest.mark.parametrize("hold", holds(), ids=lambda h: h.allocation_id)
def test_every_line_reads_the_same_to_docker_run_env_file(tmp_path: Path, hold: HoldContent, docker_image: str) -> None:
    path = tmp_path / f"{hold.allocation_id}.env"
    path.write_bytes(render_env_file(hold))
    assert docker_run_env_file(docker_image, path) == expected(hold)


def test_the_legacy_slice_name_is_what_broke(tmp_path: Path) -> None:
    """Why the slice name changed: `\\x2d` is read three ways (shell, docker, systemd)."""
    path = tmp_path / "old.env"
    path.write_text(f"BCD_CGROUP_PARENT={legacy_slice_name('train-01')}\n")
    shell = shell_env_file(SHELLS[0], path, ["BCD_CGROUP_PARENT"])["BCD_CGROUP_PARENT"] if SHELLS else "bcd-alloc-trainx2d01.slice"
    assert shell == "bcd-alloc-trainx2d01.slice"
    assert systemd_env_file(path.read_bytes())["BCD_CGROUP_PARENT"] == "bcd-alloc-trainx2d01.slice"
    assert docker_env_file(path.read_bytes())["BCD_CGROUP_PARENT"] == "bcd-alloc-train\\x2d01.slice"


# ------------------------------------------------------------------ what a spec may carry

_safe_values = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=30).filter(
    lambda v: not env_value_problem(v)
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_safe_values, min_size=1, max_size=8))
def test_any_value_a_spec_may_carry_reads_the_same_everywhere(tmp_path_factory, values: list[str]) -> None:
    env = tuple(f"V{i}={v}" for i, v in enumerate(values))
    hold = HoldContent(
        allocation_id="a-1", reservation_id="r", generation=1, binding="BINDING_HOLD",
        devices=(HoldDevice.for_gpu(GPU0, 0),), cgroup_parent=slice_name("a-1"), env=env, limits=Limits(cpus="0"),
    )
    data = render_env_file(hold)
    want = expected(hold)
    assert systemd_env_file(data) == want
    assert docker_env_file(data) == want == docker_env_file(data, trim_quotes=True)
    path = tmp_path_factory.mktemp("env") / "a-1.env"
    path.write_bytes(data)
    for shell in SHELLS:
        assert shell_env_file(shell, path, list(want)) == want


def _readers_disagree(tmp_path: Path, value: str) -> bool:
    path = tmp_path / "x.env"
    data = f"X={value}\nY=after\n".encode()
    path.write_bytes(data)
    seen = [systemd_env_file(data).get("X"), docker_env_file(data).get("X"), docker_env_file(data, trim_quotes=True).get("X")]
    for shell in SHELLS:
        try:
            got = shell_env_file(shell, path, ["X", "Y"])
            seen.append(got["X"] if got["Y"] == "after" else None)
        except AssertionError:  # the shell failed on the file: not read as written either
            seen.append(None)
    return any(s != value for s in seen)


@pytest.mark.parametrize("ch", sorted(ENV_VALUE_SPECIAL), ids=repr)
def test_each_refused_character_is_read_differently_by_some_consumer(tmp_path: Path, ch: str) -> None:
    # the character inside, first and last in a value: the decoder refuses them all
    for value in (f"a{ch}b", f"{ch}ab", f"ab{ch}", f"{ch}ab{ch}"):
        assert env_value_problem(value)
    assert any(_readers_disagree(tmp_path, v) for v in (f"a{ch}b", f"{ch}ab", f"ab{ch}", f"{ch}ab{ch}"))


@pytest.mark.skipif(not SHELLS, reason="no POSIX shell on this machine")
@pytest.mark.parametrize("value", ["~", "~/x", "a:~/x", "~root"])
def test_a_tilde_a_shell_expands_is_refused(tmp_path: Path, value: str) -> None:
    assert env_value_problem(value)
    assert _readers_disagree(tmp_path, value)


@pytest.mark.parametrize(
    ("line", "text"),
    [
        ("JAVA_OPTS=-Xmx1g -Xms1g", "holds a space"),
        ('A="quoted"', "holds a double quote"),
        ("A='quoted'", "holds a single quote"),
        ("A=a\\x2db", "holds a backslash"),
        ("A=$HOME", "holds '$'"),
        ("A=`id`", "holds a backtick"),
        ("A=x;reboot", "holds ';'"),
        ("A=~/bin", "expands to a home directory"),
        ("PATH_X=/a:~/b", "expands to a home directory"),
    ],
)
def test_a_spec_with_a_value_the_consumers_disagree_on_is_refused_with_a_clear_message(line: str, text: str) -> None:
    spec = {"node_id": "n1", "generation": 1, "devices": [{"allocation_id": "a1", "reservation_id": "r1", "binding": "BINDING_HOLD", "devices": [GPU0], "env": [line]}]}
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(json.dumps(spec))
    message = str(exc.value)
    assert message.startswith(f"{line.split('=', 1)[0]}: the value") and text in message
    assert message.endswith("- at `$.devices[0].env[0]`"), message
    assert "regex" not in message


def test_a_spec_with_values_every_consumer_reads_alike_decodes() -> None:
    spec = {"node_id": "n1", "generation": 1, "devices": [{"allocation_id": "a1", "reservation_id": "r1", "binding": "BINDING_HOLD", "devices": [GPU0], "env": list(SPEC_ENV)}]}
    assert NODE_SPEC_CODEC.decode(json.dumps(spec)).devices[0].env == list(SPEC_ENV)


def test_bcd_refuses_to_write_a_host_value_the_consumers_disagree_on() -> None:
    """The MPS pipe directory comes from host config: one with a space cannot become an env line."""
    with pytest.raises(ValueError, match="holds a space"):
        HoldContent(
            allocation_id="s", reservation_id="r", generation=1, binding="BINDING_HOLD",
            devices=(HoldDevice.for_slot(GPU0, 0, 0),), mps_pipe_dir="/run/my mps",
        )
