"""The one way the inventory starts or stops bcd's root sharing units: `bcd-sharing@.service`.

systemd accepts each connection on /run/bcd/sharing.sock (deploy/systemd/bcd-sharing.socket:
root's, group bcd-inventory, 0660, `Accept=yes`) and runs this as root, the connection on
stdin and stdout. It takes one request line of at most REQUEST_MAX bytes, from a peer whose uid
SO_PEERCRED says is the inventory's user (BCD_SHARING_CLIENT, default bcd-inventory):

    mps-start <control>                  systemctl start bcd-mps@<control>.service
    mps-stop <control>                   systemctl stop bcd-mps@<control>.service
    timeslice <GPU uuid>:<interval>      systemctl start bcd-timeslice@<uuid>:<interval>.service

each word checked as the units check their instance (sharing_unit.checked_control and
checked_timeslice), nothing else accepted. systemctl runs with `--job-mode=fail`: the job is
queued only where it conflicts with no job already queued, so nothing asked here cancels or
replaces another job. (polkit, which granted this before, is handed only the unit and the verb:
a caller allowed to start a unit could pick the mode `flush` or `replace-irreversibly` and
cancel every job queued on the host, a shutdown's included.)

It answers one line: `done <what>`, or `<outcome> <why>` with SharingStepError's outcomes, and
logs each request with its answer on stderr (the journal).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import struct
import sys
from collections.abc import Callable, Mapping

from .adapters.nvidia_sharing import MPS_UNIT, SYSTEMCTL, TIMESLICE_UNIT, CommandRunner, SubprocessRunner
from .sharing_unit import UsageError, checked_control, checked_timeslice

#: the longest request line, its newline included (a timeslice request is 56 bytes)
REQUEST_MAX = 128
#: how long a peer may take to send its line
READ_TIMEOUT_S = 10.0
#: how long systemctl may wait for a unit's job: bcd-mps@'s TimeoutStartSec= (60 s, its
#: ExecStartPre= included) and a failed start's ExecStopPost=, under the inventory's wait for
#: the answer (nvidia_sharing.NvidiaSharing.unit_timeout, 85 s) and the converger's (90 s); a
#: systemctl given up on leaves the job to systemd, which ends it within the unit's timeouts
JOB_TIMEOUT_S = 80.0
DEFAULT_CLIENT = "bcd-inventory"
_REQUEST = re.compile(r"^(mps-start|mps-stop|timeslice) ([!-~]+)\Z")
_SO_PEERCRED = struct.Struct("3i")


def unit_for(line: str) -> tuple[str, str]:
    """(systemctl verb, unit) for one request line; UsageError for anything else."""
    m = _REQUEST.match(line)
    if not m:
        raise UsageError(f"{line[:80]!r} is not 'mps-start <control>', 'mps-stop <control>' or 'timeslice <GPU uuid>:<interval>'")
    step, arg = m.groups()
    if step == "timeslice":
        uuid, interval = checked_timeslice(arg)
        return "start", TIMESLICE_UNIT.format(uuid=uuid, interval=interval)
    return ("start" if step == "mps-start" else "stop"), MPS_UNIT.format(control=checked_control(arg))


def handle(line: str, *, runner: CommandRunner, which: Callable[[str], str | None] = shutil.which) -> str:
    """The answer line to one request line (without its newline)."""
    try:
        verb, unit = unit_for(line)
    except UsageError as exc:
        return f"refused {exc}"
    systemctl = which(SYSTEMCTL)
    if systemctl is None:
        return "not-supported systemctl is not on PATH"
    argv = [systemctl, "--no-ask-password", "--job-mode=fail", verb, unit]
    try:
        code, out, err = runner.run(argv, {"PATH": os.environ.get("PATH", os.defpath)}, "", JOB_TIMEOUT_S)
    except TimeoutError:
        return f"failed systemctl {verb} {unit}: no answer within {JOB_TIMEOUT_S:g} s (journalctl -u {unit})"
    except OSError as exc:
        return f"failed systemctl could not run: {exc.strerror or exc}"
    if code != 0:
        said = next((ln.strip() for ln in (err + out).splitlines() if ln.strip()), f"exit status {code}")
        return f"failed {said} (journalctl -u {unit})"
    return f"done {verb} {unit}"


def peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = _SO_PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _SO_PEERCRED.size))
    return uid


def read_request(conn: socket.socket) -> str:
    """The peer's line (without its newline); UsageError when it is longer than REQUEST_MAX,
    not one line of ASCII, or late."""
    conn.settimeout(READ_TIMEOUT_S)
    data = b""
    try:
        while b"\n" not in data and len(data) <= REQUEST_MAX:
            chunk = conn.recv(REQUEST_MAX + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        raise UsageError(f"no request line within {READ_TIMEOUT_S:g} s") from None
    if len(data) > REQUEST_MAX or data.count(b"\n") > 1 or (b"\n" in data and not data.endswith(b"\n")):
        raise UsageError(f"a request is one line of at most {REQUEST_MAX} bytes")
    try:
        return data.decode("ascii").removesuffix("\n")
    except UnicodeDecodeError:
        raise UsageError("a request is ASCII") from None


def serve(conn: socket.socket, client_uid: int, *, runner: CommandRunner, which: Callable[[str], str | None] = shutil.which) -> str:
    """One connection: checked, read, done, answered; the answer line."""
    uid = peer_uid(conn)
    line = ""
    if uid != client_uid:
        # the socket's mode lets group bcd-inventory in; of that group, only the inventory's user asks
        answer = f"refused uid {uid} is not the inventory's ({client_uid})"
    else:
        try:
            line = read_request(conn)
        except UsageError as exc:
            answer = f"refused {exc}"
        else:
            answer = handle(line, runner=runner, which=which)
    print(f"bcd sharing gate: uid {uid} asked {line[:80]!r}: {answer}", file=sys.stderr)
    try:
        conn.sendall(f"{answer}\n".encode())
    except OSError:
        pass  # the peer went; what was done is in the journal
    return answer


def main(environ: Mapping[str, str] | None = None, *, runner: CommandRunner | None = None) -> int:
    env = os.environ if environ is None else environ
    name = env.get("BCD_SHARING_CLIENT") or DEFAULT_CLIENT
    try:
        client_uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        print(f"bcd sharing gate: no user {name!r} (BCD_SHARING_CLIENT): every request is refused", file=sys.stderr)
        client_uid = -1
    try:
        conn = socket.socket(fileno=0)
    except OSError as exc:
        print(f"bcd sharing gate: stdin is not the connection (run by bcd-sharing.socket): {exc.strerror or exc}", file=sys.stderr)
        return 2
    with conn:
        if conn.family != socket.AF_UNIX:
            print("bcd sharing gate: stdin is not a unix socket", file=sys.stderr)
            return 2
        answer = serve(conn, client_uid, runner=runner or SubprocessRunner())
    return 0 if answer.startswith("done ") else 1


if __name__ == "__main__":
    sys.exit(main())
