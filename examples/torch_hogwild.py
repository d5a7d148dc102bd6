"""Hogwild training of a PyTorch model with actorshm, after PyTorch's ``mnist_hogwild``.

    python examples/torch_hogwild.py                 # 2 trainer actors, 10 epochs
    python examples/torch_hogwild.py --workers 4
    python examples/torch_hogwild.py --quick         # a few seconds, for tests

As in PyTorch's example, one ``nn.Module`` has its weights in shared memory
(``actorshm.torch.share_module`` instead of ``model.share_memory()``), and N trainers
run SGD on it at once, without locks. Each trainer is an actor: the model is passed to
it as an ordinary argument, and arrives with its parameters viewing the same memory, so
every ``optimizer.step()`` in any actor updates the one model. Data: scikit-learn's
8x8 digits (MNIST's small cousin, no download). A single-process run of the same
training is printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import actorshm
import actorshm.torch
from actorshm import actor


class Net(nn.Module):
    """A small convolutional net for 8x8 digits (PyTorch's example net, scaled down)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def load_data(seed: int):
    """Digits as float tensors (N, 1, 8, 8) in [0, 1], split 80/20."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.from_numpy(Xtr), torch.from_numpy(Xte), torch.from_numpy(ytr),
            torch.from_numpy(yte))


def train_epoch(model, X, y, lr: float, batch_size: int, gen: torch.Generator) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    model.train()
    loss = torch.zeros(())
    for idx in torch.randperm(len(X), generator=gen).split(batch_size):
        opt.zero_grad()
        loss = F.nll_loss(model(X[idx]), y[idx])
        loss.backward()
        opt.step()  # in place: in shared memory when the model was shared
    return loss.item()


def accuracy(model, X, y) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(X).argmax(1) == y).float().mean())


@actor
class Trainer:
    """One Hogwild trainer: SGD on its shard, straight into the shared model."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.gen = torch.Generator().manual_seed(seed)

    def train(self, model, X, y, epochs: int, lr: float, batch_size: int) -> float:
        loss = 0.0
        for _ in range(epochs):
            loss = train_epoch(model, X, y, lr, batch_size, self.gen)
        return loss

    def stats(self):
        return actorshm.stats()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="few epochs (for tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = 5
    return args


async def _hogwild(args, Xtr, ytr):
    torch.manual_seed(args.seed)
    model = actorshm.torch.share_module(Net())  # like model.share_memory()
    trainers = [await Trainer.spawn(args.seed + i) for i in range(args.workers)]
    # Each trainer gets its shard; the shards are copied into shared memory once, here.
    shards = [(actorshm.torch.share(Xtr[i::args.workers]),
               actorshm.torch.share(ytr[i::args.workers])) for i in range(args.workers)]
    before = actorshm.stats()["bytes_copied"]
    t0 = time.perf_counter()
    losses = await asyncio.gather(*(
        t.train(model, X, y, args.epochs, args.lr, args.batch_size)
        for t, (X, y) in zip(trainers, shards)))
    elapsed = time.perf_counter() - t0
    copied = actorshm.stats()["bytes_copied"] - before
    return model, elapsed, float(np.mean(losses)), copied


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(1)  # as each actor has (num_cpus=1): a fair baseline
    Xtr, Xte, ytr, yte = load_data(args.seed)
    model, elapsed, loss, copied = actorshm.run(_hogwild(args, Xtr, ytr))
    acc = accuracy(model, Xte, yte)
    print(f"hogwild, {args.workers} trainer actors, {args.epochs} epochs each on its shard: "
          f"test accuracy {acc:.3f}, last loss {loss:.4f}, {elapsed:.2f} s, "
          f"bytes copied {copied}")

    torch.manual_seed(args.seed)
    single = Net()
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        train_epoch(single, Xtr, ytr, args.lr, args.batch_size, gen)
    single_time = time.perf_counter() - t0
    single_acc = accuracy(single, Xte, yte)
    print(f"single process, {args.epochs} epochs on all data: test accuracy "
          f"{single_acc:.3f}, {single_time:.2f} s")
    print(f"final test accuracy: {acc:.3f}")
    return {"test_accuracy": acc, "time_s": elapsed, "single_accuracy": single_acc,
            "single_time_s": single_time, "bytes_copied": copied}


if __name__ == "__main__":
    main()
