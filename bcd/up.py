"""`bcd up`: a whole node under one state directory, as an ordinary user.

Embedded (the default): one nats-server carries two accounts - the node bus
and an upstream with the reference control plane - and every service plus the
control plane runs as its own supervised process. With `--upstream URL
--cp-key FILE` the bridge joins an existing control plane instead. Both hops
that take a spec, the bridge and the converger, get the control plane's key
(the embedded one's own, or --cp-key); `--accept-unsigned-specs` (lab only,
--upstream without a key) is the one way to run without. Service
logs go to `<state>/logs/<service>.log` (`--verbose` shows them here).
With `--apply SPEC`, the spec is applied once the node is up and the status
table and the verified events are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
from pathlib import Path

import msgspec

from shared import logs
from shared.runtime import METRICS_PORTS, VERSION
from shared.statestamp import check_tree
from shared.busstreams import StreamSetupError
from shared.subjects import BUS_ADMIN_USER, CONTROLPLANE_USER, OPERATOR_USER, upstream_node_user

from .client import NodeInfo, NodeUnreachable, connect, ping_all, write_node_info
from .nodebus import NatsServer, prepare_node_bus, setup_streams
from .supervisor import ProcessSpec, Supervisor, die_with_parent, service_argv

EXAMPLE_HOSTS_DIR = Path(__file__).resolve().parent.parent / "examples" / "hosts"


def layout(state: Path) -> dict[str, Path]:
    return {
        "bus": state / "bus",
        "data": state / "data",
        "run": state / "run",
        "cdi": state / "cdi",
        # the hold specs' consumer copies, where /run/cdi is beside /run/bcd on a host
        "cdi_consumer": state / "run" / "cdi",
        "logs": state / "logs",
        "cp": state / "controlplane",
        "kubelet": state / "kubelet",
    }


def cmd_up(args: argparse.Namespace) -> int:
    from controlplane.keys import load_or_create_cp_key

    logs.configure("supervisor", args.log_level, args.log_format)
    log = logs.get_logger("bcd.up")
    state: Path = args.state_dir.resolve()
    paths = layout(state)
    embedded = not args.upstream
    # first: options that would leave a hop unchecked start nothing, not even the bus
    problem = spec_trust_problem(embedded, args.cp_key, args.accept_unsigned_specs)
    if problem:
        print(f"bcd up: {problem}", file=sys.stderr)
        return 2
    running = _running_supervisor(state)
    if running:
        # before the port check: a second `make run` on the same state would otherwise
        # find the ports taken, pick free ones and share the first node's files
        print(f"bcd up: a node already runs on {state} (supervisor pid {running}); stop it first or pass another --state-dir", file=sys.stderr)
        return 1
    # a state dir a newer bcd wrote: one line, nothing started (shared/statestamp.py)
    newer = check_tree(paths["data"], version=VERSION)
    if newer:
        print(f"bcd up: {newer}", file=sys.stderr)
        return 2
    if not args.any_ports:
        # a taken fixed port: free ones instead (make run), or one line naming it (bcd/ports.py)
        from .ports import fallback_line, fixed_ports, refusal, taken

        busy = taken(fixed_ports(args.port, args.http_port, args.services))
        if busy and not getattr(args, "any_ports_if_taken", False):
            print(refusal(busy), file=sys.stderr)
            return 1
        if busy:
            print(fallback_line(busy), file=sys.stderr, flush=True)
            args.any_ports = True
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
    fake_host: Path | None = args.fake_host.resolve() if args.fake_host else None
    if fake_host is not None and not fake_host.is_file():
        print(f"bcd up: fake host file {fake_host} does not exist", file=sys.stderr)
        return 2
    if fake_host is not None and fake_host.parent == EXAMPLE_HOSTS_DIR.resolve():
        # The fake kernel (vfio_switcher's fake backend) writes driver bindings into
        # the host file: work on the node's own copy, never on the checked-in example.
        copy = state / f"host-{fake_host.name}"
        if not copy.exists():
            shutil.copyfile(fake_host, copy)
        log.info("fake host: working on a copy of the example", example=str(fake_host), copy=str(copy))
        fake_host = copy
    if not embedded and bool(args.upstream_cert) != bool(args.upstream_key):
        print("bcd up: --upstream-cert and --upstream-key go together (a client certificate and its key)", file=sys.stderr)
        return 2
    conf, creds = prepare_node_bus(
        paths["bus"],
        paths["data"] / "nats",
        args.node_id,
        port=-1 if args.any_ports else args.port,
        http_port=-1 if args.any_ports else args.http_port,
        upstream_nodes=[args.node_id] if embedded else (),
    )
    bus = NatsServer(conf, paths["bus"] / "nats-server.log")
    try:
        bus.start(preexec_fn=die_with_parent)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"bcd up: the node bus did not start: {exc}", file=sys.stderr)
        return 1
    if args.any_ports:
        # pin the ports it picked, so a restarted bus comes back where the services look
        prepare_node_bus(
            paths["bus"],
            paths["data"] / "nats",
            args.node_id,
            port=bus.port,
            http_port=bus.http_port,
            upstream_nodes=[args.node_id] if embedded else (),
        )
    # the node's streams, made before any service starts by the one identity that may
    # (BUS_ADMIN_USER; no service holds it): an outbox refused for storage is said here and
    # by the converger, and the node runs on without one (every event waits)
    try:
        made = asyncio.run(
            setup_streams(
                bus.url, creds[BUS_ADMIN_USER].read_text().strip(), args.node_id,
                outbox_max_bytes=args.outbox_max_bytes, store_dir=paths["data"] / "nats",
            )
        )
    except StreamSetupError as exc:
        print(f"bcd up: {exc}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - a bus that does not answer its admin: stop, naming it
        print(f"bcd up: the node bus's streams could not be made: {exc or type(exc).__name__}", file=sys.stderr)
        bus.stop()
        return 1
    else:
        if made.warning:
            print(f"bcd up: {made.warning}", file=sys.stderr)

    common = {
        "BCD_NODE_ID": args.node_id,
        "BCD_NATS_URL": bus.url,
        "BCD_DATA_DIR": str(paths["data"]),
        "BCD_RUN_DIR": str(paths["run"]),
        "BCD_CDI_DIR": str(paths["cdi"]),
        "BCD_CDI_CONSUMER_DIR": str(paths["cdi_consumer"]),
        "BCD_LOG_LEVEL": args.log_level,
        "BCD_LOG_FORMAT": "json",
        "BCD_ADAPTER": "fakehw" if fake_host else "nvidia",
        # the inventory keeps DRA claims' MPS daemons here; the helper mounts their pipes from it
        "BCD_MPS_ROOT": str(paths["run"] / "mps"),
        # the GPU feature labels' NFD file (the inventory's): under the state dir, never the host's /etc
        "BCD_FEATURE_DIR": str(paths["run"] / "features.d"),
    }
    if fake_host is not None:
        common["BCD_FAKE_HOST"] = str(fake_host)
    if embedded:
        _, cp_pub = load_or_create_cp_key(paths["cp"])
        trust_env = {"BCD_CP_KEY": str(cp_pub), "BCD_ACCEPT_UNSIGNED_SPECS": "0"}
        bridge_env = {
            "BCD_UPSTREAM_URL": bus.url,
            "BCD_UPSTREAM_PASSWORD_FILE": str(creds[upstream_node_user(args.node_id)]),
        }
    else:
        # the services run from another directory: a relative key file is this shell's
        keys = ",".join(str(Path(k.strip()).resolve()) for k in args.cp_key.split(",") if k.strip())
        # both said outright: a BCD_* of the shell the services inherit must not contradict them
        trust_env = {"BCD_CP_KEY": keys, "BCD_ACCEPT_UNSIGNED_SPECS": "1" if args.accept_unsigned_specs else "0"}
        bridge_env = {"BCD_UPSTREAM_URL": args.upstream}
        for opt, env in (
            ("upstream_user", "BCD_UPSTREAM_USER"),
            ("upstream_password_file", "BCD_UPSTREAM_PASSWORD_FILE"),
            ("upstream_token_file", "BCD_UPSTREAM_TOKEN_FILE"),
            ("upstream_nkey_file", "BCD_UPSTREAM_NKEY_FILE"),
            ("upstream_creds", "BCD_UPSTREAM_CREDS"),
            ("upstream_ca", "BCD_UPSTREAM_CA"),
            ("upstream_cert", "BCD_UPSTREAM_CERT"),
            ("upstream_key", "BCD_UPSTREAM_KEY"),
            ("upstream_server_name", "BCD_UPSTREAM_SERVER_NAME"),
            ("upstream_tls", "BCD_UPSTREAM_TLS"),
        ):
            value = getattr(args, opt)
            if value:
                # the services run from another directory: a relative file is this shell's
                bridge_env[env] = str(Path(value).resolve()) if isinstance(value, Path) else str(value)

    # kube_reaper: the kubelet's pod-resources socket and the Eviction API when
    # given; on a fake host it reads the host file's processes. Without a
    # kubelet every pending release counts as held (unreachable = held). With
    # --kubeconfig it also serves the converger its Kubernetes Node (the MIG
    # re-layout), named as the DRA plugin names it: the node id, or BCD_NODE_NAME.
    reaper_env = {
        "BCD_PROCESSES": "fake" if fake_host else "nvml",
        "BCD_EVICTOR": "kubernetes" if args.kubeconfig else "none",
        "BCD_NODE_API": "kubernetes" if args.kubeconfig else "none",
    }
    if args.kubeconfig:
        reaper_env["BCD_KUBECONFIG"] = str(Path(args.kubeconfig).resolve())
    if args.pod_resources_socket:
        reaper_env["BCD_POD_RESOURCES_SOCKET"] = str(Path(args.pod_resources_socket).resolve())
    # device_plugin: registers in <kubelet dir>/device-plugins once a kubelet
    # serves kubelet.sock there (none on a fake host: it waits, and says so)
    kubelet_dir = getattr(args, "kubelet_dir", None)
    plugin_env = {"BCD_KUBELET_DIR": str(Path(kubelet_dir).resolve() if kubelet_dir else paths["kubelet"])}
    # dra_plugin: serves plugins_registry/ and plugins/ under the same kubelet dir; ResourceClaims and
    # ResourceSlices need an API server (--kubeconfig): without one it registers and refuses prepares
    dra_env = {**plugin_env, "BCD_KUBE_API": "kubernetes" if args.kubeconfig else "none"}
    if args.kubeconfig:
        dra_env["BCD_KUBECONFIG"] = str(Path(args.kubeconfig).resolve())
    # vfio_switcher: on a fake host it switches cards by editing the host file
    # (the inventory's next scan sees it); otherwise the real sysfs files.
    switcher_env = {"BCD_BACKEND": "fake" if fake_host else "sysfs"}
    specs: list[ProcessSpec] = []
    metrics: dict[str, str] = {}
    for name in args.services:
        port = 0 if args.any_ports else METRICS_PORTS[name]
        env = {
            **common,
            "BCD_NATS_USER": name,
            "BCD_NATS_PASSWORD_FILE": str(creds[name]),
            "BCD_METRICS_PORT": str(port),
            **(bridge_env if name == "gateway_bridge" else {}),
            # both hops that take a spec check the control plane's signature (issue 40)
            **(trust_env if name in ("gateway_bridge", "converger") else {}),
            **(reaper_env if name == "kube_reaper" else {}),
            **(plugin_env if name == "device_plugin" else {}),
            **(dra_env if name == "dra_plugin" else {}),
            **(switcher_env if name == "vfio_switcher" else {}),
        }
        if port:
            metrics[name] = f"http://127.0.0.1:{port}/metrics"
        specs.append(ProcessSpec(name, service_argv(f"services.{name}"), env, None if args.verbose else paths["logs"] / f"{name}.log"))
    if embedded:
        specs.append(
            ProcessSpec(
                "controlplane",
                [sys.executable, "-m", "controlplane", "serve"],
                {
                    "BCD_CP_NATS_URL": bus.url,
                    "BCD_CP_USER": CONTROLPLANE_USER,
                    "BCD_CP_PASSWORD_FILE": str(creds[CONTROLPLANE_USER]),
                    "BCD_CP_STATE_DIR": str(paths["cp"]),
                    "BCD_LOG_FORMAT": "json",
                },
                None if args.verbose else paths["logs"] / "controlplane.log",
            )
        )
    info = NodeInfo(
        node_id=args.node_id,
        nats_url=bus.url,
        creds_dir=str(creds[OPERATOR_USER].parent),
        monitor_url=f"http://127.0.0.1:{bus.http_port}" if bus.http_port else "",
        metrics=metrics,
        supervisor_pid=os.getpid(),
        services=list(args.services),
        cdi_dir=str(paths["cdi"]),
        cdi_consumer_dir=str(paths["cdi_consumer"]),
        run_dir=str(paths["run"]),
        data_dir=str(paths["data"]),
        controlplane_dir=str(paths["cp"]) if embedded else "",
        upstream_url=bus.url if embedded else args.upstream,
    )
    write_node_info(state, info)

    def banner(metrics: dict[str, str] = metrics, *, missing: str = "") -> None:
        lines = [
            "",
            f"bcd node {args.node_id!r} is starting on {'fake host ' + str(fake_host) if fake_host else 'this host (NVML)'}",
            f"  node bus     {bus.url}  (config {conf})",
            f"  upstream     {'embedded reference control plane (' + str(paths['cp']) + ')' if embedded else args.upstream}",
            *(["  specs        UNSIGNED ACCEPTED (--accept-unsigned-specs, lab only): whoever can put this node's spec owns its holds"]
              if args.accept_unsigned_specs else []),
            *([f"  monitoring   {info.monitor_url}/varz  /connz  /subsz  /jsz"] if info.monitor_url else []),
            *[f"  metrics      {n:<15} {u}" for n, u in metrics.items()],
            *([f"  metrics      {missing}"] if missing else []),
            f"  logs         {paths['logs']}/<service>.log" if not args.verbose else "  logs         here",
            f"  holds        {paths['cdi']}/bcd-*.json (their consumer copies in {paths['cdi_consumer']}), "
            f"{paths['run']}/allocations/*.env, {paths['run']}/slices/",
            *look_lines(args.state_dir, args.upstream if not embedded else ""),
            "Stop with Ctrl-C.",
            "",
        ]
        print("\n".join(lines), file=sys.stderr, flush=True)

    # free ports: the banner waits for the metrics ports the services took, so that it says
    # where everything went in one piece, before the demo's output (issue 41.14)
    supervisor = Supervisor(bus, specs, on_ready=None if args.any_ports else banner)

    async def free_ports_banner() -> None:
        recorded = await record_metrics(state, info, list(args.services))
        if recorded is None:
            banner({}, missing=f"not known: the services did not answer in time (node.json gets them; see {paths['logs']})")
        else:
            banner(recorded)

    async def main() -> int:
        tasks: list[asyncio.Task[None]] = []
        announced: asyncio.Task[None] | None = None
        if args.any_ports:
            # free ports: each service says the one it took; node.json and the banner get them (issue 28.8)
            announced = asyncio.create_task(free_ports_banner())
            tasks.append(announced)
        if args.apply:
            demo = asyncio.create_task(
                run_demo(state, info, Path(args.apply), [*args.services, *(["controlplane"] if embedded else [])], after=announced)
            )
            demo.add_done_callback(_report_demo)
            tasks.append(demo)
        try:
            return await supervisor.run()
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:  # Ctrl-C before the handler was installed
        return 130
    finally:
        bus.stop()
        log.debug("node bus stopped")


def spec_trust_problem(embedded: bool, cp_key: str, accept_unsigned: bool) -> str:
    """Why these spec-trust options cannot start a node ("" when they can).

    Embedded, the control plane's own key is given to the bridge and the
    converger: unsigned specs have no place there. With --upstream, exactly one of
    --cp-key and --accept-unsigned-specs. An empty --cp-key is no key: it is
    what an unset variable expands to, so it never stands for "unsigned" (the
    opt-out is named, DESIGN 3).
    """
    has_key = bool(cp_key.strip(", "))
    if embedded:
        return "--accept-unsigned-specs goes with --upstream only: the embedded control plane signs every spec" if accept_unsigned else ""
    if has_key and accept_unsigned:
        return "--cp-key and --accept-unsigned-specs together: with a control-plane key unsigned specs are refused; drop one"
    if not has_key and not accept_unsigned:
        return ("--upstream needs --cp-key FILE (the control plane's public key); in a lab only, "
                "--accept-unsigned-specs takes unsigned specs knowingly")  # fmt: skip
    return ""


def look_lines(state_dir: Path | str, upstream: str = "") -> list[str]:
    """The banner's "look at it from another terminal": only commands that work in this mode.

    With an embedded control plane (`upstream` ""), `bcd apply` and `bcd events`
    go through it; a node that joined an `upstream` has no control plane of its
    own (both refuse there), so the lines name what does work and where specs go.
    """
    s = f"--state-dir {state_dir}"
    lines = ["Look at it from another terminal:", f"  .venv/bin/bcd status {s}       # GPUs, holds, section, outbox"]
    if not upstream:
        lines += [
            f"  .venv/bin/bcd apply SPEC.json {s}   # sign and put a NodeSpec through the control plane",
            f"  .venv/bin/bcd events {s}       # the control plane's verified event log (the last 20, then follows)",
        ]
    else:
        lines += [
            f"  .venv/bin/bcd gpu list {s}     # each card's driver, phase, managementState",
            f"  .venv/bin/bcd bus {s}          # the node bus: endpoints, outbox, connections",
        ]
    lines.append(f"  .venv/bin/bcd doctor {s}       # what is wrong, if anything")
    if upstream:
        lines.append(f"Specs and the verified events go through the control plane at {upstream}, not this node.")
    return lines


def _running_supervisor(state: Path) -> int:
    """The pid of a live `bcd up` that wrote `<state>/node.json`, else 0."""
    import json

    try:
        pid = int(json.loads((state / "node.json").read_text()).get("supervisor_pid") or 0)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid > 0 and pid != os.getpid() else b""
    except (OSError, ValueError, AttributeError):
        return 0
    return pid if b"bcd" in cmdline and b"up" in cmdline.split(b"\0") else 0


def _report_demo(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        print(f"bcd up: the demo stopped: {task.exception()!r}", file=sys.stderr)


async def wait_ready(info: NodeInfo, services: list[str], timeout: float = 60.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            nc = await connect(info)
        except NodeUnreachable:
            await asyncio.sleep(0.3)
            continue
        try:
            names = {r["name"] for r in await ping_all(nc, 0.3)}
        finally:
            await nc.close()
        if set(services) - {"controlplane"} <= names:
            return True
        await asyncio.sleep(0.3)
    return False


async def record_metrics(state: Path, info: NodeInfo, services: list[str]) -> dict[str, str] | None:
    """With free ports: the metrics endpoint each service took ($SRV.PING metadata) into node.json,
    once they answer (`bcd status` and Prometheus file discovery read node.json); None when they
    did not answer in time. The banner prints them."""
    if not await wait_ready(info, services):
        return None
    nc = await connect(info)
    try:
        answers = await ping_all(nc, 0.5)
    finally:
        await nc.close()
    metrics = {
        r["name"]: f"http://{r['metadata']['metrics']}/metrics"
        for r in sorted(answers, key=lambda r: r["name"])
        if r.get("name") in services and (r.get("metadata") or {}).get("metrics")
    }
    write_node_info(state, msgspec.structs.replace(info, metrics=metrics))
    return metrics


def demo_already_put(cp_dir: Path, node_id: str) -> int:
    """The generation the embedded control plane last put for the node (0: none yet, the demo goes)."""
    from controlplane.state import peek_state

    rec = peek_state(cp_dir).nodes.get(node_id)
    return rec.last_generation if rec is not None else 0


async def run_demo(state: Path, info: NodeInfo, spec_file: Path, services: list[str], *, after: asyncio.Task[None] | None = None) -> None:
    """make run: apply the example spec (only on a state dir whose node never got a spec: a second
    `make run` keeps what the user made), show the status table and the verified events, then follow."""
    from .putspec import apply_spec_file
    from .events import follow_events
    from .status import gather, render_status

    if after is not None:
        # the banner first (with free ports it waits for the metrics ports)
        await asyncio.wait({after})
    if not await wait_ready(info, services):
        print("bcd up: services did not come up in time; see the logs", file=sys.stderr)
        return
    earlier = demo_already_put(Path(info.controlplane_dir), info.node_id) if info.controlplane_dir else 0
    if earlier:
        # a second `make run` on the same state: the holds made since are the user's, and putting
        # the demo again would release every one of them (issue 28.4)
        print(
            f"\nbcd up: {info.node_id} already has generation {earlier} on {state}: its holds stay as they are, "
            f"{spec_file} is not applied again (`bcd apply {spec_file} --state-dir {state}` puts it)\n",
            flush=True,
        )
        generation = earlier
    else:
        try:
            generation = await apply_spec_file(state, spec_file)
        except Exception as exc:  # noqa: BLE001 - shown to the user, the node keeps running
            # never silent after this (issue 41.5): what failed, how to go on, then the node as it is
            print(
                f"bcd up: could not apply {spec_file}: {exc}\n"
                f"bcd up: the node runs on without it: `bcd status --state-dir {state}` shows where it stands, "
                f"`bcd apply {spec_file} --state-dir {state}` tries again (--debug shows why it fails)",
                file=sys.stderr,
                flush=True,
            )
            generation = None
        else:
            print(f"\napplied {spec_file} as generation {generation}; waiting for the node to report...\n", flush=True)
    for _ in range(100 if generation is not None else 0):
        report = await gather(info)
        sec = report.converger.section if report.converger else None
        if sec is not None and sec.observed_generation == generation and sec.state != "PROGRESSING" and report.outbox and report.outbox.messages == 0:
            break
        await asyncio.sleep(0.2)
    print(render_status(await gather(info)), flush=True)
    print("\nverified events (the control plane's log; following until Ctrl-C):", flush=True)
    await follow_events(Path(info.controlplane_dir) / "events.jsonl", follow=True, last=50)


__all__ = ["layout", "cmd_up", "look_lines", "wait_ready", "run_demo"]
