"""Actor classes the benchmarks spawn (importable by the actor processes)."""

import actorshm
from actorshm import actor


@actor
class Sink:
    def noop(self, x=None):
        return None

    def touch(self, a):
        a[0] = 1  # touch, never sum: the cost measured is the transport's
        return None

    def stats(self):
        return actorshm.stats()


@actor
class Producer:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def batch(self, value):
        b = actorshm.empty(self.nbytes, "u1")
        b[::4096] = value  # one write per page: a refill that touches every page
        return b

    def stats(self):
        return actorshm.stats()


@actor
class PipeProducer:
    """Feeds a consumer actor directly, no driver in between: fills a fresh batch,
    calls ``consumer.touch`` with it, keeps ``in_flight`` calls going (two buffers, as
    PyTorch's buffer-return pattern), and lets each batch go home to be reused."""

    def __init__(self, nbytes):
        self.nbytes = nbytes

    async def run(self, consumer, n, in_flight=2, warm=5):
        """(seconds per batch after ``warm`` batches, pool allocations meanwhile)."""
        import collections
        import time
        pending = collections.deque()
        t0 = allocs = None
        for i in range(warm + n):
            if i == warm:
                t0 = time.perf_counter()
                allocs = actorshm.stats()["pool_allocs"]
            b = actorshm.empty(self.nbytes, "u1")
            b[::4096] = i % 255  # one write per page, as the other producers
            pending.append(consumer.touch(b))
            del b  # the consumer's lease brings it home
            if len(pending) >= in_flight:
                await pending.popleft()
        while pending:
            await pending.popleft()
        return (time.perf_counter() - t0) / n, actorshm.stats()["pool_allocs"] - allocs


@actor
class SoakWorker:
    """The soak's actor (``benchmarks.soak``): adds one, or relays through a peer."""

    def ping(self):
        return True

    def add_one(self, a):
        a += 1
        return a

    async def relay(self, peer, a):
        return await peer.add_one(a)


@actor
class Streamer:
    """Items by stream and by individual calls, for the streaming benchmark."""

    def item(self, i):
        return i

    def items(self, n):
        yield from range(n)

    def array(self, nbytes):
        a = actorshm.empty(nbytes, "u1")
        a[0] = 1
        return a

    def arrays(self, n, nbytes):
        for _ in range(n):
            a = actorshm.empty(nbytes, "u1")
            a[0] = 1
            yield a


@actor
class ReadSink:
    """For the Ray backend, where arguments arrive read-only: reads one element."""

    def noop(self, x=None):
        return None

    def touch(self, a):
        return int(a[0])
