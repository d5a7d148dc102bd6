"""One call sent over several connections, encoded once: what a group call does.

A group call (``ActorGroup``) sends the same method and arguments to every member. Its
pickle is the same for all of them: the user's objects, and the block table's rows (a
shared array is one block, in the same row for every member). What differs per
connection is only which regions it has not seen yet (their fds or handles ride along
the first time), its call id, and its ledger's grants. So ``call_many`` encodes the call
once, then per connection builds (or reuses) the block table and fds for the regions
new to it, commits the grants in its ledger and queues the frame
(``Connection.send_encoded``). Each member still holds one lease on each block, and
gives it back on its own.

A call that cannot be encoded once for all (an argument that is a call's unfinished
result, an fd passed with ``PassFd``, an encoding error) is left to the caller, who
makes one call per connection as for single calls: ``call_many`` returns None.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

from . import _leases
from . import _serialization as ser
from ._errors import PICKLING_FAILURES
from ._wire import ARENA, HAS_BLOCKS, LEN

__all__ = ["call_many"]


class _NoPeer:
    """Encodes as for a connection that has seen no region: every region gets its
    introduction, which each real connection then keeps or drops."""

    sent_regions: frozenset = frozenset()


_NO_PEER = _NoPeer()


class Lease:
    """What ``Ledger.commit`` takes of a message: the blocks it leases and the regions
    it introduces on one connection."""

    __slots__ = ("grants", "new_regions")

    def __init__(self, grants: list, new_regions: list) -> None:
        self.grants = grants
        self.new_regions = new_regions


# The counters an encoding moves (arrays copied into shared memory or sent by reference).
_COUNTED = [k for k in _leases.counters if k.endswith(("_copied", "_zero_copy"))]
# (and a spill's, ``_serialization.spill``: one per group call, whatever is sent)
_ROLLBACK = _COUNTED + ["messages_spilled", "bytes_spilled"]
_ZERO_COPY = [(k, k.replace("_zero_copy", "_copied")) for k in _COUNTED
              if k.endswith("_zero_copy") and k.replace("_zero_copy", "_copied") in _COUNTED]


def call_many(conns: list, method: str, args: tuple, kwargs: dict, what: list,
              meta: dict | None = None) -> list[asyncio.Future] | None:
    """Send ``method(*args, **kwargs)`` over every connection of ``conns``, encoded once.

    Args:
        conns: the connections (one per actor; distinct).
        method: the method's name.
        args: its positional arguments, the same for all.
        kwargs: its keyword arguments, the same for all.
        what: how errors name each call (``"Cls.method"``), one per connection.
        meta: what rides with every call (the chain of calls it is made in), or None.

    Returns:
        One future per connection, in order (a connection that cannot take a call now,
        closed or holding calls back, gets its call through ``Connection.call``, which
        fails it or holds it as for any call); or None, with nothing sent and no counter
        moved, when the call cannot be encoded once for all: then make one call per
        connection.
    """
    call = (method, args, kwargs) if meta is None else (method, args, kwargs, meta)
    counters = _leases.counters
    before = [counters[k] for k in _ROLLBACK]
    try:
        payload, fds, enc, flags = ser.encode(call, _NO_PEER)
        frames = _Frames(payload, fds, enc, flags)
    except PICKLING_FAILURES:  # the per-connection path raises it, or holds the call
        frames = None
    # What the one encoding counted (arrays copied, sent by reference), for one member.
    moved = {k: counters[k] - b for k, b in zip(_ROLLBACK, before)}
    if frames is None:
        _count(moved, -1)
        return None
    futs: list[asyncio.Future] = []
    sent = 0
    for i, conn in enumerate(conns):
        parts, cfds, lease = frames.for_conn(conn)
        try:
            fut = conn.send_encoded(parts, cfds, lease, flags, what[i])
            if fut is None:
                fut = conn.call(method, args, kwargs, what[i], meta)
            else:
                sent += 1
        except Exception as exc:  # as a later member's failure in a group call
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
        futs.append(fut)
    if sent == 0:  # (each connection encoded its own call, and counted it)
        _count(moved, -1)
    elif sent > 1:  # the other members got the arrays by reference (those copied too)
        # ... except small arrays pickled in band: every member's frame holds a copy.
        inlined = (enc.inlined, enc.n_inlined) if enc is not None else (0, 0)
        moved["bytes_copied"] -= inlined[0]
        moved["arrays_copied"] -= inlined[1]
        for k, copied in _ZERO_COPY:
            counters[k] += (moved[k] + moved[copied]) * (sent - 1)
        counters["bytes_copied"] += inlined[0] * (sent - 1)
        counters["arrays_copied"] += inlined[1] * (sent - 1)
    return futs


def _count(moved: dict, sign: int) -> None:
    counters = _leases.counters
    for k, n in moved.items():
        counters[k] += sign * n


class _Frames:
    """A call encoded once; ``for_conn`` gives one connection's frame parts."""

    __slots__ = ("payload", "fds", "enc", "flags", "body", "rows", "cache")

    def __init__(self, payload, fds, enc, flags: int) -> None:
        self.payload, self.fds, self.enc, self.flags = payload, fds, enc, flags
        self.cache: dict[tuple, tuple] = {}
        if not flags & HAS_BLOCKS:
            if fds:  # fds passed with ``PassFd``: only a per-connection encoding knows
                raise ValueError("fds ride along")
            self.body = None
            return
        if type(payload) is not list or len(payload) != 3:
            raise ValueError("not a block table, then the pickle")
        table = enc.table
        # Every region is introduced once (its first row); only arenas' introductions
        # are fds (other kinds, e.g. GPU slabs, are the same bytes for every peer).
        if sum(1 for row in table if row[0] == ARENA and row[3] is not None) != len(fds):
            raise ValueError("fds ride along that are not arenas'")
        self.rows = table
        self.body = payload[2]

    def for_conn(self, conn) -> tuple[Any, list, Any]:
        """(payload parts, fds, the ``Lease`` for ``Ledger.commit``) for ``conn``."""
        if self.body is None:
            return self.payload, self.fds, None
        sent = conn.sent_regions
        new = tuple(r.key for r in self.enc.new_regions if r.key not in sent)
        out = self.cache.get(new)
        if out is None:
            out = self.cache[new] = self._build(new)
        return out

    def _build(self, new: tuple) -> tuple:
        fds = self.fds
        rows, cfds = [], []
        for kind, rkey, rsize, intro, boff, bsize in self.rows:
            if intro is not None:
                if rkey not in new:
                    intro = None  # the peer has it already
                elif kind == ARENA:
                    cfds.append(fds[intro])
                    intro = len(cfds) - 1
            rows.append((kind, rkey, rsize, intro, boff, bsize))
        table = pickle.dumps(rows, 5)
        regions = [r for r in self.enc.new_regions if r.key in new]
        return ([LEN.pack(len(table)), table, self.body], cfds,
                Lease(self.enc.grants, regions))
