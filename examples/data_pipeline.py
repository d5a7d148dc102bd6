"""Data pipeline on actorshm: loader actors fill batches, a trainer actor consumes them.

    python examples/data_pipeline.py
    python examples/data_pipeline.py --loaders 3 --batches 500
    python examples/data_pipeline.py --quick

Each loader allocates its batch buffers with ``actorshm.empty`` in its own process, fills
them (a shuffled, noise-augmented mini-batch of its shard of the digits) and returns them.
The driver hands the arrays it got straight to the trainer: neither hop copies a byte, only
a small descriptor travels.  When the trainer and the driver drop a batch, its buffers flow
home to the loader's pool by themselves, so after a short warm-up the loaders reuse the
same few buffers forever: no bytes copied and no new blocks per batch.  The driver keeps
one batch per loader in flight while the trainer works on the current one.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import actorshm
from actorshm import actor

N_IN, N_OUT = 64, 10
KEYS = ("bytes_copied", "bytes_zero_copy", "pool_allocs", "pool_reuses")


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    return train_test_split(X / 16.0, y, test_size=0.2, random_state=seed, stratify=y)


@actor
class Loader:
    def __init__(self, index: int, count: int, seed: int, batch_size: int):
        Xtr, _, ytr, _ = load_data(seed)
        self.X, self.y = Xtr[index::count], ytr[index::count]
        self.rng = np.random.default_rng(seed * 1000 + index)
        self.batch_size = batch_size

    def next_batch(self):
        """A batch in buffers from this process's pool (recycled once every receiver drops them)."""
        X = actorshm.empty((self.batch_size, N_IN), np.float64)
        y = actorshm.empty(self.batch_size, np.int64)
        idx = self.rng.integers(0, len(self.X), self.batch_size)
        np.take(self.y, idx, out=y)
        np.take(self.X, idx, axis=0, out=X)
        X += self.rng.normal(0, 0.02, X.shape)  # light augmentation, done in place
        return X, y

    def stats(self):
        return actorshm.stats()


@actor
class Trainer:
    """Softmax regression, one SGD step per batch."""

    def __init__(self, lr: float):
        self.W = np.zeros((N_IN, N_OUT))
        self.b = np.zeros(N_OUT)
        self.lr = lr

    def step(self, X, y):
        z = X @ self.W + self.b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        p[np.arange(n), y] -= 1
        p /= n
        self.W -= self.lr * (X.T @ p)
        self.b -= self.lr * p.sum(axis=0)
        return loss  # X and y are dropped here: their buffers head home

    def weights(self):
        return self.W, self.b

    def stats(self):
        return actorshm.stats()


def parse(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--loaders", type=int, default=2)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batches = min(args.batches, 120)
    for name in ("loaders", "batches", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


async def _pipeline(args, Xte, yte):
    loaders = await asyncio.gather(*[Loader.spawn(i, args.loaders, args.seed, args.batch_size)
                                     for i in range(args.loaders)])
    trainer = await Trainer.spawn(args.lr)
    actors = [*loaders, trainer]

    async def totals():
        st = [actorshm.stats(), *await asyncio.gather(*[a.stats() for a in actors])]
        return {k: sum(s.get(k, 0) for s in st) for k in KEYS}

    # one request in flight per loader; take them round robin
    inflight = [asyncio.ensure_future(ld.next_batch()) for ld in loaders]
    losses, before, t0 = [], None, None
    for i in range(args.warmup + args.batches):
        if i == args.warmup:
            before, t0 = await totals(), time.perf_counter()
        k = i % len(loaders)
        X, y = await inflight[k]
        inflight[k] = asyncio.ensure_future(loaders[k].next_batch())  # prefetch the next
        losses.append(await trainer.step(X, y))
        del X, y  # the driver's references go too: the buffers can go home
    elapsed = time.perf_counter() - t0
    await asyncio.gather(*inflight)
    inflight = None
    after = await totals()
    W, b = await trainer.weights()
    acc = float(((Xte @ W + b).argmax(axis=1) == yte).mean())
    del W, b
    for a in actors:
        await a.kill()
    delta = {k: after[k] - before[k] for k in KEYS}
    return delta, elapsed, acc, losses


def main(argv=None) -> dict:
    args = parse(argv)
    _, Xte, _, yte = load_data(args.seed)
    delta, elapsed, acc, losses = actorshm.run(_pipeline(args, Xte, yte))
    n = args.batches
    batch_bytes = args.batch_size * (N_IN + 1) * 8
    out = {
        "bytes_copied_per_batch": delta["bytes_copied"] / n,
        "new_blocks_per_batch": delta["pool_allocs"] / n,
        "bytes_zero_copy_per_batch": delta["bytes_zero_copy"] / n,
        "pool_reuses_per_batch": delta["pool_reuses"] / n,
        "batches_per_s": n / elapsed,
        "test_accuracy": acc,
    }
    print(f"{args.loaders} loaders -> 1 trainer, batch {args.batch_size} x {N_IN} "
          f"({batch_bytes} B), {args.warmup} warm-up + {n} measured batches")
    print("after warm-up, summed over all processes, per batch:")
    print(f"  bytes copied:          {out['bytes_copied_per_batch']:.1f}")
    print(f"  new blocks (mappings): {out['new_blocks_per_batch']:.3f}")
    print(f"  bytes by reference:    {out['bytes_zero_copy_per_batch']:.0f}")
    print(f"  pool reuses:           {out['pool_reuses_per_batch']:.2f}")
    print(f"throughput: {out['batches_per_s']:.0f} batches/s; last loss "
          f"{np.mean(losses[-20:]):.4f}")
    print(f"final test accuracy: {acc:.3f}")
    return out


if __name__ == "__main__":
    main()
