"""Binding conditions (seed 003): devices published with `bindsToNode: true`,
`bindingConditions: ["Ready"]` and `bindingFailureConditions: ["BindingFailed"]`
(`--binding-conditions true`) keep the scheduler's PreBind waiting until someone
says the allocated device is ready on its node; a failure shows as condition
BindingFailed on the claim rather than a pod that hangs silently.

That someone is this node's plugin: for every allocated ResourceClaim with a
device of our driver in our pool whose `status.devices` entry has neither
condition, it writes `Ready=True` when the device is still one this node
publishes (its card still in the pool) and untainted, else `BindingFailed=True`
with the reason (a tainted device is on an unhealthy card, issue 30: the
converger refuses to prepare it, so the scheduler had better try elsewhere). `plan_binding` is pure (a table-tested decision); the plugin applies
it with a status PUT carrying the claim's resourceVersion (a conflict is tried
again at the next round).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from .devices import BINDING_CONDITIONS, BINDING_FAILURE_CONDITIONS, Pool

READY = BINDING_CONDITIONS[0]
FAILED = BINDING_FAILURE_CONDITIONS[0]


@dataclass(frozen=True)
class BindingUpdate:
    namespace: str
    name: str
    #: the claim object with its status.devices as they must be written
    body: dict
    #: device -> the condition set (for logs)
    set: tuple[tuple[str, str], ...]


def _condition(type_: str, reason: str, message: str, now: datetime, generation: int) -> dict:
    return {
        "type": type_,
        "status": "True",
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "observedGeneration": generation,
    }


def plan_binding(claims: Iterable[dict], *, driver: str, pool_name: str, pool: Pool, now: datetime) -> list[BindingUpdate]:
    """The status writes that say, for each of our allocated devices still waiting, Ready or BindingFailed."""
    published = {d.name for d in pool.devices}
    tainted = {d.name: ", ".join(t.text() for t in d.taints) for d in pool.devices if d.taints}
    out: list[BindingUpdate] = []
    for obj in claims:
        status = obj.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        ours = [r for r in results if r.get("driver") == driver and r.get("pool") == pool_name]
        if not ours:
            continue
        devices = copy.deepcopy(status.get("devices") or [])
        by_key = {(d.get("driver"), d.get("pool"), d.get("device")): d for d in devices}
        generation = int((obj.get("metadata") or {}).get("generation") or 0)
        changed: list[tuple[str, str]] = []
        for r in ours:
            key = (driver, pool_name, r.get("device"))
            entry = by_key.get(key)
            types = {c.get("type") for c in (entry or {}).get("conditions") or []}
            if READY in types or FAILED in types:
                continue
            if entry is None:
                entry = {"driver": driver, "pool": pool_name, "device": r.get("device")}
                devices.append(entry)
                by_key[key] = entry
            if r.get("device") in tainted:
                cond = _condition(
                    FAILED, "DeviceTainted", f"{r.get('device')} on node {pool_name} is unhealthy (tainted {tainted[str(r.get('device'))]}): it is not prepared", now, generation
                )
                changed.append((str(r.get("device")), FAILED))
            elif r.get("device") in published:
                cond = _condition(READY, "DevicePublished", f"{r.get('device')} is on node {pool_name} and published by it", now, generation)
                changed.append((str(r.get("device")), READY))
            else:
                cond = _condition(
                    FAILED, "DeviceNotAvailable", f"{r.get('device')} is not among the devices node {pool_name} publishes now (held, claimed by a VM, or not Ready)", now, generation
                )
                changed.append((str(r.get("device")), FAILED))
            entry["conditions"] = [*(entry.get("conditions") or []), cond]
        if changed:
            body = copy.deepcopy(obj)
            body.setdefault("status", {})["devices"] = devices
            meta = obj.get("metadata") or {}
            out.append(BindingUpdate(namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")), body=body, set=tuple(changed)))
    return out


__all__ = ["READY", "FAILED", "BindingUpdate", "plan_binding"]
