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
