"""The HostWriter port: the only way the converger changes the host.

Every path is built from a validated allocation id; every file's bytes are
built from typed fields (HoldContent) plus the vendor CDI spec on disk, by
`shared.holdfiles.hold_file_bytes` - nothing from the wire names a path, a
device node or a hook. A hold spec's consumer copy (kind `cdi-consumer`, in
the consumer dir) is made from the hold spec on disk alone
(`shared.holdfiles.consumer_file_bytes`), so the two always agree. Two
writers implement the port:

- `LocalHostWriter`, in process, for a converger that runs as root or on a
  fake host;
- `HelperHostWriter`, for an unprivileged one: every operation is a request
  to the root helper (services/helper) over the node bus, carrying typed
  fields only; the helper builds the same bytes with the same function.

Every failure is a `HostWriteError`: retryable, the pass tries again. A
refusal by the helper is one too (retried like a failed write).

The port is synchronous (the applier calls it on the event loop, as it does
the local writer's fsyncs), so `HelperHostWriter` talks to the helper over a
connection of its own, served by a thread with its own event loop
(`BusHelperTransport`); each call blocks the converger's loop for one
request (milliseconds; at most `timeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import nats
import nats.errors
from nats.aio.client import Client

from shared.fsutil import (
    TEMP_MARK,
    FileWrite,
    atomic_write,
    atomic_write_many,
    fsync_dirs,
    in_the_way,
    is_temp_name,
    occupant,
    read_regular,
    remove_durably,
    remove_many,
)
from shared.holdfiles import (
    ENV_SUBDIR,
    HOLD_FILE_MAX_BYTES,
    HoldContent,
    NotAHold,
    VendorCache,
    consumer_file_bytes,
    hold_file_bytes,
    hold_to_wire,
    limits_to_wire,
)
from shared.schemas import (
    HELPER_INFO_CODEC,
    HELPER_REPLY_CODEC,
    ID_RE,
    BadMessage,
    Empty,
    HelperFileCopy,
    HelperFileRemove,
    HelperFileWrite,
    HelperInfo,
    HelperReply,
    HelperSliceApply,
    HelperSliceRemove,
    Limits,
    encode,
)
from shared.slices import SliceError, Slices
from shared.subjects import SERVICE_ERROR_CODE_HEADER, SERVICE_ERROR_HEADER, NodeSubjects, inbox_prefix
from shared.vendorcdi import VendorSpecError


class HostWriteError(Exception):
    """A write the pass must retry (read-only dir, full disk, helper refusal, D-Bus)."""


#: the hold files a batch writes or removes: the CDI spec, its consumer copy, the env file.
HoldFileKind = Literal["cdi", "cdi-consumer", "allocation-env"]
#: called with the allocation id once its file is in place (or gone): a crash point.
Done = Callable[[str], None]


class HostWriter(Protocol):
    def write_cdi(self, content: HoldContent) -> None: ...
    def remove_cdi(self, allocation_id: str) -> None: ...
    def write_env(self, content: HoldContent) -> None: ...
    def remove_env(self, allocation_id: str) -> None: ...
    def write_consumer(self, allocation_id: str) -> None:
        """The consumer copy of the hold spec now on disk (nothing when this writer makes none)."""
        ...
    def remove_consumer(self, allocation_id: str) -> None: ...
    def apply_slice(self, allocation_id: str, limits: Limits) -> None: ...
    def stop_slice(self, allocation_id: str) -> bool: ...
    def remove_temp(self, path: str) -> None: ...

    def write_many(
        self, kind: HoldFileKind, contents: Sequence[HoldContent], done: Done = ..., *, dirs: set[Path] | None = None
    ) -> dict[str, HostWriteError]:
        """Write one kind of hold file for many holds as one group; the error of each that failed.
        (`cdi-consumer`: the copies of the hold specs on disk; the contents name the holds.)

        `dirs`: the directories whose sync the caller does later (`sync_dirs`), for the
        whole of a pass's batch at once; None: synced before it returns. A writer whose
        writes are synced anyway (the root helper) leaves it empty."""
        ...

    def remove_many(
        self, kind: HoldFileKind, allocation_ids: Sequence[str], done: Done = ..., *, dirs: set[Path] | None = None
    ) -> dict[str, HostWriteError]:
        """Remove one kind of hold file of many holds as one group; the error of each that failed (`dirs` as above)."""
        ...

    def sync_dirs(self, dirs: set[Path]) -> None:
        """fsync the directories write_many/remove_many left to the caller; HostWriteError when one fails."""
        ...


def _checked(allocation_id: str) -> str:
    if not ID_RE.match(allocation_id):
        raise HostWriteError(f"refusing allocation id {allocation_id!r}: not a valid id")
    return allocation_id


def cdi_path(cdi_dir: Path, allocation_id: str) -> Path:
    return Path(cdi_dir) / f"bcd-{_checked(allocation_id)}.json"


def env_path(run_dir: Path, allocation_id: str) -> Path:
    return Path(run_dir) / ENV_SUBDIR / f"{_checked(allocation_id)}.env"


def consumer_path(consumer_dir: Path, allocation_id: str) -> Path:
    return Path(consumer_dir) / f"bcd-{_checked(allocation_id)}.json"


class LocalHostWriter:
    def __init__(
        self,
        cdi_dir: Path,
        run_dir: Path,
        slices: Slices,
        crash: Callable[[str], None] = lambda _: None,
        *,
        consumer_dir: Path | None = None,
    ) -> None:
        self.cdi_dir = Path(cdi_dir)
        self.run_dir = Path(run_dir)
        #: where the consumer copies go; None: this writer makes none (a test's, or a bare writer)
        self.consumer_dir = Path(consumer_dir) if consumer_dir is not None else None
        self.slices = slices
        self.crash = crash
        self.vendor = VendorCache(self.cdi_dir)

    @staticmethod
    def _ready(path: Path) -> None:
        """Make the file's directory; HostWriteError when something not ours is at its name
        (a directory fails the rename, a FIFO or a device is someone else's): retried until
        someone removes it. Raises OSError as mkdir and lstat do."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if in_the_way(mode):
            raise HostWriteError(f"cannot write {path}: {occupant(path)} is in the way (bcd does not remove it; remove it to bind)")

    def _write(self, path: Path, data: bytes, point: str) -> None:
        try:
            self._ready(path)
            atomic_write(path, data, 0o644, before_rename=lambda: self.crash(point))
        except OSError as exc:
            raise HostWriteError(f"cannot write {path}: {exc.strerror or exc}") from None

    def _remove(self, path: Path) -> None:
        try:
            remove_durably(path)
        except OSError as exc:
            raise HostWriteError(f"cannot remove {path}: {exc.strerror or exc}") from None

    def write_cdi(self, content: HoldContent) -> None:
        try:
            vendor = self.vendor.get()
        except VendorSpecError as exc:
            raise HostWriteError(f"vendor CDI spec unreadable: {exc}") from None
        data = hold_file_bytes("cdi", content, vendor)
        self._write(cdi_path(self.cdi_dir, content.allocation_id), data, "bind.cdi-temp-written")

    def remove_cdi(self, allocation_id: str) -> None:
        self._remove(cdi_path(self.cdi_dir, allocation_id))

    def write_env(self, content: HoldContent) -> None:
        self._write(env_path(self.run_dir, content.allocation_id), hold_file_bytes("allocation-env", content, None), "bind.env-temp-written")

    def remove_env(self, allocation_id: str) -> None:
        self._remove(env_path(self.run_dir, allocation_id))

    def _consumer_bytes(self, allocation_id: str) -> bytes:
        """The consumer copy of the hold spec on disk; HostWriteError when there is no hold to copy."""
        path = cdi_path(self.cdi_dir, allocation_id)
        try:
            return consumer_file_bytes(allocation_id, read_regular(path, max_bytes=HOLD_FILE_MAX_BYTES))
        except FileNotFoundError:
            raise HostWriteError(f"no consumer copy of {allocation_id}: its hold spec {path} is gone") from None
        except NotAHold as exc:
            raise HostWriteError(f"no consumer copy of {allocation_id}: {path} is not its hold ({exc.reason})") from None
        except (OSError, ValueError) as exc:
            raise HostWriteError(f"no consumer copy of {allocation_id}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None

    def write_consumer(self, allocation_id: str) -> None:
        if self.consumer_dir is not None:
            self._write(consumer_path(self.consumer_dir, allocation_id), self._consumer_bytes(allocation_id), "bind.consumer-temp-written")

    def remove_consumer(self, allocation_id: str) -> None:
        if self.consumer_dir is not None:
            self._remove(consumer_path(self.consumer_dir, allocation_id))

    def apply_slice(self, allocation_id: str, limits: Limits) -> None:
        try:
            self.slices.apply(_checked(allocation_id), limits)
        except (SliceError, OSError) as exc:
            raise HostWriteError(f"slice of {allocation_id}: {exc}") from None

    def stop_slice(self, allocation_id: str) -> bool:
        try:
            return self.slices.stop(_checked(allocation_id))
        except (SliceError, OSError) as exc:
            raise HostWriteError(f"slice of {allocation_id}: {exc}") from None

    def remove_temp(self, path: str) -> None:
        p = Path(path)
        # only our own leftovers, only in our own directories
        ours = (self.cdi_dir, self.run_dir / ENV_SUBDIR, *((self.consumer_dir,) if self.consumer_dir is not None else ()))
        if not is_temp_name(p.name) or p.parent not in ours:
            raise HostWriteError(f"refusing to remove {path}: not a temp file of ours")
        self._remove(p)

    def _path(self, kind: HoldFileKind, allocation_id: str) -> Path:
        if kind == "cdi-consumer":
            assert self.consumer_dir is not None
            return consumer_path(self.consumer_dir, allocation_id)
        return cdi_path(self.cdi_dir, allocation_id) if kind == "cdi" else env_path(self.run_dir, allocation_id)

    def write_many(
        self, kind: HoldFileKind, contents: Sequence[HoldContent], done: Done = lambda _: None, *, dirs: set[Path] | None = None
    ) -> dict[str, HostWriteError]:
        """All temps, one concurrent fsync, the renames, one directory fsync (shared.fsutil.atomic_write_many)."""
        errors: dict[str, HostWriteError] = {}
        if kind == "cdi-consumer" and self.consumer_dir is None:
            return errors
        vendor = None
        if kind == "cdi" and contents:
            try:
                vendor = self.vendor.get()
            except VendorSpecError as exc:
                return {c.allocation_id: HostWriteError(f"vendor CDI spec unreadable: {exc}") for c in contents}
        files: list[FileWrite] = []
        for c in contents:
            try:
                path = self._path(kind, c.allocation_id)
                self._ready(path)
            except HostWriteError as exc:
                errors[c.allocation_id] = exc
                continue
            except OSError as exc:
                errors[c.allocation_id] = HostWriteError(f"cannot write {path}: {exc.strerror or exc}")
                continue
            if kind == "cdi-consumer":
                try:
                    data = self._consumer_bytes(c.allocation_id)
                except HostWriteError as exc:
                    errors[c.allocation_id] = exc
                    continue
            else:
                data = hold_file_bytes(kind, c, vendor)
            files.append(FileWrite(c.allocation_id, path, data, 0o644))
        point = {"cdi": "bind.cdi-temp-written", "cdi-consumer": "bind.consumer-temp-written"}.get(kind, "bind.env-temp-written")
        try:
            failed = atomic_write_many(files, after_temp=lambda _: self.crash(point), after_rename=lambda f: done(f.key), dirs=dirs)
        except OSError as exc:  # the directory fsync: nothing of the batch is known to be durable
            return {**errors, **{f.key: HostWriteError(f"cannot write {f.path}: {exc.strerror or exc}") for f in files}}
        for f in files:
            if f.key in failed:
                errors[f.key] = HostWriteError(f"cannot write {f.path}: {failed[f.key].strerror or failed[f.key]}")
        return errors

    def remove_many(
        self, kind: HoldFileKind, allocation_ids: Sequence[str], done: Done = lambda _: None, *, dirs: set[Path] | None = None
    ) -> dict[str, HostWriteError]:
        errors: dict[str, HostWriteError] = {}
        if kind == "cdi-consumer" and self.consumer_dir is None:
            return errors
        paths: list[tuple[str, Path]] = []
        for alloc in allocation_ids:
            try:
                paths.append((alloc, self._path(kind, alloc)))
            except HostWriteError as exc:
                errors[alloc] = exc
        try:
            failed = remove_many(paths, after_remove=done, dirs=dirs)
        except OSError as exc:
            return {**errors, **{a: HostWriteError(f"cannot remove {p}: {exc.strerror or exc}") for a, p in paths}}
        for alloc, path in paths:
            if alloc in failed:
                errors[alloc] = HostWriteError(f"cannot remove {path}: {failed[alloc].strerror or failed[alloc]}")
        return errors


    def sync_dirs(self, dirs: set[Path]) -> None:
        try:
            fsync_dirs(sorted(dirs))
        except OSError as exc:
            raise HostWriteError(f"cannot sync {', '.join(map(str, sorted(dirs)))}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------- through the root helper


class HelperTransport(Protocol):
    """One request to the helper: subject and encoded body in, reply body out.

    Raises HostWriteError when the helper cannot be reached or does not answer.
    """

    def request(self, subject: str, payload: bytes, timeout: float) -> bytes: ...

    def close(self) -> None: ...


class BusHelperTransport:
    """Requests to the helper over a node-bus connection of its own, in a thread of its own.

    `connect` opens the connection (the converger's NATS user); it runs on the
    transport's loop, lazily at the first request and again after a failure.
    """

    def __init__(self, connect: Callable[[], Awaitable[Client]], unreached: Callable[[str], None] = lambda _: None) -> None:
        self._connect = connect
        #: told when no helper answered (comeback.py: a pass runs again once one does)
        self.unreached = unreached
        self._nc: Client | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bcd-helper-bus", daemon=True)
        self._thread.start()
        self._closed = False

    async def _request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        if self._nc is None or self._nc.is_closed:
            self._nc = await asyncio.wait_for(self._connect(), timeout)
        msg = await self._nc.request(subject, payload, timeout=timeout)
        headers = msg.headers or {}
        if SERVICE_ERROR_HEADER in headers:
            # a bug in the helper (it answers every request it can decode with a HelperReply)
            raise HostWriteError(f"root helper error {headers.get(SERVICE_ERROR_CODE_HEADER, '500')}: {headers[SERVICE_ERROR_HEADER]}")
        return msg.data

    def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        if self._closed:
            raise HostWriteError("root helper: the converger is stopping")
        fut = asyncio.run_coroutine_threadsafe(self._request(subject, payload, timeout), self._loop)
        try:
            return fut.result(timeout + 1.0)
        except nats.errors.NoRespondersError:
            self.unreached("helper")
            raise HostWriteError("root helper not running (no responders)") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError, TimeoutError):
            fut.cancel()
            self.unreached("helper")
            raise HostWriteError(f"root helper did not answer within {timeout:g}s") from None
        except (nats.errors.Error, OSError) as exc:
            raise HostWriteError(f"root helper unreachable: {exc or type(exc).__name__}") from None

    async def _aclose(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), 3.0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()


_CDI_TEMP_RE = re.compile(r"^\.bcd-(?P<id>.+)\.json" + re.escape(TEMP_MARK) + r"(?P<pid>[1-9][0-9]{0,6})\Z")
_ENV_TEMP_RE = re.compile(r"^\.(?P<id>.+)\.env" + re.escape(TEMP_MARK) + r"(?P<pid>[1-9][0-9]{0,6})\Z")


def helper_mismatch(info: HelperInfo, cdi_dir: Path, run_dir: Path, slices_backend: str, consumer_dir: Path | None = None) -> str:
    """Why a helper cannot serve this converger ("" when it can): it must write where the converger reads."""
    problems = []
    dirs = [("CDI dir", cdi_dir, info.cdi_dir), ("run dir", run_dir, info.run_dir)]
    if consumer_dir is not None:
        dirs.append(("CDI consumer dir", consumer_dir, info.cdi_consumer_dir))
    for what, mine, theirs in dirs:
        if os.path.realpath(mine) != theirs:
            problems.append(f"the helper's {what} is {theirs or '(none: a helper older than consumer copies)'}, this converger's {os.path.realpath(mine)}")
    if slices_backend and info.slices != slices_backend:
        problems.append(f"the helper's slices are {info.slices}, this converger's {slices_backend}")
    return "; ".join(problems)


class HelperHostWriter:
    """The HostWriter port through the root helper (see the module docstring).

    Before its first write it asks the helper's `info` and checks the helper
    writes where this converger reads (`helper_mismatch`) and puts the same
    MPS pipe directory into slot holds; it asks again after any failed call,
    as the helper may have been restarted with other settings.
    """

    def __init__(
        self,
        transport: HelperTransport,
        subjects: NodeSubjects,
        cdi_dir: Path,
        run_dir: Path,
        *,
        slices_backend: str = "",
        timeout: float = 10.0,
        consumer_dir: Path | None = None,
    ) -> None:
        self.transport = transport
        self.subjects = subjects
        self.cdi_dir = Path(cdi_dir)
        self.run_dir = Path(run_dir)
        #: where the helper must write the consumer copies; None: none are asked for
        self.consumer_dir = Path(consumer_dir) if consumer_dir is not None else None
        self.slices_backend = slices_backend
        self.timeout = timeout
        self.info: HelperInfo | None = None

    def _info(self) -> HelperInfo:
        if self.info is None:
            data = self.transport.request(self.subjects.helper_info, encode(Empty()), self.timeout)
            try:
                info = HELPER_INFO_CODEC.decode(data)
            except BadMessage as exc:
                raise HostWriteError(f"root helper: info does not decode ({exc})") from None
            problem = helper_mismatch(info, self.cdi_dir, self.run_dir, self.slices_backend, self.consumer_dir)
            if problem:
                raise HostWriteError(f"root helper cannot serve this converger: {problem}")
            self.info = info
        return self.info

    def _call(self, what: str, subject: str, body: object) -> HelperReply:
        self._info()
        try:
            data = self.transport.request(subject, encode(body), self.timeout)
            reply = HELPER_REPLY_CODEC.decode(data)
        except HostWriteError:
            self.info = None
            raise
        except BadMessage as exc:
            self.info = None
            raise HostWriteError(f"{what}: the root helper's reply does not decode ({exc})") from None
        if not reply.ok:
            self.info = None
            raise HostWriteError(f"{what}: root helper {reply.outcome or 'refused'}: {reply.reason}")
        return reply

    def _hold(self, content: HoldContent) -> Any:
        try:
            wire = hold_to_wire(content)
        except ValueError as exc:
            raise HostWriteError(str(exc)) from None
        info = self._info()
        if content.mps_pipe_dir and content.mps_pipe_dir != info.mps_pipe_dir:
            raise HostWriteError(
                f"{content.allocation_id}: the root helper's MPS pipe directory is {info.mps_pipe_dir!r}, "
                f"the inventory's {content.mps_pipe_dir!r}: give the helper --mps-pipe-dir {content.mps_pipe_dir}"
            )
        return wire

    def write_cdi(self, content: HoldContent) -> None:
        body = HelperFileWrite(kind="cdi", hold=self._hold(content))
        self._call(f"CDI spec of {content.allocation_id}", self.subjects.helper_file_write, body)

    def write_env(self, content: HoldContent) -> None:
        body = HelperFileWrite(kind="allocation-env", hold=self._hold(content))
        self._call(f"env file of {content.allocation_id}", self.subjects.helper_file_write, body)

    def remove_cdi(self, allocation_id: str) -> None:
        body = HelperFileRemove(kind="cdi", allocation_id=_checked(allocation_id))
        self._call(f"CDI spec of {allocation_id}", self.subjects.helper_file_remove, body)

    def remove_env(self, allocation_id: str) -> None:
        body = HelperFileRemove(kind="allocation-env", allocation_id=_checked(allocation_id))
        self._call(f"env file of {allocation_id}", self.subjects.helper_file_remove, body)

    def write_consumer(self, allocation_id: str) -> None:
        if self.consumer_dir is not None:
            body = HelperFileCopy(allocation_id=_checked(allocation_id))
            self._call(f"consumer copy of {allocation_id}", self.subjects.helper_file_copy, body)

    def remove_consumer(self, allocation_id: str) -> None:
        if self.consumer_dir is not None:
            body = HelperFileRemove(kind="cdi-consumer", allocation_id=_checked(allocation_id))
            self._call(f"consumer copy of {allocation_id}", self.subjects.helper_file_remove, body)

    def apply_slice(self, allocation_id: str, limits: Limits) -> None:
        body = HelperSliceApply(allocation_id=_checked(allocation_id), limits=limits_to_wire(limits))
        self._call(f"slice of {allocation_id}", self.subjects.helper_slice_apply, body)

    def stop_slice(self, allocation_id: str) -> bool:
        body = HelperSliceRemove(allocation_id=_checked(allocation_id))
        return self._call(f"slice of {allocation_id}", self.subjects.helper_slice_remove, body).gone

    def remove_temp(self, path: str) -> None:
        p = Path(path)
        kind = ""
        if p.parent == self.cdi_dir:
            m, kind = _CDI_TEMP_RE.match(p.name), "cdi"
        elif self.consumer_dir is not None and p.parent == self.consumer_dir:
            m, kind = _CDI_TEMP_RE.match(p.name), "cdi-consumer"
        elif p.parent == self.run_dir / ENV_SUBDIR:
            m, kind = _ENV_TEMP_RE.match(p.name), "allocation-env"
        else:
            m = None
        if m is None or not ID_RE.match(m["id"]):
            raise HostWriteError(f"refusing to remove {path}: not a temp file of ours")
        body = HelperFileRemove(kind=kind, allocation_id=m["id"], temp_pid=int(m["pid"]))  # type: ignore[arg-type]
        self._call(f"temp file {p.name}", self.subjects.helper_file_remove, body)

    def write_many(
        self, kind: HoldFileKind, contents: Sequence[HoldContent], done: Done = lambda _: None, *, dirs: set[Path] | None = None
    ) -> dict[str, HostWriteError]:
        """One helper request per file (the helper writes and syncs each atomically: `dirs` stays empty)."""
        if kind == "cdi-consumer":
            if self.consumer_dir is None:
                return {}
            return _each([(c.allocation_id, lambda c=c: self.write_consumer(c.allocation_id)) for c in contents], done)
        write = self.write_cdi if kind == "cdi" else self.write_env
        return _each([(c.allocation_id, lambda c=c: write(c)) for c in contents], done)

    def remove_many(
        self, kind: HoldFileKind, allocation_ids: Sequence[str], done: Done = lambda _: None, *, dirs: set[Path] | None = None
    ) -> dict[str, HostWriteError]:
        if kind == "cdi-consumer" and self.consumer_dir is None:
            return {}
        remove = {"cdi": self.remove_cdi, "cdi-consumer": self.remove_consumer}.get(kind, self.remove_env)
        return _each([(a, lambda a=a: remove(a)) for a in allocation_ids], done)

    def sync_dirs(self, dirs: set[Path]) -> None:
        """Nothing left to sync: the helper synced each file and directory."""

    def close(self) -> None:
        self.transport.close()


def _each(calls: Sequence[tuple[str, Callable[[], object]]], done: Done) -> dict[str, HostWriteError]:
    """Run each (allocation id, call) in turn; the error of each that failed, `done` after each that did not."""
    errors: dict[str, HostWriteError] = {}
    for alloc, call_one in calls:
        try:
            call_one()
        except HostWriteError as exc:
            errors[alloc] = exc
            continue
        done(alloc)
    return errors


def writer_kind(mode: str, *, fake_host: bool, euid: int) -> str:
    """`--writer` resolved: "local" (in process) or "helper" (through the root helper).

    auto: local as root or on a fake host, else the helper; whether a helper
    answers decides only whether the node is privileged (see the service).
    """
    if mode not in ("auto", "local", "helper"):
        raise ValueError(f"--writer {mode!r} is not auto, local or helper")
    if mode == "auto":
        return "local" if fake_host or euid == 0 else "helper"
    return mode


def helper_connector(opts: Any) -> Callable[[], Awaitable[Client]]:
    """How BusHelperTransport connects: the converger's NATS user, password and inbox prefix."""

    async def connect() -> Client:
        password = Path(opts.nats_password_file).read_text().strip() if opts.nats_password_file else None

        async def quiet(_: Exception) -> None:
            """Connection trouble shows as a failed write (HostWriteError), logged by the pass."""

        return await nats.connect(
            opts.nats_url,
            name="bcd-converger-helper-writer",
            user=opts.nats_user if password is not None else None,
            password=password,
            inbox_prefix=inbox_prefix(opts.nats_user).encode(),
            error_cb=quiet,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            connect_timeout=3,
        )

    return connect


__all__ = [
    "HostWriteError",
    "HoldFileKind",
    "HostWriter",
    "LocalHostWriter",
    "cdi_path",
    "consumer_path",
    "env_path",
    "HelperTransport",
    "BusHelperTransport",
    "HelperHostWriter",
    "helper_mismatch",
    "helper_connector",
    "writer_kind",
]
