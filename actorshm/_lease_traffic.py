"""Lease traffic on a connection: releases, forward notices and retirements.

``LeaseTraffic`` is a part of ``_protocol.Connection`` (its base class), kept here so
that each module stays one idea: grants given back (batched, riding ahead of the next
frame or in a RELEASE frame of their own), notices that we passed a peer's block on
(``_leases.forwarded``), and retirements of regions. It uses the connection's ``ledger``,
``_releases``, ``_forwards``, ``_send`` and ``write_urgent``.
"""

from __future__ import annotations

import asyncio
import logging
import pickle

from . import _leases, _quarantine
from ._wire import HEADER, RELEASE, RETIRE

__all__ = ["LeaseTraffic"]

logger = logging.getLogger("actorshm")
_dumps = pickle.dumps


class LeaseTraffic:
    """Releases, forward notices and retirements: see the module's docstring."""

    def queue_release(self, key: tuple, n: int) -> None:
        """Give ``n`` grants of block ``key`` back to the peer (batched, sent soon)."""
        if self.closed or self._off_loop(self.queue_release, key, n):
            return
        self._releases[key] = self._releases.get(key, 0) + n
        if not self._release_scheduled:
            self._release_scheduled = True
            self.loop.call_soon(self._send_releases)

    def _off_loop(self, method, *args) -> bool:
        """Whether this runs off the connection's event loop, and so was handed to it.

        Releases are dispatched on one loop of the process (``_leases.set_release_hook``),
        while a runtime a thread opened on a loop of its own has connections there: those
        are that loop's alone (a write from here would interleave with its own, and a
        uvloop ``call_soon`` from another thread can stall it).
        """
        if asyncio._get_running_loop() is self.loop:
            return False
        try:
            self.loop.call_soon_threadsafe(method, *args)
        except RuntimeError:  # its loop has ended: so has the connection
            pass
        return True

    def _send_releases(self) -> None:
        self._release_scheduled = False
        if (self._releases or self._forwards) and not self.closed:
            self._send(0, 0, 0, b"", ())

    def send_owed(self) -> None:
        """Send pending releases and withdrawals now, as far as the socket takes them."""
        self._send_releases()
        self.flush_now()

    def send_forward(self, key: tuple, n: int):
        """Tell the peer we passed on (n=1), or got back (n=-1), a block it leased us.

        A notice that we passed a block on is written at once (even while this
        connection is corked, and ahead of frames held back by ``hold``). If the socket
        cannot take it yet, the queued notice is returned: the frame that passes the
        block on must wait for it (``hold``, ``after_item``), since should we die right
        after passing the block on, the peer must know it may still be in use downstream.
        """
        if self.closed:
            return None
        self._forwards[key] = self._forwards.get(key, 0) + n
        if n < 0:
            if not self._release_scheduled:
                self._release_scheduled = True
                self.loop.call_soon(self._send_releases)
            return None
        notice = _dumps(([], list(self._forwards.items())), 5)
        self._forwards.clear()
        return self.write_urgent(HEADER.pack(len(notice), RELEASE, 0, 0, 0) + notice)

    def send_retire(self, key: tuple) -> None:
        """Tell the peer we will send no more blocks of region ``key``."""
        if not self.closed and not self._off_loop(self.send_retire, key):
            payload = pickle.dumps(key, protocol=5)
            self._send(RETIRE, 0, 0, payload, ())


    def _apply_releases(self, payload) -> bool:
        """Leases the peer gave back, and its forward notices (``_leases.forwarded``)."""
        try:
            items = pickle.loads(payload)
            if type(items) is tuple:
                items, forwards = items
                self.ledger.apply(items, forwards)
            else:
                self.ledger.apply(items)
        except Exception as exc:
            self._protocol_error(f"bad release frame: {exc!r}")
            return False
        _leases.counters["releases_received"] += 1
        return True


    def _warn_kept(self, n: int) -> None:
        if self.host.closing:
            return  # everything stops: nobody is left to use them
        logger.warning(
            "actorshm: %s ended while processes it passed %d shared block(s) of this "
            "process's to may still use them; this process keeps those blocks (not "
            "recycled) %s. See docs/shared-memory.md.", self.label, n, _quarantine.until())
