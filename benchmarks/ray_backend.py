"""actorshm on its Ray backend next to raw Ray, measured in the same run.

    python -m benchmarks.ray_backend [--quick]    # this part of `python -m benchmarks` alone

Three things, each interleaved round by round: a trivial call's round trip, pipelined
calls (100 in flight), and a call with a 64 MiB numpy argument. Raw Ray is measured with
a sync actor (Ray's fastest) and an async actor (what actorshm's Ray host is: it runs
sync and async methods alike and keeps each caller's calls in order).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import numpy as np

from benchmarks._bench_actors import ReadSink

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray starts

MiB = 1 << 20


def _raw_actors(ray):  # pragma: no cover - needs ray
    @ray.remote
    class RawSync:
        def noop(self, x=None):
            return None

        def touch(self, a):
            return int(a[0])

    @ray.remote
    class RawAsync:
        async def noop(self, x=None):
            return None

        async def touch(self, a):
            return int(a[0])

    s, a = RawSync.remote(), RawAsync.remote()
    ray.get([s.noop.remote(), a.noop.remote()])
    return s, a


async def measure(quick: bool) -> dict:  # pragma: no cover - needs ray
    """Median seconds per trivial call, calls/s pipelined, seconds per 64 MiB call."""
    import actorshm
    import ray
    rt = await actorshm.Runtime(backend="ray", num_cpus=2).start()
    try:
        ours = await ReadSink.spawn()
        raw_sync, raw_async = _raw_actors(ray)
        trivial = {"actorshm on Ray": lambda: ours.noop(),
                   "raw Ray, sync actor": lambda: raw_sync.noop.remote(),
                   "raw Ray, async actor": lambda: raw_async.noop.remote()}
        big = np.ones(64 * MiB, np.uint8)
        arg = {"actorshm on Ray": lambda: ours.touch(big),
               "raw Ray, sync actor": lambda: raw_sync.touch.remote(big),
               "raw Ray, async actor": lambda: raw_async.touch.remote(big)}
        lat = {k: [] for k in trivial}
        rate = {k: [] for k in trivial}
        arr = {k: [] for k in trivial}
        rounds, per, n = (3, 50, 100) if quick else (8, 200, 100)
        for fn in trivial.values():  # warm-up
            for _ in range(20):
                await fn()
        for _ in range(rounds):
            for k, fn in trivial.items():
                for _ in range(per):
                    t = time.perf_counter()
                    await fn()
                    lat[k].append(time.perf_counter() - t)
                t = time.perf_counter()
                await asyncio.gather(*[fn() for _ in range(n)])
                rate[k].append(n / (time.perf_counter() - t))
                for _ in range(2):
                    t = time.perf_counter()
                    await arg[k]()
                    arr[k].append(time.perf_counter() - t)
        return {"latency": {k: statistics.median(v) for k, v in lat.items()},
                "throughput": {k: statistics.median(v) for k, v in rate.items()},
                "64 MiB": {k: statistics.median(v) for k, v in arr.items()}}
    finally:
        await rt.close()


def rows(res: dict) -> list[list[str]]:
    """Table rows: contender, µs per call, calls/s, ms per 64 MiB call, vs raw sync."""
    base = res["latency"]["raw Ray, sync actor"]
    out = []
    for k in res["latency"]:
        out.append([k, f"{res['latency'][k] * 1e6:.0f}", f"{res['throughput'][k]:,.0f}",
                    f"{res['64 MiB'][k] * 1e3:.1f}", f"{res['latency'][k] / base:.2f}x"])
    return out


HEADER = ["contender", "trivial call µs", "pipelined calls/s (100 in flight)",
          "64 MiB argument ms", "trivial vs raw Ray sync"]


def ratios(res: dict) -> str:
    """actorshm on Ray against the like-for-like raw Ray (an async actor), as text."""
    us, raw = "actorshm on Ray", "raw Ray, async actor"
    return (f"actorshm on Ray vs raw Ray async actor: trivial call "
            f"{res['latency'][us] / res['latency'][raw]:.2f}x the time, pipelined "
            f"{res['throughput'][raw] / res['throughput'][us]:.2f}x, 64 MiB argument "
            f"{res['64 MiB'][us] / res['64 MiB'][raw]:.2f}x")


def main(quick: bool) -> None:  # pragma: no cover - needs ray
    """Measure and print the table and the ratios."""
    result = asyncio.run(measure(quick))
    print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER))
    for row in rows(result):
        print("| " + " | ".join(row) + " |")
    print(ratios(result))


if __name__ == "__main__":  # pragma: no cover - needs ray
    import sys

    from benchmarks import ray_backend  # Ray imports the actor classes by module name
    ray_backend.main("--quick" in sys.argv)
