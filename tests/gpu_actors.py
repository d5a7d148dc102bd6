"""GPU actor classes for tests/test_cuda.py (imported only where CuPy is present)."""

import gc
import os
import time

import cupy

import actorshm
from actorshm import actor


@actor
class GpuArrays:
    def __init__(self):
        self.kept = None

    def fill(self, a, v):
        a[...] = v
        cupy.cuda.get_current_stream().synchronize()

    def make(self, n, v):
        a = actorshm.cuda.empty(n, cupy.float32)
        a[...] = v
        return a

    def add_one(self, a):
        a += 1
        return a

    def add_queued(self, a, v, times):
        for _ in range(times):
            a += v  # queued on the current stream; not synchronized here

    def sleep(self, seconds):
        time.sleep(seconds)

    def reply_waits_held(self):
        """Calls whose reply waits this process still keeps (none once they ended)."""
        from actorshm._protocol import Connection
        return sum(len(o.reply_waits) for o in gc.get_objects() if isinstance(o, Connection))

    def stream_syncs(self):
        return cupy.cuda.Stream.synchronizes  # (the simulated GPU counts them)

    def echo(self, a):
        return a

    def sum(self, a):
        return float(a.sum())

    def info(self, a):
        return (a.shape, a.strides, str(a.dtype), actorshm.cuda.is_shared(a),
                cupy.cuda.runtime.deviceGetPCIBusId(a.data.device_id))

    def keep(self, a):
        self.kept = a

    def drop(self):
        self.kept = None

    def sum_kept(self):
        return float(self.kept.sum())

    async def lend_kept(self, other):
        await other.keep(self.kept)

    def stats(self):
        return actorshm.stats()

    def env(self, name):
        return os.environ.get(name)

    def device_bus_id(self):
        return cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.runtime.getDevice())
