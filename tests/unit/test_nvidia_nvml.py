"""nvidia_nvml alone: `PynvmlNvml` on the real `pynvml` module with its functions replaced one by one
(monkeypatch fails on a name the module lacks), and the failure helpers the adapter's parts share."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from services.inventory.adapters.nvidia_nvml import (
    NVML_ERRORS,
    NvmlError,
    NvmlProcess,
    PynvmlNvml,
    nvml_code,
    try_list,
    try_value,
)

NO_INSTANCE = 0xFFFFFFFF


def _raise(exc: BaseException) -> Any:
    raise exc


def stub(monkeypatch: pytest.MonkeyPatch, name: str, body: Any) -> None:
    """pynvml's function `name` replaced by body, under its own name (NvmlError names the call)."""

    def call(*args: Any) -> Any:
        return body(*args)

    call.__name__ = name
    monkeypatch.setattr(pynvml, name, call)


@pytest.fixture
def handles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """nvmlDeviceGetHandleByIndex answers "dev<k>"; the indices it was asked for, in order."""
    asked: list[int] = []

    def get(index: int) -> str:
        asked.append(index)
        return f"dev{index}"

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", get)
    return asked


# --------------------------------------------------------------------------- NVML's failures


def test_a_pynvml_failure_becomes_an_nvml_error_with_its_code_and_call(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    stub(monkeypatch, "nvmlDeviceGetUUID", lambda h: _raise(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)))
    with pytest.raises(NvmlError) as err:
        PynvmlNvml().device_uuid(0)
    assert err.value.code == pynvml.NVML_ERROR_GPU_IS_LOST
    assert str(err.value) == "nvmlDeviceGetUUID: GPU is lost"
    # pynvml's own error is not chained on: the message says all
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_other_exceptions_pass_through_unmapped(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: _raise(KeyError("not NVML's")))
    with pytest.raises(KeyError):
        PynvmlNvml().device_name(0)


def test_a_failed_handle_is_the_call_that_failed(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    stub(monkeypatch, "nvmlDeviceGetHandleByIndex", lambda k: _raise(pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)))
    with pytest.raises(NvmlError, match="^nvmlDeviceGetHandleByIndex: ") as err:
        PynvmlNvml().device_memory_total(9)
    assert err.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (NvmlError("x", pynvml.NVML_ERROR_IN_USE), pynvml.NVML_ERROR_IN_USE),
        (NvmlError("x"), None),
        (pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND), pynvml.NVML_ERROR_NOT_FOUND),
        (ValueError("not NVML's"), None),
    ],
    ids=["port-error", "port-error-without-code", "pynvml-error", "other"],
)
def test_nvml_code(exc: BaseException, code: int | None) -> None:
    assert nvml_code(exc) == code


def test_optional_facts_swallow_nvml_failures_only() -> None:
    assert NvmlError in NVML_ERRORS and pynvml.NVMLError in NVML_ERRORS
    assert try_value(lambda: _raise(NvmlError("no", 3)), "default") == "default"
    assert try_value(lambda: _raise(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)), 0) == 0
    assert try_value(lambda: "read", "default") == "read"
    assert try_list(lambda: _raise(pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION))) == []
    assert try_list(lambda: [1, 2]) == [1, 2]
    with pytest.raises(ValueError):
        try_value(lambda: _raise(ValueError("a bug, not a refusal")), "default")
    with pytest.raises(ValueError):
        try_list(lambda: _raise(ValueError("a bug, not a refusal")))


# --------------------------------------------------------------------------- reads


def test_handles_are_got_once_per_index_until_nvml_is_initialised_again(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: f"name of {h}")
    port = PynvmlNvml()
    assert [port.device_name(0), port.device_name(1), port.device_name(0)] == ["name of dev0", "name of dev1", "name of dev0"]
    assert handles == [0, 1]
    port.init()  # a new NVML session: the old handles are not trusted
    port.device_name(0)
    assert handles == [0, 1, 0]


def test_text_from_bytes_or_str(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: b"NVIDIA H200\xff")
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: "570.86.15")
    port = PynvmlNvml()
    assert port.device_name(0) == "NVIDIA H200\ufffd"  # undecodable bytes replaced, not an error
    assert port.driver_version() == "570.86.15"


@pytest.mark.parametrize(("nvml", "text"), [(12040, "12.4"), (11080, "11.8"), (12000, "12.0"), (13010, "13.1")])
def test_cuda_driver_version(monkeypatch: pytest.MonkeyPatch, nvml: int, text: str) -> None:
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: nvml)
    assert PynvmlNvml().cuda_driver_version() == text


def test_mig_mode_of_a_card_without_mig_is_off_and_other_failures_raise(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    answers: dict[str, Any] = {
        "dev0": (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE),  # on, off pending: still on
        "dev1": (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE),
        "dev2": pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "dev3": pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST),
    }

    def mode(handle: str) -> Any:
        got = answers[handle]
        return _raise(got) if isinstance(got, Exception) else got

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", mode)
    port = PynvmlNvml()
    assert [port.device_mig_mode(k) for k in range(3)] == [True, False, False]
    with pytest.raises(NvmlError) as err:
        port.device_mig_mode(3)
    assert err.value.code == pynvml.NVML_ERROR_GPU_IS_LOST


def test_set_mig_mode_says_when_the_change_waits_for_a_reset(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"current": pynvml.NVML_DEVICE_MIG_DISABLE, "pending": pynvml.NVML_DEVICE_MIG_DISABLE, "applies": False}

    def set_mode(handle: str, mode: int) -> int:
        state["pending"] = mode
        if state["applies"]:
            state["current"] = mode
        return pynvml.NVML_SUCCESS

    monkeypatch.setattr(pynvml, "nvmlDeviceSetMigMode", set_mode)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda h: (state["current"], state["pending"]))
    port = PynvmlNvml()
    assert port.set_mig_mode(0, True) is True  # pending until the GPU is reset
    state["applies"] = True
    assert port.set_mig_mode(0, True) is False
    assert port.set_mig_mode(0, False) is False


def test_compute_processes_keep_their_mig_instance_or_none(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    procs = [
        SimpleNamespace(pid=10, gpuInstanceId=NO_INSTANCE, computeInstanceId=NO_INSTANCE),  # on the whole card
        SimpleNamespace(pid=11, gpuInstanceId=3, computeInstanceId=0),
        SimpleNamespace(pid=12, gpuInstanceId=None, computeInstanceId=None),
        SimpleNamespace(pid=13),  # an older driver's struct: no MIG fields at all
    ]
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: procs)
    assert PynvmlNvml().compute_processes(0) == [
        NvmlProcess(pid=10),
        NvmlProcess(pid=11, gi_id=3, ci_id=0),
        NvmlProcess(pid=12),
        NvmlProcess(pid=13),
    ]


def test_placements_are_read_at_most_to_the_bound(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML says how many placements there are, then fills an array that large; a count past the
    schema's bound (64) is read only up to it."""
    sizes: list[int | None] = []

    def possible(handle: object, profile_id: int, placements: Any, count: Any) -> int:
        sizes.append(None if placements is None else len(placements))
        if placements is None:
            count._obj.value = 100
            return pynvml.NVML_SUCCESS
        for k in range(len(placements)):
            placements[k].start, placements[k].size = k, 1
        count._obj.value = len(placements)
        return pynvml.NVML_SUCCESS

    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstancePossiblePlacements", possible)
    got = PynvmlNvml().gpu_instance_placements(0, 19)
    assert sizes == [None, 64]
    assert got == [(k, 1) for k in range(64)]


def test_no_placements_ask_once(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def possible(handle: object, profile_id: int, placements: Any, count: Any) -> int:
        calls.append(placements)
        count._obj.value = 0
        return pynvml.NVML_SUCCESS

    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstancePossiblePlacements", possible)
    assert PynvmlNvml().gpu_instance_placements(0, 19) == []
    assert calls == [None]


def test_a_compute_instance_spans_its_gpu_instance(handles: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The compute instance made is of the largest profile the GPU instance offers; profiles it lacks are skipped."""
    slices = {0: 1, 1: 2, 2: None, 3: 3, 4: None}  # compute instance profile index -> slice count (None: not offered)
    made: list[int] = []

    def profile(gi: object, k: int, engine: int) -> Any:
        assert gi == "gi5" and engine == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        if slices.get(k) is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(id=100 + k, sliceCount=slices[k])

    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstanceById", lambda h, gi: f"gi{gi}")
    monkeypatch.setattr(pynvml, "nvmlGpuInstanceGetComputeInstanceProfileInfo", profile)
    monkeypatch.setattr(pynvml, "nvmlGpuInstanceCreateComputeInstance", lambda gi, pid: made.append(pid) or "ci")
    monkeypatch.setattr(pynvml, "nvmlComputeInstanceGetInfo", lambda ci: SimpleNamespace(id=0))
    assert PynvmlNvml().create_compute_instance(0, 5) == 0
    assert made == [103]

    monkeypatch.setattr(pynvml, "nvmlGpuInstanceGetComputeInstanceProfileInfo", lambda gi, k, e: _raise(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)))
    with pytest.raises(NvmlError, match="no compute instance profile"):
        PynvmlNvml().create_compute_instance(0, 5)
    assert made == [103]
