"""Actor classes for the backend contract tests (tests/test_ray.py). Free of pytest."""

import asyncio
import os
import time

import numpy as np

from actorshm import actor


@actor
class Streamer:
    def __init__(self):
        self.closed = []
        self.produced = 0

    async def count(self, n, delay=0.0, first_after=0.0):
        try:
            if first_after:
                await asyncio.sleep(first_after)
            for i in range(n):
                self.produced = i + 1
                yield i
                if delay:
                    await asyncio.sleep(delay)
        finally:
            self.closed.append(n)

    def sync_count(self, n):
        for i in range(n):
            yield i * i

    async def fail_after(self, n):
        for i in range(n):
            yield i
        raise KeyError("stream failed on purpose")

    def arrays(self, n, size):
        for i in range(n):
            yield np.full(size, i, dtype=np.int32)

    async def die_after(self, n):
        for i in range(n):
            yield i
        await asyncio.sleep(0.05)
        os._exit(3)
        yield n  # never reached

    def closed_(self):
        return list(self.closed)

    def produced_(self):
        return self.produced

    def ping(self):
        return "pong"


class _NoPickle:
    def __reduce__(self):
        raise TypeError("no pickling this on purpose")


class Batch:  # a plain object holding arrays (as a dataclass does)
    def __init__(self, **arrays):
        self.__dict__.update(arrays)


@actor
class ArrayUser:
    def total(self, arr):
        return float(arr.sum())

    def scale_in_place(self, arr, k):
        arr *= k  # on Ray the argument is read-only: this raises ValueError
        return True

    def writable(self, arr):
        return bool(arr.flags.writeable)

    def writable_attrs(self, obj):
        return {k: bool(v.flags.writeable) if isinstance(v, np.ndarray)
                else self.writable_attrs(v) for k, v in vars(obj).items()}

    def make(self, n):
        return np.arange(n, dtype=np.float64)

    def node(self):
        import ray
        return ray.get_runtime_context().get_node_id()

    def pid_(self):
        return os.getpid()

    def lock(self):
        import threading
        return threading.Lock()  # a result that cannot be pickled

    def pipe_end(self):
        import multiprocessing
        return multiprocessing.Pipe()[0]  # pickles as a bare fd number

    def bad_reduce(self):
        return _NoPickle()

    def echo(self, x):
        return x

    def lock_items(self):
        import threading
        yield 1
        yield threading.Lock()

    def graph(self, dtype_name=None, depth=0):
        import torch  # a result in an autograd graph, or of a dtype given by name
        if dtype_name is not None:  # (``depth`` lists deep)
            out = torch.ones(3).to(getattr(torch, dtype_name))
            for _ in range(depth):
                out = [out]
            return out
        return {"out": torch.ones(3, requires_grad=True) * 2}

    def graph_items(self):
        import torch
        yield torch.ones(1)
        yield [torch.ones(3, requires_grad=True) * 2]

    def storage_items(self, depth):
        import torch  # an untyped storage ``depth`` lists deep, after an item
        yield 1
        out = torch.zeros(2).untyped_storage()
        for _ in range(depth):
            out = [out]
        yield out

    def step(self, module):
        import torch
        with torch.no_grad():
            module.bias += 1.0  # a module argument's parameters: written in place
        return float(module.bias.sum())

    def fill(self, t, v):
        t.fill_(v)  # a torch tensor argument: written in place
        return float(t.sum())

    def dense(self, x):
        """A tensor argument, or a module's buffers, as dense lists."""
        import torch
        if isinstance(x, torch.nn.Module):
            return {name: b.to_dense().tolist() for name, b in x.named_buffers()}
        return x.to_dense().tolist()


@actor(max_concurrency=2)
class ThreadCanceller:
    """A sync method in a thread cancels the call it made to another actor."""

    def cancel_queued(self, counter):
        first = counter.slow_record(1, 0.5)
        second = counter.record(2)  # queued behind the first
        assert second.cancel()
        return first.result(timeout=10)


@actor
class Ticker:
    """Starts a background task on its event loop in __init__ (as servers do)."""

    def __init__(self):
        self.ticks = 0
        self.task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self):
        while True:
            self.ticks += 1
            await asyncio.sleep(0.01)

    def ticks_(self):
        return self.ticks


@actor
class SlotLog:
    """Logs when its calls and its streams' items start and end (streams and slots)."""

    def __init__(self):
        self.log = []
        self.active = self.peak = 0

    def _enter(self, what):
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.log.append(what + "-start")

    def _leave(self, what):
        self.active -= 1
        self.log.append(what + "-end")

    async def slow(self, t=0.5):
        self._enter("slow")
        await asyncio.sleep(t)
        self._leave("slow")

    def quick(self):
        self.log.append("quick")

    def blocking(self, t=0.5):
        self._enter("blocking")  # (with max_concurrency > 1, in a thread: the GIL
        time.sleep(t)            # makes these counts safe enough for a test)
        self._leave("blocking")

    async def items(self, n, t=0.3):
        for _ in range(n):
            self._enter("item")
            await asyncio.sleep(t)
            self._leave("item")
            yield 0

    def sync_items(self, n):
        for _ in range(n):
            self.log.append("sync-item")
            yield 0

    def slow_sync_items(self, n, t=0.5):
        try:
            for _ in range(n):
                self._enter("sync-step")
                time.sleep(t)
                self._leave("sync-step")
                yield 0
        finally:
            self.log.append("sync-closed")

    def take_log(self):
        out, self.log = self.log, []
        return out, self.peak


@actor(max_concurrency=4)
class SlowCloser:
    """A stream whose finally awaits: with max_concurrency > 1 a call runs beside it."""

    def __init__(self):
        self.closed = []

    async def count(self, n):
        try:
            for i in range(n):
                yield i
        finally:
            await asyncio.sleep(0.3)
            self.closed.append(n)

    def closed_(self):
        return list(self.closed)


@actor(max_restarts=2)
class SlowRestart:
    """Its restarts (each start after the first: the file at ``marker`` says so) take
    a second."""

    def __init__(self, marker):
        if os.path.exists(marker):
            time.sleep(1)
        else:
            open(marker, "w").close()

    def ping(self):
        return "pong"

    async def crash_soon(self):
        asyncio.get_running_loop().call_later(0.2, os._exit, 3)
        await asyncio.sleep(5)

    def slow(self, seconds):
        time.sleep(seconds)
        return 1
