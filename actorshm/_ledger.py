"""One connection's lease ledger: the blocks we leased to the peer, and the regions known.

Sending a message that carries blocks grants the peer a lease on each (``commit``); the
ledger keeps each such block alive (a ``Grant``) until the peer gives every grant back
(``apply``: RELEASE frames, or releases riding ahead of a frame). A peer that passes one
of our blocks on tells us (a forward notice, counted in ``Grant.forwarded``), so that if
it dies, we keep that block from going home while processes downstream may still use it
(``settle``). The ledger also remembers which regions each side introduced, so that a
region's fd or IPC handle crosses each connection once.
"""

from __future__ import annotations

from typing import Any, Callable

from . import _leases

__all__ = ["Grant", "Ledger"]


class Grant:
    """What the peer holds of one of the blocks we leased it.

    Attributes:
        block: our ``Block`` (kept alive by this record).
        count: grants the peer holds (one per message that carried the block).
        told: the upstream channels we told that we passed the block on (a peer's block
            we relay), or None.
        forwarded: how many holders the peer passed the block on to (its notices).
    """

    __slots__ = ("block", "count", "told", "forwarded")

    def __init__(self, block, told) -> None:
        self.block = block
        self.count = 1
        self.told = told
        self.forwarded = 0


class Ledger:
    """The lease records of one connection (``Connection.ledger``).

    Attributes:
        grants: block key -> ``Grant``, for every block the peer holds of ours.
        sent_regions: keys of the regions we introduced to the peer.
        received_regions: keys of the regions the peer introduced to us.
    """

    __slots__ = ("grants", "sent_regions", "received_regions")

    def __init__(self) -> None:
        self.grants: dict[tuple, Grant] = {}
        self.sent_regions: set[tuple] = set()
        self.received_regions: set[tuple] = set()

    def commit(self, enc, channel: _leases.Channel) -> None:
        """Record the grants and introduced regions of a message about to be sent.

        Args:
            enc: the message's encoder (``_serialization.encode``), or None (no blocks).
            channel: the connection it is sent on (told to upstreams we relay for).
        """
        if enc is None:
            return
        grants = self.grants
        for block in enc.grants:
            g = grants.get(block.key)
            if g is None:
                grants[block.key] = Grant(block, _leases.forwarded(block, channel))
            else:
                g.count += 1
        for region in enc.new_regions:
            self.sent_regions.add(region.key)
            region.sent_to.add(channel)

    def apply(self, releases, forwards=()) -> None:
        """The peer gave grants back, and told us of blocks it passed on.

        Args:
            releases: ``(block key, n)`` pairs: n grants back.
            forwards: ``(block key, n)`` pairs: passed on to n more (n < 0: fewer).

        Raises:
            TypeError, ValueError: a malformed item (a protocol error).
        """
        grants = self.grants
        for key, n in forwards:
            g = grants.get(key)
            if g is not None:
                g.forwarded += n
        for key, n in releases:
            g = grants.get(key)
            if g is not None:
                g.count -= n
                if g.count <= 0:
                    del grants[key]
                    if g.told:
                        _leases.unforwarded(key, g.told)

    def settle(self, peer_gone: bool) -> int:
        """The connection closed: its leases come back, except for blocks that may still
        be in use. Those that the peer passed on (processes downstream of it may hold
        them), and, when it may live on, a peer's blocks we relayed to it, are kept
        (``_leases.quarantine``), and the forward notices we sent for them stand.

        Args:
            peer_gone: the peer exited or closed its end (it holds nothing any more).

        Returns:
            How many blocks the peer passed on (kept for as long as this process runs).
        """
        kept, ours = [], []
        for g in self.grants.values():
            if g.forwarded > 0:
                kept.append(g.block)
            elif g.told:
                if peer_gone:
                    _leases.unforwarded(g.block.key, g.told)
                else:
                    ours.append(g.block)
        self.grants.clear()
        if kept or ours:
            _leases.quarantine(kept + ours)
        return len(kept)

    def count(self, which: Callable[[Grant], Any]) -> int:
        """How many of the peer's grants ``which(grant)`` is true for."""
        return sum(1 for g in self.grants.values() if which(g))
