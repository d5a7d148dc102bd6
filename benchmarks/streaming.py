"""Streaming methods against the same items fetched by individual calls, in one run."""

from __future__ import annotations

import statistics
import time

MiB = 1 << 20


async def streaming(quick: bool) -> dict[str, dict[str, float]]:
    """Items/s of small items and of 8 MiB shared arrays: streamed (``async for`` over a
    generator method) and fetched one awaited call at a time. Returns
    ``{kind: {"stream": items/s, "calls": items/s}}`` (medians of a few rounds)."""
    from benchmarks._bench_actors import Streamer
    s = await Streamer.spawn()
    rounds = 3 if quick else 7
    out: dict[str, dict[str, float]] = {}
    for kind, n, big in (("small items (ints)", 2000 if quick else 20000, 0),
                         ("8 MiB shared arrays", 50 if quick else 200, 8 * MiB)):
        stream_rates, call_rates = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            if big:
                async for a in s.arrays(n, big):
                    del a
            else:
                async for _i in s.items(n):
                    pass
            stream_rates.append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i in range(n):
                if big:
                    a = await s.array(big)
                    del a
                else:
                    await s.item(i)
            call_rates.append(n / (time.perf_counter() - t0))
        out[kind] = {"stream": statistics.median(stream_rates),
                     "calls": statistics.median(call_rates)}
    await s.kill()
    return out


def rows(result: dict[str, dict[str, float]]) -> list[list[str]]:
    """Table rows: kind, streamed items/s, individual calls items/s, ratio."""
    return [[k, f"{v['stream']:,.0f}", f"{v['calls']:,.0f}",
             f"{v['stream'] / v['calls']:.1f}x"] for k, v in result.items()]
