"""Torch actor classes the benchmarks spawn (importing this module imports torch)."""

import torch

import actorshm
import actorshm.torch
from actorshm import actor


@actor
class TensorProducer:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def batch(self, value):
        b = actorshm.torch.empty(self.nbytes, dtype=torch.uint8)
        b[::4096] = value  # one write per page, as the numpy producer does
        return b

    def stats(self):
        return actorshm.stats()
