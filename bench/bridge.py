"""Bridge forwarding benchmark: outbox store -> stored upstream. Prints figures, asserts nothing.

    .venv/bin/python bench/bridge.py [--singles 100] [--burst 1000] [--rounds 2]

The rig is `tests/integration/test_bridge_pipeline.Rig`: a real node bus (the
production users and permissions, `sync_interval: always`) with the outbox
stream as the bus setup makes it, the real signer, a stand-in converger, and
the real gateway_bridge as an OS process, forwarding to a separate upstream
nats-server (also syncing every write) with `BCD_EVENTS` made by
`controlplane.serve.ControlPlane.ensure_upstream`. The bench journals into the
outbox as the converger does (its user, then its `converger.journaled` notice,
which is what wakes a bridge that reads by direct get) and watches `BCD_EVENTS` through its own push
consumer (no acks, no flow control) as the control-plane user; "stored
upstream" is when that consumer delivers the event, which stands in for the
bridge's PubAck (same server, same store).

- single: one event at a time (50 ms apart), from the outbox's PubAck to
  the bench until it is delivered from `BCD_EVENTS` (a few samples can read
  slightly negative: the upstream copy arrived before the bench had taken its
  own PubAck);
- section+bound: a section and a bound journaled back to back (as a pass
  journals a hold's events); the bound's latency, measured as above;
- burst: `--burst` events journaled as fast as the bench can (async
  publishes), from the first publish until the last is upstream and the
  outbox is empty (the journaling itself is in this figure);
- pre-filled: the bridge SIGSTOPped while `--burst` events are journaled,
  then SIGCONTed: from SIGCONT until the last is upstream / the outbox empty.

To compare two versions of the bridge, run it in each checkout (the rig
starts `python -m services.gateway_bridge` from the checkout it is in).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy  # noqa: E402

from shared.subjects import MSG_ID_HEADER, UPSTREAM_EVENTS_STREAM  # noqa: E402
from tests.integration.test_bridge_pipeline import Rig  # noqa: E402


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def figures(what: str, ms: list[float]) -> str:
    return (
        f"{what}: n={len(ms)} p50={statistics.median(ms):.2f} ms p90={quantile(ms, 0.9):.2f} ms "
        f"min={min(ms):.2f} ms max={max(ms):.2f} ms"
    )


async def bench(singles: int, burst: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp))
        try:
            await rig.start()
            await rig.start_bridge()
            await rig.wait_hello()
            cp = await rig.cp_connect()
            seen: dict[str, float] = {}
            arrived = asyncio.Event()

            async def on_upstream(msg) -> None:  # noqa: ANN001
                seen[(msg.headers or {}).get(MSG_ID_HEADER, "")] = time.perf_counter()
                arrived.set()

            # the control-plane user may not answer flow control: a plain push consumer without it
            await cp.jetstream().subscribe(
                "bcd.events.>",
                stream=UPSTREAM_EVENTS_STREAM,
                cb=on_upstream,
                deliver_policy=DeliverPolicy.NEW,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE),
            )
            section, bound = rig.subjects.outbox_subject("section"), rig.subjects.outbox_subject("bound")
            body = json.dumps({"pad": "x" * 200}).encode()
            # journaled as the converger journals: as its user, then its notice to the bridge
            js = rig.conv.jetstream()

            async def told() -> None:
                await rig.conv.publish(rig.subjects.converger_journaled, b"")

            async def until(pred, timeout: float = 120.0) -> None:  # noqa: ANN001
                deadline = time.monotonic() + timeout
                while not pred():
                    if time.monotonic() > deadline:
                        raise TimeoutError("events did not arrive upstream")
                    arrived.clear()
                    try:
                        await asyncio.wait_for(arrived.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass

            for k in range(5):  # warm-up
                await js.publish(section, body, headers={MSG_ID_HEADER: f"warm{k}"})
                await told()
                await until(lambda k=k: f"warm{k}" in seen)

            lat: list[float] = []
            for k in range(singles):
                eid = f"single{k}"
                await js.publish(section, body, headers={MSG_ID_HEADER: eid})
                stored = time.perf_counter()
                await told()
                await until(lambda eid=eid: eid in seen)
                lat.append((seen[eid] - stored) * 1000)
                await asyncio.sleep(0.05)
            print(figures("single event, outbox store -> stored upstream", lat))

            lat = []
            for k in range(singles):
                sid, bid = f"pair{k}.section", f"pair{k}.bound"
                first = await js.publish_async(section, body, headers={MSG_ID_HEADER: sid})
                second = await js.publish_async(bound, body, headers={MSG_ID_HEADER: bid})
                await first
                await second
                stored = time.perf_counter()
                await told()
                await until(lambda bid=bid: bid in seen)
                lat.append((seen[bid] - stored) * 1000)
                await asyncio.sleep(0.05)
            print(figures("section+bound back to back, the bound's store -> stored upstream", lat))

            for r in range(rounds):
                ids = [f"burst{r}.{k}" for k in range(burst)]
                await asyncio.sleep(0.5)
                t0 = time.perf_counter()
                acks = [await js.publish_async(section, body, headers={MSG_ID_HEADER: i}) for i in ids]
                await asyncio.gather(*acks)
                journaled = time.perf_counter()
                await told()
                await until(lambda ids=ids: all(i in seen for i in ids))
                last_up = max(seen[i] for i in ids)
                while await rig.outbox_depth():
                    await asyncio.sleep(0.01)
                empty = time.perf_counter()
                print(
                    f"burst of {burst}: journaled in {(journaled - t0) * 1000:.0f} ms; first publish -> last upstream "
                    f"{(last_up - t0) * 1000:.0f} ms, -> outbox empty {(empty - t0) * 1000:.0f} ms"
                )

            for r in range(rounds):
                ids = [f"pre{r}.{k}" for k in range(burst)]
                await asyncio.sleep(0.5)
                assert rig.bridge is not None
                os.kill(rig.bridge.proc.pid, signal.SIGSTOP)
                try:
                    acks = [await js.publish_async(section, body, headers={MSG_ID_HEADER: i}) for i in ids]
                    await asyncio.gather(*acks)
                    await told()
                finally:
                    os.kill(rig.bridge.proc.pid, signal.SIGCONT)
                t0 = time.perf_counter()
                await until(lambda ids=ids: all(i in seen for i in ids))
                last_up = max(seen[i] for i in ids)
                while await rig.outbox_depth():
                    await asyncio.sleep(0.01)
                empty = time.perf_counter()
                print(
                    f"{burst} pre-filled (bridge stopped while journaled): SIGCONT -> last upstream "
                    f"{(last_up - t0) * 1000:.0f} ms, -> outbox empty {(empty - t0) * 1000:.0f} ms"
                )
            await cp.close()
        finally:
            await rig.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--singles", type=int, default=100, help="samples of the single and the section+bound figures")
    ap.add_argument("--burst", type=int, default=1000, help="events per burst")
    ap.add_argument("--rounds", type=int, default=2, help="bursts (and pre-filled drains) measured")
    a = ap.parse_args()
    asyncio.run(bench(a.singles, a.burst, a.rounds))


if __name__ == "__main__":
    main()
