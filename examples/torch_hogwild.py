"""Hogwild! training of a torch ``nn.Module`` with actors, as PyTorch's ``mnist_hogwild``.

    python examples/torch_hogwild.py                 # 2 trainer actors
    python examples/torch_hogwild.py --workers 4 --epochs 10
    python examples/torch_hogwild.py --quick         # a few seconds, for tests

PyTorch's example calls ``model.share_memory()`` and starts N ``torch.multiprocessing``
processes that each train the same model with their own optimizer. Here the driver calls
``actorshm.torch.share_module(model)`` and passes the model to N trainer actors: every
actor receives the module with its parameters viewing the same shared memory, so each
actor's ``optimizer.step()`` updates the one model in place, with no locks and no copy
(``stats()`` shows 0 bytes copied). The data are scikit-learn's handwritten digits
(8x8 images, 10 classes); the driver tests the shared model at the end, next to the same
model trained in one process with the same number of epochs.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch
from torch import nn

import actorshm
import actorshm.torch as at
from actorshm import actor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X / 16.0, y, test_size=0.2, random_state=seed,
                                          stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    g = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return f(Xtr), f(Xte), g(ytr), g(yte)


def train_epochs(model, X, y, epochs: int, lr: float, batch: int, seed: int) -> float:
    """Plain SGD over ``(X, y)``: what each Hogwild process runs on the shared model."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(0.0)
    for _ in range(epochs):
        for idx in torch.randperm(len(X), generator=gen).split(batch):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            loss.backward()
            opt.step()
    return float(loss.detach())


def accuracy(model, X, y) -> float:
    with torch.no_grad():
        return float((model(X).argmax(dim=1) == y).float().mean())


@actor
class Trainer:
    """One Hogwild process: trains the shared model on its shard."""

    def train(self, model, X, y, epochs, lr, batch, seed):
        return train_epochs(model, X, y, epochs, lr, batch, seed)

    def stats(self):
        return actorshm.stats()


async def hogwild(args, data) -> tuple[float, float, dict]:
    Xtr, Xte, ytr, yte = data
    torch.manual_seed(args.seed)
    model = at.share_module(Net())  # parameters move to shared memory, in place
    # The data go to shared memory once too, so each call passes references only.
    Xs, ys = at.share(Xtr), at.share(ytr)
    trainers = await actorshm.ActorGroup.spawn(Trainer, args.workers)
    n = len(Xs) // args.workers  # each actor's shard: a view, so it travels by reference
    shards = [slice(i * n, (i + 1) * n) for i in range(args.workers)]
    s0 = actorshm.stats()
    t0 = time.perf_counter()
    await asyncio.gather(*(
        t.train(model, Xs[idx], ys[idx], args.epochs, args.lr, args.batch, args.seed + i)
        for i, (t, idx) in enumerate(zip(trainers, shards))))
    elapsed = time.perf_counter() - t0
    s1 = actorshm.stats()
    moved = {k: s1[k] - s0[k] for k in ("bytes_copied", "bytes_zero_copy")}
    return accuracy(model, Xte, yte), elapsed, moved


def single(args, data) -> tuple[float, float]:
    Xtr, Xte, ytr, yte = data
    torch.manual_seed(args.seed)
    model = Net()
    t0 = time.perf_counter()
    train_epochs(model, Xtr, ytr, args.epochs, args.lr, args.batch, args.seed)
    return accuracy(model, Xte, yte), time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 epochs (for tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = 3
    for name in ("workers", "epochs", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(1)  # as each actor runs (num_cpus=1): a fair baseline
    data = load_data(args.seed)
    print(f"torch hogwild: {args.workers} trainer actors, {args.epochs} epochs, "
          f"train {len(data[0])} test {len(data[1])}")
    acc, took, moved = actorshm.run(hogwild(args, data))
    print(f"hogwild  test accuracy {acc:.3f}  train time {took:.2f} s  "
          f"copied {moved['bytes_copied']} B  by reference {moved['bytes_zero_copy']} B")
    sacc, stook = single(args, data)
    print(f"single   test accuracy {sacc:.3f}  train time {stook:.2f} s  (one process, "
          f"the same epochs over all the data)")
    return {"accuracy": acc, "single_accuracy": sacc, **moved}


if __name__ == "__main__":
    main()
