"""The command line, `bcd-controlplane serve|put` (`python -m controlplane`): options, the two commands, exit codes.

This module owns the options, each a flag and a BCD_CP_* variable. It owns
`serve`: ensure the upstream objects, then consume events until SIGTERM, staying
alive through a refused connection, TLS files that do not load yet, or a
cluster still electing, because a supervisor would only loop on an exit. It owns
`put`: the generation on stdout, and a refusal or failure as one line on stderr.
It also owns which error is an operator's (exit 2, said as one line) and which
is a refused spec (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import nats.errors

from shared import logs
from shared.schemas import BadMessage
from shared.schemas.strict import UnknownFieldsError
from shared.stopping import sleep_unless
from shared.subjects import CONTROLPLANE_USER
from shared.tlsconfig import TlsConfigError

from .keys import KeyFileError, load_or_create_cp_key
from .publish import RebaseRefused
from .put import LOCAL_HELLO_WAIT_S, put_spec_file, rebase_node
from .serve import ControlPlane
from .specs import UnknownNode
from .state import GenerationExhausted, StateError
from .upstream import TLS_CHECK_S, close, connect_serving, tls_from_args, watch_tls

log = logs.get_logger("controlplane")


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value else default


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats-url", default=_env("BCD_CP_NATS_URL", "nats://127.0.0.1:4222"), help="upstream NATS URL [env BCD_CP_NATS_URL]")
    common.add_argument("--user", default=_env("BCD_CP_USER", CONTROLPLANE_USER), help="upstream NATS user [env BCD_CP_USER]")
    common.add_argument("--password-file", type=Path, default=_env("BCD_CP_PASSWORD_FILE"), help="file holding the user's password [env BCD_CP_PASSWORD_FILE]")
    common.add_argument(
        "--nkey-file",
        type=Path,
        default=_env("BCD_CP_NKEY_FILE"),
        help="the user's nkey seed file (`bcd fleet init`: DIR/upstream/controlplane.nk); wins over --password-file [env BCD_CP_NKEY_FILE]",
    )
    common.add_argument(
        "--ca-file", type=Path, default=_env("BCD_CP_CA_FILE"), help="CA bundle the upstream's certificate must chain to (turns TLS on) [env BCD_CP_CA_FILE]"
    )
    common.add_argument("--cert-file", type=Path, default=_env("BCD_CP_CERT_FILE"), help="client certificate for mutual TLS (with --key-file) [env BCD_CP_CERT_FILE]")
    common.add_argument("--key-file", type=Path, default=_env("BCD_CP_KEY_FILE"), help="the client certificate's key [env BCD_CP_KEY_FILE]")
    common.add_argument(
        "--server-name", default=_env("BCD_CP_SERVER_NAME", ""), help="name the upstream's certificate must have (default: the URL's host) [env BCD_CP_SERVER_NAME]"
    )
    common.add_argument(
        "--tls-required",
        action="store_true",
        default=(_env("BCD_CP_TLS", "") or "").lower() == "required",
        help="TLS even with a nats:// URL and no CA file (the system's trust store); a plain-text server is refused [env BCD_CP_TLS=required]",
    )
    common.add_argument("--state-dir", type=Path, default=_env("BCD_CP_STATE_DIR"), help="key, state.json, events.jsonl [env BCD_CP_STATE_DIR]")
    common.add_argument(
        "--replicas",
        type=int,
        default=_env("BCD_CP_REPLICAS", "1"),
        help="JetStream replicas of the events stream and the buckets when it creates them (3 on a 3-server cluster) [env BCD_CP_REPLICAS]",
    )
    common.add_argument("--log-level", default=_env("BCD_CP_LOG_LEVEL", "INFO"), help="[env BCD_CP_LOG_LEVEL]")
    common.add_argument("--log-format", default=_env("BCD_CP_LOG_FORMAT", "json"), choices=("json", "text"), help="[env BCD_CP_LOG_FORMAT]")
    parser = argparse.ArgumentParser(prog="bcd-controlplane", description="bcd reference control plane")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", parents=[common], help="ensure the upstream buckets and stream, consume events until SIGTERM")
    put = sub.add_parser("put", parents=[common], help="sign and put one NodeSpec, print its generation")
    put.add_argument("spec", help="NodeSpec JSON file ('-' for stdin); generation optional")
    put.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="put fields NodeSpec does not declare as given (for a newer node) instead of refusing the spec (exit 2)",
    )
    put.add_argument(
        "--hello-wait",
        type=float,
        default=float(_env("BCD_CP_HELLO_WAIT", str(LOCAL_HELLO_WAIT_S))),
        help="seconds to wait for the node's Hello: a spec for a node that never said Hello is refused (exit 2) [env BCD_CP_HELLO_WAIT]",
    )
    put.add_argument("--force", action="store_true", help="put the spec even for a node that never said Hello")
    rebase = sub.add_parser(
        "rebase",
        parents=[common],
        help="put a node's spec (ours, in the bucket) again at a generation our count goes on from, for a node above 2^53 - 1; its holds kept",
    )
    rebase.add_argument("node_id", help="the node to rebase")
    return parser


async def _serve(args: argparse.Namespace) -> int:
    key, pub = load_or_create_cp_key(args.state_dir)
    tls = tls_from_args(args)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        connected = await connect_serving(args, tls, stopping)
        if connected is None:
            return 0
        nc, files = connected
        every = float(_env("BCD_CP_TLS_CHECK", str(TLS_CHECK_S)) or TLS_CHECK_S)
        watcher = asyncio.ensure_future(watch_tls(files, nc, stopping, every)) if tls.enabled else None
        try:
            cp = ControlPlane(nc, key, args.state_dir, replicas=args.replicas)
            # a cluster still electing, or short of peers for the replicas, refuses the
            # stream for now: retried rather than exiting (which a supervisor would loop on)
            while True:
                try:
                    await cp.ensure_upstream()
                    break
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    log.warning("upstream objects not ready; retrying", error=str(exc) or type(exc).__name__, replicas=args.replicas)
                    await sleep_unless(stopping, 2.0)
                    if stopping.is_set():
                        return 0
            log.info(
                "started", nats_url=args.nats_url, user=args.user, key_id=cp.key_id, public_key=str(pub), pid=os.getpid(),
                auth="nkey" if args.nkey_file else ("password" if args.password_file else "none"), tls=tls.describe(),
            )
            await cp.run(stopping)
            log.info("stopping")
            return 0
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await close(nc)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _put(args: argparse.Namespace) -> int:
    spec: Path | bytes = sys.stdin.buffer.read() if args.spec == "-" else Path(args.spec)
    result = await put_spec_file(
        args.nats_url,
        args.user,
        args.password_file,
        args.state_dir,
        spec,
        allow_unknown_fields=args.allow_unknown_fields,
        replicas=args.replicas,
        require_known_node=not args.force,
        hello_wait=args.hello_wait,
        nkey_file=args.nkey_file,
        tls=tls_from_args(args),
    )
    if result.note:
        print(f"note: {result.note}", file=sys.stderr)
    print(result.generation)
    return 0


async def _rebase(args: argparse.Namespace) -> int:
    result = await rebase_node(
        args.nats_url, args.user, args.password_file, args.state_dir, args.node_id,
        replicas=args.replicas, nkey_file=args.nkey_file, tls=tls_from_args(args),
    )  # fmt: skip
    print(f"note: node {result.node_id} {result.note}; its holds kept", file=sys.stderr)
    print(result.generation)
    return 0


def _put_main(args: argparse.Namespace) -> int:
    """`put` (and `rebase`) as a command: its generation on stdout, a refusal or failure as one line
    on stderr (`bcd-controlplane put: ...`), as `bcd apply` says it; `serve` logs structured lines."""

    def say(text: str, code: int) -> int:
        print(f"bcd-controlplane {args.command}: {text}", file=sys.stderr)
        return code

    if args.state_dir is None:
        return say("--state-dir (or BCD_CP_STATE_DIR) is required", 2)
    try:
        tls_from_args(args)
    except TlsConfigError as exc:
        return say(str(exc), 2)
    try:
        return asyncio.run(_rebase(args) if args.command == "rebase" else _put(args))
    except (KeyFileError, StateError) as exc:
        return say(str(exc), 2)
    except (GenerationExhausted, RebaseRefused) as exc:  # the node's situation: refused, what to do said
        return say(str(exc), 1)
    except UnknownNode as exc:
        return say(f"{exc}: is the node id right? Nothing was put (--force puts it anyway)", 2)
    except UnknownFieldsError as exc:
        return say(str(exc).replace("\n", "; "), 2)
    except BadMessage as exc:
        return say(f"spec refused: {exc}", 1)
    except (OSError, nats.errors.Error) as exc:
        return say(f"put failed: {type(exc).__name__}: {exc}", 2)
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("put", "rebase"):
        # a command, not a server: warnings and errors only, the outcome as one line
        logs.configure("controlplane", "ERROR", args.log_format)
        return _put_main(args)
    logs.configure("controlplane", args.log_level, args.log_format)
    if args.state_dir is None:
        log.error("cannot start", reason="--state-dir (or BCD_CP_STATE_DIR) is required")
        return 2
    try:
        tls_from_args(args)
    except TlsConfigError as exc:
        log.error("cannot start", reason=str(exc))
        return 2
    try:
        return asyncio.run(_serve(args))
    except (KeyFileError, StateError) as exc:
        log.error("cannot start", reason=str(exc))
        return 2
    except UnknownFieldsError as exc:
        log.error("spec refused", reason=str(exc), unknown_fields=[str(f) for f in exc.fields][:100])
        return 2
    except BadMessage as exc:
        log.error("spec refused", reason=str(exc))
        return 1
    except (OSError, nats.errors.Error) as exc:
        log.error("stopped on an error" if args.command == "serve" else "put failed", reason=f"{type(exc).__name__}: {exc}")
        return 2
    except KeyboardInterrupt:
        return 0


__all__ = ["main"]
