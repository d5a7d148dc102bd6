"""Call control on a connection: cancels, streaming items and their credit, and calls
held until a result they take as an argument is in (``_results``).

``CallControl`` is a part of ``_protocol.Connection`` (its base class), kept here so that
each module stays one idea: it uses the connection's ``pending`` calls, ``streams``,
``held`` calls, ``ledger`` and ``_send``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from . import _results
from . import _serialization as ser
from ._culprit import at as culprit_at
from ._errors import REPLY_PICKLING_FAILURES, ProtocolError
from ._remote_errors import UNPICKLING_ERRORS
from ._wire import CANCEL, CREDIT, ITEM, LEN

__all__ = ["CallControl"]

_RLEN = LEN


class CallControl:
    """Cancels, stream items and credit, held calls: see the module's docstring."""

    def _hold(self, entry: tuple, waits_for: asyncio.Future) -> None:
        """Hold ``entry``'s call, and the calls after it, until ``waits_for`` is done,
        or until that call is cancelled (the calls after it need not wait then)."""
        if not self.held:
            self.held.append(entry)
        waits_for.add_done_callback(self._send_held)
        entry[0].add_done_callback(self._head_done)

    def _head_done(self, fut: asyncio.Future) -> None:
        if self.held and self.held[0][0] is fut:  # cancelled while it waited
            self._send_held()

    def _send_held(self, _fut=None) -> None:
        while self.held and not self.closed:
            entry = self.held[0]
            if not entry[0].done():  # (a held call cancelled meanwhile is dropped)
                try:
                    self._send_call(*entry)
                except _results.Unfinished as u:
                    u.fut.add_done_callback(self._send_held)
                    entry[0].add_done_callback(self._head_done)
                    return
                except Exception as exc:
                    entry[0].set_exception(exc)
            if self.held and self.held[0] is entry:  # (a send that broke the connection
                self.held.popleft()  # closed it: its held calls failed, the queue is new)

    _cancels_corked = False

    def cancel(self, cid: int) -> None:
        """Forget call ``cid`` (its reply, if any, is dropped) and tell the peer.

        The cancels made in one turn of the event loop go out in one write, after it:
        cancelling a running call and the call queued behind it, the peer reads both
        before the first has stopped, so the queued one never starts. A call made
        between them in that turn goes at once (calls are sent when made), taking the
        cancels made before it along: then the later cancel may reach the queued call
        only once it started.
        """
        self.streams.pop(cid, None)
        if self.pending.pop(cid, None) is None:
            return
        self.pending_meta.pop(cid, None)
        if not self.closed:
            if not self._cancels_corked:
                self._cancels_corked = True
                self.cork()
                self.loop.call_soon(self._uncork_cancels)
            self._send(CANCEL, 0, cid, b"", ())

    def _uncork_cancels(self) -> None:
        self._cancels_corked = False
        self.uncork()

    def send_credit(self, cid: int, n: int) -> None:
        """Let the peer send ``n`` more items of streaming call ``cid``."""
        if not self.closed and cid in self.pending:
            self._send(CREDIT, 0, cid, _RLEN.pack(n), ())

    def send_item(self, cid: int, value: Any, what: str = "") -> None:
        """Send one item of streaming call ``cid`` (as a result is sent).

        Raises:
            TypeError: the item cannot be serialized.
        """
        if self.closed:
            return
        try:
            payload, fds, enc, flags = ser.encode(value, self)
        except MemoryError:  # out of shared memory: as it is
            raise
        except REPLY_PICKLING_FAILURES as exc:
            where = culprit_at([("item", value)], exc, lambda part: ser.encode_part(part, self),
                               REPLY_PICKLING_FAILURES)
            raise TypeError(f"an item of {what or 'the stream'} cannot be sent: {where}{exc}") \
                from exc
        self.ledger.commit(enc, self)
        self._send(ITEM, flags, cid, payload, fds)

    def _control_frame(self, kind: int, flags: int, cid: int, payload, fds) -> None:
        """Receive a ``ITEM``, ``CANCEL`` or ``CREDIT`` frame."""
        if kind == ITEM:
            st = self.streams.get(cid)
            try:
                value = ser.decode(payload, fds, self, flags)  # (decoded even if dropped:
            except ProtocolError as exc:  # leases come back)
                self._protocol_error(str(exc))
                return
            except UNPICKLING_ERRORS as exc:
                if st is not None:
                    st.fail(TypeError(f"an item of {st.what} could not be deserialized "
                                      f"here: {type(exc).__name__}: {exc}"))
                return
            if st is not None:
                st.push(value)
        elif kind == CANCEL:
            cancel = getattr(self.host, "cancel_call", None)
            if cancel is not None:
                cancel(self, cid)
        elif kind == CREDIT:
            credit = getattr(self.host, "stream_credit", None)
            if credit is not None and len(payload) == 4:
                credit(self, cid, _RLEN.unpack_from(payload)[0])
