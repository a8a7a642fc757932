"""The root helper's operations without the bus (services/helper/ops.py).

Good requests write exactly the bytes the converger's in-process writer
writes (one content function, shared/holdfiles/files.py). Malicious ones are
refused with a reason and write nothing: path traversal in the id, a hook,
device node or mount smuggled in as an unknown field, a foreign slice name,
an oversized or malformed cpulist, limits out of bounds, an env key bcd sets
itself. Symlinks and hard links planted in the directories are never
followed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from services.converger.hostwriter import LocalHostWriter
from shared.slices import FakeSlices as ConvergerFakeSlices
from services.helper.ops import HelperOps
from shared.holdfiles import HoldContent, HoldDevice, hold_to_wire, limits_to_wire
from shared.schemas import (
    HELPER_REPLY_CODEC,
    HelperFileCopy,
    HelperFileRemove,
    HelperFileWrite,
    HelperReply,
    HelperSliceApply,
    HelperSliceRemove,
    HugePages,
    Limits,
    encode,
)
from shared.slices import FakeSlices

REPO = Path(__file__).resolve().parents[2]
H200 = json.loads((REPO / "examples" / "hosts" / "h200x8.json").read_text())
MPS = H200["mps_pipe_dir"]
UUID = [g["uuid"] for g in H200["gpus"]]
GIB = 1 << 30


def gpu(i: int) -> HoldDevice:
    return HoldDevice.for_gpu(UUID[i], i)


def mig(i: int, gi: int, ci: int) -> HoldDevice:
    m = next(m for m in H200["gpus"][i]["mig_instances"] if (m["gi"], m["ci"]) == (gi, ci))
    return HoldDevice(f"{UUID[i]}/gi{gi}/ci{ci}", "mig", UUID[i], i, m["uuid"], (m["uuid"],))


LIMITS = Limits(cpus="0-3", cpu_millis=4000, memory_bytes=8 * GIB, hugepages=[HugePages(page_size_kib=2048, count=512)], mems="0")

CONTENTS = {
    "sliced-whole-gpu": HoldContent(
        allocation_id="whole", reservation_id="rsv-whole", generation=42, binding="BINDING_HOLD", devices=(gpu(0),),
        cgroup_parent="bcd-alloc-whole.slice", env=("MY_VAR=1", "OTHER=a,b=c"), limits=LIMITS,
    ),
    "two-gpus": HoldContent(allocation_id="two", reservation_id="rsv-two", generation=1, binding="BINDING_HOLD", devices=(gpu(1), gpu(2))),
    "mig": HoldContent(allocation_id="mig", reservation_id="rsv-mig", generation=3, binding="BINDING_HOLD", devices=(mig(6, 1, 0), mig(6, 5, 0))),
    "slots-with-mps": HoldContent(
        allocation_id="slots", reservation_id="rsv-slots", generation=2, binding="BINDING_HOLD",
        devices=(HoldDevice.for_slot(UUID[4], 4, 0), HoldDevice.for_slot(UUID[4], 4, 1)), mps_pipe_dir=MPS,
    ),
    "kubernetes": HoldContent(allocation_id="kube", reservation_id="rsv-kube", generation=9, binding="BINDING_KUBERNETES", devices=(gpu(3),)),
}  # fmt: skip


def tree(root: Path) -> dict[str, bytes | str]:
    """Every file and link under root, with its content (links: their target)."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes()
    return out


@pytest.fixture
def vendor_dir(tmp_path: Path) -> Path:
    """A CDI dir holding the example host's vendor spec."""
    d = tmp_path / "vendor"
    d.mkdir()
    (d / "nvidia.json").write_text(json.dumps(H200["vendor_cdi_spec"]))
    return d


def make_ops(root: Path, vendor_dir: Path | None = None) -> HelperOps:
    cdi, run = root / "cdi", root / "run"
    cdi.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    if vendor_dir is not None:
        (cdi / "nvidia.json").write_bytes((vendor_dir / "nvidia.json").read_bytes())
    return HelperOps(cdi, run, FakeSlices(run), slices_backend="fake", mps_pipe_dir=MPS)


def ask(ops: HelperOps, op: str, body: object) -> HelperReply:
    """As the service does: raw bytes in, a reply that encodes and decodes."""
    data = body if isinstance(body, bytes) else encode(body)
    reply, _ = ops.answer(op, data)
    return HELPER_REPLY_CODEC.decode(encode(reply))


# --------------------------------------------------------------------------- good requests


@pytest.mark.parametrize("with_vendor", [True, False], ids=["vendor-spec", "no-vendor-spec"])
@pytest.mark.parametrize("name", sorted(CONTENTS))
def test_files_are_byte_identical_to_the_local_writer(tmp_path: Path, vendor_dir: Path, name: str, with_vendor: bool) -> None:
    content = CONTENTS[name]
    local_root, helper_root = tmp_path / "local", tmp_path / "helper"
    ops = make_ops(helper_root, vendor_dir if with_vendor else None)
    (local_root / "cdi").mkdir(parents=True)
    if with_vendor:
        (local_root / "cdi" / "nvidia.json").write_bytes((vendor_dir / "nvidia.json").read_bytes())
    local = LocalHostWriter(local_root / "cdi", local_root / "run", ConvergerFakeSlices(local_root / "run"))
    local.write_cdi(content)
    local.write_env(content)
    wire = hold_to_wire(content)
    for kind in ("cdi", "allocation-env"):
        r = ask(ops, "file.write", HelperFileWrite(kind=kind, hold=wire))
        assert r.ok and r.outcome == "done" and r.changed, r
    if content.limits is not None:
        local.apply_slice(content.allocation_id, content.limits)
        assert ask(ops, "slice.apply", HelperSliceApply(allocation_id=content.allocation_id, limits=limits_to_wire(content.limits))).ok
    assert tree(helper_root) == tree(local_root)
    for p in (helper_root / "cdi" / f"bcd-{content.allocation_id}.json", helper_root / "run" / "allocations" / f"{content.allocation_id}.env"):
        assert p.stat().st_mode & 0o777 == 0o644


def test_a_second_identical_write_changes_nothing(tmp_path: Path) -> None:
    ops = make_ops(tmp_path)
    body = HelperFileWrite(kind="cdi", hold=hold_to_wire(CONTENTS["two-gpus"]))
    first, second = ask(ops, "file.write", body), ask(ops, "file.write", body)
    assert first.changed and not second.changed
    assert first.path == second.path == str(Path(os.path.realpath(tmp_path)) / "cdi" / "bcd-two.json")


def test_the_same_content_with_other_permissions_is_written_again(tmp_path: Path) -> None:
    ops = make_ops(tmp_path)
    body = HelperFileWrite(kind="allocation-env", hold=hold_to_wire(CONTENTS["two-gpus"]))
    assert ask(ops, "file.write", body).changed
    path = tmp_path / "run" / "allocations" / "two.env"
    path.chmod(0o600)
    assert ask(ops, "file.write", body).changed
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("edit", ["memory-raised", "garbled"])
def test_a_slice_changed_from_outside_is_put_back_through_the_helper(tmp_path: Path, edit: str) -> None:
    """An unprivileged converger's re-apply of a drifted slice (issue 41.1) is the helper's slice.apply:
    idempotent, and a record that no longer reads is written again rather than failing every pass."""
    ops = make_ops(tmp_path)
    body = HelperSliceApply(allocation_id="whole", limits=limits_to_wire(LIMITS))
    assert ask(ops, "slice.apply", body).ok
    record = tmp_path / "run" / "slices" / "bcd-alloc-whole.slice.json"
    saved = record.read_bytes()
    if edit == "garbled":
        record.write_text("{")
    else:
        record.write_text(record.read_text().replace(str(8 * GIB), str(64 * GIB)))
    assert record.read_bytes() != saved
    r = ask(ops, "slice.apply", body)
    assert r.ok, r
    assert record.read_bytes() == saved


def test_remove_files_slices_and_a_left_temp_file(tmp_path: Path) -> None:
    ops = make_ops(tmp_path)
    c = CONTENTS["sliced-whole-gpu"]
    for kind in ("cdi", "allocation-env"):
        assert ask(ops, "file.write", HelperFileWrite(kind=kind, hold=hold_to_wire(c))).ok
    assert ask(ops, "slice.apply", HelperSliceApply(allocation_id="whole", limits=limits_to_wire(LIMITS))).ok
    temp = tmp_path / "cdi" / ".bcd-whole.json.tmp-4242"
    temp.write_text("{")
    assert ask(ops, "file.remove", HelperFileRemove(kind="cdi", allocation_id="whole", temp_pid=4242)).changed
    assert not temp.exists() and (tmp_path / "cdi" / "bcd-whole.json").exists()
    # a busy slice is kept, an empty one stopped
    FakeSlices(tmp_path / "run").set_pids("whole", [123])
    assert ask(ops, "slice.remove", HelperSliceRemove(allocation_id="whole")).gone is False
    FakeSlices(tmp_path / "run").set_pids("whole", [])
    assert ask(ops, "slice.remove", HelperSliceRemove(allocation_id="whole")).gone is True
    for kind in ("cdi", "allocation-env"):
        r = ask(ops, "file.remove", HelperFileRemove(kind=kind, allocation_id="whole"))
        assert r.ok and r.changed
        assert not ask(ops, "file.remove", HelperFileRemove(kind=kind, allocation_id="whole")).changed
    assert tree(tmp_path / "cdi") == {} and tree(tmp_path / "run") == {}


def test_info_names_the_real_directories(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    ops = HelperOps(tmp_path / "link" / "cdi", tmp_path / "link" / "run", FakeSlices(tmp_path), slices_backend="fake", mps_pipe_dir=MPS)
    info = ops.info()
    real = Path(os.path.realpath(tmp_path / "real"))
    assert (info.cdi_dir, info.run_dir, info.slices, info.mps_pipe_dir) == (str(real / "cdi"), str(real / "run"), "fake", MPS)
    assert info.euid == os.geteuid()


# --------------------------------------------------------------------------- malicious requests

GOOD_HOLD = msgspec.to_builtins(hold_to_wire(CONTENTS["sliced-whole-gpu"]))


def write_body(**hold_changes: object) -> dict:
    return {"kind": "cdi", "hold": {**GOOD_HOLD, **hold_changes}}


def with_device(**changes: object) -> dict:
    return write_body(devices=[{**GOOD_HOLD["devices"][0], **changes}])


REFUSED = [
    # path traversal and friends in the id
    pytest.param("file.write", write_body(allocation_id="../x"), "not a valid id", id="write-id-dotdot"),
    pytest.param("file.write", write_body(allocation_id="a/b"), "not a valid id", id="write-id-slash"),
    pytest.param("file.write", write_body(allocation_id="a\n"), "not a valid id", id="write-id-newline"),
    pytest.param("file.write", write_body(allocation_id=""), "not a valid id", id="write-id-empty"),
    pytest.param("file.write", write_body(allocation_id="/etc/passwd"), "not a valid id", id="write-id-absolute"),
    pytest.param("file.write", write_body(reservation_id="../r"), "reservation id", id="write-reservation-dotdot"),
    pytest.param("file.remove", {"kind": "cdi", "allocation_id": "../x"}, "not a valid id", id="remove-id-dotdot"),
    pytest.param("file.remove", {"kind": "allocation-env", "allocation_id": "a/b"}, "not a valid id", id="remove-id-slash"),
    pytest.param("file.remove", {"kind": "cdi", "allocation_id": "a\n"}, "not a valid id", id="remove-id-newline"),
    pytest.param("file.remove", {"kind": "cdi", "allocation_id": "x", "temp_pid": 0}, "temp_pid", id="remove-temp-pid-0"),
    # no path, hook, device node or mount from the wire: unknown fields are refused
    pytest.param("file.write", {**write_body(), "path": "/etc/cron.d/x"}, "unknown field `path`", id="write-path"),
    pytest.param("file.write", write_body(hooks=[{"hookName": "createContainer", "path": "/bin/sh"}]), "unknown field `hooks`", id="hook"),
    pytest.param("file.write", write_body(deviceNodes=[{"path": "/dev/mem"}]), "unknown field `deviceNodes`", id="device-node"),
    pytest.param("file.write", write_body(mounts=[{"hostPath": "/", "containerPath": "/host"}]), "unknown field `mounts`", id="mount"),
    pytest.param("file.write", with_device(path="/dev/mem"), "unknown field `path`", id="device-path"),
    pytest.param("file.write", with_device(vendor_names=["all"]), "unknown field `vendor_names`", id="device-vendor-names"),
    pytest.param("file.write", write_body(cgroup_parent="system.slice"), "unknown field `cgroup_parent`", id="write-cgroup-parent"),
    pytest.param("file.write", write_body(mps_pipe_dir="/etc"), "unknown field `mps_pipe_dir`", id="write-mps-dir"),
    pytest.param("file.remove", {"kind": "cdi", "allocation_id": "x", "path": "/etc/passwd"}, "unknown field `path`", id="remove-path"),
    pytest.param("file.write", {"kind": "systemd-unit", "hold": GOOD_HOLD}, "kind", id="write-unknown-kind"),
    pytest.param("file.write", with_device(gpu_uuid="../../etc"), "gpu_uuid", id="device-uuid-traversal"),
    pytest.param("file.write", with_device(kind="mig", gi=1, ci=0, mig_uuid="all"), "MIG uuid", id="mig-uuid-all"),
    pytest.param("file.write", with_device(kind="mig", gi=1, ci=0, mig_uuid="MIG-x,GPU-y"), "MIG uuid", id="mig-uuid-comma"),
    pytest.param("file.write", with_device(slot=3), "slot is for slots only", id="gpu-with-slot"),
    pytest.param("file.write", write_body(binding="BINDING_INSTANCE"), "binding", id="instance-binding"),
    pytest.param("file.write", write_body(binding="BINDING_KUBERNETES"), "never sliced", id="sliced-kubernetes"),
    pytest.param("file.write", write_body(devices=[]), "devices", id="no-devices"),
    # env keys bcd owns, and env lines that would break the file
    pytest.param("file.write", write_body(env=["BCD_ALLOCATION_ID=other"]), "not allowed", id="env-bcd-key"),
    pytest.param("file.write", write_body(env=["NVIDIA_VISIBLE_DEVICES=all"]), "not allowed", id="env-visible-devices"),
    pytest.param("file.write", write_body(env=["CUDA_MPS_PIPE_DIRECTORY=/etc"]), "not allowed", id="env-mps-dir"),
    pytest.param("file.write", write_body(env=["A=b\nNVIDIA_VISIBLE_DEVICES=all"]), "not allowed", id="env-newline"),
    pytest.param("file.write", write_body(env=["1A=b"]), "not allowed", id="env-bad-key"),
    # slices: only bcd-alloc-<id>.slice, bounded limits
    pytest.param("slice.apply", {"allocation_id": "system.slice", "limits": {}}, "not a valid id", id="slice-foreign-name"),
    pytest.param("slice.apply", {"allocation_id": "../user.slice", "limits": {}}, "not a valid id", id="slice-traversal"),
    pytest.param("slice.apply", {"allocation_id": "x", "name": "system.slice", "limits": {}}, "unknown field `name`", id="slice-name-field"),
    pytest.param("slice.remove", {"allocation_id": "-.slice"}, "not a valid id", id="slice-remove-root-slice"),
    pytest.param("slice.remove", {"allocation_id": "init.scope"}, "not a valid id", id="slice-remove-scope"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpus": "0-9999"}}, "above the highest", id="cpulist-oversized"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpus": "0," * 600 + "1"}}, "length <= 1024", id="cpulist-too-long"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpus": "0-99999"}}, "not a cpulist", id="cpulist-too-large-number"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpus": "3-1"}}, "backwards", id="cpulist-backwards"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpus": "a-b"}}, "not a cpulist", id="cpulist-malformed"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpus": ""}}, "not a cpulist", id="cpulist-empty"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"mems": "0-4000"}}, "above the highest", id="mems-oversized"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpu_millis": 0}}, "must be positive", id="cpu-millis-zero"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpu_millis": 10**12}}, "cpu_millis", id="cpu-millis-huge"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"memory_bytes": 2**60}}, "memory_bytes", id="memory-huge"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"memory_bytes": -1}}, "memory_bytes", id="memory-negative"),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"hugepages": [{"page_size_kib": 3000, "count": 1}]}}, "power of two", id="hugepage-size"),
    pytest.param(
        "slice.apply", {"allocation_id": "x", "limits": {"hugepages": [{"page_size_kib": 2048, "count": 1}] * 2}}, "listed twice", id="hugepages-twice"
    ),
    pytest.param("slice.apply", {"allocation_id": "x", "limits": {"cpus": "0", "AllowedCPUs": "0-1"}}, "unknown field", id="slice-raw-property"),
    # bodies that are not requests at all
    pytest.param("file.write", b"not json", "bad request", id="not-json"),
    pytest.param("file.write", b"[]", "bad request", id="not-an-object"),
    pytest.param("slice.apply", b"{}", "missing required field", id="empty-object"),
    pytest.param("file.write", b"{" + b" " * (2 << 20) + b"}", "larger than", id="oversized-body"),
]  # fmt: skip


@pytest.mark.parametrize(("op", "body", "reason"), REFUSED)
def test_malicious_requests_are_refused_and_write_nothing(tmp_path: Path, vendor_dir: Path, op: str, body: object, reason: str) -> None:
    ops = make_ops(tmp_path / "node", vendor_dir)
    victim = tmp_path / "etc"
    victim.mkdir()
    before = tree(tmp_path)
    r = ask(ops, op, body if isinstance(body, bytes) else json.dumps(body).encode())
    assert (r.ok, r.outcome) == (False, "refused"), r
    assert reason in r.reason, r.reason
    assert tree(tmp_path) == before


def test_a_symlinked_directory_is_not_followed(tmp_path: Path) -> None:
    ops = make_ops(tmp_path / "node")
    target = tmp_path / "etc"
    target.mkdir()
    # the unprivileged converger owns run_dir and plants allocations -> /etc
    (tmp_path / "node" / "run" / "allocations").symlink_to(target)
    r = ask(ops, "file.write", HelperFileWrite(kind="allocation-env", hold=hold_to_wire(CONTENTS["two-gpus"])))
    assert (r.ok, r.outcome) == (False, "failed") and "not a plain directory" in r.reason, r
    assert not any(target.iterdir())
    r = ask(ops, "file.remove", HelperFileRemove(kind="allocation-env", allocation_id="two"))
    assert r.outcome == "failed"


def test_a_symlink_at_the_file_name_is_replaced_not_followed(tmp_path: Path) -> None:
    ops = make_ops(tmp_path / "node")
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    env_dir = tmp_path / "node" / "run" / "allocations"
    env_dir.mkdir()
    (env_dir / "two.env").symlink_to(victim)
    assert ask(ops, "file.write", HelperFileWrite(kind="allocation-env", hold=hold_to_wire(CONTENTS["two-gpus"]))).ok
    assert victim.read_text() == "keep me\n"
    assert not (env_dir / "two.env").is_symlink()
    (env_dir / "two.env").unlink()
    (env_dir / "two.env").symlink_to(victim)
    assert ask(ops, "file.remove", HelperFileRemove(kind="allocation-env", allocation_id="two")).changed
    assert victim.read_text() == "keep me\n"


def test_a_planted_temp_file_is_never_written_through(tmp_path: Path) -> None:
    ops = make_ops(tmp_path / "node")
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    cdi = tmp_path / "node" / "cdi"
    # a hard link and a symlink at the name the helper's temp file will have
    os.link(victim, cdi / f".bcd-two.json.tmp-{os.getpid()}")
    assert ask(ops, "file.write", HelperFileWrite(kind="cdi", hold=hold_to_wire(CONTENTS["two-gpus"]))).ok
    assert victim.read_text() == "keep me\n"
    (cdi / f".bcd-kube.json.tmp-{os.getpid()}").symlink_to(victim)
    assert ask(ops, "file.write", HelperFileWrite(kind="cdi", hold=hold_to_wire(CONTENTS["kubernetes"]))).ok
    assert victim.read_text() == "keep me\n"
    assert sorted(p.name for p in cdi.iterdir()) == ["bcd-kube.json", "bcd-two.json"]


def test_an_unreadable_vendor_spec_fails_the_cdi_write(tmp_path: Path) -> None:
    ops = make_ops(tmp_path)
    (tmp_path / "cdi" / "nvidia.json").write_text("{not json")
    r = ask(ops, "file.write", HelperFileWrite(kind="cdi", hold=hold_to_wire(CONTENTS["two-gpus"])))
    assert (r.ok, r.outcome) == (False, "failed") and "vendor CDI spec unreadable" in r.reason
    assert not (tmp_path / "cdi" / "bcd-two.json").exists()


def test_a_slice_backend_failure_is_a_failure_not_a_refusal(tmp_path: Path) -> None:
    ops = make_ops(tmp_path)
    # (a garbled record is no failure: apply writes it whole again; a directory in its place is)
    (tmp_path / "run" / "slices" / "bcd-alloc-x.slice.json" / "sub").mkdir(parents=True)
    r = ask(ops, "slice.apply", HelperSliceApply(allocation_id="x", limits=limits_to_wire(Limits(cpus="0"))))
    assert (r.ok, r.outcome) == (False, "failed") and "cannot write fake slice record" in r.reason


@pytest.mark.parametrize("what", ["directory", "fifo"])
def test_a_hold_path_occupied_by_a_non_file_fails_the_write_and_leaves_nothing_behind(tmp_path: Path, what: str) -> None:
    """Issue 11 (12): a rename onto a directory left `.<name>.tmp-<pid>` behind; a FIFO was swallowed."""
    ops = make_ops(tmp_path / "node")
    env_dir = tmp_path / "node" / "run" / "allocations"
    env_dir.mkdir(parents=True, exist_ok=True)
    env = env_dir / "two.env"
    if what == "directory":
        env.mkdir()
    else:
        os.mkfifo(env)
    r = ask(ops, "file.write", HelperFileWrite(kind="allocation-env", hold=hold_to_wire(CONTENTS["two-gpus"])))
    kind = "a directory" if what == "directory" else "a FIFO"
    assert (r.ok, r.outcome) == (False, "failed") and f"cannot write {env}: {kind} is in the way" in r.reason, r
    assert [p.name for p in env_dir.iterdir()] == ["two.env"]  # no temp file, the occupant kept
    if what == "directory":
        assert env.is_dir()
        env.rmdir()
    else:
        assert env.is_fifo()
        env.unlink()
    assert ask(ops, "file.write", HelperFileWrite(kind="allocation-env", hold=hold_to_wire(CONTENTS["two-gpus"]))).ok
    assert env.read_text().startswith("BCD_ALLOCATION_ID=two\n")


# --------------------------------------------------------------------------- consumer copies


def make_copying_ops(root: Path, vendor_dir: Path | None = None) -> HelperOps:
    """make_ops' directories, and a consumer dir of its own (the service's --cdi-consumer-dir)."""
    make_ops(root, vendor_dir)
    return HelperOps(root / "cdi", root / "run", FakeSlices(root / "run"), slices_backend="fake", mps_pipe_dir=MPS, consumer_dir=root / "run-cdi")


@pytest.mark.parametrize("name", sorted(CONTENTS))
def test_a_copy_is_made_from_the_hold_spec_on_the_helpers_disk_as_the_local_writer_makes_it(tmp_path: Path, vendor_dir: Path, name: str) -> None:
    content = CONTENTS[name]
    local_root, helper_root = tmp_path / "local", tmp_path / "helper"
    ops = make_copying_ops(helper_root, vendor_dir)
    (local_root / "cdi").mkdir(parents=True)
    (local_root / "cdi" / "nvidia.json").write_bytes((vendor_dir / "nvidia.json").read_bytes())
    local = LocalHostWriter(local_root / "cdi", local_root / "run", ConvergerFakeSlices(local_root / "run"), consumer_dir=local_root / "run-cdi")
    local.write_cdi(content)
    local.write_consumer(content.allocation_id)
    assert ask(ops, "file.write", HelperFileWrite(kind="cdi", hold=hold_to_wire(content))).ok
    r = ask(ops, "file.copy", HelperFileCopy(allocation_id=content.allocation_id))
    assert r.ok and r.changed and r.path == str(Path(os.path.realpath(helper_root)) / "run-cdi" / f"bcd-{content.allocation_id}.json"), r
    assert not ask(ops, "file.copy", HelperFileCopy(allocation_id=content.allocation_id)).changed
    assert tree(helper_root / "run-cdi") == tree(local_root / "run-cdi") != {}
    assert (helper_root / "run-cdi" / f"bcd-{content.allocation_id}.json").stat().st_mode & 0o777 == 0o644
    assert ops.info().cdi_consumer_dir == str(Path(os.path.realpath(helper_root)) / "run-cdi")
    r = ask(ops, "file.remove", HelperFileRemove(kind="cdi-consumer", allocation_id=content.allocation_id))
    assert r.ok and r.changed and tree(helper_root / "run-cdi") == {}


def _hold_file(root: Path) -> Path:
    return root / "cdi" / "bcd-two.json"


@pytest.mark.parametrize(
    ("plant", "outcome", "reason"),
    [
        (None, "failed", "no hold spec"),
        (lambda p: p.write_text("{not json"), "refused", "not valid JSON"),
        (lambda p: p.write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "bcd.dev/gpu", "devices": []})), "refused", "no annotations"),
        (lambda p: p.symlink_to("/etc/passwd"), "failed", "not a regular file"),
        (lambda p: os.mkfifo(p), "failed", "not a regular file"),
    ],
    ids=["missing", "not-json", "not-a-hold", "symlink", "fifo"],
)
def test_a_copy_of_what_is_not_that_hold_is_not_made(tmp_path: Path, plant, outcome: str, reason: str) -> None:  # noqa: ANN001
    ops = make_copying_ops(tmp_path)
    if plant is not None:
        plant(_hold_file(tmp_path))
    r = ask(ops, "file.copy", HelperFileCopy(allocation_id="two"))
    assert not r.ok and r.outcome == outcome and reason in r.reason, r
    assert tree(tmp_path / "run-cdi") == {}


def test_another_allocations_hold_is_not_copied_under_this_id(tmp_path: Path) -> None:
    ops = make_copying_ops(tmp_path)
    assert ask(ops, "file.write", HelperFileWrite(kind="cdi", hold=hold_to_wire(CONTENTS["mig"]))).ok
    os.rename(tmp_path / "cdi" / "bcd-mig.json", _hold_file(tmp_path))
    r = ask(ops, "file.copy", HelperFileCopy(allocation_id="two"))
    assert r.outcome == "refused" and "does not match the file name" in r.reason


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"allocation_id": "../../etc/x"}, "not a valid id"),
        ({"allocation_id": "two", "path": "/etc/cdi/x.json"}, "unknown field"),
        ({"allocation_id": "two", "content": "{}"}, "unknown field"),
    ],
)
def test_a_copy_request_carries_an_id_and_nothing_else(tmp_path: Path, body: dict, reason: str) -> None:
    ops = make_copying_ops(tmp_path)
    r = ask(ops, "file.copy", json.dumps(body).encode())
    assert r.outcome == "refused" and reason in r.reason, r


def test_a_consumer_copy_is_never_written_from_wire_fields(tmp_path: Path) -> None:
    ops = make_copying_ops(tmp_path)
    r = ask(ops, "file.write", HelperFileWrite(kind="cdi-consumer", hold=hold_to_wire(CONTENTS["two-gpus"])))
    assert r.outcome == "refused" and "file.copy" in r.reason
    assert not (tmp_path / "run-cdi").exists() or tree(tmp_path / "run-cdi") == {}


def test_a_helper_without_a_consumer_dir_refuses_copies(tmp_path: Path) -> None:
    ops = make_ops(tmp_path)
    assert ops.info().cdi_consumer_dir == ""
    r = ask(ops, "file.copy", HelperFileCopy(allocation_id="two"))
    assert r.outcome == "refused" and "no --cdi-consumer-dir" in r.reason
