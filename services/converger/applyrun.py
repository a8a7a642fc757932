"""What one apply() carries between its single steps (apply.py) and its group commits (batch.py).

`ApplyResult` is what a pass learns from applying its plan, `PassRun` what
the batches and the single steps of one apply() tell each other, and
`CommitTools` what a group commit uses of the Applier (its writer, signer,
outbox, journal, clock and crash points). They sit below both modules so
that batch.py needs nothing of apply.py: the Applier runs GroupCommits and
hands itself to them as their CommitTools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from shared.schemas import SectionStatus

from .hostwriter import HostWriter
from .model import ConvergerState
from .outbox import Outbox, Signer


@dataclass
class ApplyResult:
    errors: list[str] = field(default_factory=list)
    done: int = 0
    section: SectionStatus | None = None
    #: a driver switch is to be asked for again (refused, failed, switcher unreachable).
    vfio_retry: bool = False
    #: switch requests sent in this pass.
    switch_requests: int = 0

    @property
    def retry(self) -> bool:
        return bool(self.errors)


@dataclass
class PassRun:
    """What one apply() has learnt so far, shared by its batches and its single steps."""

    #: a reported release failed: no bind (and no switch to vfio-pci) in this pass.
    release_failed: bool = False
    #: a release, or the undo of an unreported bind, failed: no switch to vfio-pci.
    switch_held: bool = False
    #: allocations whose Bound could not be reported in this pass.
    unreported: set[str] = field(default_factory=set)
    #: kept holds whose slice or env file could not be put back: no Bound for them yet.
    incomplete: set[str] = field(default_factory=set)
    #: the outbox has room for new binds.
    room: bool = True


class CommitTools(Protocol):
    """What a GroupCommit uses of the Applier that runs it."""

    writer: HostWriter
    signer: Signer
    outbox: Outbox
    save_state: Callable[[ConvergerState], None]
    boot_id: Callable[[], str]
    crash: Callable[[str], None]
    clock: Callable[[], datetime]


__all__ = ["ApplyResult", "PassRun", "CommitTools"]
