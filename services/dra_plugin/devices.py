"""What the DRA plugin publishes, as pure functions of the inventory and the claims ledger.

`plan_pool(inventory, claims, claim_gis=...)` -> `Pool`: the devices and shared counter sets of
one node's pool, and a note per card left out (or partly left out) saying why.
`render_slices(pool, driver=..., node_name=..., node_uid=..., generation=...)` -> the
ResourceSlice objects (resource.k8s.io/v1, Kubernetes 1.35) that carry that pool.
`pool_content_key(pool)` changes exactly when what is published changes (the plugin bumps the
pool generation then). `resolve_device` / `resolve` map a device of a ResourceClaim allocation
back to a card (`ClaimDevice`), from its name and the inventory.

Which cards: a card is published only when its PhysicalGPU phase is Ready (seed 003: a card with
AdapterReady=False is in no ResourceSlice), its management state is not Excluded, it is not on
vfio-pci, and nothing but a DRA claim claims it (a GpuClaim of kind "claim" keeps the card: the
scheduler accounts for what it allocated itself; any other kind removes it). While the claims
are not known (None) nothing is published: fail-closed, a card a VM took a moment ago must not
be offered.

Unhealthy cards (issue 30): a card whose Healthy condition is False reads phase Failed. With
`device_taints` (the API server's DRADeviceTaints feature, KEP 5055) it stays published when
it would be Ready but for its health (AdapterReady=True, not Reconfiguring, not Passthrough:
physicalgpu.PHASE_ROWS without the "unhealthy" row), and every device of it (the whole card,
its MIG placements, a shared card) carries the taints of its faults (`health_taints`): the
scheduler gives it to no claim that does not tolerate them, and NoExecute evicts the pods of
claims it already has. Without `device_taints` it is left out, as every card not Ready is.
Healthy=Unknown (Unmonitored, NotChecked) neither taints nor withdraws a card.

Names (DNS labels, deterministic): the whole card `gpu-<index>`; a MIG placement
`gpu-<index>-mig-<profile label>-<start>` (`1g.10gb+me` -> `1g-10gb-me`); the card's counter set
`gpu-<index>-counters`. The start is the last dash-separated part of a MIG name, so names are
unique exactly when the profile labels of a card are: profiles whose labels collide are left out
(noted), as is one whose name would be longer than 63.

MIG (partitionable devices, KEP 4815): a card in MIG mode gets its whole-card device and one
device per (profile, placement), all consuming from one counter set of the card: `slices` (compute
slices), `slice-<k>` per memory slice, `multiprocessors`, `copy-engines`, `decoders`, `encoders`,
`jpeg-engines`, `ofa-engines`, `memory`. The totals are what the card's largest placement covers
(max over profiles; memory slices: max(start+size) over all placements); a placement consumes its
profile's counts and `slice-<k>` = 1 for each memory slice it covers; the whole card consumes all.
So the scheduler keeps placements exclusive by itself (seed 003: a 7g consumes every slice-k).
Zero counts are neither offered nor consumed (a card without encoders has no `encoders`).
A MIG card is published only when every GPU instance on it belongs to a prepared DRA claim
(`claim_gis`): any other instance means something else uses part of the card.

Slices (1.35 rules): a slice has devices or shared counters, never both; at most 8 counter sets
per slice, 32 counters per set; at most 64 devices per slice when any consumes counters (128
otherwise). Counter-set slices come first, then device slices, a card's devices kept together
where they fit. A pool with nothing to publish is one slice with `devices: []` (the API allows a
slice with neither devices nor counters: only both at once is refused), so the pool is known and
empty rather than absent.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from shared.schemas import ClaimDevice, Claims, Condition, Gpu, Inventory, MigPlacement, MigProfile
from shared.schemas.inventory import PhysicalGPUStatus, health_text

#: the domain of device attributes and capacities (`gpu.bcd.dev/<name>`)
ATTRIBUTE_DOMAIN = "gpu.bcd.dev"
#: the driver name unless configured (DESIGN section 10)
DEFAULT_DRIVER = "gpu.bcd.dev"
API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "bcd"
NODE_LABEL = "gpu.bcd.dev/node"
#: a kind of GpuClaim that does not remove the card from the pool (a DRA claim's own hold)
DRA_CLAIM_KIND = "claim"
VFIO_DRIVER = "vfio-pci"
#: seed 003: what each device declares when binding conditions are on
BINDING_CONDITIONS = ("Ready",)
BINDING_FAILURE_CONDITIONS = ("BindingFailed",)

# resource.k8s.io/v1 limits (Kubernetes 1.35, pkg/apis/resource/validation)
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_COUNTERS = 64
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
MAX_ATTRIBUTES_AND_CAPACITIES = 32
ATTRIBUTE_ID_MAX = 32
ATTRIBUTE_STRING_MAX = 64
DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
DRIVER_NAME_MAX = 63
LABEL_VALUE_MAX = 63

#: device taints of an unhealthy card (issue 30), modelled on NVIDIA's DRA driver (gpu.nvidia.com/xid,
#: gpu.nvidia.com/gpu-lost): one key per kind of fault, the value says which (the XID number, else
#: the Healthy reason). resource.k8s.io/v1 DeviceTaint: key a label name, value a label value,
#: effect None|NoSchedule|NoExecute, at most 16 per device; a slice with a tainted device takes 64.
TAINT_XID = f"{ATTRIBUTE_DOMAIN}/xid"
TAINT_GPU_LOST = f"{ATTRIBUTE_DOMAIN}/gpu-lost"
TAINT_ECC = f"{ATTRIBUTE_DOMAIN}/ecc"
TAINT_ROW_REMAP = f"{ATTRIBUTE_DOMAIN}/row-remap"
#: a Healthy=False reason this plugin does not know (a newer inventory's): fatal, fail-safe
TAINT_UNHEALTHY = f"{ATTRIBUTE_DOMAIN}/unhealthy"
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
#: Healthy=False reason (services/inventory/health.py) -> (taint key, effect). The sticky faults
#: (the card needs a reset or a reboot and a clean check) evict; the level ones (rows waiting to be
#: remapped, correctable errors over the threshold) keep new claims off and let running ones be.
HEALTH_TAINTS: dict[str, tuple[str, str]] = {
    "GpuLost": (TAINT_GPU_LOST, NO_EXECUTE),
    "XidCritical": (TAINT_XID, NO_EXECUTE),
    "EccUncorrectable": (TAINT_ECC, NO_EXECUTE),
    "RowRemapFailed": (TAINT_ROW_REMAP, NO_EXECUTE),
    "RowRemapPending": (TAINT_ROW_REMAP, NO_SCHEDULE),
    "EccCorrectable": (TAINT_ECC, NO_SCHEDULE),
}
MAX_TAINTS_PER_DEVICE = 16
#: the conditions the phase is derived from (services/inventory/physicalgpu.py)
ADAPTER_READY_CONDITION = "AdapterReady"
RECONFIGURING_CONDITION = "Reconfiguring"

#: the capacities a share of a card asks (consumable capacity): percent of the card, bytes of its memory
CAPACITY_SHARE_PERCENT = "sharePercent"
CAPACITY_MEMORY = "memory"
#: a share's memory is asked in whole MiB (MPS pinned limits are MiB)
MEMORY_STEP = 1 << 20

COUNTER_SLICES = "slices"
COUNTER_MEMORY = "memory"
#: counter name -> MigProfile field, in counter-set order after `slices` and the `slice-<k>`s
ENGINE_COUNTERS: tuple[tuple[str, str], ...] = (
    ("multiprocessors", "multiprocessors"),
    ("copy-engines", "copy_engines"),
    ("decoders", "decoders"),
    ("encoders", "encoders"),
    ("jpeg-engines", "jpeg_engines"),
    ("ofa-engines", "ofa_engines"),
)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[_a-zA-Z][_a-zA-Z0-9]*$")
_GPU_INDEX = re.compile(r"^gpu-(0|[1-9][0-9]*)(?:-|$)")
_DECIMAL_SUFFIXES = ("", "k", "M", "G", "T", "P", "E")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
#: another fault in a Healthy condition's message: health.healthy_condition writes the worst fault's
#: text, then "; also <Reason>: <text>" for each other one (an earlier inventory: "<Reason>: <text>"
#: for every fault, joined by "; ")
_FAULT_IN_MESSAGE = re.compile(r"(?:^|; )(?:also )?([A-Z][A-Za-z]*): ")
#: the XID of an XidCritical fault: its text starts "XID <n>" (the worst fault's at the message's start)
_XID_IN_MESSAGE = re.compile(r"(?:^|XidCritical: )XID (\d+)\b")

DeviceKind = Literal["gpu", "mig"]


# --------------------------------------------------------------------------- names and values


def is_dns_label(name: str) -> bool:
    return len(name) <= DNS_LABEL_MAX and bool(_DNS_LABEL.match(name))


def is_dns_subdomain(name: str) -> bool:
    return len(name) <= DNS_SUBDOMAIN_MAX and bool(_DNS_SUBDOMAIN.match(name))


def is_attribute_id(name: str) -> bool:
    """The identifier of an attribute or capacity name (`<domain>/<id>`): a C identifier of at most 32."""
    return len(name) <= ATTRIBUTE_ID_MAX and bool(_C_IDENTIFIER.match(name))


def profile_label(profile: str) -> str:
    """A MIG profile as a DNS-label part: lowercase, every run of other characters one dash
    (`1g.10gb` -> `1g-10gb`, `1g.10gb+me` -> `1g-10gb-me`); "" when nothing is left."""
    return re.sub(r"[^a-z0-9]+", "-", profile.lower()).strip("-")


def gpu_device_name(index: int) -> str:
    return f"gpu-{index}"


def mig_device_name(index: int, profile: str, start: int) -> str:
    return f"gpu-{index}-mig-{profile_label(profile)}-{start}"


def counter_set_name(index: int) -> str:
    return f"gpu-{index}-counters"


def slice_counter(k: int) -> str:
    return f"slice-{k}"


def quantity(n: int) -> str:
    """A non-negative integer as the canonical Kubernetes quantity the API server stores
    (decimal SI: `7`, `10737418240`, `80G`), so what is published reads back unchanged."""
    if n < 0:
        raise ValueError(f"a counter or capacity is never negative: {n}")
    exp = 0
    while n and n % 1000 == 0 and exp < len(_DECIMAL_SUFFIXES) - 1:
        n //= 1000
        exp += 1
    return f"{n}{_DECIMAL_SUFFIXES[exp]}"


def _clip(text: str, limit: int = ATTRIBUTE_STRING_MAX) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, at a character boundary."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[:limit].decode(errors="ignore")


def _short_hash(text: str, n: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _label_value(value: str) -> str:
    """A label value of at most 63: `value` when it fits, else a prefix and a hash of the whole."""
    if len(value) <= LABEL_VALUE_MAX:
        return value
    digest = _short_hash(value)
    return value[: LABEL_VALUE_MAX - len(digest) - 1].rstrip(".-_") + "-" + digest


# --------------------------------------------------------------------------- health as device taints


def _stamp(at: datetime) -> str:
    """A time as metav1.Time writes it (RFC 3339 in UTC, whole seconds), so it reads back unchanged."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def taint_value(text: str) -> str:
    """`text` as a label value (at most 63 of [-A-Za-z0-9_.], alphanumeric at both ends; "" when nothing is left)."""
    value = re.sub(r"[^-A-Za-z0-9_.]+", "-", text)[:LABEL_VALUE_MAX]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    return value if _LABEL_VALUE_RE.match(value) else ""


@dataclass(frozen=True)
class DeviceTaint:
    """One resource.k8s.io/v1 DeviceTaint of a device."""

    key: str
    effect: str
    value: str = ""
    #: when the fault was first seen (the Healthy condition's since); None: the API server's to say
    time_added: datetime | None = None

    def to_api(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key}
        if self.value:
            out["value"] = self.value
        out["effect"] = self.effect
        if self.time_added is not None:
            out["timeAdded"] = _stamp(self.time_added)
        return out

    def text(self) -> str:
        """`key=value:effect`, as kubectl writes a node taint."""
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"


def health_taints(condition: Condition | None) -> tuple[DeviceTaint, ...]:
    """The taints of a card's Healthy condition: none unless it is False; else one per kind of fault
    it names (its reason first, then each other fault its message lists, "also <Reason>: ...",
    worst first as health.py orders them), the first of a key kept (NoExecute before NoSchedule:
    the fatal reasons come first). `gpu.bcd.dev/xid` says the XID number when the message has one;
    every other value is the reason. A reason this plugin does not know taints
    `gpu.bcd.dev/unhealthy` NoExecute. Every taint was added at the condition's since (when its
    worst fault was first seen)."""
    if condition is None or condition.status != "False":
        return ()
    reasons = [condition.reason] + [m.group(1) for m in _FAULT_IN_MESSAGE.finditer(condition.message) if m.group(1) in HEALTH_TAINTS]
    xid = _XID_IN_MESSAGE.search(condition.message)
    out: dict[str, DeviceTaint] = {}
    for reason in reasons:
        key, effect = HEALTH_TAINTS.get(reason, (TAINT_UNHEALTHY, NO_EXECUTE))
        if key in out:
            continue
        value = xid.group(1) if key == TAINT_XID and xid else taint_value(reason) or "Unhealthy"
        out[key] = DeviceTaint(key=key, effect=effect, value=value, time_added=condition.since)
    return tuple(out.values())[:MAX_TAINTS_PER_DEVICE]


def _condition_true(status: PhysicalGPUStatus, type_: str) -> bool:
    return any(c.type == type_ and c.status == "True" for c in status.conditions)


def ready_but_for_health(status: PhysicalGPUStatus) -> bool:
    """The phase would be Ready without the Healthy condition (physicalgpu.PHASE_ROWS without its
    "unhealthy" row): not Passthrough, not Reconfiguring, AdapterReady=True. Any other reason a card
    is not Ready keeps it out whatever its health."""
    return (
        status.driver_binding.mode != "Passthrough"
        and not _condition_true(status, RECONFIGURING_CONDITION)
        and _condition_true(status, ADAPTER_READY_CONDITION)
    )


# --------------------------------------------------------------------------- the pool


@dataclass(frozen=True)
class CounterSet:
    """One card's shared counters (`gpu-<index>-counters`); counters in a fixed order, none zero."""

    name: str
    pci: str
    counters: tuple[tuple[str, int], ...]

    def to_api(self) -> dict[str, Any]:
        return {"name": self.name, "counters": {k: {"value": quantity(v)} for k, v in self.counters}}


@dataclass(frozen=True)
class PublishedDevice:
    """One device of the pool: a whole card (kind "gpu") or a MIG placement (kind "mig")."""

    name: str
    pci: str
    #: the card's uuid (the parent's, for a MIG placement: a MIG uuid exists only once prepared)
    uuid: str
    index: int
    kind: DeviceKind
    product: str = ""
    #: mig: the GPU instance profile and its placement, in memory slices
    profile: str = ""
    start: int | None = None
    size: int | None = None
    memory_bytes: int = 0
    multiprocessors: int = 0
    #: the counter set it consumes from (None: a card not in MIG mode), and what it consumes
    counter_set: str | None = None
    consumes: tuple[tuple[str, int], ...] = ()
    binding_conditions: bool = False
    #: a whole card several claims may share (consumable capacity, KEP 5075): published with
    #: allowMultipleAllocations and the capacities a claim asks a part of (sharePercent, memory)
    shared: bool = False
    #: the card is unhealthy and published anyway (the API server keeps device taints)
    taints: tuple[DeviceTaint, ...] = ()

    def claim_device(self, pool: str) -> ClaimDevice:
        return ClaimDevice(
            pool=pool,
            device=self.name,
            pci=self.pci,
            kind=self.kind,
            profile=self.profile if self.kind == "mig" else "",
            start=self.start if self.kind == "mig" else None,
        )

    def attributes(self) -> dict[str, dict[str, Any]]:
        attrs: dict[str, dict[str, Any]] = {"type": {"string": self.kind}}
        attrs["parentUUID" if self.kind == "mig" else "uuid"] = {"string": _clip(self.uuid)}
        attrs["index"] = {"int": self.index}
        if self.product:
            attrs["productName"] = {"string": _clip(self.product)}
        attrs["pciAddress"] = {"string": self.pci}
        if self.kind == "mig":
            attrs["migProfile"] = {"string": _clip(self.profile)}
            attrs["placementStart"] = {"int": self.start}
            attrs["placementSize"] = {"int": self.size}
        return {f"{ATTRIBUTE_DOMAIN}/{k}": v for k, v in attrs.items()}

    def capacity(self) -> dict[str, Any]:
        if self.shared:
            return self._shared_capacity()
        cap: dict[str, Any] = {}
        if self.memory_bytes:
            cap[f"{ATTRIBUTE_DOMAIN}/memory"] = {"value": quantity(self.memory_bytes)}
        if self.multiprocessors:
            cap[f"{ATTRIBUTE_DOMAIN}/multiprocessors"] = {"value": quantity(self.multiprocessors)}
        return cap

    def _shared_capacity(self) -> dict[str, Any]:
        """What a claim asks a part of. Every capacity of a device that allows multiple
        allocations is consumed, and one a claim does not ask for is consumed whole unless its
        policy says otherwise: sharePercent defaults to 100 (a claim that asks nothing gets the
        card to itself), memory to 0; multiprocessors is left out (no policy could make it
        default to a part, and the whole of it would make every share exclusive)."""
        cap: dict[str, Any] = {
            f"{ATTRIBUTE_DOMAIN}/{CAPACITY_SHARE_PERCENT}": {
                "value": quantity(100),
                "requestPolicy": {"default": quantity(100), "validRange": {"min": quantity(1), "max": quantity(100), "step": quantity(1)}},
            }
        }
        if self.memory_bytes:
            cap[f"{ATTRIBUTE_DOMAIN}/{CAPACITY_MEMORY}"] = {
                "value": quantity(self.memory_bytes),
                "requestPolicy": {"default": quantity(0), "validRange": {"min": quantity(0), "max": quantity(self.memory_bytes), "step": quantity(MEMORY_STEP)}},
            }
        return cap

    def to_api(self) -> dict[str, Any]:
        """The device as a resource.k8s.io/v1 Device."""
        out: dict[str, Any] = {"name": self.name, "attributes": self.attributes()}
        cap = self.capacity()
        if cap:
            out["capacity"] = cap
        if self.shared:
            out["allowMultipleAllocations"] = True
        if self.counter_set and self.consumes:
            out["consumesCounters"] = [
                {"counterSet": self.counter_set, "counters": {k: {"value": quantity(v)} for k, v in self.consumes}}
            ]
        if self.binding_conditions:
            out["bindsToNode"] = True
            out["bindingConditions"] = list(BINDING_CONDITIONS)
            out["bindingFailureConditions"] = list(BINDING_FAILURE_CONDITIONS)
        if self.taints:
            out["taints"] = [t.to_api() for t in self.taints]
        return out


@dataclass(frozen=True)
class Pool:
    """What one node publishes: devices, the counter sets of its MIG cards, and why cards are missing."""

    devices: tuple[PublishedDevice, ...] = ()
    counter_sets: tuple[CounterSet, ...] = ()
    #: one line per card left out, or partly left out, and why ("<pci> gpu-<index>: <why>")
    notes: tuple[str, ...] = ()
    #: one line per card published with taints, and why ("<pci> gpu-<index>: <taints> (<Healthy>)")
    tainted: tuple[str, ...] = ()
    #: False while the inventory or the claims are not known (then nothing is published)
    known: bool = True

    def device(self, name: str) -> PublishedDevice | None:
        for d in self.devices:
            if d.name == name:
                return d
        return None

    @property
    def cards(self) -> tuple[str, ...]:
        """The PCI addresses of the cards published, in device order."""
        return tuple(dict.fromkeys(d.pci for d in self.devices))


@dataclass(frozen=True)
class _MigLayout:
    """A MIG card's publishable placements and counter totals (derived from its profiles alone)."""

    #: (device name, profile, placement), in a fixed order
    placements: tuple[tuple[str, MigProfile, MigPlacement], ...]
    totals: tuple[tuple[str, int], ...]
    problems: tuple[str, ...]
    #: why the card cannot be published at all ("" when it can)
    refused: str = ""


def _profile_counts(profile: MigProfile) -> list[tuple[str, int]]:
    return [(counter, getattr(profile, attr)) for counter, attr in ENGINE_COUNTERS]


def _mig_layout(gpu: Gpu) -> _MigLayout:
    problems: list[str] = []
    profiles = sorted(gpu.mig_profiles, key=lambda p: (p.profile_id, p.name))
    # one entry per name (the first), and no two names on one label
    by_name: dict[str, MigProfile] = {}
    for p in profiles:
        if p.name in by_name:
            problems.append(f"profile {p.name} listed twice: the first kept")
            continue
        by_name[p.name] = p
    by_label: dict[str, list[str]] = {}
    for name in by_name:
        by_label.setdefault(profile_label(name), []).append(name)
    usable: list[MigProfile] = []
    valid: list[tuple[MigProfile, list[MigPlacement]]] = []
    for p in by_name.values():
        seen: set[int] = set()
        places: list[MigPlacement] = []
        for pl in sorted(p.placements, key=lambda x: (x.start, x.size)):
            if pl.size < 1 or pl.start in seen:
                continue
            seen.add(pl.start)
            places.append(pl)
        if not places:
            continue
        valid.append((p, places))
        label = profile_label(p.name)
        if not label:
            problems.append(f"profile {p.name!r} gives no name: left out")
            continue
        if len(by_label[label]) > 1:
            problems.append(f"profile {p.name} left out: {' and '.join(by_label[label])} would share names gpu-{gpu.index}-mig-{label}-*")
            continue
        longest = mig_device_name(gpu.index, p.name, max(pl.start for pl in places))
        if not is_dns_label(longest):
            problems.append(f"profile {p.name} left out: {longest!r} is not a DNS label of at most {DNS_LABEL_MAX}")
            continue
        usable.append(p)
    if not valid:
        return _MigLayout((), (), tuple(problems))
    memory_slices = max(pl.start + pl.size for _, places in valid for pl in places)
    totals: list[tuple[str, int]] = [(COUNTER_SLICES, max(p.slices for p, _ in valid))]
    totals += [(slice_counter(k), 1) for k in range(memory_slices)]
    totals += [(c, max(dict(_profile_counts(p))[c] for p, _ in valid)) for c, _ in ENGINE_COUNTERS]
    totals.append((COUNTER_MEMORY, max(p.memory_bytes for p, _ in valid)))
    totals = [(k, v) for k, v in totals if v > 0]
    if len(totals) > MAX_COUNTERS_PER_SET:
        return _MigLayout((), (), tuple(problems), refused=f"{len(totals)} counters (over {MAX_COUNTERS_PER_SET}): {memory_slices} memory slices")
    places_of = dict((p.name, places) for p, places in valid)
    placements = tuple(
        (mig_device_name(gpu.index, p.name, pl.start), p, pl) for p in usable for pl in places_of[p.name]
    )
    return _MigLayout(placements, tuple(totals), tuple(problems))


def _consumption(profile: MigProfile, placement: MigPlacement, offered: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    want: list[tuple[str, int]] = [(COUNTER_SLICES, profile.slices)]
    want += [(slice_counter(k), 1) for k in range(placement.start, placement.start + placement.size)]
    want += _profile_counts(profile)
    want.append((COUNTER_MEMORY, profile.memory_bytes))
    # never more than offered (totals are maxima, so only a zero total drops a zero count)
    return tuple((k, v) for k, v in want if v > 0 and k in offered)


def _exclusion(gpu: Gpu, claims: Claims, device_taints: bool = False) -> str:
    """Why the card is not published at all, or ""."""
    st = gpu.status
    sick = st.unhealthy()
    if sick is not None and not (device_taints and ready_but_for_health(st)):
        off = "" if device_taints else "; withdrawn, not tainted: device taints are off"
        return f"phase {st.phase}, not Ready: {health_text(sick)}{off}"
    if st.phase != "Ready" and sick is None:
        return f"phase {st.phase}, not Ready"
    if st.driver_binding.management_state == "Excluded":
        return "excluded from management"
    if VFIO_DRIVER in (gpu.driver, st.driver_binding.driver) or st.driver_binding.mode == "Passthrough" or gpu.pci_address in claims.vfio:
        return f"on {VFIO_DRIVER}"
    held = sorted({f"{c.kind} {c.holder}" for c in claims.claims if c.pci_address == gpu.pci_address and c.kind != DRA_CLAIM_KIND})
    if held:
        return "held by " + ", ".join(held)
    return ""


def _card_devices(
    gpu: Gpu,
    claim_gis: Mapping[str, Iterable[int]],
    binding_conditions: bool,
    mig_devices: bool,
    shared_cards: bool = False,
    taints: tuple[DeviceTaint, ...] = (),
) -> tuple[list[PublishedDevice], CounterSet | None, list[str], str]:
    """The devices and counter set of one eligible card, its problems, and a refusal ("" when none).
    Every device of the card carries `taints`."""
    def whole(**kw: Any) -> PublishedDevice:
        return PublishedDevice(
            name=gpu_device_name(gpu.index),
            pci=gpu.pci_address,
            uuid=gpu.uuid,
            index=gpu.index,
            kind="gpu",
            product=gpu.name,
            binding_conditions=binding_conditions,
            taints=taints,
            **kw,
        )

    if not gpu.mig_mode:
        return [whole(memory_bytes=gpu.memory_bytes, shared=shared_cards)], None, [], ""
    present = {gi.gi for gi in gpu.gpu_instances} | {m.gi for m in gpu.mig_instances}
    foreign = sorted(present - set(claim_gis.get(gpu.pci_address, ())))
    if foreign:
        gis = ", ".join(f"gi{g}" for g in foreign)
        return [], None, [], f"GPU instance{'s' if len(foreign) > 1 else ''} {gis} not a DRA claim's: something else uses part of the card"
    if not mig_devices:
        if present:
            return [], None, [], "GPU instances on the card and MIG devices off: nothing to count the whole card against"
        return [whole(memory_bytes=gpu.memory_bytes)], None, ["MIG devices off: the whole card only"], ""
    layout = _mig_layout(gpu)
    if layout.refused:
        return [], None, list(layout.problems), layout.refused
    if not layout.totals:
        if present:
            return [], None, list(layout.problems), "GPU instances on the card but no profile with placements to count them against"
        problems = [*layout.problems, "MIG mode but no profile with placements: the whole card only"]
        return [whole(memory_bytes=gpu.memory_bytes)], None, problems, ""
    cset = CounterSet(name=counter_set_name(gpu.index), pci=gpu.pci_address, counters=layout.totals)
    offered = dict(layout.totals)
    devices = [
        whole(
            memory_bytes=gpu.memory_bytes or offered.get(COUNTER_MEMORY, 0),
            multiprocessors=offered.get("multiprocessors", 0),
            counter_set=cset.name,
            consumes=layout.totals,
        )
    ]
    for name, p, pl in layout.placements:
        devices.append(
            PublishedDevice(
                name=name,
                pci=gpu.pci_address,
                uuid=gpu.uuid,
                index=gpu.index,
                kind="mig",
                product=gpu.name,
                profile=p.name,
                start=pl.start,
                size=pl.size,
                memory_bytes=p.memory_bytes,
                multiprocessors=p.multiprocessors,
                counter_set=cset.name,
                consumes=_consumption(p, pl, offered),
                binding_conditions=binding_conditions,
                taints=taints,
            )
        )
    return devices, cset, list(layout.problems), ""


def _note(gpu: Gpu, why: str) -> str:
    return f"{gpu.pci_address} {gpu_device_name(gpu.index)}: {why}"


def plan_pool(
    inventory: Inventory | None,
    claims: Claims | None,
    *,
    claim_gis: Mapping[str, Iterable[int]] | None = None,
    binding_conditions: bool = False,
    mig_devices: bool = True,
    shared_cards: bool = False,
    device_taints: bool = False,
) -> Pool:
    """The pool this node publishes.

    `claim_gis`: PCI address -> the GPU instance ids that prepared DRA claims own on the card; a
    MIG card with any other GPU instance is left out. `binding_conditions`: every device declares
    bindsToNode with bindingConditions ["Ready"] and bindingFailureConditions ["BindingFailed"]
    (seed 003; off by default: it needs the DRADeviceBindingConditions feature; binding.py sets Ready).
    `mig_devices=False`: a MIG card is its whole-card device only, with no counters, and a MIG card
    with GPU instances is left out. For a cluster without the DRAPartitionableDevices feature,
    where the API server drops sharedCounters and consumesCounters on write: published anyway,
    MIG placements would no longer exclude each other.
    `shared_cards`: every whole card not in MIG mode allows multiple allocations, each asking a
    sharePercent and memory of it (consumable capacity, the DRAConsumableCapacity feature; a
    cluster without it drops the fields, and the plugin then publishes exclusive cards again).
    A MIG card and its placements stay exclusive: the counters keep them apart.
    `device_taints`: an unhealthy card (Healthy=False) that would be Ready but for its health is
    published with the taints of its faults on every device (the DRADeviceTaints feature; a
    cluster without it drops them, and the plugin then withdraws such cards again); off: it is
    left out like every card not Ready.
    """
    if inventory is None:
        return Pool(notes=("inventory not known yet: nothing published",), known=False)
    gpus = sorted(inventory.gpus, key=lambda g: (g.index, g.pci_address))
    if claims is None:
        return Pool(notes=tuple(_note(g, "claims not known yet: nothing published (fail-closed)") for g in gpus), known=False)
    claim_gis = claim_gis or {}
    indexes: dict[int, int] = {}
    for g in gpus:
        indexes[g.index] = indexes.get(g.index, 0) + 1
    devices: list[PublishedDevice] = []
    sets: list[CounterSet] = []
    notes: list[str] = []
    tainted: list[str] = []
    names: set[str] = set()
    for g in gpus:
        if indexes[g.index] > 1:
            notes.append(_note(g, f"index {g.index} is not unique on the node: its names would be ambiguous"))
            continue
        why = _exclusion(g, claims, device_taints)
        if why:
            notes.append(_note(g, why))
            continue
        sick = g.status.unhealthy()
        taints = health_taints(sick)
        card, cset, problems, refused = _card_devices(g, claim_gis, binding_conditions, mig_devices, shared_cards, taints)
        if refused:
            notes.append(_note(g, "; ".join([refused, *problems])))
            continue
        clash = [d.name for d in card if d.name in names]
        if clash:  # cannot happen with the naming above; refuse rather than publish one name twice
            notes.append(_note(g, f"device names already published: {', '.join(clash)}"))
            continue
        names.update(d.name for d in card)
        devices.extend(card)
        if cset is not None:
            sets.append(cset)
        if problems:
            notes.append(_note(g, "; ".join(problems)))
        if taints and sick is not None:
            tainted.append(_note(g, f"published tainted {', '.join(t.text() for t in taints)} ({health_text(sick)})"))
    return Pool(devices=tuple(devices), counter_sets=tuple(sets), notes=tuple(notes), tainted=tuple(tainted))


# --------------------------------------------------------------------------- slices


def pool_content_key(pool: Pool) -> str:
    """A digest of what is published (devices and counter sets, not notes): equal pools give equal
    keys, and any change to a published device or counter gives another one."""
    body = {"devices": [d.to_api() for d in pool.devices], "sharedCounters": [c.to_api() for c in pool.counter_sets]}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_driver(driver: str) -> None:
    if len(driver) > DRIVER_NAME_MAX or not _DNS_SUBDOMAIN.match(driver):
        raise ValueError(f"driver {driver!r}: a lowercase DNS subdomain of at most {DRIVER_NAME_MAX} characters")


def _slice_base(node_name: str, driver: str, count: int) -> str:
    base = f"{node_name}-{driver.replace('.', '-')}"
    room = DNS_SUBDOMAIN_MAX - len(f"-{count - 1}")
    if len(base) <= room:
        return base
    digest = _short_hash(base)
    return base[: room - len(digest) - 1].rstrip(".-") + "-" + digest


def _pack(devices: Sequence[PublishedDevice], limit: int) -> list[list[PublishedDevice]]:
    """Devices in slices of at most `limit`, one card's devices together where they fit."""
    groups: dict[str, list[PublishedDevice]] = {}
    for d in devices:
        groups.setdefault(d.pci, []).append(d)
    chunks: list[list[PublishedDevice]] = []
    for group in groups.values():
        if chunks and len(chunks[-1]) + len(group) <= limit:
            chunks[-1].extend(group)
            continue
        for i in range(0, len(group), limit):
            chunks.append(list(group[i : i + limit]))
    return chunks


def render_slices(
    pool: Pool,
    *,
    node_name: str,
    generation: int,
    driver: str = DEFAULT_DRIVER,
    node_uid: str | None = None,
) -> list[dict[str, Any]]:
    """The ResourceSlices of the pool (named `<node>-<driver, dots as dashes>-<n>`), counter sets first.

    The pool is named after the node; every slice carries the same generation and the number of
    slices. A pool with nothing to publish is one slice with no devices. With `node_uid` the Node
    owns each slice (garbage-collected with it).
    """
    _check_driver(driver)
    if not is_dns_subdomain(node_name):
        raise ValueError(f"node name {node_name!r}: a DNS subdomain of at most {DNS_SUBDOMAIN_MAX} characters")
    if generation < 0:
        raise ValueError(f"generation {generation}: never negative")
    specs: list[tuple[str, list[dict[str, Any]]]] = []
    sets = list(pool.counter_sets)
    for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE):
        specs.append(("sharedCounters", [c.to_api() for c in sets[i : i + MAX_COUNTER_SETS_PER_SLICE]]))
    # 1.35: 64 devices in a slice where any consumes counters or has taints (applied to every slice)
    limit = MAX_DEVICES_PER_SLICE_WITH_COUNTERS if any(d.consumes or d.taints for d in pool.devices) else MAX_DEVICES_PER_SLICE
    for chunk in _pack(pool.devices, limit):
        specs.append(("devices", [d.to_api() for d in chunk]))
    if not specs:
        specs.append(("devices", []))
    count = len(specs)
    base = _slice_base(node_name, driver, count)
    metadata_labels = {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: _label_value(node_name)}
    out: list[dict[str, Any]] = []
    for n, (field, items) in enumerate(specs):
        metadata: dict[str, Any] = {"name": f"{base}-{n}", "labels": dict(metadata_labels)}
        if node_uid:
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
            ]
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": metadata,
                "spec": {
                    "driver": driver,
                    "nodeName": node_name,
                    "pool": {"name": node_name, "generation": generation, "resourceSliceCount": count},
                    field: items,
                },
            }
        )
    return out


# --------------------------------------------------------------------------- back from a name


def _resolve(inventory: Inventory | None, device_name: str) -> tuple[Gpu, DeviceKind, str, int | None] | None:
    if inventory is None or not is_dns_label(device_name):
        return None
    m = _GPU_INDEX.match(device_name)
    if not m:
        return None
    index = int(m.group(1))
    cards = [g for g in inventory.gpus if g.index == index]
    if len(cards) != 1:
        return None
    gpu = cards[0]
    if device_name == gpu_device_name(index):
        return gpu, "gpu", "", None
    if not gpu.mig_mode:
        return None
    for name, profile, placement in _mig_layout(gpu).placements:
        if name == device_name:
            return gpu, "mig", profile.name, placement.start
    return None


def resolve_device(inventory: Inventory | None, device_name: str, *, pool: str) -> ClaimDevice | None:
    """The card (and MIG profile and placement) a device name of ours stands for in the inventory,
    or None for a name that is not ours or names nothing the inventory has.

    Names are parsed against the inventory, not the pool last published: a card the claim being
    prepared has taken since (its GPU instance not yet among `claim_gis`) may have left the pool,
    and its device must still resolve. Whether the card may be used is the converger's to decide.
    """
    if not pool:
        return None
    found = _resolve(inventory, device_name)
    if found is None:
        return None
    gpu, kind, profile, start = found
    return ClaimDevice(pool=pool, device=device_name, pci=gpu.pci_address, kind=kind, profile=profile, start=start)


def resolve(
    inventory: Inventory | None,
    pool_name: str,
    device_name: str,
    *,
    node_name: str,
    published: Pool | None = None,
) -> ClaimDevice | None:
    """A device of a ResourceClaim allocation result (this driver's), as a `ClaimDevice`.

    None when the pool is not this node's, the name is not ours, or, given the pool last
    `published`, the name stood for another card there (indexes moved: the allocation was made
    against a card that is not the one the name means now).
    """
    if pool_name != node_name:
        return None
    found = _resolve(inventory, device_name)
    if found is None:
        return None
    gpu, kind, profile, start = found
    if published is not None:
        was = published.device(device_name)
        if was is not None and (was.pci != gpu.pci_address or was.uuid != gpu.uuid):
            return None
    return ClaimDevice(pool=pool_name, device=device_name, pci=gpu.pci_address, kind=kind, profile=profile, start=start)


__all__ = [
    "ATTRIBUTE_DOMAIN",
    "DEFAULT_DRIVER",
    "API_VERSION",
    "NODE_LABEL",
    "MANAGED_BY_LABEL",
    "ENGINE_COUNTERS",
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_WITH_COUNTERS",
    "MAX_COUNTER_SETS_PER_SLICE",
    "MAX_COUNTERS_PER_SET",
    "MAX_TAINTS_PER_DEVICE",
    "HEALTH_TAINTS",
    "TAINT_XID",
    "TAINT_GPU_LOST",
    "TAINT_ECC",
    "TAINT_ROW_REMAP",
    "TAINT_UNHEALTHY",
    "NO_SCHEDULE",
    "NO_EXECUTE",
    "CounterSet",
    "DeviceTaint",
    "PublishedDevice",
    "Pool",
    "is_dns_label",
    "is_dns_subdomain",
    "is_attribute_id",
    "profile_label",
    "gpu_device_name",
    "mig_device_name",
    "counter_set_name",
    "slice_counter",
    "quantity",
    "taint_value",
    "health_taints",
    "ready_but_for_health",
    "plan_pool",
    "pool_content_key",
    "render_slices",
    "resolve_device",
    "resolve",
]
