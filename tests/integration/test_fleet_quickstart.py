"""The README's fleet quick start, run as written: an upstream nats-server with JetStream
(`bcd fleet upstream`), the control plane as its own program (`bcd-controlplane serve`),
two nodes each with its own upstream nkey and client certificate (`bcd fleet add-node`,
`bcd up --upstream tls://... --upstream-ca ...`), all of it over mutual TLS with the fleet's
own CA (`bcd fleet init`), a spec put for each (`bcd-controlplane put`) and the fleet's verified events
(`bcd fleet events`).

The commands are read from the README block between `<!-- fleet-quickstart:begin -->`
and `<!-- fleet-quickstart:end -->` and run one by one in a temporary directory, with
three substitutions only: `.venv/bin/` is this interpreter's bin directory, `examples/`
the repository's, and the port 4333 a free one. A line ending in `&` is started in the
background and the test waits until it is ready (the upstream accepts connections,
the control plane logged `started`, a node's services answer) before the next line,
as a person would; `export` lines set the environment of the lines after them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.subjects import upstream_node_permissions

from .harness import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

README = REPO / "README.md"
BIN = Path(sys.executable).parent
README_PORT = "4333"


def quickstart_lines() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- fleet-quickstart:begin -->\n```sh\n(.*?)```\n<!-- fleet-quickstart:end -->", text, flags=re.S)
    assert block, "the README has no fleet quick start block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, procs: list[subprocess.Popen] = ()):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args} exited with {p.returncode} while waiting for {what}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


class Runner:
    def __init__(self, cwd: Path, port: int) -> None:
        self.cwd = cwd
        self.port = port
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
        self.background: list[subprocess.Popen] = []
        self.outputs: dict[str, str] = {}

    def words(self, line: str) -> list[str]:
        line = line.replace(".venv/bin/", f"{BIN}/").replace(README_PORT, str(self.port))
        line = re.sub(r"(?<![\w/])examples/", f"{REPO}/examples/", line)
        return shlex.split(line, comments=True)

    def run(self, line: str) -> subprocess.Popen | subprocess.CompletedProcess | None:
        words = self.words(line)
        if words[0] == "export":
            self.env.update(w.split("=", 1) for w in words[1:])
            return None
        background = words[-1] == "&"
        if background:
            words = words[:-1]
        out = None
        if ">" in words:
            i = words.index(">")
            out = self.cwd / words[i + 1]
            words = [w for w in words[:i] + words[i + 2 :] if w != "2>&1"]
        if background:
            log = open(out or self.cwd / f"bg-{len(self.background)}.log", "ab")  # noqa: SIM115
            proc = subprocess.Popen(words, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            self.background.append(proc)
            self.ready(words, out)
            return proc
        done = subprocess.run(words, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        self.outputs[line] = done.stdout
        return done

    def ready(self, words: list[str], log: Path | None) -> None:
        name = Path(words[0]).name
        if words[1:3] == ["fleet", "upstream"]:
            def accepts() -> bool:
                with socket.socket() as s:
                    return s.connect_ex(("127.0.0.1", self.port)) == 0
            wait_for(accepts, 30, "the upstream to accept connections", self.background)
        elif name == "bcd-controlplane":
            wait_for(lambda: log is not None and log.exists() and "started" in log.read_text(), 60, "the control plane to start", self.background)
        elif words[1] == "up":
            state = self.cwd / words[words.index("--state-dir") + 1]

            def services_up() -> bool:
                out = subprocess.run([str(BIN / "bcd"), "ping", "--state-dir", str(state), "--json", "--wait", "0.7"], capture_output=True, text=True, timeout=30)
                names = {r["name"] for r in json.loads(out.stdout)} if out.returncode == 0 else set()
                return {"signer", "inventory", "converger", "gateway_bridge"} <= names

            wait_for(services_up, 90, f"the services of {state.name}", self.background)

    def stop(self) -> None:
        for proc in reversed(self.background):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.background):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_the_readme_fleet_quick_start_works_as_written(tmp_path: Path) -> None:
    lines = quickstart_lines()
    assert lines[-1].split()[0].endswith("bcd") and " fleet events " in f" {lines[-1]} "
    runner = Runner(tmp_path, free_port())
    try:
        for line in lines[:-1]:
            runner.run(line)

        fleet = tmp_path / "fleet"
        # over TLS, the nodes' and the control plane's certificates verified (mutual TLS: verify)
        conf = json.loads((fleet / "upstream" / "nats.conf").read_text())
        assert conf["tls"]["verify"] is True and conf["tls"]["ca_file"] == str((fleet / "pki" / "ca.crt").resolve())
        for key in ["ca.key", "upstream.key", "controlplane.key", "nodes/node-a.key", "nodes/node-b.key"]:
            assert oct((fleet / "pki" / key).stat().st_mode & 0o777) == "0o600", key
        assert oct((fleet / "upstream" / "controlplane.nk").stat().st_mode & 0o777) == "0o600"
        assert not (fleet / "upstream" / "controlplane.password").exists()
        # what the README says is what the commands print: init's export line, add-node's `bcd up` flags
        (init_out,) = [out for line, out in runner.outputs.items() if " fleet init " in line]
        (export,) = [line for line in lines if line.startswith("export ")]
        assert " ".join(runner.words(export)) in init_out.replace("  export", "export"), init_out
        for node in ("node-a", "node-b"):
            (added,) = [out for line, out in runner.outputs.items() if runner.words(line)[1:5] == ["fleet", "add-node", "fleet", node]]
            printed = shlex.split(added.splitlines()[1])
            (up_line,) = [line for line in lines if f" up --node-id {node} " in line]
            up_words = runner.words(up_line)
            for flag in ("--upstream", "--cp-key", "--upstream-nkey-file", "--upstream-ca", "--upstream-cert", "--upstream-key"):
                assert up_words[up_words.index(flag) + 1] == printed[printed.index(flag) + 1], (flag, added)
        log = (fleet / "controlplane.log").read_text()
        assert "auth=nkey" in log and "tls=on (CA fleet/pki/ca.crt, client certificate fleet/pki/controlplane.crt)" in log, log[-2000:]
        # each node has its own upstream user alone in its own account, exactly its permissions
        # (docs/upstream.md section 8)
        users = {u.get("nkey", u.get("user")): u for a in conf["accounts"].values() for u in a["users"]}
        nodes = json.loads((fleet / "upstream" / "nodes.json").read_text())
        assert set(nodes) == {"node-a", "node-b"}
        for node, key in nodes.items():
            perms = upstream_node_permissions(node)
            assert users[key]["permissions"]["publish"]["allow"] == list(perms.publish)
            assert users[key]["permissions"]["subscribe"]["allow"] == list(perms.subscribe)
            assert oct((fleet / "nodes" / f"{node}.nk").stat().st_mode & 0o777) == "0o600"
        # the put lines printed generations
        puts = [out for line, out in runner.outputs.items() if " put " in line]
        assert len(puts) == 2 and all(out.strip().isdigit() for out in puts)

        # the last line follows the verified events until both nodes' holds are bound
        words = runner.words(lines[-1])
        events_log = tmp_path / "events.out"
        with open(events_log, "wb") as out:
            events = subprocess.Popen(words, cwd=tmp_path, env=runner.env, stdout=out, stderr=subprocess.STDOUT)
        want = {("node-a", "train-a1"), ("node-b", "notebook-b1"), ("node-b", "infer-b2")}
        seen: list[str] = []
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                seen = events_log.read_text(errors="replace").splitlines()
                bound = {(w[1], w[3]) for w in map(str.split, seen) if len(w) > 3 and w[2] == "bound" and "verified" in w}
                if want <= bound:
                    break
                assert events.poll() is None, f"bcd fleet events exited: {seen}"
                time.sleep(0.3)
            else:
                raise AssertionError(f"not every hold reported bound and verified: {seen}\n" + (fleet / "controlplane.log").read_text()[-3000:])
            assert not [l for l in seen if "REJECTED" in l], seen
        finally:
            events.send_signal(signal.SIGINT)
            try:
                events.wait(10)
            except subprocess.TimeoutExpired:
                events.kill()
                events.wait()
        # the holds are on each node's disk, the slice under its escape-free name
        assert (fleet / "node-a" / "cdi" / "bcd-train-a1.json").exists()
        assert (fleet / "node-a" / "run" / "slices" / "bcd-alloc-train.a1.slice.json").exists()
        assert "BCD_CGROUP_PARENT=bcd-alloc-train.a1.slice\n" in (fleet / "node-a" / "run" / "allocations" / "train-a1.env").read_text()
        assert {p.name for p in (fleet / "node-b" / "cdi").glob("bcd-*.json")} == {"bcd-notebook-b1.json", "bcd-infer-b2.json"}
    finally:
        runner.stop()
