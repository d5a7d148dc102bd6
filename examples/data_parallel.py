"""Data-parallel training on actorshm: an ActorGroup of workers, one shared weights array.

    python examples/data_parallel.py                  # 2 workers, then the parameter server
    python examples/data_parallel.py --workers 4 --no-compare
    python examples/data_parallel.py --quick          # a few seconds, for tests

The driver owns two shared arrays: the MLP's weights (``actorshm.zeros``, one flat
float64 vector) and a gradient matrix with one row per worker. Each step is ONE group
call, ``await group.step(w, grads)``: every worker gets both arrays by reference (the
same memory, nothing copied), computes the gradient of its own batch straight into its
row, and returns its loss. The driver then sums the rows and updates ``w`` in place;
the workers read the new weights in the next step. Same model, data, learning rate and
batch size as ``examples/parameter_server.py`` (sync mode), which runs afterwards for
comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import actorshm
from actorshm import ActorGroup, actor
from parameter_server import N_PARAMS, accuracy, init_params, load_data, loss_and_grad, shard


@actor
class DPWorker:
    """Holds one shard of the training set; writes its batch's gradient into its row."""

    def __init__(self, seed: int, batch_size: int):
        self.seed = seed
        self.batch_size = batch_size

    def use_shard(self, index: int, count: int) -> int:
        Xtr, _, ytr, _ = load_data(self.seed)
        self.X, self.y = shard(Xtr, ytr, index, count)
        self.index = index
        self.rng = np.random.default_rng(self.seed * 1000 + index)
        self.order = np.empty(0, dtype=np.int64)
        return len(self.X)

    def step(self, w: np.ndarray, grads: np.ndarray) -> float:
        """One batch: d loss / d w into ``grads[self.index]`` (shared: the driver sees it)."""
        if len(self.order) < self.batch_size:
            self.order = np.concatenate([self.order, self.rng.permutation(len(self.X))])
        idx, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
        return loss_and_grad(w, self.X[idx], self.y[idx], grads[self.index])

    def stats(self) -> dict:
        return actorshm.stats()


def parse(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="per worker and step")
    p.add_argument("--quick", action="store_true", help="few epochs, for tests")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the parameter-server run with the same settings")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = min(args.epochs, 6)
    for name in ("workers", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _counts(dicts):
    keys = ("bytes_copied", "bytes_zero_copy", "pool_allocs")
    return {k: sum(d.get(k, 0) for d in dicts) for k in keys}


async def train(args, Xte, yte, n_train: int):
    group = await ActorGroup.spawn(DPWorker, args.workers, args.seed, args.batch_size)
    # per-member set-up: each worker takes its own shard (individual calls, at once)
    await asyncio.gather(
        *(h.use_shard(i, args.workers) for i, h in enumerate(group)))
    w = actorshm.zeros(N_PARAMS)  # shared weights: every worker reads this memory
    w[...] = init_params(args.seed)
    grads = actorshm.zeros((args.workers, N_PARAMS))  # one row per worker
    total = np.empty(N_PARAMS)
    steps = max(1, n_train // (args.workers * args.batch_size))
    history = []
    before = _counts([actorshm.stats(), *await group.stats()])
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        losses = []
        for _ in range(steps):
            losses += await group.step(w, grads)  # one call, every worker, by reference
            np.sum(grads, axis=0, out=total)
            w -= (args.lr / args.workers) * total
        dt = time.perf_counter() - t0
        acc = accuracy(w, Xte, yte)
        now = _counts([actorshm.stats(), *await group.stats()])
        st = {k: now[k] - before[k] for k in now}
        before = now
        sps = steps * args.workers / dt  # gradients per second, as the parameter server
        history.append(dict(epoch=epoch, loss=float(np.mean(losses)), accuracy=acc,
                            steps_per_s=sps, **st))
        print(f"epoch {epoch:3d}  loss {np.mean(losses):.4f}  acc {acc:.3f}  "
              f"{sps:7.0f} steps/s  copied {st['bytes_copied']} B  "
              f"by reference {st['bytes_zero_copy']} B  pool allocs {st['pool_allocs']}",
              flush=True)
    final = np.array(w)
    await group.kill()
    return final, history


def main(argv=None) -> dict:
    args = parse(argv)
    Xtr, Xte, ytr, yte = load_data(args.seed)
    print(f"data parallel: ActorGroup of {args.workers} workers, {N_PARAMS} params, "
          f"train {len(Xtr)} test {len(Xte)}")
    t0 = time.perf_counter()
    w, history = actorshm.run(train(args, Xte, yte, len(Xtr)))
    elapsed = time.perf_counter() - t0
    acc = accuracy(w, Xte, yte)
    sps = float(np.mean([h["steps_per_s"] for h in history]))
    print(f"time: {elapsed:.1f} s")
    out = {"test_accuracy": acc, "history": history, "time_s": elapsed, "steps_per_s": sps}
    if not args.no_compare:
        import parameter_server
        print("\nthe parameter server, same settings (sync):")
        ps = parameter_server.main(
            ["--mode", "sync", "--workers", str(args.workers), "--epochs", str(args.epochs),
             "--lr", str(args.lr), "--seed", str(args.seed),
             "--batch-size", str(args.batch_size)])
        out["parameter_server"] = ps
        print(f"\n{'':16}{'test acc':>9}{'steps/s':>9}{'time':>8}")
        print(f"{'data parallel':16}{acc:9.3f}{sps:9.0f}{elapsed:7.1f}s")
        print(f"{'parameter server':16}{ps['test_accuracy']:9.3f}{ps['steps_per_s']:9.0f}"
              f"{ps['time_s']:7.1f}s")
    print(f"final test accuracy: {acc:.3f}")
    return out


if __name__ == "__main__":
    main()
