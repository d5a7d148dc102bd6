"""The driver's own cost of sending a group call, per member, with no process to wake.

A group call's time on a small machine is mostly wake-ups (the kernel switching to each
member's process and back). To see the driver's own work, this sends the same call
over ``n`` socket-pair connections whose far ends nobody waits on (they are read and
dropped between rounds): once encoded for all (``_multicast.call_many``, what
``ActorGroup`` calls do) and once per connection (``Connection.call``, what single calls
do), interleaved round by round.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time

import numpy as np

import actorshm
from actorshm import _multicast, _protocol


class _Sink:
    """A connection host that is never asked anything."""

    closing = False

    def handle_call(self, conn, cid, call) -> None:
        pass

    def connection_eof(self, conn) -> None:
        pass

    def connection_closed(self, conn) -> None:
        pass


def _drain(socks, conns) -> None:
    buf = bytearray(1 << 16)
    for s in socks:
        try:
            while s.recv_into(buf):
                pass
        except BlockingIOError:
            pass
    for c in conns:  # the calls will never be answered: forget them
        c.pending.clear()
        c.pending_meta.clear()
        c.ledger.grants.clear()


async def send_cost(n: int = 8, rounds: int = 200) -> dict[str, float]:
    """Median µs per member to send ``touch(a)`` (``a``: a shared 512 MiB array) to ``n``
    connections: ``{"encoded once": µs, "encoded per member": µs}``."""
    loop = asyncio.get_running_loop()
    pairs = [socket.socketpair() for _ in range(n)]
    for _, far in pairs:
        far.setblocking(False)
    conns = [_protocol.Connection(loop, _Sink(), near, f"peer {i}")
             for i, (near, _) in enumerate(pairs)]
    a = actorshm.empty(512 << 20, np.uint8)
    whats = ["Sink.touch"] * n
    kinds = {"encoded once": lambda: _multicast.call_many(conns, "touch", (a,), {}, whats),
             "encoded per member": lambda: [c.call("touch", (a,), {}, "Sink.touch")
                                            for c in conns]}
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for _ in range(rounds):
            for k, send in kinds.items():
                t = time.perf_counter()
                send()
                samples[k].append((time.perf_counter() - t) / n * 1e6)
                _drain([far for _, far in pairs], conns)
                await asyncio.sleep(0)
    finally:
        for c in conns:
            c.close(peer_gone=True)
        for _, far in pairs:
            far.close()
    return {k: statistics.median(v) for k, v in samples.items()}
