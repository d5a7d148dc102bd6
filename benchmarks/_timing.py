"""Timing helpers shared by the benchmark sections."""

from __future__ import annotations

# Peers' contenders that failed in this run, each "name: why": the report lists them.
FAILED: list[str] = []
# Contenders that must not fail, by a word of their name: actorshm's own, and the
# floors and baselines that the ratios divide by (they run in this process).
_MUST_RUN = ("actorshm", "floor", "pickle round trip")


async def sample(fns: dict, rounds: int, reps=1) -> dict[str, list[float]]:
    """Seconds per run of each timed function of ``fns`` (name -> async function that
    returns its own duration): one warm-up run each, then ``rounds`` rounds, the
    contenders interleaved, ``reps`` runs each per round (an int, or name -> int).

    A peer's contender that raises (Ray out of object-store or disk space, say) is
    dropped from the rest of the run, missing from the result and listed in ``FAILED``,
    so that one peer's trouble costs its cells, not the run; actorshm's own contenders,
    the floors and baselines failing is an error (``_MUST_RUN``).
    """
    live = dict(fns)
    samples: dict[str, list[float]] = {k: [] for k in fns}

    async def run(k: str, keep: bool = True) -> None:
        try:
            took = await live[k]()
        except Exception as exc:
            if any(w in k for w in _MUST_RUN):
                raise
            why = (str(exc).strip().splitlines() or [""])[0][:200]
            FAILED.append(f"{k}: failed ({type(exc).__name__}: {why}); not measured")
            del live[k], samples[k]
        else:
            if keep:
                samples[k].append(took)

    for k in list(live):
        await run(k, keep=False)  # (a warm-up run)
    for _ in range(rounds):
        for k in list(live):
            for _ in range(reps if isinstance(reps, int) else reps[k]):
                if k in live:
                    await run(k)
    return samples
