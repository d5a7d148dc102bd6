"""Actor classes for tests/test_torch_cuda.py (imported where CuPy and torch are)."""

import cupy
import torch

import actorshm
import actorshm.torch as at
from actorshm import actor

SIMULATED = cupy.__version__ == "0.0-simulated"


def sync():
    """Our queued GPU work is done (the caller reads the memory next)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@actor
class TorchGpu:
    def __init__(self):
        if SIMULATED:
            import simtorchcuda
            simtorchcuda.install()
        self.kept = None

    def fill(self, t, v):
        t.fill_(v)
        sync()

    def info(self, t):
        return (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                t.device.type, at.is_shared(t))

    def kind(self, t):
        return type(t).__name__, t.requires_grad, t.device.type

    def total(self, t):
        return float(t.sum())

    def echo(self, t):
        return t

    def make(self, n, v):
        t = at.empty(n, device="cuda")
        t.fill_(v)
        sync()
        return t

    def stats(self):
        return actorshm.stats()
