"""The consumer copy of a hold spec (shared.holdfiles.consumer_spec) and the MPS mounts of a slot hold.

Every scenario of test_holdfiles is copied: the copy carries no annotation at
any level, the hold's kind, device names and edits unchanged, declares the
lowest cdiVersion of what is left (what a CDI library of v0.3 to v0.5 reads
unless the vendor's own edits need more), passes the official CDI schema and
the project's CDI rules beside the other copies, and is a pure function of the
hold spec's bytes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from shared.fsutil import content_digest
from shared.holdfiles import (
    BINDING_CLAIM,
    MPS_SHM_DIR,
    HoldContent,
    NotAHold,
    build_cdi_spec,
    check_cdi_rules,
    checked_consumer_dir,
    claim_mps_pipe_dir,
    consumer_file_bytes,
    consumer_spec,
    hold_file_name,
    min_cdi_version,
    parse_hold,
    render_cdi_spec,
    validate_against_schema,
)
from shared.vendorcdi import vendor_cdi_from_json

from tests.unit.test_holdfiles import H200, H200_VENDOR, MPS_DIR, SCENARIOS, _schema_dir, built, gpu, hold, uuid

from shared.holdfiles import HoldDevice


def _annotations_anywhere(spec: dict[str, Any]) -> bool:
    return "annotations" in spec or any("annotations" in d for d in spec["devices"])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_copy_is_the_hold_spec_without_annotations(name: str) -> None:
    spec = built(name)
    c = consumer_spec(spec)
    assert not _annotations_anywhere(c)
    assert c["kind"] == spec["kind"]
    assert [d["name"] for d in c["devices"]] == [d["name"] for d in spec["devices"]]
    assert [d["containerEdits"] for d in c["devices"]] == [d["containerEdits"] for d in spec["devices"]]
    assert c["containerEdits"] == spec["containerEdits"]
    assert c["cdiVersion"] == min_cdi_version(c)
    # what podman 4.3 (CDI library v0.5) reads, unless the vendor's edits need 0.7.0 themselves
    needs_gids = any("additionalGids" in e for e in (spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])))
    assert c["cdiVersion"] == ("0.7.0" if needs_gids else "0.3.0")
    assert list(c) == ["cdiVersion", "kind", "devices", "containerEdits"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_copy_validates_against_the_official_schema(name: str) -> None:
    assert validate_against_schema(consumer_spec(built(name)), _schema_dir()) == []


def test_the_copies_of_one_host_pass_the_cdi_rules_together() -> None:
    # the holds one host could have at once (no atom twice)
    names = ["gpu-h200", "two-gpus-with-env", "mig", "slot0-mps", "slot1-mps", "kubernetes"]
    files = {hold_file_name(SCENARIOS[n][0].allocation_id): consumer_spec(built(n)) for n in names}
    assert check_cdi_rules(files) == []


def test_copying_does_not_change_the_hold_spec() -> None:
    spec = built("slot0-mps")
    before = copy.deepcopy(spec)
    c = consumer_spec(spec)
    c["devices"][0]["containerEdits"]["deviceNodes"].append({"path": "/dev/evil"})
    c["containerEdits"]["env"].clear()
    assert spec == before


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_copy_file_is_made_from_the_hold_file_bytes_alone(name: str) -> None:
    h, vendor = SCENARIOS[name]
    data = render_cdi_spec(build_cdi_spec(h, vendor))
    copy_bytes = consumer_file_bytes(h.allocation_id, data)
    assert json.loads(copy_bytes) == consumer_spec(json.loads(data))
    assert copy_bytes == render_cdi_spec(consumer_spec(json.loads(data)))
    # the reader of the hold spec knows which copy it makes (the planner compares the digests)
    assert parse_hold(hold_file_name(h.allocation_id), data).consumer_digest == content_digest(copy_bytes)


def test_only_a_hold_of_that_allocation_is_copied() -> None:
    h, vendor = SCENARIOS["gpu-h200"]
    data = render_cdi_spec(build_cdi_spec(h, vendor))
    with pytest.raises(NotAHold, match="does not match the file name"):
        consumer_file_bytes("someone-else", data)
    with pytest.raises(NotAHold, match="not valid JSON"):
        consumer_file_bytes(h.allocation_id, b"{")
    with pytest.raises(NotAHold, match="no annotations"):
        consumer_file_bytes(h.allocation_id, render_cdi_spec(consumer_spec(json.loads(data))))
    with pytest.raises(ValueError, match="not a valid id"):
        consumer_file_bytes("../etc", data)


def test_vendor_gids_make_the_copy_0_7_0_as_the_vendor_spec_itself() -> None:
    vendor_spec = copy.deepcopy(H200["vendor_cdi_spec"])
    vendor_spec["cdiVersion"] = "0.7.0"
    vendor_spec["containerEdits"]["additionalGids"] = [44]
    vendor = vendor_cdi_from_json(json.dumps(vendor_spec).encode(), "/etc/cdi/nvidia.json")
    c = consumer_spec(build_cdi_spec(hold((gpu(0),), alloc="gids"), vendor))
    assert c["cdiVersion"] == "0.7.0" and c["containerEdits"]["additionalGids"] == [44]


@pytest.mark.parametrize(
    ("consumer_dir", "problem"),
    [
        ("/var/run/cdi", ""),
        ("/run/cdi", ""),
        ("", "is not an absolute path"),
        ("run/cdi", "is not an absolute path"),
        ("/etc/cdi", "is the CDI dir itself"),
        ("/etc/cdi/", "is the CDI dir itself"),
    ],
)
def test_the_consumer_dir_must_be_another_absolute_dir(consumer_dir: str, problem: str) -> None:
    if problem:
        with pytest.raises(ValueError, match=problem):
            checked_consumer_dir("/etc/cdi", consumer_dir)
    else:
        assert str(checked_consumer_dir("/etc/cdi", consumer_dir)) == consumer_dir


# ---------------------------------------------------------------------------- MPS


def _mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec["containerEdits"].get("mounts", [])


def test_a_slot_hold_with_mps_running_mounts_the_pipe_directory_and_never_the_hosts_shm() -> None:
    """The host's /dev/shm holds every tenant's shared memory and root's MPS servers': a slot,
    whose daemon is the host's, gets its pipe directory only (docs/cdi-runtimes.md)."""
    spec = built("slot0-mps")
    ours = [m for m in _mounts(spec) if m["containerPath"] in (MPS_DIR, MPS_SHM_DIR) or m["hostPath"] == "/dev/shm"]
    assert ours == [{"hostPath": MPS_DIR, "containerPath": MPS_DIR, "options": ["rw", "nosuid", "nodev", "bind"]}]
    # the vendor's own mounts stay, before ours
    vendor = list(H200_VENDOR.container_edits["mounts"])
    assert _mounts(spec)[: len(vendor)] == vendor
    assert f"CUDA_MPS_PIPE_DIRECTORY={MPS_DIR}" in spec["containerEdits"]["env"]
    # bind mounts without a type: still what a 0.3.0 library reads
    assert consumer_spec(spec)["cdiVersion"] == "0.3.0"


CONTROL = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-a1b2c3"


def _claim(vendor: Any = H200_VENDOR) -> dict[str, Any]:
    pipe = claim_mps_pipe_dir("/run/bcd/mps", CONTROL)
    content = HoldContent(f"claim-{CONTROL[:36]}", f"claim-{CONTROL[:36]}", 0, BINDING_CLAIM, (gpu(0),), mps_pipe_dir=pipe, mps_control=CONTROL)
    return build_cdi_spec(content, vendor)


def test_a_claims_mps_daemon_is_mounted_from_its_own_root_made_directories_only() -> None:
    """The pipe and log (read-only) directories at their paths, the daemon's own shm tmpfs at
    /dev/shm: every host path under /run/bcd/mps/<control>/, none of them the host's /dev/shm."""
    d = f"/run/bcd/mps/{CONTROL}"
    opts = ["rw", "nosuid", "nodev", "bind"]
    ours = [m for m in _mounts(_claim()) if m["hostPath"].startswith("/run/bcd/mps/") or m["containerPath"] == MPS_SHM_DIR]
    assert ours == [
        {"hostPath": f"{d}/pipe", "containerPath": f"{d}/pipe", "options": opts},
        {"hostPath": f"{d}/log", "containerPath": f"{d}/log", "options": ["ro", "nosuid", "nodev", "bind"]},
        {"hostPath": f"{d}/shm", "containerPath": "/dev/shm", "options": opts},
    ]
    assert not [m for m in _mounts(_claim()) if m["hostPath"] == "/dev/shm"]
    assert f"CUDA_MPS_PIPE_DIRECTORY={d}/pipe" in _claim()["containerEdits"]["env"]


@pytest.mark.parametrize("name", ["two-slots-one-hold", "gpu-h200", "mig", "kubernetes", "no-vendor-spec"])
def test_no_mps_no_mps_mounts(name: str) -> None:
    assert not [m for m in _mounts(built(name)) if m["containerPath"] in (MPS_DIR, MPS_SHM_DIR)]


def test_a_vendor_mount_at_an_mps_path_gives_way_to_ours() -> None:
    vendor_spec = copy.deepcopy(H200["vendor_cdi_spec"])
    vendor_spec["containerEdits"]["mounts"].append({"hostPath": "/somewhere", "containerPath": "/dev/shm", "options": ["ro"]})
    vendor_spec["containerEdits"]["mounts"].append({"hostPath": "/elsewhere", "containerPath": MPS_DIR, "options": ["ro"]})
    vendor = vendor_cdi_from_json(json.dumps(vendor_spec).encode(), "/etc/cdi/nvidia.json")
    spec = build_cdi_spec(hold((HoldDevice.for_slot(uuid(5), 4, 0),), alloc="s0", mps=True), vendor)
    assert [m for m in _mounts(spec) if m["containerPath"] == MPS_DIR] == [{"hostPath": MPS_DIR, "containerPath": MPS_DIR, "options": ["rw", "nosuid", "nodev", "bind"]}]
    # a slot mounts no /dev/shm: the vendor's, from root's spec, is the vendor's business
    assert [m["hostPath"] for m in _mounts(spec) if m["containerPath"] == "/dev/shm"] == ["/somewhere"]
    shm = [m for m in _mounts(_claim(vendor)) if m["containerPath"] == "/dev/shm"]
    assert shm == [{"hostPath": f"/run/bcd/mps/{CONTROL}/shm", "containerPath": "/dev/shm", "options": ["rw", "nosuid", "nodev", "bind"]}]
