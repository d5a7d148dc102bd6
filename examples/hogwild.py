"""Hogwild! SGD on actorshm: one shared weight buffer, N actors updating it in place, no locks.

    python examples/hogwild.py                  # 2 actors
    python examples/hogwild.py --workers 4 --epochs 20
    python examples/hogwild.py --quick          # a few seconds, for tests

The driver allocates the weights of a softmax-regression model on the digits with
``actorshm.zeros`` and passes the array to every actor: each receives a writable view of
the same memory, runs plain SGD on its own shard and writes ``w -= lr * grad`` straight
into it while the others do the same.  Updates may overwrite each other now and then;
Hogwild's point is that for SGD this costs little and saves all synchronisation.
The driver only reads the buffer at the end (and between epochs, for the log).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import actorshm
from actorshm import actor

N_IN, N_OUT = 64, 10
N_PARAMS = (N_IN + 1) * N_OUT


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    X = np.hstack([X, np.ones((len(X), 1))])  # bias column
    return train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)


def as_matrix(w):
    return w.reshape(N_IN + 1, N_OUT)  # a view: writes go to the shared buffer


def grad(W, X, y):
    z = X @ W
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y] + 1e-12).mean()
    p[np.arange(len(y)), y] -= 1
    return loss, X.T @ p / len(y)


def accuracy(w, X, y) -> float:
    return float(((X @ as_matrix(w)).argmax(axis=1) == y).mean())


def sgd_epoch(w, X, y, lr, batch_size, rng):
    W = as_matrix(w)
    order = rng.permutation(len(X))
    losses = []
    for i in range(0, len(X), batch_size):
        idx = order[i:i + batch_size]
        loss, g = grad(W, X[idx], y[idx])
        W -= lr * g  # in place, no lock: races with the other actors by design
        losses.append(loss)
    return float(np.mean(losses))


@actor
class HogwildWorker:
    def __init__(self, index: int, count: int, seed: int):
        Xtr, _, ytr, _ = load_data(seed)
        self.X, self.y = Xtr[index::count], ytr[index::count]
        self.rng = np.random.default_rng(seed * 1000 + index)

    def train(self, w, epochs: int, lr: float, batch_size: int):
        """Run ``epochs`` passes over this shard, updating the shared ``w`` in place."""
        assert actorshm.is_shared(w) and w.flags.writeable
        return [sgd_epoch(w, self.X, self.y, lr, batch_size, self.rng) for _ in range(epochs)]

    def stats(self):
        return actorshm.stats()


def parse(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = min(args.epochs, 10)
    for name in ("workers", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


async def _hogwild(args, Xte, yte):
    copied_before = actorshm.stats()["bytes_copied"]  # counters are per process, cumulative
    w = actorshm.zeros(N_PARAMS)  # the one shared weight buffer
    workers = await asyncio.gather(*[HogwildWorker.spawn(i, args.workers, args.seed)
                                     for i in range(args.workers)])
    t0 = time.perf_counter()
    # Every actor gets the same buffer (by reference) and trains until done.
    losses = await asyncio.gather(*[h.train(w, args.epochs, args.lr, args.batch_size)
                                    for h in workers])
    elapsed = time.perf_counter() - t0
    acc = accuracy(w, Xte, yte)
    st = [actorshm.stats(), *await asyncio.gather(*[h.stats() for h in workers])]
    for h in workers:
        await h.kill()
    copied = sum(s["bytes_copied"] for s in st) - copied_before
    return acc, elapsed, float(np.mean([ls[-1] for ls in losses])), copied


def main(argv=None) -> dict:
    args = parse(argv)
    Xtr, Xte, ytr, yte = load_data(args.seed)
    acc, elapsed, loss, copied = actorshm.run(_hogwild(args, Xte, yte))
    print(f"hogwild, {args.workers} actors, {args.epochs} epochs each on its shard: "
          f"test accuracy {acc:.3f}, last loss {loss:.4f}, {elapsed:.2f} s, "
          f"bytes copied {copied}")

    # Single process: same model, lr and batch size, one pass over all of the data per epoch.
    w = np.zeros(N_PARAMS)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        sgd_epoch(w, Xtr, ytr, args.lr, args.batch_size, rng)
    single_time = time.perf_counter() - t0
    single_acc = accuracy(w, Xte, yte)
    print(f"single process, {args.epochs} epochs on all data: test accuracy {single_acc:.3f}, "
          f"{single_time:.2f} s")
    print(f"final test accuracy: {acc:.3f}")
    return {"test_accuracy": acc, "time_s": elapsed, "single_accuracy": single_acc,
            "single_time_s": single_time, "bytes_copied": copied}


if __name__ == "__main__":
    main()
