"""What the converger's rooms share: the journal, the NodeSpec as accepted, the plan config, the pass lock.

Made once at setup and handed to each room (passes.py, endpoints.py,
cardclaims.py, claimdesk.py, maintenance.py, helperwatch.py), so that none
reaches into the app for them. Each field says who writes it; the others read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shared.schemas import NodeSpec

from .model import ConvergerState, PlanConfig
from .state import StateStore


@dataclass
class NodeFacts:
    #: the journal, loaded at setup (the same object from then on) and saved through `store`;
    #: the pass, the claim desk and maintenance change it under `lock`
    state: ConvergerState
    store: StateStore
    #: the planner's config; `privileged` is rewritten by the helper watch (helperwatch.py)
    config: PlanConfig
    #: the NodeSpec as accepted, kept on disk (the spec endpoint writes it; None: none yet)
    spec: NodeSpec | None = None
    #: fields of `spec` as received that NodeSpec does not declare (ignored; reported
    #: as condition NodeSpecUnknownFields at its generation).
    spec_unknown: tuple[str, ...] = ()
    #: one pass, claim prepare/unprepare or maintenance check at a time
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def privileged(self) -> bool:
        """Do plain holds bind (root, or a root helper that answers)?"""
        return self.config.privileged


__all__ = ["NodeFacts"]
