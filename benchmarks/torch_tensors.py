"""The torch rows of ``python -m benchmarks``: tensor arguments and the tensor recycling loop.

A shared tensor argument (``actorshm.torch.empty``) against the same size of ordinary
tensor (copied once), ``torch.multiprocessing``'s queue with a ``share_memory_()`` tensor,
and Ray, all in the run's interleaved rounds; then the goal, as ratios: a shared tensor
argument within 1.5x of a trivial call, and faster than the torch.multiprocessing queue,
at every size measured.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from benchmarks._timing import sample

KiB, MiB = 1 << 10, 1 << 20
GOAL_VS_TRIVIAL = 1.5
SHARED = "actorshm, shared tensor"
ORDINARY = "actorshm, ordinary tensor (copied once)"
TMP_QUEUE = "torch.multiprocessing queue, shared tensor"
RAY = "Ray, tensor argument"


def sizes(quick: bool) -> list[int]:
    """1 MiB in --quick (CI: fast); up to 512 MiB in the full run."""
    return [MiB] if quick else [MiB, 64 * MiB, 512 * MiB]


async def tensor_arguments(c, sizes: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """Median seconds per call with a uint8 tensor argument of each size, per contender
    (``c``: the run's ``Contenders``; its torch and ray peers when started)."""
    import torch

    import actorshm.torch as at
    out: dict[str, dict[int, float]] = {}
    for size in sizes:
        shared = at.empty(size, dtype=torch.uint8)
        shared[::4096] = 1
        ordinary = torch.ones(size, dtype=torch.uint8)
        pc = time.perf_counter
        fns = {}

        async def shm_shared():
            t = pc()
            await c.sink.touch(shared)
            return pc() - t

        async def shm_ordinary():
            t = pc()
            await c.sink.touch(ordinary)
            return pc() - t
        fns[SHARED] = shm_shared
        fns[ORDINARY] = shm_ordinary
        mp_shared = None
        if c.torch is not None:  # pragma: no cover - not in --quick
            mp_shared = torch.ones(size, dtype=torch.uint8).share_memory_()

            async def tmp_queue():
                t = pc()
                c.torch["q_in"].put(mp_shared)
                c.torch["q_out"].get()
                return pc() - t
            fns[TMP_QUEUE] = tmp_queue
        if c.ray is not None:  # pragma: no cover - needs ray
            ray, h = c.ray["ray"], c.ray["h"]

            async def ray_arg():
                t = pc()
                ray.get(h.touch.remote(ordinary))
                return pc() - t
            fns[RAY] = ray_arg
        reps = 2 if size >= 64 * MiB else 10
        # The by-reference calls are cheap at every size: sample them as often as small
        # calls, so that one slow wake-up does not make their median.
        samples = await sample(fns, rounds, {k: 30 if k in (SHARED, TMP_QUEUE) else reps
                                             for k in fns})
        for k, v in samples.items():
            out.setdefault(k, {})[size] = statistics.median(v)
        del shared, ordinary, mp_shared
    return out


async def tensor_recycling(c, n: int) -> tuple[float, float, float]:
    """The 64 MiB recycling loop with tensors: (seconds per batch, bytes copied per batch,
    new blocks per batch), over every process involved."""
    import actorshm
    from benchmarks._torch_actors import TensorProducer
    prod = await TensorProducer.spawn(64 * MiB)
    for i in range(3):
        b = await prod.batch(i)
        await c.sink.touch(b)
        del b
    await asyncio.sleep(0.05)
    p0, c0, d0 = await prod.stats(), await c.sink.stats(), actorshm.stats()
    t = time.perf_counter()
    for i in range(n):
        b = await prod.batch(i)
        await c.sink.touch(b)
        del b
    per = (time.perf_counter() - t) / n
    await asyncio.sleep(0.05)
    p1, c1, d1 = await prod.stats(), await c.sink.stats(), actorshm.stats()
    pairs = ((p0, p1), (c0, c1), (d0, d1))
    copied = sum(b["bytes_copied"] - a["bytes_copied"] for a, b in pairs) / n
    allocs = sum(b["pool_allocs"] - a["pool_allocs"] for a, b in pairs) / n
    await prod.kill()
    return per, copied, allocs


def goal_notes(args: dict[str, dict[int, float]], trivial: float, fmt_size) -> list[str]:
    """The goal, as ratios per size, and whether it is met."""
    shared = args[SHARED]
    ratios = {s: shared[s] / trivial for s in shared}
    notes = ["Shared tensor argument vs a trivial call: " + ", ".join(
        f"{fmt_size(s)} {r:.2f}x" for s, r in ratios.items()) +
        f" (goal: within {GOAL_VS_TRIVIAL}x at every size: "
        f"{'met' if max(ratios.values()) <= GOAL_VS_TRIVIAL else 'not met'})."]
    if TMP_QUEUE in args:  # pragma: no cover - not in --quick
        q = {s: args[TMP_QUEUE][s] / shared[s] for s in shared if s in args[TMP_QUEUE]}
        notes.append("torch.multiprocessing's queue with a shared tensor takes " + ", ".join(
            f"{fmt_size(s)} {r:.1f}x" for s, r in q.items()) +
            " actorshm's time for a shared tensor (goal: actorshm faster at every size: "
            f"{'met' if min(q.values()) > 1 else 'not met'}).")
    else:
        notes.append("torch.multiprocessing's queue not measured (--quick or torch "
                     "missing): the second half of the tensor goal is not checked.")
    if RAY in args:  # pragma: no cover - needs ray
        notes.append("Ray passing the tensor as an argument takes " + ", ".join(
            f"{fmt_size(s)} {args[RAY][s] / shared[s]:.0f}x" for s in shared
            if s in args[RAY]) + " actorshm's time for a shared tensor.")
    return notes


async def section(c, table, data: dict, quick: bool, trivial: float, fmt_ms, fmt_size) -> None:
    """Measure the torch rows and add them to the run's ``table`` (``benchmarks.run``)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        c.skipped.append("torch not installed: tensor rows skipped "
                         "(pip install -e '.[torch]')")
        return
    ss = sizes(quick)
    args = await tensor_arguments(c, ss, rounds=2 if quick else 3)
    data["tensors"] = {"sizes": ss, "args": args}
    table.add("A call with a torch tensor argument (median; effective GB/s)",
              ["contender"] + [fmt_size(s) for s in ss],
              [[k] + [f"{fmt_ms(v[s])} ms ({s / v[s] / 1e9:.1f} GB/s)" if s in v
                      else "not measured" for s in ss] for k, v in args.items()])
    table.notes.extend(goal_notes(args, trivial, fmt_size))
    per, copied, allocs = await tensor_recycling(c, 10 if quick else 40)
    table.add("Recycling loop, 64 MiB torch tensors (producer actor fills an "
              "actorshm.torch.empty tensor, consumer touches, it goes home)",
              ["contender", "ms per batch", "bytes copied/batch", "new blocks/batch"],
              [["actorshm", fmt_ms(per), f"{copied:.0f}", f"{allocs:.2f}"]])
