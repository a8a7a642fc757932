"""adminAccess (KEP-5018) as the DRA plugin reads it from a ResourceClaim's allocation results."""

from __future__ import annotations

from services.dra_plugin.kubeapi import ClaimView


def test_admin_access_is_read_from_the_allocation_result_true_only() -> None:
    obj = {
        "metadata": {"uid": "u", "namespace": "monitoring", "name": "m"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": "gpu.bcd.dev", "pool": "node-1", "device": "gpu-0", "adminAccess": True},
            {"request": "gpus", "driver": "gpu.bcd.dev", "pool": "node-1", "device": "gpu-1", "adminAccess": False},
            {"request": "gpus", "driver": "gpu.bcd.dev", "pool": "node-1", "device": "gpu-2", "adminAccess": "true"},
            {"request": "gpus", "driver": "gpu.bcd.dev", "pool": "node-1", "device": "gpu-3"},
        ]}}},
    }
    view = ClaimView.from_object(obj)
    assert [r.admin_access for r in view.results] == [True, False, False, False]
