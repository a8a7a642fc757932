"""Which inventory changes start a pass (vfio.planner_view): not the ones a pass's own claims cause.

After every pass the inventory derives managementState, the Managed condition
and the phase from the new claims and publishes a new revision; a pass for
that alone plans nothing and only competes with the next spec for the CPU. A
change the planner reads must still start one.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from services.converger.vfio import planner_view
from shared.schemas import Condition
from tests.converger_kit import host_inventory, with_drivers, with_status

INV = host_inventory()
PCI = INV.gpus[0].pci_address
T = datetime(2026, 12, 1, tzinfo=timezone.utc)


def cond(type_: str, status: str, reason: str) -> Condition:
    return Condition(type=type_, status=status, reason=reason, since=T)  # type: ignore[arg-type]


def later(inv):  # noqa: ANN001, ANN201
    return msgspec.structs.replace(inv, revision=inv.revision + 1, observed_at=inv.observed_at + timedelta(seconds=3))


CHANGES = [
    # (what changed, the inventory after, does a pass run)
    ("nothing but revision and time", later(INV), False),
    ("a card became Managed (a hold claims it)", later(with_status(INV, PCI, management_state="Managed", conditions=(cond("Managed", "True", "Claimed"),))), False),
    ("a card became Unclaimed", later(with_status(INV, PCI, management_state="Unclaimed", conditions=(cond("Managed", "False", "Unclaimed"),))), False),
    ("the phase moved", later(msgspec.structs.replace(INV, gpus=[msgspec.structs.replace(INV.gpus[0], status=msgspec.structs.replace(INV.gpus[0].status, phase="Ready")), *INV.gpus[1:]])), False),
    ("the operator excluded a card", later(with_status(INV, PCI, management_state="Excluded")), True),
    ("an exclusion waits for a release", later(with_status(INV, PCI, conditions=(cond("Managed", "False", "ExcludedReleasePending"),))), True),
    ("a reclaim was admitted", later(with_status(INV, PCI, conditions=(cond("Reclaim", "Unknown", "InProgress"),))), True),
    ("a card is reconfiguring", later(with_status(INV, PCI, conditions=(cond("Reconfiguring", "True", "DisruptionRequired"),))), True),
    ("a card moved to vfio-pci", later(with_drivers(INV, {PCI: "vfio-pci"})), True),
    ("a card is gone", later(msgspec.structs.replace(INV, gpus=INV.gpus[1:])), True),
    ("an atom is gone", later(msgspec.structs.replace(INV, atoms=INV.atoms[1:])), True),
]


@pytest.mark.parametrize(("after", "runs"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_a_pass_runs_only_for_what_the_planner_reads(after, runs: bool) -> None:  # noqa: ANN001
    assert (planner_view(INV) != planner_view(after)) is runs
