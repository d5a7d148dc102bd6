"""What an encoder keeps of the message it makes: the blocks it leases, fds and waits.

Every way of encoding a message (``_serialization``'s picklers, ``_flat``'s flat
messages) records the same things in an ``Encoding``: the message's block table (the
shared blocks it leases to the receiver, each once), the fds that ride with it (an
arena's fd the first time its region crosses the connection), and what must be waited
for before it leaves (``before_send``). Nothing is committed until the connection's
ledger commits the encoding (``_ledger.Ledger.commit``), just before the frame is queued.
"""

from __future__ import annotations

from ._wire import MAX_FDS_PER_SEND, MAX_MESSAGE

__all__ = ["Encoding", "MessageTooBig", "SCALARS", "add_fd", "add_wait", "arena_fd", "check_size"]

# The builtin scalars, by exact type: what plain pickle does right (no subclass, no tuple).
SCALARS = frozenset({int, float, str, bytes, bool, type(None), complex})


class Encoding:
    """The blocks, fds and waits of one message being encoded for one connection."""

    def _start(self, conn) -> None:
        self.conn = conn
        self.fds: list[int] = []
        self.table: list[tuple] = []  # the blocks this message leases, in order
        self.index: dict[tuple, int] = {}  # block key -> its row in the table
        self.grants: list = []  # the Block of each row
        self.new_regions: list = []  # regions introduced on the connection by this message
        self.waits: dict = {}  # ``before_send``: fn -> the items it waits for
        self.inlined = 0  # bytes of small ordinary arrays pickled in band so far
        self.n_inlined = 0  # and how many (counted as copies once the message is made)
        self.counts: dict = {}  # ``count``: this message's traffic, for ``stats()``
        self.copies: dict | None = None  # a plug-in's copies made for this message, by
        # what was copied (``_torch``: a storage's address), so that it copies each once

    def before_send(self, fn, item) -> None:
        """Call ``fn(items)`` once, before the message leaves, with every ``item`` given
        for it (e.g. the GPUs whose queued work the receiver must see)."""
        add_wait(self.waits, fn, item)

    def count(self, key: str, n: int) -> None:
        """Add ``n`` to the ``stats()`` counter ``key`` once the message is made
        (``settle_counts``): a message that fails to encode counts nothing."""
        counts = self.counts
        counts[key] = counts.get(key, 0) + n

    def settle_counts(self, counters: dict) -> None:
        """Add what this message counted (``count``) to ``counters``: it is made. (A key
        that ``counters`` lacks, a plug-in's own, starts at 0.)"""
        for key, n in self.counts.items():
            counters[key] = counters.get(key, 0) + n

    def lease(self, view, kind: int, intro) -> int:
        """The row of ``view``'s block in this message's table, added (with its grant)
        the first time. ``kind`` says how the receiver opens the region (``_OPENERS``);
        ``intro(enc, region)`` gives what opens it, asked only when the region is new
        to this connection."""
        row = self.index.get(view.key)
        if row is not None:
            return row
        region = view.region
        what = None
        if region.key not in self.conn.sent_regions and region not in self.new_regions:
            self.new_regions.append(region)
            what = intro(self, region)
        row = self.index[view.key] = len(self.table)
        self.table.append((kind, region.key, region.size, what, view.offset, view.size))
        self.grants.append(view)
        return row


def arena_fd(enc: Encoding, arena) -> int:
    """How a host arena is introduced: its fd rides with the message (its index)."""
    return add_fd(enc, arena.fd)


def add_fd(enc: Encoding, fd: int) -> int:
    """``fd`` rides with the message: its index among the message's fds.

    Raises:
        MessageTooBig: the message would carry more fds than one ``sendmsg`` can (Linux
            takes 253: past that the send failed, and the connection with it).
    """
    if len(enc.fds) >= MAX_FDS_PER_SEND:
        raise MessageTooBig(
            f"the message brings more than {MAX_FDS_PER_SEND} shared-memory arenas new to "
            "the receiver, each with a file descriptor, and one message carries at most "
            f"{MAX_FDS_PER_SEND} (Linux's limit). Each array of 4 MiB or more has an arena "
            "of its own: send them in several calls (an arena sent once does not count "
            "again), or make them one array")
    enc.fds.append(fd)
    return len(enc.fds) - 1


def add_wait(waits: dict, fn, item) -> None:
    """Record that ``fn`` must be called with ``item`` among its items (fn -> set)."""
    items = waits.get(fn)
    if items is None:
        items = waits[fn] = set()
    items.add(item)


class MessageTooBig(ValueError):
    """A message over the frame limit (``MAX_MESSAGE``)."""


def check_size(n: int) -> None:
    """Refuse a message of ``n`` bytes over the frame limit, before anything is committed."""
    if n > MAX_MESSAGE:
        raise MessageTooBig(
            f"the message is {n / 2**30:.1f} GiB once pickled, over actorshm's 2 GiB frame "
            "limit; pass big data as numpy arrays, which travel in shared memory, not as "
            "bytes or lists")
