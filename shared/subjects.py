"""Every NATS subject, KV bucket, stream and permission set of bcd, in one place.

Node-bus subjects are `bcd.<node_id>.<service>.<verb>`; upstream names are the
contract of DESIGN section 3. The NATS users and their permissions are derived
from the same table (`PERMISSIONS`), so a subject cannot be added to a service
without deciding who may publish and subscribe to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas.common import ID_RE
from shared.schemas.events import EVENT_TYPES

SERVICES: tuple[str, ...] = (
    "inventory",
    "converger",
    "signer",
    "kube_reaper",
    "device_plugin",
    "dra_plugin",
    "vfio_switcher",
    "gateway_bridge",
    "helper",
)

#: operator tools (`bcd status`, `bcd doctor`) and the supervisor.
OPERATOR_USER = "cli"

# Upstream contract (DESIGN 3).
UPSTREAM_NODESPECS_BUCKET = "bcd_nodespecs"
UPSTREAM_NODES_BUCKET = "bcd_nodes"
UPSTREAM_INVENTORY_BUCKET = "bcd_inventory"
UPSTREAM_EVENTS_STREAM = "BCD_EVENTS"
MSG_ID_HEADER = "Nats-Msg-Id"
SERVICE_ERROR_HEADER = "Nats-Service-Error"
SERVICE_ERROR_CODE_HEADER = "Nats-Service-Error-Code"


#: node ids that would make `bcd.<node_id>.…` collide with an upstream name
#: (`bcd.events.>` is the BCD_EVENTS stream; in the embedded default both buses
#: are one nats-server, so that stream would capture a node "events"'s requests).
RESERVED_NODE_IDS = frozenset({"events"})


def _token(value: str, what: str) -> str:
    if not ID_RE.match(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token")
    if what == "node_id" and value in RESERVED_NODE_IDS:
        raise ValueError(f"node_id {value!r} is reserved (bcd.{value}.> is an upstream subject)")
    return value


def upstream_event(node_id: str, event_type: str) -> str:
    if event_type not in EVENT_TYPES:
        raise ValueError(f"event type {event_type!r} is not one of {', '.join(EVENT_TYPES)}")
    return f"bcd.events.{_token(node_id, 'node_id')}.{event_type}"


def upstream_events_filter() -> str:
    return "bcd.events.>"


def server_list(url: str) -> list[str]:
    """A NATS URL as nats-py's server pool takes it: "nats://a:4222,nats://b:4222" (a
    cluster's servers, any of which may be down when we connect) is several servers."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server in {url!r}")
    return servers


def inbox_prefix(user: str) -> str:
    """Each NATS user gets its own inbox prefix so no user can read another's replies."""
    return f"_INBOX_{user}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    #: may reply to requests it received (nats-server `allow_responses`).
    allow_responses: bool = True


#: the control plane's user on upstream (the reference control plane, `python -m controlplane`).
CONTROLPLANE_USER = "controlplane"
UPSTREAM_BUCKETS: tuple[str, ...] = (UPSTREAM_NODESPECS_BUCKET, UPSTREAM_NODES_BUCKET, UPSTREAM_INVENTORY_BUCKET)


def upstream_node_user(node_id: str) -> str:
    return f"node-{_token(node_id, 'node_id')}"


def upstream_spec_key_subject(node_id: str) -> str:
    return f"$KV.{UPSTREAM_NODESPECS_BUCKET}.{_token(node_id, 'node_id')}"


def upstream_spec_get_subject(node_id: str) -> str:
    """Direct get of the last value of one key (the bucket allows direct gets)."""
    return f"$JS.API.DIRECT.GET.KV_{UPSTREAM_NODESPECS_BUCKET}.{upstream_spec_key_subject(node_id)}"


def upstream_node_permissions(node_id: str) -> Permissions:
    """What one node's bridge may touch upstream: its own keys and its own event subjects.

    It reads its spec by direct get and by subscribing to its key's subject
    (a KV put is a publish there), so it needs no consumer, and no other
    node's key is reachable. It needs no stream info either: a missing
    bucket or stream shows as "no responders" to a get or a publish.
    """
    user = upstream_node_user(node_id)
    return Permissions(
        publish=(
            f"$KV.{UPSTREAM_NODES_BUCKET}.{node_id}",
            f"$KV.{UPSTREAM_INVENTORY_BUCKET}.{node_id}",
            f"bcd.events.{node_id}.>",
            upstream_spec_get_subject(node_id),
        ),
        subscribe=(upstream_spec_key_subject(node_id), f"{inbox_prefix(user)}.>"),
        allow_responses=False,
    )


def upstream_controlplane_permissions() -> Permissions:
    """The control plane owns the upstream account's buckets and stream."""
    return Permissions(
        publish=("$JS.API.>", f"$KV.{UPSTREAM_NODESPECS_BUCKET}.>", f"$JS.ACK.{UPSTREAM_EVENTS_STREAM}.>"),
        subscribe=(f"{inbox_prefix(CONTROLPLANE_USER)}.>", f"$KV.{UPSTREAM_NODES_BUCKET}.>", f"$KV.{UPSTREAM_INVENTORY_BUCKET}.>"),
        allow_responses=False,
    )


@dataclass(frozen=True)
class NodeSubjects:
    """Subjects and node-bus names of one node."""

    node_id: str
    prefix: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", f"bcd.{_token(self.node_id, 'node_id')}")

    def subject(self, service: str, verb: str) -> str:
        if service not in SERVICES:
            raise ValueError(f"unknown service {service!r}")
        return f"{self.prefix}.{service}.{verb}"

    def service_wildcard(self, service: str) -> str:
        return f"{self.prefix}.{service}.>"

    # inventory
    @property
    def inventory_get(self) -> str:
        return self.subject("inventory", "get")

    @property
    def inventory_rescan(self) -> str:
        return self.subject("inventory", "rescan")

    @property
    def inventory_changed(self) -> str:
        """Published (plain) after every change; the KV holds the value."""
        return self.subject("inventory", "changed")

    @property
    def inventory_gpu(self) -> str:
        """An operator's exclude / include / reclaim of one card (GpuRequest)."""
        return self.subject("inventory", "gpu")

    @property
    def inventory_bucket(self) -> str:
        return f"bcd_node_{self.node_id}_inventory"

    # signer
    @property
    def signer_sign(self) -> str:
        return self.subject("signer", "sign")

    @property
    def signer_sign_batch(self) -> str:
        """Many report bodies signed in one request (SignBatchRequest): a pass's reports."""
        return self.subject("signer", "sign_batch")

    @property
    def signer_key(self) -> str:
        return self.subject("signer", "key")

    # converger
    @property
    def converger_spec(self) -> str:
        """The bridge hands a verified NodeSpec to the converger here."""
        return self.subject("converger", "spec")

    @property
    def converger_status(self) -> str:
        return self.subject("converger", "status")

    @property
    def converger_holder(self) -> str:
        """Which allocation, instance or pending release holds a GPU (asked before a switch or reset)."""
        return self.subject("converger", "holder")

    @property
    def converger_claims(self) -> str:
        """Every GPU's claims (Claims): what the inventory derives managementState from."""
        return self.subject("converger", "claims")

    @property
    def converger_claims_changed(self) -> str:
        """Published (plain Claims) by the converger when the claims change."""
        return self.subject("converger", "claims_changed")

    @property
    def converger_pass(self) -> str:
        """Ask for a pass now (operator, reaper)."""
        return self.subject("converger", "pass")

    @property
    def converger_status_changed(self) -> str:
        """Published (plain, empty) by the converger when what the Hello derives from
        its status changed (it found the root helper: it binds holds now)."""
        return self.subject("converger", "status_changed")

    # vfio_switcher
    @property
    def vfio_switch(self) -> str:
        """switch(pci, target): the switcher's only endpoint (SwitchRequest -> SwitchReply)."""
        return self.subject("vfio_switcher", "switch")

    @property
    def vfio_result(self) -> str:
        """Published (plain SwitchReply) after every attempted switch, for the inventory."""
        return self.subject("vfio_switcher", "result")

    # kube_reaper
    @property
    def reaper_held(self) -> str:
        """Does any pod (or kubepods process) hold these devices? Unreachable counts as held."""
        return self.subject("kube_reaper", "held")

    @property
    def reaper_evict(self) -> str:
        """Evict the pods holding these withdrawn devices (the reaper then watches them)."""
        return self.subject("kube_reaper", "evict")

    @property
    def reaper_orphans(self) -> str:
        return self.subject("kube_reaper", "orphans")

    @property
    def reaper_freed(self) -> str:
        """Published by the reaper when a withdrawn allocation's devices are free."""
        return self.subject("kube_reaper", "freed")

    # device_plugin
    @property
    def device_plugin_status(self) -> str:
        """What the device plugin advertises and whether the kubelet has it (DevicePluginStatus)."""
        return self.subject("device_plugin", "status")

    @property
    def device_plugin_withdraw(self) -> str:
        """A Kubernetes hold was withdrawn (DevicesQuery -> WithdrawReply): answered once the
        kubelet's ListAndWatch streams took the update, so the converger asks the reaper after."""
        return self.subject("device_plugin", "withdraw")

    # dra_plugin
    @property
    def dra_plugin_status(self) -> str:
        """What the DRA plugin publishes and has prepared, and whether the kubelet registered it."""
        return self.subject("dra_plugin", "status")

    @property
    def converger_claim_prepare(self) -> str:
        """Make a DRA claim's hold (ClaimPrepareRequest -> ClaimPrepareReply); only the DRA plugin asks."""
        return self.subject("converger", "claim_prepare")

    @property
    def converger_claim_unprepare(self) -> str:
        """Remove a DRA claim's hold (ClaimUnprepareRequest -> ClaimUnprepareReply); only the DRA plugin asks."""
        return self.subject("converger", "claim_unprepare")

    @property
    def inventory_mig_instance(self) -> str:
        """One NVML step on a card's MIG instances (MigInstanceRequest -> MigInstanceReply); the converger asks."""
        return self.subject("inventory", "mig_instance")

    @property
    def inventory_sharing(self) -> str:
        """One GPU sharing step, MPS daemon or time slice (SharingStepRequest -> SharingStepReply); the converger asks."""
        return self.subject("inventory", "sharing")

    @property
    def converger_gpu_op(self) -> str:
        """An operator's maintenance operation on a card (GpuOpRequest -> GpuOpReply): reset, diag."""
        return self.subject("converger", "gpu_op")

    @property
    def inventory_diag(self) -> str:
        """Run the vendor's diagnostic on a card (DiagRequest -> DiagReply); the converger asks."""
        return self.subject("inventory", "diag")

    @property
    def inventory_mig_layout(self) -> str:
        """Make a card's MIG layout this (MigLayoutRequest -> MigLayoutReply); the converger asks."""
        return self.subject("inventory", "mig_layout")

    @property
    def converger_holds_changed(self) -> str:
        """Published (plain, empty) by the converger after a pass that wrote or removed hold files."""
        return self.subject("converger", "holds_changed")

    # helper (root, optional): only the converger may ask it anything
    @property
    def helper_file_write(self) -> str:
        """Write a hold's CDI spec or env file (HelperFileWrite -> HelperReply)."""
        return self.subject("helper", "file.write")

    @property
    def helper_file_remove(self) -> str:
        return self.subject("helper", "file.remove")

    @property
    def helper_file_copy(self) -> str:
        """Write a hold spec's consumer copy from the spec on the helper's disk (HelperFileCopy -> HelperReply)."""
        return self.subject("helper", "file.copy")

    @property
    def helper_slice_apply(self) -> str:
        return self.subject("helper", "slice.apply")

    @property
    def helper_slice_remove(self) -> str:
        return self.subject("helper", "slice.remove")

    @property
    def helper_info(self) -> str:
        """Where the helper writes (HelperInfo); the converger's look for a helper."""
        return self.subject("helper", "info")

    @property
    def helper_endpoints(self) -> tuple[str, ...]:
        return (
            self.helper_file_write,
            self.helper_file_copy,
            self.helper_file_remove,
            self.helper_slice_apply,
            self.helper_slice_remove,
            self.helper_info,
        )

    # the node's durable outbox (node-bus JetStream), drained upstream by the bridge
    @property
    def outbox_stream(self) -> str:
        return f"BCD_OUTBOX_{self.node_id}"

    def outbox_subject(self, event_type: str) -> str:
        if event_type not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event_type!r}")
        return f"{self.prefix}.outbox.{event_type}"

    @property
    def outbox_filter(self) -> str:
        return f"{self.prefix}.outbox.>"

    def stream_subjects(self, stream: str, *, create: bool) -> tuple[str, ...]:
        return (
            f"$JS.API.STREAM.INFO.{stream}",
            *((f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}") if create else ()),
            "$JS.API.INFO",
        )

    def kv_read_subjects(self, bucket: str) -> tuple[str, ...]:
        """What a client needs to read and watch one KV bucket."""
        stream = f"KV_{bucket}"
        return (
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.>",
            "$JS.API.INFO",
        )

    def kv_subjects(self, bucket: str) -> tuple[str, ...]:
        """What a client needs to create, read and write one KV bucket."""
        stream = f"KV_{bucket}"
        return (
            f"$KV.{bucket}.>",
            f"$JS.API.STREAM.CREATE.{stream}",
            f"$JS.API.STREAM.UPDATE.{stream}",
            *self.kv_read_subjects(bucket),
        )

    def permissions(self, user: str) -> Permissions:
        """The exact subjects one NATS user may touch on the node bus."""
        micro = _micro_subjects(user) if user in SERVICES else ()
        inbox = (f"{inbox_prefix(user)}.>",)
        table: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
            "inventory": (
                (
                    self.inventory_changed,
                    *self.kv_subjects(self.inventory_bucket),
                    # managementState needs the claims; gpu events go upstream through the outbox
                    self.converger_claims,
                    self.outbox_subject("gpu"),
                ),
                (self.service_wildcard("inventory"), self.converger_claims_changed, self.vfio_result),
            ),
            "signer": ((), (self.service_wildcard("signer"),)),
            "converger": (
                (
                    self.inventory_get,
                    self.signer_sign,
                    self.signer_sign_batch,
                    self.signer_key,
                    *self.kv_read_subjects(self.inventory_bucket),
                    self.outbox_filter,
                    *self.stream_subjects(self.outbox_stream, create=True),
                    self.reaper_held,
                    self.reaper_evict,
                    self.reaper_orphans,
                    # the VFIO side: the converger is the only one that asks for switches
                    self.vfio_switch,
                    self.converger_claims_changed,
                    # the root helper writes for an unprivileged converger; nobody else may ask it
                    *self.helper_endpoints,
                    self.converger_status_changed,
                    # the device plugin stops advertising a withdrawn hold before the reaper evicts
                    self.device_plugin_withdraw,
                    self.converger_holds_changed,
                    # maintenance: the diagnostic and MIG layouts run where the vendor adapter is
                    self.inventory_diag,
                    self.inventory_mig_layout,
                    # DRA: MIG instances made on prepare, destroyed on unprepare
                    self.inventory_mig_instance,
                    # DRA: MPS daemons and time slices of shared cards
                    self.inventory_sharing,
                ),
                (
                    self.service_wildcard("converger"),
                    self.inventory_changed,
                    f"$KV.{self.inventory_bucket}.>",
                    self.reaper_freed,
                ),
            ),
            "gateway_bridge": (
                (
                    self.inventory_get,
                    self.signer_key,
                    self.converger_spec,
                    self.converger_status,
                    *self.kv_read_subjects(self.inventory_bucket),
                    # drains the outbox through an ephemeral pull consumer of its own (created
                    # without a name: the server refuses a durable there), pulled from and
                    # deleted by its name; what upstream acknowledged is purged (up to a sequence)
                    f"$JS.API.STREAM.INFO.{self.outbox_stream}",
                    f"$JS.API.CONSUMER.CREATE.{self.outbox_stream}",
                    f"$JS.API.CONSUMER.MSG.NEXT.{self.outbox_stream}.*",
                    f"$JS.API.CONSUMER.DELETE.{self.outbox_stream}.*",
                    f"$JS.API.STREAM.PURGE.{self.outbox_stream}",
                    # node conditions (NodeSpecRejected) go through the outbox too
                    self.outbox_subject("condition"),
                ),
                (
                    self.service_wildcard("gateway_bridge"),
                    self.inventory_changed,
                    f"$KV.{self.inventory_bucket}.>",
                    # wake-up when the converger adds to the outbox
                    self.outbox_filter,
                    # the Hello is put again when the converger's privilege changed
                    self.converger_status_changed,
                ),
            ),
            "kube_reaper": ((self.inventory_get, self.reaper_freed), (self.service_wildcard("kube_reaper"),)),
            "device_plugin": (
                (self.inventory_get,),
                (self.service_wildcard("device_plugin"), self.inventory_changed, self.converger_holds_changed),
            ),
            "dra_plugin": (
                (self.inventory_get, self.converger_claims, self.converger_status, self.converger_claim_prepare, self.converger_claim_unprepare),
                (self.service_wildcard("dra_plugin"), self.inventory_changed, self.converger_claims_changed),
            ),
            "vfio_switcher": (
                (self.inventory_get, self.converger_holder, self.vfio_result),
                (self.service_wildcard("vfio_switcher"),),
            ),
            "helper": ((self.inventory_get,), (self.service_wildcard("helper"),)),
            OPERATOR_USER: (
                (
                    "$SRV.>",
                    self.converger_status,
                    self.converger_holder,
                    self.converger_pass,
                    *self.stream_subjects(self.outbox_stream, create=False),
                    self.inventory_get,
                    self.inventory_rescan,
                    self.inventory_gpu,
                    self.converger_claims,
                    self.signer_key,
                    self.device_plugin_status,
                    self.dra_plugin_status,
                    self.converger_gpu_op,
                    *self.kv_read_subjects(self.inventory_bucket),
                ),
                (self.inventory_changed, f"$KV.{self.inventory_bucket}.>"),
            ),
        }
        if user not in table:
            raise ValueError(f"unknown node-bus user {user!r}")
        publish, subscribe = table[user]
        return Permissions(
            publish=tuple(publish),
            subscribe=tuple((*subscribe, *micro, *inbox)),
        )


def _micro_subjects(service: str) -> tuple[str, ...]:
    """`$SRV.PING|INFO|STATS`, by kind and by id, for one micro service."""
    return tuple(
        s
        for verb in ("PING", "INFO", "STATS")
        for s in (f"$SRV.{verb}", f"$SRV.{verb}.{service}", f"$SRV.{verb}.{service}.*")
    )


NODE_BUS_USERS: tuple[str, ...] = (*SERVICES, OPERATOR_USER)

__all__ = [
    "SERVICES",
    "OPERATOR_USER",
    "NODE_BUS_USERS",
    "UPSTREAM_NODESPECS_BUCKET",
    "UPSTREAM_NODES_BUCKET",
    "UPSTREAM_INVENTORY_BUCKET",
    "UPSTREAM_EVENTS_STREAM",
    "MSG_ID_HEADER",
    "SERVICE_ERROR_HEADER",
    "SERVICE_ERROR_CODE_HEADER",
    "RESERVED_NODE_IDS",
    "CONTROLPLANE_USER",
    "UPSTREAM_BUCKETS",
    "upstream_node_user",
    "upstream_spec_key_subject",
    "upstream_spec_get_subject",
    "upstream_node_permissions",
    "upstream_controlplane_permissions",
    "upstream_event",
    "upstream_events_filter",
    "inbox_prefix",
    "Permissions",
    "NodeSubjects",
]
