"""What the device plugin advertises, as pure functions of the holds on disk and the inventory.

`plan_advertisement(holds, inventory, names, withdrawn)` -> `Advertisement`:
every atom of every live BINDING_KUBERNETES hold becomes one kubelet device,
of the resource its kind names (`ResourceNames`: `bcd.dev/gpu`,
`bcd.dev/mig-<profile>`, `bcd.dev/gpu-slot` by default). Nothing else is
advertised: not plain holds, not VM instances, not free cards, not a hold
the converger just withdrew (still on disk for an instant, or its removal
not yet seen). The device id the kubelet gets is the CDI device name bcd
wrote for the atom (unique on the node, `GPU-<uuid>_gi1_ci0`), so `Allocate`
maps it back to the CDI name `bcd.dev/gpu=<name>` without a table.

Health is the PhysicalGPU phase: a card that is not Ready is Unhealthy (one whose Healthy
condition is False says why: the XID, the ECC error, the card lost), and
so is every atom on a card the inventory does not list; before any
inventory is read everything is Unhealthy (nothing is promised that cannot
be checked). A MIG atom the inventory does not know has no profile and so no
resource: it is not advertised, and the status says why.

`preferred_allocation` and `allocation_env` are what GetPreferredAllocation
and Allocate answer, also pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.holdfiles import BINDING_KUBERNETES, HoldOnDisk, device_name
from shared.schemas import Gpu, Inventory
from shared.schemas.inventory import health_text

#: an extended resource name: `<domain>/<name>` (k8s.io apimachinery IsQualifiedName, and not in kubernetes.io).
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
NAME_PART_MAX = 63
DOMAIN_MAX = 253
_MIG_ATOM = re.compile(r"^(GPU-[^/]+)/gi(\d+)/ci(\d+)$")
_SLOT_ATOM = re.compile(r"^(GPU-[^/]+)/slot(\d+)$")


class BadResourceName(ValueError):
    pass


#: the domain of the extended resource names bcd's DRA DeviceClasses map (`extendedResourceName`,
#: KEP-5004; deploy/kubernetes/dra-deviceclasses.yaml): the DRA driver's name. Kubernetes lets one
#: node offer a name through a device plugin or through DRA, never both (KEP-5004: "One node in a
#: cluster cannot have both"): the scheduler checks a name the Node's allocatable has against the
#: device plugin's count only, so a DRA card would never be given for it there. Both run on a bcd
#: node, and what each offers differs (the device plugin: the control plane's Kubernetes holds; DRA:
#: the free cards), so the two keep apart by domain, and the device plugin refuses this one.
DRA_RESOURCE_DOMAIN = "gpu.bcd.dev"


def check_resource_name(name: str) -> str:
    """`name` when it is a valid extended resource name the kubelet accepts from a plugin."""
    domain, sep, part = name.partition("/")
    if not sep:
        raise BadResourceName(f"{name!r}: an extended resource name is <domain>/<name>")
    if len(domain) > DOMAIN_MAX or not _DOMAIN.match(domain):
        raise BadResourceName(f"{name!r}: {domain!r} is not a DNS subdomain")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise BadResourceName(f"{name!r}: the kubernetes.io domain is reserved")
    if len(part) > NAME_PART_MAX or not _NAME_PART.match(part):
        raise BadResourceName(f"{name!r}: {part!r} must be 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends")
    return name


def profile_token(profile: str) -> str:
    """A MIG profile as a resource name part: `1g.10gb` stays, `1g.10gb+me` is `1g.10gb.me`.

    BadResourceName for a profile that names nothing (empty, or no letter or digit at either end
    once spelled so): a name is never built of an empty or placeholder part (`mig-.profile.`)."""
    token = re.sub(r"[^A-Za-z0-9_.-]", ".", profile.replace("+", "."))
    if not _NAME_PART.match(token):
        raise BadResourceName(f"MIG profile {profile!r} makes no resource name part ({token!r})")
    return token


@dataclass(frozen=True)
class ResourceNames:
    """How atoms are named as extended resources (`--resource-domain`, `--gpu-resource`, ...)."""

    domain: str = "bcd.dev"
    gpu: str = "gpu"
    #: `{profile}` is replaced by the MIG profile (`1g.10gb`).
    mig: str = "mig-{profile}"
    slot: str = "gpu-slot"

    def check(self, dra_domain: str = DRA_RESOURCE_DOMAIN) -> "ResourceNames":
        """Self when every name is one the kubelet takes and none is DRA's (`dra_domain`, above)."""
        if dra_domain and (self.domain == dra_domain or self.domain.endswith("." + dra_domain)):
            raise BadResourceName(
                f"{self.domain!r} is the domain of the DRA driver's extended resources ({dra_domain}/...); "
                "a node offers a name through the device plugin or through DRA, never both: pick another --resource-domain"
            )
        if "{profile}" not in self.mig:
            raise BadResourceName(f"MIG resource {self.mig!r} must contain {{profile}}")
        names = [self.gpu_name, self.slot_name, self.mig_name("1g.10gb")]
        for n in names:
            check_resource_name(n)
        if len(set(names)) != len(names):
            raise BadResourceName(f"resource names must differ: {', '.join(names)}")
        return self

    @property
    def gpu_name(self) -> str:
        return f"{self.domain}/{self.gpu}"

    @property
    def slot_name(self) -> str:
        return f"{self.domain}/{self.slot}"

    @property
    def mig_pattern(self) -> str:
        """The MIG resources as a pattern, for people (`bcd.dev/mig-{profile}`): no resource has this name."""
        return f"{self.domain}/{self.mig}"

    def mig_name(self, profile: str) -> str:
        """The resource of a MIG profile; BadResourceName when the profile or the name made of it is not valid."""
        return check_resource_name(f"{self.domain}/{self.mig.replace('{profile}', profile_token(profile))}")


def socket_name(resource: str) -> str:
    """The plugin's socket file for one resource: `bcd-<name part>.sock` (one plugin, one domain)."""
    return f"bcd-{resource.partition('/')[2]}.sock"


@dataclass(frozen=True)
class AdvertisedDevice:
    #: the kubelet's device id: the CDI device name of the atom.
    id: str
    resource: str
    allocation_id: str
    atom_id: str
    #: `bcd.dev/gpu=<id>`, what Allocate puts in cdi_devices.
    cdi_name: str
    healthy: bool
    numa_node: int | None = None
    #: what NVIDIA_VISIBLE_DEVICES takes for this atom (GPU uuid, or MIG uuid).
    visible_id: str = ""
    #: why it is Unhealthy ("" when healthy).
    why: str = ""


@dataclass(frozen=True)
class HoldView:
    allocation_id: str
    advertised: bool
    devices: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    reason: str = ""


@dataclass
class Advertisement:
    #: resource -> its devices, sorted by id; every resource the plugin serves (possibly empty).
    resources: dict[str, tuple[AdvertisedDevice, ...]] = field(default_factory=dict)
    by_id: dict[str, AdvertisedDevice] = field(default_factory=dict)
    holds: dict[str, HoldView] = field(default_factory=dict)

    def devices_of(self, resource: str) -> tuple[AdvertisedDevice, ...]:
        return self.resources.get(resource, ())


def atom_kind(atom_id: str) -> str:
    if _MIG_ATOM.match(atom_id):
        return "mig"
    if _SLOT_ATOM.match(atom_id):
        return "slot"
    return "gpu"


def card_of(atom_id: str) -> str:
    return atom_id.split("/", 1)[0]


def _cards(inventory: Inventory | None) -> dict[str, Gpu]:
    return {g.atom_id: g for g in inventory.gpus} if inventory is not None else {}


def resources_of(inventory: Inventory | None, names: ResourceNames) -> set[str]:
    """Every resource this node can have: gpu, slots, and a MIG resource per profile its cards know."""
    out = {names.gpu_name, names.slot_name}
    for g in inventory.gpus if inventory is not None else ():
        for profile in [*(p.name for p in g.mig_profiles), *(m.profile for m in g.mig_instances)]:
            try:
                out.add(names.mig_name(profile))
            except BadResourceName:
                continue  # a profile that makes no name is no resource (a hold on it says why)
    return out


def plan_advertisement(
    holds: Mapping[str, HoldOnDisk],
    inventory: Inventory | None,
    names: ResourceNames,
    withdrawn: Iterable[str] = (),
    served: Iterable[str] = (),
) -> Advertisement:
    """The devices to advertise now. `served` keeps resources already registered in the result (empty)."""
    cards = _cards(inventory)
    gone = set(withdrawn)
    per_resource: dict[str, list[AdvertisedDevice]] = {r: [] for r in (*resources_of(inventory, names), *served)}
    out = Advertisement()
    for alloc in sorted(holds):
        hold = holds[alloc]
        if hold.binding != BINDING_KUBERNETES:
            continue
        if alloc in gone:
            out.holds[alloc] = HoldView(alloc, False, reason="withdrawn: a Kubernetes release started")
            continue
        devices: list[AdvertisedDevice] = []
        problems: list[str] = []
        for atom in hold.devices:
            card = cards.get(card_of(atom))
            kind = atom_kind(atom)
            numa = card.numa_node if card is not None and card.numa_node is not None and card.numa_node >= 0 else None
            if inventory is None:
                healthy, why = False, "inventory not read yet"
            elif card is None:
                healthy, why = False, f"card {card_of(atom)} is not in the inventory"
            elif (sick := card.status.unhealthy()) is not None:
                # a fatal XID, an ECC error, the card lost: the kubelet hears it in the next ListAndWatch
                healthy, why = False, f"card {card.pci_address} is unhealthy: {health_text(sick)}"
            elif card.status.phase != "Ready":
                healthy, why = False, f"card {card.pci_address} is {card.status.phase}, not Ready"
            else:
                healthy, why = True, ""
            visible = card_of(atom)
            if kind == "mig":
                mig = next((m for m in card.mig_instances if m.atom_id == atom), None) if card is not None else None
                if mig is None or not mig.profile:
                    problems.append(f"{atom}: MIG instance not in the inventory (no profile, no resource)")
                    continue
                try:
                    resource = names.mig_name(mig.profile)
                except BadResourceName as exc:
                    problems.append(f"{atom}: {exc}")
                    continue
                visible = mig.uuid or atom
                if healthy and not mig.uuid:
                    healthy, why = False, f"{atom}: MIG instance has no uuid in the inventory"
            elif kind == "slot":
                resource = names.slot_name
            else:
                resource = names.gpu_name
            try:
                check_resource_name(resource)
            except BadResourceName as exc:
                problems.append(f"{atom}: {exc}")
                continue
            dev_id = device_name(atom)
            cdi = next((n for n in hold.cdi_names if n.endswith("=" + dev_id)), "")
            if not cdi:
                problems.append(f"{atom}: no CDI device {dev_id} in the hold's spec")
                continue
            devices.append(AdvertisedDevice(dev_id, resource, alloc, atom, cdi, healthy, numa, visible, why))
        if problems and not devices:
            out.holds[alloc] = HoldView(alloc, False, reason="; ".join(problems))
            continue
        for d in devices:
            per_resource.setdefault(d.resource, []).append(d)
            out.by_id[d.id] = d
        unhealthy = sorted({d.why for d in devices if not d.healthy})
        out.holds[alloc] = HoldView(
            alloc,
            True,
            tuple(d.id for d in devices),
            tuple(dict.fromkeys(d.resource for d in devices)),
            "; ".join([*problems, *(f"Unhealthy: {w}" for w in unhealthy)]),
        )
    out.resources = {r: tuple(sorted(ds, key=lambda d: d.id)) for r, ds in sorted(per_resource.items())}
    return out


# ---------------------------------------------------------------------------- GetPreferredAllocation


def preferred_allocation(
    advertised: Mapping[str, AdvertisedDevice], available: Sequence[str], must_include: Sequence[str], size: int
) -> list[str]:
    """`size` ids from `available`: `must_include` first, then devices of the holds already chosen,
    then of the hold that fits the rest exactly (or the largest), then on the NUMA node already used."""
    chosen: list[str] = [d for d in dict.fromkeys(must_include) if d in available][:size]
    pool = [d for d in dict.fromkeys(available) if d not in chosen]

    def alloc(d: str) -> str:
        dev = advertised.get(d)
        return dev.allocation_id if dev is not None else ""

    def numa(d: str) -> int | None:
        dev = advertised.get(d)
        return dev.numa_node if dev is not None else None

    while len(chosen) < size and pool:
        want = size - len(chosen)
        used_allocs = {alloc(d) for d in chosen}
        used_numa = {numa(d) for d in chosen}
        same = [d for d in pool if alloc(d) in used_allocs and alloc(d)]
        if same:
            pick = same[:want]
        else:
            groups: dict[str, list[str]] = {}
            for d in pool:
                groups.setdefault(alloc(d), []).append(d)
            exact = [g for g in groups.values() if len(g) == want]
            candidates = exact or sorted(groups.values(), key=lambda g: (-len(g), g[0]))
            near = [g for g in candidates if used_numa & {numa(d) for d in g}]
            pick = (near or candidates)[0][:want]
        chosen.extend(pick)
        pool = [d for d in pool if d not in pick]
    return chosen


# ---------------------------------------------------------------------------- Allocate


class AllocateRefused(Exception):
    """An Allocate the plugin will not answer; the text goes to the kubelet (and the pod's events)."""


#: env keys that name the hold(s): joined with "," when one container gets devices of several holds.
_JOINED_KEYS = ("BCD_ALLOCATION_ID", "BCD_RESERVATION_ID")


def parse_env_file(data: bytes) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for line in data.decode("utf-8", "replace").splitlines():
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out.append((key, value))
    return out


def allocation_env(devices: Sequence[AdvertisedDevice], env_files: Mapping[str, bytes]) -> dict[str, str]:
    """The env a container gets with `devices`: its holds' env files, NVIDIA_VISIBLE_DEVICES narrowed
    to these devices. Refused when an env file is missing or two holds set one variable differently."""
    env: dict[str, str] = {}
    joined: dict[str, list[str]] = {k: [] for k in _JOINED_KEYS}
    setter: dict[str, str] = {}
    for alloc in dict.fromkeys(d.allocation_id for d in devices):
        data = env_files.get(alloc)
        if data is None:
            raise AllocateRefused(f"the env file of allocation {alloc} is not written yet (the converger rewrites it); retry")
        for key, value in parse_env_file(data):
            if key == "NVIDIA_VISIBLE_DEVICES":
                continue
            if key in joined:
                if value not in joined[key]:
                    joined[key].append(value)
                continue
            if key in env and env[key] != value:
                raise AllocateRefused(f"allocations {setter[key]} and {alloc} set {key} differently; ask for devices of one hold")
            env[key] = value
            setter.setdefault(key, alloc)
    out = {k: ",".join(v) for k, v in joined.items() if v}
    out.update(env)
    out["NVIDIA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(d.visible_id for d in devices))
    return out


__all__ = [
    "Advertisement",
    "AdvertisedDevice",
    "AllocateRefused",
    "BadResourceName",
    "DRA_RESOURCE_DOMAIN",
    "HoldView",
    "ResourceNames",
    "allocation_env",
    "atom_kind",
    "check_resource_name",
    "plan_advertisement",
    "preferred_allocation",
    "profile_token",
    "resources_of",
    "socket_name",
]
