"""Every NATS subject, KV bucket, stream, route and permission set of bcd, in one place.

Node-bus subjects are `bcd.<node_id>.<service>.<verb>`; upstream names are the
contract of DESIGN section 3. Who reaches whom is one table of routes
(`NodeSubjects.routes()`, `upstream_routes()`): the NATS users' permissions, each
identity's server account with its exports and imports (bcd.nodebus renders them) and
the caller check of every endpoint derive from it, so a subject cannot be added to a
service without deciding who may ask it or listen to it. Why accounts: docs/security.md.
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


#: the owner of the routes the node bus's JetStream answers (its streams live in the store
#: account, NODE_STORE_ACCOUNT, with no service in it)
BUS_STORE = "bus"
#: the identity that makes the node's streams and buckets at bus start; no service holds it
BUS_ADMIN_USER = "bus_admin"
#: the node bus account that holds JetStream (the outbox, the inventory's bucket). Its name is
#: the one every node had before each identity got an account of its own: a node upgraded in
#: place finds its outbox where it was.
NODE_STORE_ACCOUNT = "NODE"
#: the upstream account that holds the control plane and the upstream's JetStream
UPSTREAM_ACCOUNT = "UPSTREAM"


def node_account(user: str) -> str:
    """The node-bus account of one identity: every service, the operator, alone in its own."""
    return NODE_STORE_ACCOUNT if user in (BUS_STORE, BUS_ADMIN_USER) else f"NODE_{user}"


def upstream_node_account(node_id: str) -> str:
    """Each node's upstream user is alone in an account of its own (docs/security.md)."""
    return f"UPSTREAM_{upstream_node_user(node_id)}"


@dataclass(frozen=True)
class Route:
    """One way an identity reaches another's subject, the unit every permission derives from.

    A service route (`notice` False): `owner` answers requests on `subject`, `callers` may
    send them. A notice: `owner` publishes `subject`, `callers` may listen. Each identity has a
    server account of its own; a route is an export of the owner's account to exactly the
    callers' accounts and an import in each of theirs. Nothing else crosses between accounts:
    not a reply sent to a subject the requester chose, not a message the server's JetStream
    delivers or republishes, since the server routes a reply back to the requester's account.
    """

    subject: str
    owner: str
    callers: tuple[str, ...]
    notice: bool = False
    #: a request answered by several messages (a batched direct get)
    stream_reply: bool = False

    @classmethod
    def service(cls, subject: str, owner: str, *callers: str) -> "Route":
        return cls(subject, owner, tuple(callers))

    @classmethod
    def notice_of(cls, subject: str, owner: str, *listeners: str) -> "Route":
        return cls(subject, owner, tuple(listeners), notice=True)



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


def upstream_routes(node_id: str) -> tuple[Route, ...]:
    """What one node's upstream account imports from the control plane's: its own keys and
    event subjects (JetStream publishes, answered with a PubAck), the direct get of its spec
    and the live puts of its spec. The control plane's account holds every bucket and stream."""
    node = upstream_node_user(node_id)
    cp = CONTROLPLANE_USER
    return (
        Route.service(f"$KV.{UPSTREAM_NODES_BUCKET}.{node_id}", cp, node),
        Route.service(f"$KV.{UPSTREAM_INVENTORY_BUCKET}.{node_id}", cp, node),
        Route.service(f"bcd.events.{node_id}.>", cp, node),
        Route.service(upstream_spec_get_subject(node_id), cp, node),
        Route.notice_of(upstream_spec_key_subject(node_id), cp, node),
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
    def reaper_node(self) -> str:
        """The node's Kubernetes Node: read it, or change the MIG re-layout flow's labels, taint and cordon."""
        return self.subject("kube_reaper", "node")

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

    # notices a writer of the outbox publishes after it journaled: the bridge reads the outbox then
    @property
    def converger_journaled(self) -> str:
        """Published (plain, empty) by the converger after it journaled events in the outbox."""
        return self.subject("converger", "journaled")

    @property
    def inventory_journaled(self) -> str:
        """Published (plain, empty) by the inventory after it journaled GPU events in the outbox."""
        return self.subject("inventory", "journaled")

    # what the node bus's JetStream (the store account) answers
    @property
    def outbox_direct_get(self) -> str:
        """Batched direct get of the outbox by sequence: how the bridge reads it (no consumer)."""
        return f"$JS.API.DIRECT.GET.{self.outbox_stream}"

    @property
    def outbox_info(self) -> str:
        return f"$JS.API.STREAM.INFO.{self.outbox_stream}"

    @property
    def outbox_purge(self) -> str:
        return f"$JS.API.STREAM.PURGE.{self.outbox_stream}"

    @property
    def inventory_key(self) -> str:
        """The inventory's one key in its KV bucket (a put is a JetStream publish here)."""
        return f"$KV.{self.inventory_bucket}.{self.node_id}"

    @property
    def inventory_key_get(self) -> str:
        """Direct get of the last value of the inventory's key (the bucket allows direct gets)."""
        return f"$JS.API.DIRECT.GET.KV_{self.inventory_bucket}.{self.inventory_key}"

    @property
    def inventory_bucket_info(self) -> str:
        return f"$JS.API.STREAM.INFO.KV_{self.inventory_bucket}"

    def routes(self) -> tuple[Route, ...]:
        """Every way one node-bus identity reaches another: the one table the permissions,
        the accounts' exports and imports and the endpoints' caller checks derive from."""
        ask = Route.service
        tell = Route.notice_of
        cli = OPERATOR_USER
        routes: list[Route] = [
            # inventory
            # the root helper and the vfio_switcher check what they are asked against the inventory
            ask(self.inventory_get, "inventory", "converger", "gateway_bridge", "kube_reaper", "device_plugin", "dra_plugin", "vfio_switcher", "helper", cli),
            ask(self.inventory_rescan, "inventory", cli),
            ask(self.inventory_gpu, "inventory", cli),
            # maintenance and DRA steps run where the vendor adapter is; only the converger asks
            ask(self.inventory_diag, "inventory", "converger"),
            ask(self.inventory_mig_layout, "inventory", "converger"),
            ask(self.inventory_mig_instance, "inventory", "converger"),
            ask(self.inventory_sharing, "inventory", "converger"),
            tell(self.inventory_changed, "inventory", "converger", "gateway_bridge", "device_plugin", "dra_plugin", cli),
            tell(self.inventory_journaled, "inventory", "gateway_bridge"),
            # signer: only the converger has reports signed; its key is public
            ask(self.signer_sign, "signer", "converger"),
            ask(self.signer_sign_batch, "signer", "converger"),
            ask(self.signer_key, "signer", "converger", "gateway_bridge", cli),
            # converger
            ask(self.converger_spec, "converger", "gateway_bridge"),
            ask(self.converger_status, "converger", "gateway_bridge", "dra_plugin", cli),
            ask(self.converger_holder, "converger", "vfio_switcher", cli),
            # managementState needs the claims
            ask(self.converger_claims, "converger", "inventory", "dra_plugin", cli),
            ask(self.converger_pass, "converger", cli),
            ask(self.converger_gpu_op, "converger", cli),
            ask(self.converger_claim_prepare, "converger", "dra_plugin"),
            ask(self.converger_claim_unprepare, "converger", "dra_plugin"),
            tell(self.converger_claims_changed, "converger", "inventory", "dra_plugin"),
            tell(self.converger_status_changed, "converger", "gateway_bridge"),
            tell(self.converger_holds_changed, "converger", "device_plugin"),
            tell(self.converger_journaled, "converger", "gateway_bridge"),
            # kube_reaper
            ask(self.reaper_held, "kube_reaper", "converger"),
            ask(self.reaper_evict, "kube_reaper", "converger"),
            ask(self.reaper_orphans, "kube_reaper", "converger"),
            ask(self.reaper_node, "kube_reaper", "converger"),
            tell(self.reaper_freed, "kube_reaper", "converger"),
            # device_plugin: the converger withdraws a hold before the reaper evicts
            ask(self.device_plugin_withdraw, "device_plugin", "converger"),
            ask(self.device_plugin_status, "device_plugin", cli),
            ask(self.dra_plugin_status, "dra_plugin", cli),
            # the VFIO side: the converger is the only one that asks for switches
            ask(self.vfio_switch, "vfio_switcher", "converger"),
            tell(self.vfio_result, "vfio_switcher", "inventory"),
            # the root helper writes for an unprivileged converger; nobody else may ask it
            *(ask(s, "helper", "converger") for s in self.helper_endpoints),
        ]
        # discovery: every micro service answers the operator's `$SRV.PING|INFO|STATS`
        for svc in SERVICES:
            routes.extend(ask(s, svc, cli) for s in _micro_subjects(svc))
        # the node bus's JetStream (the store account): each writer publishes only its own
        # event types, the bridge alone reads and purges the outbox; nobody makes or changes
        # a stream or a consumer (BUS_ADMIN_USER does, at bus start)
        converger_events = tuple(t for t in EVENT_TYPES if t != "gpu")
        routes += [
            *(ask(self.outbox_subject(t), BUS_STORE, "converger") for t in converger_events if t != "condition"),
            # node conditions: the converger's (KubernetesReleaseStuck) and the bridge's (NodeSpecRejected)
            ask(self.outbox_subject("condition"), BUS_STORE, "converger", "gateway_bridge"),
            ask(self.outbox_subject("gpu"), BUS_STORE, "inventory"),
            ask(self.outbox_info, BUS_STORE, "converger", "gateway_bridge", cli),
            Route(self.outbox_direct_get, BUS_STORE, ("gateway_bridge",), stream_reply=True),
            ask(self.outbox_purge, BUS_STORE, "gateway_bridge"),
            ask(self.inventory_key, BUS_STORE, "inventory"),
            ask(self.inventory_key_get, BUS_STORE, "inventory"),
            ask(self.inventory_bucket_info, BUS_STORE, cli),
        ]
        return tuple(routes)

    def permissions(self, user: str) -> Permissions:
        """The exact subjects one NATS user may touch on the node bus (from `routes()`)."""
        if user not in NODE_BUS_USERS:
            raise ValueError(f"unknown node-bus user {user!r}")
        publish: list[str] = []
        subscribe: list[str] = []
        for r in self.routes():
            if r.notice:
                if r.owner == user:
                    publish.append(r.subject)
                if user in r.callers:
                    subscribe.append(r.subject)
            else:
                if user in r.callers:
                    publish.append(r.subject)
                if r.owner == user:
                    subscribe.append(r.subject)
        return Permissions(publish=tuple(dict.fromkeys(publish)), subscribe=tuple(dict.fromkeys((*subscribe, f"{inbox_prefix(user)}.>"))))

    def callers(self, subject: str) -> tuple[str, ...] | None:
        """Who may ask the endpoint `subject` (None: no route names it)."""
        for r in self.routes():
            if not r.notice and r.subject == subject:
                return r.callers
        return None

    def bus_admin_permissions(self) -> Permissions:
        """BUS_ADMIN_USER: makes and updates this node's streams at bus start, nothing else.
        No service holds its password; it reaches no service (its account exports to them,
        imports nothing), so even it cannot make the server deliver to one."""
        streams = (self.outbox_stream, f"KV_{self.inventory_bucket}")
        return Permissions(
            publish=(
                "$JS.API.INFO",
                *(f"$JS.API.STREAM.{verb}.{s}" for s in streams for verb in ("INFO", "CREATE", "UPDATE")),
            ),
            subscribe=(f"{inbox_prefix(BUS_ADMIN_USER)}.>",),
            allow_responses=False,
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
    "Route",
    "BUS_STORE",
    "BUS_ADMIN_USER",
    "NODE_STORE_ACCOUNT",
    "UPSTREAM_ACCOUNT",
    "node_account",
    "upstream_node_account",
    "upstream_routes",
    "NodeSubjects",
]
