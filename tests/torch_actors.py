"""Actor classes for tests/test_torch.py. Kept free of pytest so actor processes import it
fast; importing it needs torch."""

import os

import numpy as np
import torch

import actorshm
import actorshm.torch as at
from actorshm import actor


@actor
class Tensors:
    def __init__(self):
        self.kept = []

    def info(self, t):
        return (type(t).__name__, str(t.dtype), tuple(t.shape), t.stride(),
                t.storage_offset(), t.device.type, t.requires_grad, at.is_shared(t))

    def echo(self, x):
        return x

    def fill(self, t, value):
        with torch.no_grad():
            t.fill_(value)

    def add_one(self, t):
        t += 1
        return t

    def make(self, n, value, dtype="float32"):
        t = at.empty(n, dtype=getattr(torch, dtype))
        t.fill_(value)
        self.kept.append(t)
        return t

    def ordinary(self, n):
        return torch.arange(n, dtype=torch.float32)

    def total(self, t):
        return float(t.double().sum())

    def first_bytes(self, t, n):
        """The first ``n`` bytes of a tensor's storage, as the actor sees them."""
        s = t.untyped_storage()
        return bytes(torch.empty(0, dtype=torch.uint8).set_(s)[:n].tolist())

    def nested(self, obj):
        return {k: [float(x.double().sum()) for x in v] for k, v in obj.items()}

    def write_numpy(self, a, value):
        a[...] = value

    def threads(self):
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

    def stats(self):
        return actorshm.stats()

    def train(self, model, steps, seed):
        """SGD steps on a tiny regression, in place on the model's (shared) weights."""
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(steps):
            x = torch.randn(16, model.in_features, generator=g)
            y = x.sum(dim=1, keepdim=True)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [at.is_shared(p) for p in model.parameters()]

    def np_sum(self, a):
        return float(np.asarray(a).sum())
