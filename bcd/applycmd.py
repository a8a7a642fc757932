"""`bcd apply`: check a NodeSpec strictly, put it (or plan it with `--dry-run`), and follow it (`--wait`).

Exit codes (bcd.exits): 0 applied (with `--wait`: CONVERGED; with
`--dry-run`: the plan refuses nothing), 1 FAILED (or the node refused the
spec, a newer generation superseded it, the dry run's plan refuses
something, the node is at the last generation a spec can carry), 2 the spec
was refused here and nothing was put (a field NodeSpec does not know, a value
the schema refuses, a generation asked for above 2^52, a signed envelope
the node bus cannot carry, a node that never announced itself, an unreadable
file), 3 the control plane was not reachable, or no outcome within
`--wait-timeout` (the node may be down).

A `generation` in the spec file is ignored (said on stderr) unless
`--generation-from-file`: generations are the control plane's to give.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from controlplane.keys import KeyFileError
from controlplane.ledger import EVENTS_FILE
from controlplane.publish import RebaseRefused
from controlplane.specs import PutResult, UnknownNode, check_spec
from controlplane.state import GenerationExhausted, StateError, next_generation, peek_state
from shared.fsutil import read_regular
from shared.schemas import BadMessage
from shared.schemas.strict import UnknownFieldsError

from .applywait import Follower, events_offset, follow
from .client import node_info
from .putspec import put_through_node, rebase_through_node, unasked_generation

#: a spec file larger than this is not read (the control plane takes at most 4 MiB of JSON).
SPEC_FILE_MAX_BYTES = 4 * 1024 * 1024
#: unknown fields listed one per line before "... and N more".
UNKNOWN_LINES = 20
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_UNREACHABLE = 3
DEFAULT_TIMEOUT_S = 120.0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"seconds must be > 0, not {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `apply` subcommand's own flags (the parser gives the spec argument, --state-dir, --json, --timeout)."""
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="follow the generation to its outcome, printing each hold's result; exit 0 CONVERGED, 1 FAILED, "
        "3 no outcome within --wait-timeout (default: wait when stdout is a terminal)",
    )
    p.add_argument(
        "--wait-timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="how long --wait waits for the node's outcome before exit 3 (default %(default)g)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the spec and print the plan against the node's holds now (bind, keep, release, refuse); put nothing",
    )
    p.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="put fields NodeSpec does not know as given (for a newer node) instead of refusing the spec (exit 2)",
    )
    p.add_argument("--force", action="store_true", help="put the spec even for a node the control plane never heard from")
    p.add_argument(
        "--generation-from-file",
        action="store_true",
        help="put the spec at the `generation` its file carries (up to 2^52; bumped to the next when not above the last) "
        "instead of ignoring it; without it the control plane gives the next generation",
    )


def _say(text: str, *, json_mode: bool) -> None:
    print(text, file=sys.stderr if json_mode else sys.stdout, flush=True)


def _refused(args: argparse.Namespace, text: str, extra: dict[str, Any] | None = None, code: int = EXIT_REFUSED) -> int:
    # the command the user ran (`bcd rebase` shares this path, and said "bcd apply:")
    print(f"bcd {getattr(args, 'command', None) or 'apply'}: {text}", file=sys.stderr)
    if args.json:
        print(json.dumps({"spec": str(args.spec), "outcome": "REFUSED", "error": text, **(extra or {})}, indent=2))
    return code


def _unknown(args: argparse.Namespace, exc: UnknownFieldsError) -> int:
    fields = exc.fields
    if len(fields) == 1:
        # one field, one line (issue 28.8: it took three)
        print(f"bcd apply: {args.spec}: {fields[0]}; nothing was put (--allow-unknown-fields puts it as given, for a newer node)", file=sys.stderr)
    else:
        print(
            f"bcd apply: {args.spec}: {len(fields)} fields NodeSpec does not know; nothing was put "
            "(--allow-unknown-fields puts them as given, for a newer node):",
            file=sys.stderr,
        )
        for f in fields[:UNKNOWN_LINES]:
            print(f"  {f}", file=sys.stderr)
        if len(fields) > UNKNOWN_LINES:
            print(f"  ... and {len(fields) - UNKNOWN_LINES} more", file=sys.stderr)
    if args.json:
        doc = {"spec": str(args.spec), "outcome": "REFUSED", "error": "unknown fields", "unknown_fields": [{"path": f.path, "suggestion": f.suggestion} for f in fields]}
        print(json.dumps(doc, indent=2))
    return EXIT_REFUSED


def apply_command(args: argparse.Namespace) -> int:
    state_dir = args.state_dir.resolve()
    try:
        data = read_regular(args.spec, max_bytes=SPEC_FILE_MAX_BYTES)
    except OSError as exc:
        return _refused(args, f"{args.spec}: cannot read ({exc.strerror or exc})")
    given = None
    try:
        if not getattr(args, "generation_from_file", False):  # a Namespace built by a caller, not the parser
            # the control plane gives generations; one from a file is taken only when asked (issue 41.5)
            data, given = unasked_generation(data)
        checked = check_spec(data, allow_unknown_fields=args.allow_unknown_fields)
    except UnknownFieldsError as exc:
        return _unknown(args, exc)
    except BadMessage as exc:
        return _refused(args, f"{args.spec}: {exc}")
    if given is not None:
        print(f"note: {args.spec}: its generation {given} is ignored; the control plane puts the next one (--generation-from-file takes it)", file=sys.stderr)
    info = node_info(state_dir)
    if args.dry_run:
        return _dry_run(args, info, checked)
    if info.put_command:
        # the compose node: its control plane's key is its container's, and it signs there
        return _refused(args, f"{args.state_dir} is a node whose control plane signs in its own container: {put_advice(info, args.spec)} (a dry run works here)")
    events = Path(info.controlplane_dir) / EVENTS_FILE if info.controlplane_dir else None
    offset = events_offset(events) if events is not None else 0
    try:
        result = asyncio.run(
            put_through_node(
                state_dir,
                data,
                allow_unknown_fields=args.allow_unknown_fields,
                force=args.force,
                connect_timeout=getattr(args, "timeout", None) or 5.0,
            )
        )
    except UnknownFieldsError as exc:  # checked above; the control plane checks again
        return _unknown(args, exc)
    except UnknownNode as exc:
        return _refused(args, f"{exc}: is the node id right? Nothing was put (--force puts it anyway)", {"node_id": exc.node_id})
    except BadMessage as exc:
        return _refused(args, f"{args.spec}: {exc}")
    except ConnectionError as exc:
        return _refused(args, f"{exc}; is `bcd up` running? (--state-dir {args.state_dir})", code=EXIT_UNREACHABLE)
    except (OSError, ValueError) as exc:  # a node joined to another upstream
        return _refused(args, str(exc))
    except (KeyFileError, StateError) as exc:  # the control plane's files: the text says what to do
        return _refused(args, str(exc))
    except GenerationExhausted as exc:  # the node's situation, not the spec's: refused, what to do said
        return _refused(args, str(exc), {"node_id": exc.node_id}, code=EXIT_FAILED)
    wait = args.wait if args.wait is not None else sys.stdout.isatty()
    if result.note:
        print(f"note: {result.note}", file=sys.stderr)
    applied = f"applied {args.spec} as generation {result.generation}"
    if result.unknown_fields:
        applied += f" with {len(result.unknown_fields)} field(s) this control plane does not know, as given"
    if not wait:
        if args.json:
            print(json.dumps(_put_json(args, result), indent=2))
        else:
            print(applied)
        return 0
    _say(applied + "; waiting for the node's outcome...", json_mode=args.json)
    assert events is not None  # put_through_node refuses a node without an embedded control plane
    # the record names the holds the spec dropped; no result is taken from it (only the node's events)
    follower = Follower.for_spec(result.spec, result.generation, peek_state(Path(info.controlplane_dir)).reservations)
    try:
        follow(events, offset, follower, timeout=args.wait_timeout, emit=lambda text: _say(text, json_mode=args.json))
    except KeyboardInterrupt:
        _say(f"stopped waiting; generation {result.generation} stays put (`bcd events` follows it)", json_mode=args.json)
        return 130
    for line in follower.summary(args.wait_timeout):
        _say(line, json_mode=args.json)
    if args.json:
        print(json.dumps({**_put_json(args, result), **follower.to_json()}, indent=2))
    return follower.exit_code()


def add_rebase_arguments(p: argparse.ArgumentParser) -> None:
    """`bcd rebase`'s own flags (the parser gives --state-dir, --json, --timeout)."""
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="follow the rebased generation to the node's outcome, as `apply --wait` (default: wait when stdout is a terminal)",
    )
    p.add_argument("--wait-timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS", help="as apply's (default %(default)g)")


def rebase_command(args: argparse.Namespace) -> int:
    """`bcd rebase`: the node's embedded control plane, with its key, brings a node put above
    2^53 - 1 back to its count (controlplane.publish.SpecPublisher.rebase): the same spec at
    a generation never put before, which the node takes though it is lower; its holds kept.
    Exit 0 rebased (with --wait: the node reported it CONVERGED), 1 nothing to rebase or the
    node's outcome not CONVERGED, 2 a node whose control plane is not here, 3 unreachable."""
    state_dir = args.state_dir.resolve()
    info = node_info(state_dir)
    args.spec = "the node's spec"
    if info.put_command:
        return _refused(args, f"{args.state_dir} is a node whose control plane signs in its own container: rebase it there (`python -m controlplane rebase {info.node_id}`)")
    events = Path(info.controlplane_dir) / EVENTS_FILE if info.controlplane_dir else None
    offset = events_offset(events) if events is not None else 0
    try:
        result = asyncio.run(rebase_through_node(state_dir, connect_timeout=getattr(args, "timeout", None) or 5.0))
    except RebaseRefused as exc:
        return _refused(args, str(exc), code=EXIT_FAILED)
    except ConnectionError as exc:
        return _refused(args, f"{exc}; is `bcd up` running? (--state-dir {args.state_dir})", code=EXIT_UNREACHABLE)
    except ValueError as exc:  # a node joined to another upstream
        return _refused(args, str(exc))
    except (KeyFileError, StateError) as exc:
        return _refused(args, str(exc))
    stuck = result.spec.rebase_from
    said = f"rebased node {result.node_id} from generation {stuck} to {result.generation}: its spec as it was, its holds kept"
    wait = args.wait if args.wait is not None else sys.stdout.isatty()
    if not wait or events is None:
        if args.json:
            print(json.dumps({**_put_json(args, result), "rebased_from": stuck, "outcome": "rebased"}, indent=2))
        else:
            print(said)
        return 0
    _say(said + "; waiting for the node's outcome...", json_mode=args.json)
    follower = Follower.for_spec(result.spec, result.generation, peek_state(Path(info.controlplane_dir)).reservations)
    follow(events, offset, follower, timeout=args.wait_timeout, emit=lambda text: _say(text, json_mode=args.json))
    for line in follower.summary(args.wait_timeout):
        _say(line, json_mode=args.json)
    if args.json:
        print(json.dumps({**_put_json(args, result), "rebased_from": stuck, **follower.to_json()}, indent=2))
    return follower.exit_code()


def put_advice(info: Any, spec: object) -> str:
    """How a spec is put on this node, in words: one answer for the dry run's advice and apply's refusal.

    A compose node's control plane signs in its own container (`put_command`), where `bcd
    apply` refuses; everywhere else `bcd apply` puts it.
    """
    from .dryrun import APPLY_ADVICE

    if info.put_command:
        return f"put the spec with `{info.put_command.replace('SPEC', str(spec))}`"
    return APPLY_ADVICE


def _put_json(args: argparse.Namespace, result: PutResult) -> dict[str, Any]:
    return {
        "spec": str(args.spec),
        "node_id": result.node_id,
        "generation": result.generation,
        "note": result.note,
        "unknown_fields": [str(f) for f in result.unknown_fields],
        "outcome": "applied",
    }


def _dry_run(args: argparse.Namespace, info: Any, checked: Any) -> int:
    import msgspec

    from .dryrun import dry_run, dry_run_json, render_dry_run

    spec = checked.draft
    if spec.node_id != info.node_id:
        return _refused(args, f"the spec names node {spec.node_id}; {args.state_dir} is node {info.node_id}: a dry run plans against this node only")
    try:
        generation, _ = next_generation(peek_state(Path(info.controlplane_dir)), spec.node_id, checked.requested) if info.controlplane_dir else (
            checked.requested if checked.requested is not None else 0,
            "",
        )
    except GenerationExhausted as exc:  # what the put would say, said by the dry run too (not an internal error)
        return _refused(args, str(exc), {"node_id": exc.node_id}, code=EXIT_FAILED)
    # a node bus or service that does not answer ends in bcd.exits (exit 3 or 4)
    try:
        d = dry_run(info, msgspec.structs.replace(spec, generation=generation), checked)
    except BadMessage as exc:  # SpecTooLarge: the put's own check, so both give one answer
        return _refused(args, f"{args.spec}: {exc}")
    if args.json:
        print(json.dumps({"spec": str(args.spec), **dry_run_json(d)}, indent=2))
    else:
        print(render_dry_run(d, str(args.spec), put_advice(info, args.spec)))
    return 1 if d.would_fail else 0


__all__ = ["add_arguments", "add_rebase_arguments", "apply_command", "rebase_command", "EXIT_REFUSED", "DEFAULT_TIMEOUT_S"]
