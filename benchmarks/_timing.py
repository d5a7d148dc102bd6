"""Timing helpers shared by the benchmark sections."""

from __future__ import annotations


async def sample(fns: dict, rounds: int, reps=1) -> dict[str, list[float]]:
    """Seconds per run of each timed function of ``fns`` (name -> async function that
    returns its own duration): one warm-up run each, then ``rounds`` rounds, the
    contenders interleaved, ``reps`` runs each per round (an int, or name -> int)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        await fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            for _ in range(reps if isinstance(reps, int) else reps[k]):
                samples[k].append(await fn())
    return samples
