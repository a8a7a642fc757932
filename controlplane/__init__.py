"""bcd's reference control plane: signs and pushes NodeSpecs, verifies and applies node events.

It speaks the upstream contract of DESIGN section 3 (docs/upstream.md) exactly,
and nothing more. It owns the KV buckets `bcd_nodespecs`, `bcd_nodes`,
`bcd_inventory` and the stream `BCD_EVENTS`. It puts each node's spec as a
`SignedNodeSpec` signed with its own Ed25519 key. It reads `bcd.events.<node>.<type>`
through a durable pull consumer and checks every AttestedReport against the key
the node announced in its Hello (signature, node, boot id, `Nats-Msg-Id`). It
rejects what does not check out, and runs a small reservation state machine
(state.py).

Everything it decides survives a restart in `<state_dir>/state.json`, and each
event it took is a line in `<state_dir>/events.jsonl` and on stdout. It is a
program of its own, beside the node's: `bcd up` starts it as a process
(`python -m controlplane serve`), and a fleet runs `bcd-controlplane serve|put`.
It imports only `shared` and third-party libraries, never `bcd` or `services`.
The node-side CLI imports the few pieces it needs to put a spec or read the
ledger (put, specs, state, keys, ledger), never the serve loop.

One concern per module:

    state.py     state.json: reservations, nodes, processed ids; pure transitions; StateStore
    ledger.py    EventRecord, events.jsonl, the readable event line
    keys.py      the signing key, cp.key and cp.pub
    specs.py     a spec checked before a put; PutResult, UnknownNode
    buckets.py   the buckets and the events stream, created or fixed
    nodes.py     Hellos (checked, cached, learnt live), inventories, reported state
    publish.py   one spec signed and put, its generation reserved
    judge.py     one event message judged: verified or rejected, nothing applied
    commit.py    a judged batch applied with one state write
    serve.py     ControlPlane: the wiring and the consumer loop
    upstream.py  the connection: credentials, TLS, retries said once
    stopping.py  the stoppable sleep every retry waits in
    put.py       a one-off put (connect, put, close)
    cli.py       `bcd-controlplane serve|put`
"""

from shared import lazynats as _lazynats

_lazynats.install()  # nats without aiohttp until a ws:// URL needs it (shared/lazynats.py)
