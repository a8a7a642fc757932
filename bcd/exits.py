"""How every `bcd` command ends: the exit codes, defined once, and the one wrapper around all commands.

`run_command` is what `bcd.cli.main` calls for every subcommand. A command
returns its code (0 ok, 1 unhealthy) or raises; whatever it raises ends as ONE
line on stderr and a documented code, never a traceback (unless `--debug`):
no node or an unreachable node bus is 3, a service that does not answer is 4,
an exception that declares itself an operator's situation (`operator_error =
True`: an unsafe key file, a state file that does not read) is its text,
a closed stdout (`bcd status | head -1`) is 141 and Ctrl-C is 130, both quiet.
"""

from __future__ import annotations

import asyncio
import enum
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    NO_SERVICE = 4
    INTERRUPTED = 130
    BROKEN_PIPE = 141


#: (code, meaning), in the order `bcd --help`, the man page and the README list them.
EXIT_CODES: tuple[tuple[Exit, str], ...] = (
    (Exit.OK, "ok: done, or healthy"),
    (Exit.FAILED, "unhealthy (status, doctor, bus), refused or failed, or an internal error"),
    (Exit.USAGE, "usage or input error: a bad flag, an address the inventory does not list"),
    (Exit.UNREACHABLE, "node not reachable: no node at --state-dir, no answer within --timeout"),
    (Exit.NO_SERVICE, "a service the command needs did not answer (see `bcd ping`)"),
    (Exit.INTERRUPTED, "interrupted (Ctrl-C)"),
    (Exit.BROKEN_PIPE, "stdout closed early (`bcd status | head -1`): 128 + SIGPIPE, quietly"),
)


def exit_codes_text() -> str:
    """The table for `bcd --help`'s epilog."""
    return "exit codes:\n" + "\n".join(f"  {int(code):<4} {meaning}" for code, meaning in EXIT_CODES)


class CliError(Exception):
    """A failure the operator gets as one line, `bcd: <message>`, with `code` as the exit status."""

    code: int = Exit.FAILED

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class UsageError(CliError):
    """Bad flags or input (exit 2)."""

    code = Exit.USAGE


class Unreachable(CliError):
    """No node at the state dir, or its node bus did not answer (exit 3).

    `state_hint`: append "is `bcd up` running? (--state-dir X)" to the line.
    """

    code = Exit.UNREACHABLE
    state_hint = True


class ServiceUnavailable(CliError):
    """The node bus answered, the service a command needs did not (exit 4)."""

    code = Exit.NO_SERVICE


def _quiet_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's last flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to silence
        pass


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed too: the exit code still says it
        pass


def run_command(func: Callable[[Any], int | None], args: Any, *, debug: bool = False) -> int:
    """Run one subcommand; every way it can end is an exit code from `Exit` (see EXIT_CODES)."""
    import nats.errors

    from shared.runtime import ServiceCallError

    state = getattr(args, "state_dir", None)

    def fail(code: int, line: str) -> int:
        if debug:
            traceback.print_exc()
        _say(line)
        return code

    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return int(code or 0)
    except BrokenPipeError:
        _quiet_stdout()
        return Exit.BROKEN_PIPE
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        return Exit.INTERRUPTED
    except Unreachable as exc:
        hint = f"; is `bcd up` running? (--state-dir {state})" if exc.state_hint and state is not None else ""
        return fail(exc.code, f"bcd: {exc}{hint}")
    except CliError as exc:
        return fail(exc.code, f"bcd: {exc}")
    except ServiceCallError as exc:
        # 400: the request did not decode at the service (what the operator typed); else a refusal
        return fail(Exit.USAGE if str(exc.code) == "400" else Exit.FAILED, f"bcd: the node refused: {exc}")
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
        return fail(Exit.NO_SERVICE, f"bcd: a service did not answer ({type(exc).__name__}); see `bcd ping --state-dir {state}`")
    except (nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError, nats.errors.UnexpectedEOF) as exc:
        return fail(Exit.UNREACHABLE, f"bcd: lost the node bus ({type(exc).__name__}); is `bcd up` running? (--state-dir {state})")
    except Exception as exc:  # noqa: BLE001 - a bug still ends as one line; --debug shows where
        if getattr(exc, "operator_error", False):
            # a situation an operator can be in (an unsafe key file, a state file that does not
            # read), raised by code below the CLI that says what to do: not a bug
            return fail(Exit.FAILED, f"bcd: {exc}")
        return fail(Exit.FAILED, f"bcd: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)")


__all__ = ["Exit", "EXIT_CODES", "exit_codes_text", "CliError", "UsageError", "Unreachable", "ServiceUnavailable", "run_command"]
