"""A soak: restartable actors under calls with arrays, SIGKILLs and kill+respawns.

Prints one row of resources per interval (a minute by default), so that a leak shows as
a column that keeps growing: the driver's open fds, arenas and shared bytes it owns,
blocks alive and quarantined, its resident memory. After the run everything is drained
(calls finished, restarts done, idle memory given back) and a last row is printed.

    python -m benchmarks.soak --seconds 600 [--every 60] [--actors 4]

``tests/test_soak.py`` runs the same workload for a few seconds and checks that fds,
arenas and live blocks are back where they started after the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import signal
import time

import numpy as np

import actorshm
from actorshm import ActorDiedError, _shm
from benchmarks._bench_actors import SoakWorker

COLUMNS = ("elapsed_s", "ops", "kills", "respawns", "fds", "arenas_owned",
           "arena_MiB_owned", "blocks_live", "blocks_quarantined", "rss_MiB")


def resources() -> dict:
    """The driver's resource gauges (after letting returned blocks go home)."""
    gc.collect()
    st = actorshm.stats()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"fds": len(os.listdir("/proc/self/fd")), "arenas_owned": st["arenas_owned"],
            "arena_MiB_owned": st["arena_bytes_owned"] >> 20,
            "blocks_live": st["blocks_live"], "blocks_quarantined": st["blocks_quarantined"],
            "rss_MiB": rss >> 20}


async def _settle(handles: list) -> None:
    """Wait until every actor answers (restarts done)."""
    for h in handles:
        for _ in range(200):
            try:
                await h.ping()
                break
            except ActorDiedError:
                await asyncio.sleep(0.05)


async def soak(seconds: float, every: float = 60.0, n_actors: int = 3,
               in_flight: int = 16, max_bytes: int = 4 << 20, on_row=print) -> dict:
    """Run the soak in the current (open) runtime; return counts and the drained gauges.

    Args:
        seconds: how long to run the load.
        every: seconds between resource rows (``on_row(dict)``).
        n_actors: restartable actors under load.
        in_flight: calls outstanding at once.
        max_bytes: the largest array sent (sizes are log-uniform from 1 KiB).
        on_row: called with each row.
    """
    rng = random.Random(0)
    handles = [await SoakWorker.options(max_restarts=-1).spawn() for _ in range(n_actors)]
    counts = {"ops": 0, "kills": 0, "respawns": 0, "errors": 0}
    start = time.monotonic()
    next_row = start + every
    next_kill = start + 0.3

    async def one(i: int) -> None:
        nbytes = int(2 ** rng.uniform(10, np.log2(max_bytes)))
        a = actorshm.empty(nbytes // 8 or 1, np.float64)
        a[...] = i
        k = i % len(handles)
        h = handles[k]
        try:
            if i % 3 == 0 and k + 1 < len(handles):
                # Actor-to-actor relay, down the list only: a relay busy in each actor of
                # a ring would wait on the next one's queue for ever, a deadlock through
                # several queues that nobody detects (docs/concepts.md, re-entrant calls).
                out = await h.relay(handles[k + 1], a)
            else:
                out = await h.add_one(a)
            assert float(out[0]) == i + 1 and float(out[-1]) == i + 1, "corrupted array"
            counts["ops"] += 1
        except ActorDiedError:
            counts["errors"] += 1

    i = 0
    pending: set = set()
    while time.monotonic() - start < seconds:
        while len(pending) < in_flight:
            pending.add(asyncio.ensure_future(one(i)))
            i += 1
        done, pending = await asyncio.wait(pending, timeout=0.05,
                                           return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()
        now = time.monotonic()
        if now >= next_kill:
            next_kill = now + 0.3
            k = rng.randrange(len(handles))
            if rng.random() < 0.8:
                # It restarts. Through the driver's record, only while it runs: one
                # still restarting has the number of a process that is gone (and may
                # be another's by now).
                rec = actorshm.current_runtime().record(handles[k].actor_id)
                if rec is not None and rec.alive:
                    rec.send_signal(signal.SIGKILL)
                    counts["kills"] += 1
            else:
                await handles[k].kill()  # dead for good: a fresh actor takes its place
                handles[k] = await SoakWorker.options(max_restarts=-1).spawn()
                counts["respawns"] += 1
        if now >= next_row:
            next_row = now + every
            on_row({"elapsed_s": round(now - start), **counts, **resources()})
    for t in asyncio.as_completed(pending):
        await t
    await _settle(handles)
    gc.collect()
    await asyncio.sleep(0)
    for h in handles:
        await h.kill()
    return {**counts, "handles": handles}


def drained() -> dict:
    """Gauges once everything that could go home has, and idle memory is given back."""
    gc.collect()
    _shm.pool().trim()
    return resources()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every", type=float, default=60)
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    args = ap.parse_args()
    print(" ".join(f"{c:>18}" for c in COLUMNS))

    def row(r: dict) -> None:
        print(" ".join(f"{r.get(c, ''):>18}" for c in COLUMNS), flush=True)

    async def run() -> None:
        async with actorshm.Runtime(shutdown_grace=1.0):
            row({"elapsed_s": 0, **resources()})
            counts = await soak(args.seconds, args.every, args.actors,
                                max_bytes=args.max_bytes, on_row=row)
            counts.pop("handles")
            print("after drain:", counts)
            row({"elapsed_s": "drained", **counts, **drained()})
    actorshm.run(run())


if __name__ == "__main__":
    main()
