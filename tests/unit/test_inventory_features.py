"""GPU feature labels (issue 43): the pure labels as a table, Kubernetes' label syntax, and the
feature file's writer (atomic, only on change, symlink/FIFO refused, removed at stop)."""

from __future__ import annotations

import os
import stat
from datetime import datetime, timezone
from pathlib import Path

import pytest

from services.inventory.adapters import load_adapter
from services.inventory.build import build_inventory
from services.inventory.features import FeatureFile, FeatureKeeper, card_labels, label_problem, node_labels, render, sanitise
from shared.schemas import Gpu, GpuInstance, Inventory, MigInstance, MigProfile, PhysicalGPUStatus, Slot
from shared.schemas.inventory import DriverBinding

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hosts"
GIB = 1024**3


def _gpu(i: int, *, name: str = "NVIDIA A100-SXM4-40GB", mig: bool = False, slots: int = 0, mps: bool = False,
         instances: list[tuple[int, str]] | None = None, mode: str = "Compute") -> Gpu:
    uuid = f"GPU-{i:08d}-0000-4000-8000-000000000000"
    profiles = [
        MigProfile(name="1g.5gb", profile_id=19, slices=1, memory_bytes=4864 * 1024**2, multiprocessors=14, copy_engines=1, decoders=0, jpeg_engines=0),
        MigProfile(name="3g.20gb", profile_id=9, slices=3, memory_bytes=19968 * 1024**2, multiprocessors=42, copy_engines=3, decoders=2, jpeg_engines=0),
    ]
    instances = instances or []
    return Gpu(
        atom_id=uuid, uuid=uuid, index=i, pci_address=f"0000:{i + 16:02x}:00.0", name=name, vendor="nvidia",
        memory_bytes=40 * GIB, compute_capability="8.0", mig_mode=mig, mig_profiles=profiles,
        mig_instances=[MigInstance(atom_id=f"{uuid}/gi{gi}/ci0", gi=gi, ci=0, profile=p, memory_bytes=(4864 if p.startswith("1g") else 19968) * 1024**2) for gi, p in instances],
        gpu_instances=[GpuInstance(gi=gi, profile=p.split("c.", 1)[-1] if "c." in p else p) for gi, p in instances],
        slots=[Slot(atom_id=f"{uuid}/slot{k}", index=k) for k in range(slots)], mps_running=mps,
        status=PhysicalGPUStatus(driver_binding=DriverBinding(driver="nvidia" if mode == "Compute" else "vfio-pci", mode=mode)),  # type: ignore[arg-type]
    )


def _inv(*gpus: Gpu, cuda: str = "12.4") -> Inventory:
    gpus = tuple(g.__class__(**{**{f: getattr(g, f) for f in g.__struct_fields__}, "labels": card_labels(g, node_id="node-a", sharer=True).labels}) for g in gpus)
    return Inventory(node_id="node-a", observed_at=NOW, vendor="nvidia", driver_version="550.127.05", cuda_driver_version=cuda, gpus=list(gpus))


VERSIONS = {
    "nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "127", "nvidia.com/cuda.driver.rev": "05",
    "nvidia.com/cuda.driver-version.major": "550", "nvidia.com/cuda.driver-version.minor": "127",
    "nvidia.com/cuda.driver-version.revision": "05", "nvidia.com/cuda.driver-version.full": "550.127.05",
    "nvidia.com/cuda.runtime.major": "12", "nvidia.com/cuda.runtime.minor": "4",
    "nvidia.com/cuda.runtime-version.major": "12", "nvidia.com/cuda.runtime-version.minor": "4", "nvidia.com/cuda.runtime-version.full": "12.4",
}
ARCH = {"nvidia.com/gpu.family": "ampere", "nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.memory": "40960"}
A100 = "NVIDIA-A100-SXM4-40GB"
ONE_G = {
    "memory": "4864", "slices.gi": "1", "slices.ci": "1", "multiprocessors": "14",
    "engines.copy": "1", "engines.decoder": "0", "engines.encoder": "0", "engines.jpeg": "0", "engines.ofa": "0",
}


def _whole(count: int, product: str = A100, replicas: int = 1, strategy: str = "none") -> dict[str, str]:
    return {
        **VERSIONS, **ARCH, "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.replicas": str(replicas), "nvidia.com/gpu.sharing-strategy": strategy,
    }


ROWS: list[tuple[str, Inventory, str, dict[str, str]]] = [
    ("no GPU: no label at all, as GFD", _inv(), "mixed", {}),
    ("a card on vfio-pci only: NVML (GFD) sees none", _inv(_gpu(0, mode="Passthrough")), "mixed", {}),
    (
        "whole cards, strategy none",
        _inv(_gpu(0), _gpu(1)),
        "none",
        {**_whole(2), "nvidia.com/mig.capable": "true", "nvidia.com/mps.capable": "false",
         "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true"},
    ),
    (
        "whole cards, no CUDA version known: no cuda.runtime labels",
        _inv(_gpu(0), cuda=""),
        "none",
        {**{k: v for k, v in _whole(1).items() if "runtime" not in k}, "nvidia.com/mig.capable": "true", "nvidia.com/mps.capable": "false",
         "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true"},
    ),
    (
        "shared cards, all MPS with 4 slots: replicas, mps, -SHARED, mps.capable",
        _inv(_gpu(0, slots=4, mps=True), _gpu(1, slots=4, mps=True)),
        "mixed",
        {**_whole(2, A100 + "-SHARED", 4, "mps"), "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed",
         "nvidia.com/mps.capable": "true", "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true"},
    ),
    (
        "shared cards, time slices (no MPS)",
        _inv(_gpu(0, slots=2), _gpu(1, slots=2)),
        "none",
        {**_whole(2, A100 + "-SHARED", 2, "time-slicing"), "nvidia.com/mig.capable": "true", "nvidia.com/mps.capable": "false",
         "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true"},
    ),
    (
        "cards shared unalike: GFD cannot say it, so not shared",
        _inv(_gpu(0, slots=4, mps=True), _gpu(1)),
        "none",
        {**_whole(2), "nvidia.com/mig.capable": "true", "nvidia.com/mps.capable": "false",
         "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true"},
    ),
    (
        "MIG mixed: one card whole, one in MIG mode with 2 x 1g.5gb and a 3g.20gb",
        _inv(_gpu(0), _gpu(1, mig=True, instances=[(1, "1g.5gb"), (2, "1g.5gb"), (3, "3g.20gb")])),
        "mixed",
        {
            **_whole(2), "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed", "nvidia.com/mps.capable": "false",
            "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true",
            "nvidia.com/mig-1g.5gb.product": A100 + "-MIG-1g.5gb", "nvidia.com/mig-1g.5gb.count": "2",
            "nvidia.com/mig-1g.5gb.replicas": "1", "nvidia.com/mig-1g.5gb.sharing-strategy": "none",
            **{f"nvidia.com/mig-1g.5gb.{k}": v for k, v in ONE_G.items()},
            "nvidia.com/mig-3g.20gb.product": A100 + "-MIG-3g.20gb", "nvidia.com/mig-3g.20gb.count": "1",
            "nvidia.com/mig-3g.20gb.replicas": "1", "nvidia.com/mig-3g.20gb.sharing-strategy": "none",
            "nvidia.com/mig-3g.20gb.memory": "19968", "nvidia.com/mig-3g.20gb.slices.gi": "3", "nvidia.com/mig-3g.20gb.slices.ci": "3",
            "nvidia.com/mig-3g.20gb.multiprocessors": "42", "nvidia.com/mig-3g.20gb.engines.copy": "3",
            "nvidia.com/mig-3g.20gb.engines.decoder": "2", "nvidia.com/mig-3g.20gb.engines.encoder": "0",
            "nvidia.com/mig-3g.20gb.engines.jpeg": "0", "nvidia.com/mig-3g.20gb.engines.ofa": "0",
        },
    ),
    (
        "MIG single: every card in MIG mode, one profile: gpu.* overloaded",
        _inv(_gpu(0, mig=True, instances=[(1, "1g.5gb"), (2, "1g.5gb")]), _gpu(1, mig=True, instances=[(1, "1g.5gb")])),
        "single",
        {
            **VERSIONS, **{k: v for k, v in ARCH.items() if k != "nvidia.com/gpu.memory"},
            "nvidia.com/gpu.product": A100 + "-MIG-1g.5gb", "nvidia.com/gpu.count": "3", "nvidia.com/gpu.replicas": "1",
            "nvidia.com/gpu.sharing-strategy": "none", **{f"nvidia.com/gpu.{k}": v for k, v in ONE_G.items()},
            "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "single", "nvidia.com/mps.capable": "false",
            "gpu.deckhouse.io/sharing.mps": "false", "gpu.deckhouse.io/sharing.ts": "false",
        },
    ),
    (
        "MIG single with a whole card beside: INVALID, as GFD",
        _inv(_gpu(0), _gpu(1, mig=True, instances=[(1, "1g.5gb")])),
        "single",
        {
            **VERSIONS, **ARCH, "nvidia.com/gpu.product": A100 + "-MIG-INVALID", "nvidia.com/gpu.count": "0",
            "nvidia.com/gpu.replicas": "0", "nvidia.com/gpu.sharing-strategy": "none", "nvidia.com/gpu.memory": "0",
            "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "single", "nvidia.com/mps.capable": "false",
            "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true",
        },
    ),
]


@pytest.mark.parametrize(("inv", "strategy", "want"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_node_labels_table(inv: Inventory, strategy: str, want: dict[str, str]) -> None:
    got = node_labels(inv, mig_strategy=strategy)
    assert got.skipped == []
    assert got.labels == want


def test_card_labels_seed_names() -> None:
    whole = card_labels(_gpu(0), node_id="node-a", sharer=True).labels
    assert whole == {
        "gpu.deckhouse.io/vendor": "nvidia", "gpu.deckhouse.io/device": "NVIDIA-A100-SXM4-40GB", "gpu.deckhouse.io/node": "node-a",
        "gpu.deckhouse.io/sharing.mps": "true", "gpu.deckhouse.io/sharing.ts": "true",
    }
    # a MIG card, a card on vfio-pci, an adapter that cannot share: no sharing
    assert card_labels(_gpu(1, mig=True), node_id="n", sharer=True).labels["gpu.deckhouse.io/sharing.mps"] == "false"
    assert card_labels(_gpu(2, mode="Passthrough"), node_id="n", sharer=True).labels["gpu.deckhouse.io/sharing.ts"] == "false"
    assert card_labels(_gpu(3), node_id="n", sharer=False).labels["gpu.deckhouse.io/sharing.mps"] == "false"


def test_gfd_sanitises_product_names() -> None:
    assert sanitise("NVIDIA H200") == "NVIDIA-H200"
    assert sanitise("Tesla  T4 (PCIe)™") == "Tesla-T4-PCIe"
    assert sanitise("NVIDIA A100-SXM4-80GB") == "NVIDIA-A100-SXM4-80GB"


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("nvidia.com/gpu.count", "8", True),
        ("nvidia.com/gpu.sharing-strategy", "", True),
        ("nvidia.com/mig-1g.5gb.count", "2", True),
        ("gpu.count", "x", True),
        ("Nvidia.com/gpu.count", "1", False),
        ("nvidia.com/", "1", False),
        ("nvidia.com/-gpu", "1", False),
        ("nvidia.com/" + "a" * 64, "1", False),
        ("nvidia.com/gpu.product", "NVIDIA H200", False),
        ("nvidia.com/gpu.product", "a" * 64, False),
        ("nvidia.com/gpu.product", "-x", False),
    ],
)
def test_label_syntax(name: str, value: str, ok: bool) -> None:
    assert (label_problem(name, value) == "") is ok


def test_too_long_product_is_left_out_and_named() -> None:
    long = _inv(_gpu(0, name="NVIDIA " + "X" * 70))
    got = node_labels(long, mig_strategy="none")
    assert "nvidia.com/gpu.product" not in got.labels
    assert any("gpu.product" in p for p in got.skipped)
    card = card_labels(long.gpus[0], node_id="node-a", sharer=True)
    assert "gpu.deckhouse.io/device" not in card.labels and card.skipped


@pytest.mark.parametrize("host", sorted(p.name for p in EXAMPLES.glob("*.json")))
@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_every_example_host_gives_valid_kubernetes_labels(tmp_path: Path, host: str, strategy: str) -> None:
    adapter = load_adapter(
        "fakehw", fake_host=EXAMPLES / host, cdi_dir=tmp_path, sysfs_root=tmp_path, proc_root=tmp_path,
        slots_per_gpu=0, mps_pipe_dir=str(tmp_path), known_uuids=None,
    )
    inv = build_inventory(adapter, node_id="node-a", revision=1, now=NOW)
    labels = node_labels(inv, mig_strategy=strategy)
    assert labels.skipped == []
    assert labels.labels, "every example host has a GPU"
    for name, value in labels.labels.items():
        assert label_problem(name, value) == "", (name, value)
    for gpu in inv.gpus:
        assert gpu.labels["gpu.deckhouse.io/node"] == "node-a"
        for name, value in gpu.labels.items():
            assert label_problem(name, value) == "", (name, value)
    # the file is NFD's format: a comment, then name=value a line
    lines = render(labels.labels).decode().splitlines()
    assert lines[0].startswith("#") and all("=" in line for line in lines[1:])


# ------------------------------------------------------------------ the writer


def test_written_atomically_then_unchanged_then_rewritten(tmp_path: Path) -> None:
    d = tmp_path / "features.d"
    f = FeatureFile(d)
    assert f.sync(b"a=1\n").what == "written"
    assert f.path.read_bytes() == b"a=1\n"
    assert stat.S_IMODE(f.path.stat().st_mode) == 0o644
    inode = f.path.stat().st_ino
    assert f.sync(b"a=1\n").what == "unchanged"
    assert f.path.stat().st_ino == inode  # nothing written
    assert f.sync(b"a=2\n").what == "written"
    assert f.path.read_bytes() == b"a=2\n"
    assert f.path.stat().st_ino != inode  # a new file renamed over the old: never half written
    assert sorted(os.listdir(d)) == ["bcd-gpu"]  # no temporary file left


def test_directory_made_only_where_its_parent_exists(tmp_path: Path) -> None:
    # a host with no NFD tree (not a Kubernetes worker) is no error: said once, at INFO
    out = FeatureFile(tmp_path / "no" / "features.d").sync(b"a=1\n")
    assert out.what == "not written" and f"{tmp_path / 'no'} does not exist" in out.message
    assert not (tmp_path / "no").exists()


def test_symlink_file_refused_and_left(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep\n")
    d = tmp_path / "features.d"
    d.mkdir()
    (d / "bcd-gpu").symlink_to(target)
    f = FeatureFile(d)
    out = f.sync(b"a=1\n")
    assert out.what == "refused" and "symlink" in out.message
    assert target.read_bytes() == b"keep\n" and (d / "bcd-gpu").is_symlink()
    assert f.remove().what == "refused"
    assert (d / "bcd-gpu").is_symlink()
    assert sorted(os.listdir(d)) == ["bcd-gpu"]


def test_symlinked_directory_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "features.d").symlink_to(real)
    out = FeatureFile(tmp_path / "features.d").sync(b"a=1\n")
    assert out.what == "refused" and "symlink" in out.message
    assert list(real.iterdir()) == []


def test_fifo_refused_without_blocking(tmp_path: Path) -> None:
    d = tmp_path / "features.d"
    d.mkdir()
    os.mkfifo(d / "bcd-gpu")
    f = FeatureFile(d)
    out = f.sync(b"a=1\n")  # a read of a FIFO without a writer would block forever
    assert out.what == "refused" and "FIFO" in out.message
    assert stat.S_ISFIFO(os.lstat(d / "bcd-gpu").st_mode)
    assert f.remove().what == "refused"


def test_removed_at_stop(tmp_path: Path) -> None:
    class Log:
        def __init__(self) -> None:
            self.lines: list[tuple[str, str]] = []

        def info(self, msg: str, **kw: object) -> None:
            self.lines.append(("info", msg))

        def error(self, msg: str, **kw: object) -> None:
            self.lines.append(("error", msg))

        def warning(self, msg: str, **kw: object) -> None:
            self.lines.append(("warning", msg))

    log = Log()
    keeper = FeatureKeeper(tmp_path, mig_strategy="mixed", log=log)
    inv = _inv(_gpu(0))
    assert keeper.sync(inv).what == "written"
    assert b"nvidia.com/gpu.count=1\n" in keeper.file.path.read_bytes()
    assert keeper.sync(inv).what == "unchanged"
    assert keeper.stop().what == "removed"
    assert not keeper.file.path.exists()
    assert keeper.stop().what == "absent"
    assert log.lines == [("info", "GPU feature file written"), ("info", "GPU feature file removed"), ("info", "GPU feature file absent")]
