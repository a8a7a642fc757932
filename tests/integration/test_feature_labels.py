"""GPU feature labels on a whole node (issue 43): `bcd up` on the example fake host writes NFD's
feature file under its state dir with GFD's labels, each card carries the seed's labels in the
inventory, and a clean stop removes the file."""

from __future__ import annotations

import json
import signal

import pytest

from services.inventory.features import label_problem

from . import test_bcd_up
from .test_bcd_up import bcd, wait_for

#: the fixture of test_bcd_up: a whole node (`bcd up`) on the example h200x8 fake host
up = test_bcd_up.up

pytestmark = pytest.mark.integration


def test_bcd_up_writes_the_feature_file_and_removes_it_at_stop(up):
    proc, state, log = up
    path = state / "run" / "features.d" / "bcd-gpu"
    text = wait_for(lambda: path.read_text() if path.exists() else None, 60, "the feature file")
    lines = text.splitlines()
    assert lines[0].startswith("#")
    labels = dict(line.split("=", 1) for line in lines[1:])
    for name, value in labels.items():
        assert label_problem(name, value) == "", (name, value)
    # GFD's names and formats for 8 x H200 (two in MIG mode), driver 550.127.05, CUDA 12.4
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert labels["nvidia.com/gpu.memory"] == "143771"
    assert labels["nvidia.com/gpu.family"] == "hopper"
    assert (labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]) == ("9", "0")
    assert labels["nvidia.com/cuda.driver-version.full"] == "550.127.05"
    assert labels["nvidia.com/cuda.runtime-version.full"] == "12.4"
    assert labels["nvidia.com/mig.capable"] == "true"
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/mig-1g.18gb.count"] == "4"
    assert labels["nvidia.com/mig-1g.18gb.product"] == "NVIDIA-H200-MIG-1g.18gb"
    assert labels["gpu.deckhouse.io/sharing.mps"] == "true"

    inv = bcd("inventory", "--state-dir", str(state), "--json")
    assert inv.returncode == 0, inv.stderr
    gpus = json.loads(inv.stdout)["gpus"]
    assert {g["labels"]["gpu.deckhouse.io/node"] for g in gpus} == {"node-up"}
    assert {g["labels"]["gpu.deckhouse.io/device"] for g in gpus} == {"NVIDIA-H200"}
    # whole cards share (MPS, time slices); cards in MIG mode do not
    assert [g["labels"]["gpu.deckhouse.io/sharing.mps"] for g in gpus] == ["true"] * 6 + ["false"] * 2

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not path.exists(), "a clean stop removes the feature file: bcd no longer speaks for the node's GPUs"
    assert "GPU feature file removed" in (state / "logs" / "inventory.log").read_text()
