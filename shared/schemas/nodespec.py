"""What the control plane asks of a node: the NodeSpec and its signed envelope.

Everything that later lands in a file (ids, env lines, cpulists) is validated
here, at decode, so the converger never sees a value it would have to refuse
on the way to a path. A spec that fails decoding is refused whole.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .common import (
    DENIED_ENV_LINE_PATTERN,
    HUGEPAGE_MAX_KIB,
    HUGEPAGE_MIN_KIB,
    HUGEPAGES_MAX_COUNT,
    LIMITS_MAX_CPU_MILLIS,
    LIMITS_MAX_MEMORY_BYTES,
    AtomId,
    CpuList,
    EnvLine,
    Generation,
    Id,
    PciAddress,
    Struct,
    env_key_problem,
    env_value_problem,
)

#: BINDING_UNSPECIFIED is the protobuf zero value: it decodes, and the
#: converger refuses the hold with unsupported-binding, like INSTANCE.
Binding = Literal["BINDING_UNSPECIFIED", "BINDING_HOLD", "BINDING_KUBERNETES", "BINDING_INSTANCE"]
BINDINGS: tuple[str, ...] = Binding.__args__  # type: ignore[attr-defined]

MAX_DEVICES_PER_ASSIGNMENT = 64
MAX_ASSIGNMENTS = 1024
MAX_ENV_LINES = 128

#: an env line of a spec. Its key is checked in DeviceAssignment.__post_init__ (the message names the
#: key and why); the JSON Schema says the same as `not` a pattern, for a control plane's validator.
SpecEnvLine = Annotated[
    EnvLine,
    msgspec.Meta(
        extra_json_schema={
            "not": {
                "pattern": DENIED_ENV_LINE_PATTERN,
                "description": "keys a spec may not set: bcd's own (BCD_*, NVIDIA_VISIBLE_DEVICES, CUDA_MPS_PIPE_DIRECTORY) and those "
                "the dynamic loader, glibc, the NVIDIA container toolkit's root hook, the CUDA MPS client or a shell reads "
                "(docs/upstream.md, section 3)",
            }
        }
    ),
]


class HugePages(Struct, kw_only=True):
    page_size_kib: Annotated[int, msgspec.Meta(ge=HUGEPAGE_MIN_KIB, le=HUGEPAGE_MAX_KIB)]
    count: Annotated[int, msgspec.Meta(ge=0, le=HUGEPAGES_MAX_COUNT)]


class Limits(Struct, kw_only=True):
    """Host resources an assignment books; any of them makes the hold sliced.

    Bounded as the root helper is (shared.schemas.common LIMITS_*): whatever limits a
    spec carries, the helper that writes its slice takes."""

    cpus: CpuList | None = None
    cpu_millis: Annotated[int, msgspec.Meta(ge=0, le=LIMITS_MAX_CPU_MILLIS)] | None = None
    memory_bytes: Annotated[int, msgspec.Meta(ge=0, le=LIMITS_MAX_MEMORY_BYTES)] | None = None
    hugepages: Annotated[list[HugePages], msgspec.Meta(max_length=8)] = []
    #: NUMA nodes, nodelist syntax ("0" or "0-1").
    mems: CpuList | None = None

    def __post_init__(self) -> None:
        sizes = [h.page_size_kib for h in self.hugepages]
        if len(sizes) != len(set(sizes)):
            raise ValueError("hugepages: page_size_kib listed twice")
        for field, value in (("cpus", self.cpus), ("mems", self.mems)):
            if value is not None:
                for part in value.split(","):
                    lo, _, hi = part.partition("-")
                    if hi and int(hi) < int(lo):
                        raise ValueError(f"{field}: range {part!r} runs backwards")

    def is_empty(self) -> bool:
        return (
            self.cpus is None
            and self.cpu_millis is None
            and self.memory_bytes is None
            and not self.hugepages
            and self.mems is None
        )


class DeviceAssignment(Struct, kw_only=True):
    """One allocation of the devices section: becomes one hold."""

    allocation_id: Id
    reservation_id: Id
    binding: Binding
    #: for BINDING_INSTANCE; not read (GPUs for VMs come in `instances`).
    instance_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    devices: Annotated[list[AtomId], msgspec.Meta(max_length=MAX_DEVICES_PER_ASSIGNMENT)] = []
    limits: Limits | None = None
    env: Annotated[list[SpecEnvLine], msgspec.Meta(max_length=MAX_ENV_LINES)] = []

    def __post_init__(self) -> None:
        # Each message starts with the line's own path (`env[3]: `): the codec joins it to the
        # assignment's (`- at `$.devices[2]``), so the refusal names `$.devices[2].env[3]`.
        seen: set[str] = set()
        for i, line in enumerate(self.env):
            key = line.split("=", 1)[0]
            # bcd's own keys, and those the loader, libc, the runtime's hook or a shell reads
            problem = env_key_problem(key)
            if problem:
                raise ValueError(f"env[{i}]: {problem} and cannot come from the spec")
            if key in seen:
                raise ValueError(f"env[{i}]: {key} is set twice")
            seen.add(key)
            # the env file must read the same to every consumer (common.env_value_problem)
            problem = env_value_problem(line.split("=", 1)[1])
            if problem:
                raise ValueError(f"env[{i}]: {key}: {problem}")

    @property
    def sliced(self) -> bool:
        return self.limits is not None and not self.limits.is_empty()


class InstanceGpus(Struct, kw_only=True):
    """The GPU part of a VM instance's spec: which cards it passes through."""

    instance_id: Id
    gpus: Annotated[list[PciAddress], msgspec.Meta(max_length=64)] = []


#: the largest generation a control plane asks for or rebases a node to: 2^53 - 1, the largest
#: integer every JSON reader takes exactly. Above it a node can be rebased (docs/upstream.md,
#: "Generations"): a generation there was never a control plane's count, and no count gets there.
GENERATION_SAFE_MAX = 2**53 - 1


class NodeSpec(Struct, kw_only=True):
    node_id: Id
    generation: Generation
    devices: Annotated[list[DeviceAssignment], msgspec.Meta(max_length=MAX_ASSIGNMENTS)] = []
    instances: Annotated[list[InstanceGpus], msgspec.Meta(max_length=256)] = []
    #: a rebase only (a control plane's `rebase`, signed like any spec): the applied generation,
    #: above GENERATION_SAFE_MAX, that this spec's lower one replaces. Absent otherwise.
    rebase_from: Generation | None = None

    def __post_init__(self) -> None:
        if self.rebase_from is not None and not (self.generation <= GENERATION_SAFE_MAX < self.rebase_from):
            raise ValueError(
                f"rebase_from: a rebase goes from a generation above {GENERATION_SAFE_MAX} to one at or below it, "
                f"not from {self.rebase_from} to {self.generation}"
            )
        seen: set[str] = set()
        for a in self.devices:
            if a.allocation_id in seen:
                raise ValueError(f"devices: allocation_id {a.allocation_id} appears twice")
            seen.add(a.allocation_id)
        seen.clear()
        for i in self.instances:
            if i.instance_id in seen:
                raise ValueError(f"instances: instance_id {i.instance_id} appears twice")
            seen.add(i.instance_id)


class SignedNodeSpec(Struct, kw_only=True):
    """Upstream envelope in KV `bcd_nodespecs/<node_id>`.

    `spec` is the NodeSpec JSON (base64 on the wire); the signature covers
    `b"node-spec\\0" + spec` with the control plane's Ed25519 key. Unsigned
    specs carry an empty key_id and signature.
    """

    spec: bytes
    key_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    signature: bytes = b""


def takes_rebase(spec: NodeSpec, applied: int) -> bool:
    """Does a node at generation `applied` take `spec`, lower, as its control plane's rebase?

    Only a spec naming exactly the applied generation (so an old rebase replayed later names
    another and is refused as any lower generation is), from above GENERATION_SAFE_MAX (where no
    control plane's count gets again, __post_init__). The bridge and the converger both ask.
    """
    return spec.rebase_from is not None and spec.rebase_from == applied and spec.generation < applied


__all__ = [
    "Binding",
    "BINDINGS",
    "HugePages",
    "Limits",
    "DeviceAssignment",
    "InstanceGpus",
    "NodeSpec",
    "SignedNodeSpec",
    "GENERATION_SAFE_MAX",
    "takes_rebase",
]

