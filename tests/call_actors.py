"""Actor classes for the tests of calls users control (cancellation, streams, chains).

Kept free of pytest so actor processes import it fast.
"""

import asyncio
import os
import time

import actorshm
from actorshm import actor


@actor
class Worker:
    def __init__(self):
        self.log = []

    def work(self, t):
        time.sleep(t)
        self.log.append(("work", t))
        return t

    def spin(self, t):
        """Keep the CPU busy for ``t`` seconds (a short call that holds the loop)."""
        end = time.perf_counter() + t
        while time.perf_counter() < end:
            pass
        self.log.append(("spin", t))

    def block_loop_later(self, delay, t):
        """Hold the event loop for ``t`` seconds, ``delay`` seconds from now, with no call
        running: what arrives meanwhile is read at once when it ends."""
        asyncio.get_running_loop().call_later(delay, time.sleep, t)

    async def awork(self, t):
        try:
            await asyncio.sleep(t)
        except asyncio.CancelledError:
            self.log.append("cancelled")
            raise
        self.log.append(("awork", t))
        return t

    def record(self, x):
        self.log.append(x)
        return x

    def get_log(self):
        return list(self.log)

    def clear_log(self):
        self.log.clear()

    def count(self, n):
        try:
            for i in range(n):
                self.log.append(("made", i))
                yield i
        finally:
            self.log.append("count-finally")

    def forgot_await(self):
        return asyncio.sleep(0, "never awaited")

    async def acount(self, n, delay=0.0):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                self.log.append(("made", i))
                yield i
        finally:
            self.log.append("acount-finally")

    def fails_after(self, n):
        yield from range(n)
        raise ValueError(f"failed after {n}")

    def dies_after(self, n):
        yield from range(n)
        time.sleep(0.05)
        os._exit(3)

    def arrays_then_die(self, n, nbytes):
        for i in range(n):
            a = actorshm.empty(nbytes, "uint8")
            a[0] = i
            yield a
        time.sleep(0.05)
        os._exit(3)

    def arrays(self, n, nbytes):
        for i in range(n):
            a = actorshm.empty(nbytes, "uint8")
            a[0] = i % 256
            yield a

    def fails_nonstream(self):
        raise ValueError("no")

    def stats(self):
        return actorshm.stats()

    def made(self):
        return sum(1 for e in self.log if isinstance(e, tuple) and e[0] == "made")


@actor
class Relay:
    """Calls other actors from inside an actor."""

    async def timeout_on(self, target, t, limit):
        try:
            await asyncio.wait_for(target.awork(t), limit)
        except asyncio.TimeoutError:
            return "timed out"
        return "finished"

    async def forward(self, target, t):
        return await target.awork(t)

    async def total(self, target, n):
        return sum([x async for x in target.acount(n)])

    async def first(self, target, n):
        async for x in target.count(n):
            return x

    async def call_back(self, other):
        return await other.ping()

    async def ping_via(self, other, delay=0.0):
        await asyncio.sleep(delay)  # (two calls started together both hold a slot)
        return await other.call_back(self_handle[0])

    async def pings_back(self, other, n):  # a stream whose items are calls to `other`
        for _ in range(n):
            yield await other.ping()

    async def ping_via_stream(self, other):
        return [x async for x in other.pings_back(self_handle[0], 2)]

    async def until_death(self, source, n):
        """Take ``source``'s arrays until it dies: how many came."""
        k = 0
        try:
            async for a in source.arrays_then_die(n, 1 << 20):
                k += 1
        except actorshm.ActorDiedError:
            return k
        return k

    async def hold_stream(self, target, n):
        async for _ in target.acount(n):
            await asyncio.sleep(3600)  # takes one item and waits

    async def kill_then_call(self, target, delay):
        """Kill ``target``, then call it ``delay`` s later: what that call gave."""
        await target.record("linked")  # (the call goes over a link already made)
        kill = target.kill()
        await asyncio.sleep(delay)
        try:
            out = await asyncio.wait_for(target.record("after"), 10)
        except actorshm.ActorDiedError as exc:
            out = str(exc)
        await kill
        return out

    async def pass_along(self, source, sink):
        return await sink.record(source.work(0.2))

    async def fire_and_return(self, other):
        self.bg = asyncio.ensure_future(other.call_back_later(self_handle[0], 0.1))
        return "sent"

    async def call_back_later(self, other, delay):
        await asyncio.sleep(delay)
        self.result = await other.ping()

    def last(self):
        return getattr(self, "result", None)

    async def hold(self, t):
        await asyncio.sleep(t)
        return "held"

    def set_self(self, h):
        self_handle[0] = h

    def ping(self):
        return "pong"


self_handle = [None]
