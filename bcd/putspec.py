"""A spec put through the control plane embedded in this node (`bcd apply`, `bcd up --apply`).

This module owns the node's side of a put. It finds the upstream URL, the
control plane's password and its state dir in `<state>/node.json` (written by
`bcd up`), then puts through controlplane.put. The put is strict: a spec for a
node that never said Hello is refused unless forced, and for this state dir's
own node a Hello is waited for a little, since it may be starting. It lives in
`bcd` because it reads the node's files. The control plane package knows
nothing of a node's layout.
"""

from __future__ import annotations

import sys
from pathlib import Path

from controlplane.put import LOCAL_HELLO_WAIT_S, put_spec_file, rebase_node
from controlplane.specs import PutResult
from shared.schemas import encode
from shared.schemas.codec import DEFAULT_MAX_BYTES, bounded_json_loads
from shared.subjects import CONTROLPLANE_USER

from .client import node_info


async def put_through_node(
    state: Path, spec: Path | bytes, *, allow_unknown_fields: bool = False, force: bool = False, connect_timeout: float = 5.0
) -> PutResult:
    """`bcd apply`: put one spec through the embedded control plane of the node at `state`.

    Finds the upstream URL, the control plane's password and its state dir in
    `<state>/node.json` (written by `bcd up`). Unless `force`, a spec for a
    node that never put a Hello is refused (UnknownNode); for the node of this
    state dir, a Hello is waited for a little (it may be starting).
    """
    info = node_info(Path(state))
    if not info.controlplane_dir:
        raise ValueError("this node joined an existing upstream: apply specs through that control plane")
    return await put_spec_file(
        info.upstream_url or info.nats_url,
        CONTROLPLANE_USER,
        Path(info.creds_dir) / f"{CONTROLPLANE_USER}.password",
        Path(info.controlplane_dir),
        spec,
        allow_unknown_fields=allow_unknown_fields,
        require_known_node=not force,
        hello_wait=lambda node_id: LOCAL_HELLO_WAIT_S if node_id == info.node_id else 0.0,
        connect_timeout=connect_timeout,
    )


async def rebase_through_node(state: Path, *, connect_timeout: float = 5.0) -> PutResult:
    """`bcd rebase`: the embedded control plane rebases the node of `state` (controlplane.publish)."""
    info = node_info(Path(state))
    if not info.controlplane_dir:
        raise ValueError("this node joined an existing upstream: its control plane rebases it (`python -m controlplane rebase NODE`)")
    return await rebase_node(
        info.upstream_url or info.nats_url,
        CONTROLPLANE_USER,
        Path(info.creds_dir) / f"{CONTROLPLANE_USER}.password",
        Path(info.controlplane_dir),
        info.node_id,
        connect_timeout=connect_timeout,
    )


def unasked_generation(data: bytes) -> tuple[bytes, int | None]:
    """The spec without the `generation` its file carries: (the JSON to put, the generation left out).

    A generation is the control plane's to give (last + 1): one taken from a file unasked
    put a node at 2^63 - 1 for good (issue 41.5). `bcd apply --generation-from-file` keeps it.
    JSON that does not read is BadMessage (check_spec's own words); anything else not an
    object is returned as it is, for check_spec to refuse.
    """
    if not data.strip():
        return data, None  # check_spec says what an empty spec is
    fields = bounded_json_loads(data, 4 * DEFAULT_MAX_BYTES, "spec")
    if not isinstance(fields, dict) or "generation" not in fields:
        return data, None
    given = fields.pop("generation")
    # a generation that is no number is left out all the same: not asked for, it does not matter
    return encode(fields), given


async def apply_spec_file(state: Path, spec_file: Path | str) -> int:
    """Put one spec file through the node's embedded control plane (strictly); return its generation.

    A `generation` in the file is left out, said on stderr (`bcd up --apply`: the control plane
    gives the next one)."""
    data, given = unasked_generation(Path(spec_file).read_bytes())
    if given is not None:
        print(f"note: {spec_file}: its generation {given} is ignored; the control plane puts the next one", file=sys.stderr)
    result = await put_through_node(Path(state), data)
    if result.note:
        print(f"note: {result.note}", file=sys.stderr)
    return result.generation


__all__ = ["put_through_node", "apply_spec_file", "rebase_through_node", "unasked_generation"]
