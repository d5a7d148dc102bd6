"""Connections: calls, replies, and the lease traffic that rides with them.

``Connection`` speaks actorshm frames (``_wire``) over one end of a socket pair, moved
by ``_framing.FramedSocket``. It is symmetric: either side can make calls and answer
them. The host object (the driver's runtime or an actor process's worker, see ``Host``)
answers calls and is told when a connection breaks and when it closes.

Besides calls, results and errors, three kinds of lease traffic cross it: releases
(grants given back, batched, one-way; also riding ahead of any frame, flag
``HAS_RELEASES``), forward notices (we passed a peer's block on, see
``_leases.forwarded``), and retirements (we will send no more of a region). What the
peer holds of ours is in ``Connection.ledger`` (``_ledger``).

Sockets are pairs made by the driver and inherited or passed over existing pairs: there
is no listening socket and no path in the filesystem, so no other process can connect
or inject frames. A malformed or truncated frame closes that one connection with a
logged error.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import pickle
import socket
import traceback
from typing import Any, Protocol

from . import _leases, _results
from . import _remote_errors as remote_errors
from ._remote_errors import UNPICKLING_ERRORS, copy_exc, result_undecodable
from . import _serialization as ser
from ._errors import (PICKLING_FAILURES, REPLY_PICKLING_FAILURES, ActorDiedError,
                      ProtocolError, undeserializable_arguments)
from ._control import CallControl
from ._culprit import TOO_DEEP, arguments_error, too_deep
from ._culprit import at as culprit_at
from ._framing import SMALL_FRAME, FramedSocket, close_fd, run_callbacks
from ._lease_traffic import LeaseTraffic
from ._ledger import Ledger
from ._wire import (CALL, CANCEL, CREDIT, ERROR, HAS_BLOCKS, HAS_RELEASES,  # noqa: F401
                    HEADER, HSIZE, ITEM, LEAVING, LEAVING_PAYLOAD, LEN, PLAIN, RELEASE,
                    RESULT, RETIRE)

__all__ = ["Connection", "Host"]

logger = logging.getLogger("actorshm")
_dumps = pickle.dumps
_loads = pickle.loads
_plain_call = ser.encode_plain_call
_counters = _leases.counters
_RLEN = LEN
_CallFuture = _results.CallFuture


class Host(Protocol):
    """What a connection needs of the object that owns it (a runtime or a worker)."""

    closing: bool  # it is stopping everything: nobody is left to use kept blocks
    read_at: float  # when a connection last read (``perf_counter``), set by the reader

    def handle_call(self, conn: "Connection", cid: int, call: list) -> None:
        """Answer call ``cid`` (``[method, args, kwargs]``) with ``conn.reply``."""

    def connection_eof(self, conn: "Connection") -> None:
        """The peer closed its end or the socket broke: decide when to close."""

    def connection_closed(self, conn: "Connection") -> None:
        """``conn`` closed (its calls have failed)."""

    # Optional: ``cancel_call(conn, cid)``, the caller cancelled call ``cid``;
    # ``stream_credit(conn, cid, n)``, the caller of streaming call ``cid`` took n items;
    # ``connection_leaving(conn)``, the peer (an actor) began to stop (``LEAVING``); and
    # ``read_ended()``, every frame of a read (and of the reads that follow one that
    # carried fds) was handled after ``handle_call`` set ``conn.deferred`` (it queued a
    # call until then, ``conn.cancel_behind()`` being true); ``read_cut_short()``, the
    # reads that follow one with fds stopped at their cap, frames maybe left unread.


class Connection(CallControl, LeaseTraffic, FramedSocket):
    """One end of a socket pair, speaking actorshm frames, driven by the event loop.

    Args:
        loop: the event loop that runs it.
        host: answers its calls and hears when it closes (``Host``).
        sock: its socket, or None to queue frames until ``attach``.
        label: how errors name the peer (``"actor Foo (pid 12)"``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, host: Host,
                 sock: socket.socket | None = None, label: str = "peer") -> None:
        super().__init__(loop, label)
        self.host = host
        self.pending: dict[int, asyncio.Future] = {}
        self.pending_meta: dict[int, str] = {}
        self.held: collections.deque = collections.deque()  # calls held (``_hold``)
        self.failed_types: set[type] = set()  # error types calls on it have failed with
        self.streams: dict[int, Any] = {}  # streaming calls we made: cid -> its receiver
        # calls we run whose arguments' work must be waited for before the reply leaves
        # (a GPU argument the actor may have written to): cid -> {fn: items}
        self.reply_waits: dict[int, dict] = {}
        self.ledger = Ledger()
        # (The lease engine's view of the ledger: see ``_leases.Channel``.)
        self.sent_regions = self.ledger.sent_regions
        self.received_regions = self.ledger.received_regions
        self.close_exc: BaseException | None = None
        self._next_id = 1
        self._releases: dict[tuple, int] = {}
        self._forwards: dict[tuple, int] = {}  # forward notices to send: key -> +n / -n
        self._release_scheduled = False
        self.peer_id: int | None = None
        self.peer_pid: int | None = None  # an actor's link to another actor: its pid
        # (such a link) the driver linked it to a process that is stopping and that no
        # restart follows: its LEAVING is no reason for a new link (``_worker``)
        self.last_process = False
        # The peer (an actor) is stopping, its clean-up taking at most this many seconds
        # (``LEAVING``, ``say_leaving``): the driver waits for its exit that long, and
        # a little more, once the connection has ended (``_supervise``).
        self.leaving: float | None = None
        if sock is not None:
            self.attach(sock)

    def __repr__(self) -> str:
        return f"<Connection {self.label}{' closed' if self.closed else ''}>"

    def close(self, exc: BaseException | None = None, *, peer_gone: bool = True) -> None:
        """Close the connection and fail every call waiting on it with ``exc``.

        Args:
            exc: what waiting calls fail with (default: ``ActorDiedError``).
            peer_gone: the peer has exited or closed its end, so it holds none of the
                blocks we leased it any more. False when we close while it may live on
                (we stop, or it broke the protocol).
        """
        if self.closed:
            return
        self.closed = True
        self.close_exc = exc if exc is not None else ActorDiedError(
            f"the connection to {self.label} is closed")
        waiting = self._close_socket()
        self.fail_pending(self.close_exc)  # (the held calls too)
        self.reply_waits.clear()
        self.held = collections.deque()  # (a new one: see ``_send_held``)
        streams, self.streams = self.streams, {}
        for st in streams.values():
            st.wake()
        kept = self.ledger.settle(peer_gone)
        if kept:
            self.loop.call_later(0.5, self._warn_kept, kept)
        self._releases.clear()
        self._forwards.clear()
        _leases.connection_closed(self)  # and the memory it brought in is let go
        try:
            self.host.connection_closed(self)
        except Exception:  # pragma: no cover
            logger.exception("actorshm: error while closing %s", self.label)
        # Whoever waited for frames that will never be written now (last: a callback may
        # close other connections): ``peer_gone`` tells whether that still matters.
        run_callbacks(waiting, peer_gone)

    # -- sending ---------------------------------------------------------------
    def call(self, method: str, args: tuple, kwargs: dict, what: str = "",
             meta: dict | None = None, stream: Any = None) -> asyncio.Future:
        """Send a call now and return a future for its reply.

        Cancelling the future cancels the call: its entry goes at once and the peer is
        told (``CANCEL``), so a queued call never runs and a running one is cancelled.

        Args:
            meta: what rides with the call besides its arguments (the chain of actors
                it was made from, a stream's run-ahead), or None.
            stream: the receiver of a streaming call's items (``_streams.Inbox``).

        Raises (before anything is sent): ``TypeError`` when an argument cannot be
        serialized (an open file, an object over the frame limit, an unpicklable one);
        ``SharedMemoryError`` (a ``MemoryError``) when copying an array into shared
        memory runs out of budget.
        """
        fut = _CallFuture(loop=self.loop)
        if self.closed:
            fut.set_exception(copy_exc(self.close_exc))
            return fut
        if meta is None and stream is None and not self.held:
            # The common call, builtin scalars only: one short path to the socket.
            data = _plain_call(method, args, kwargs)
            if data is not None:
                if len(data) > ser.SPILL_MIN:  # (through shared memory: ``ser.spill``)
                    self._send_call(fut, method, args, kwargs, what, None, None, data)
                    return fut
                cid = self._next_id
                self._next_id = cid + 1
                self.pending[cid] = fut
                if what:
                    self.pending_meta[cid] = what
                _counters["calls_sent"] += 1
                if _leases.pending_releases or self._releases or self._forwards or \
                        not self.write_small(CALL, PLAIN, cid, data):
                    self._send(CALL, PLAIN, cid, data, ())
                fut.conn, fut.cid = self, cid
                return fut
        entry = (fut, method, args, kwargs, what, meta, stream)
        if self.held:  # behind a call waiting for a result it takes (``_results``)
            self.held.append(entry)
        else:
            try:
                self._send_call(*entry)
            except _results.Unfinished as u:
                self._hold(entry, u.fut)
        return fut

    def call_ahead(self, method: str, args: tuple, kwargs: dict) -> asyncio.Future:
        """Send a call now, ahead of calls held behind an unfinished result (``_hold``):
        a service call whose arguments hold no call's result, and whose answer must not
        wait for one (``Worker._connect``)."""
        fut = _CallFuture(loop=self.loop)
        if self.closed:
            fut.set_exception(copy_exc(self.close_exc))
            return fut
        self._send_call(fut, method, args, kwargs, "", None, None)
        return fut

    def _send_call(self, fut, method, args, kwargs, what, meta, stream,
                   plain: bytes | None = None) -> None:
        """Send a call (``plain``: its payload, pickled already by the plain path)."""
        call = (method, args, kwargs) if meta is None else (method, args, kwargs, meta)
        try:
            if plain is None:
                payload, fds, enc, flags = ser.encode(call, self)
            else:
                payload, fds, enc, flags = ser.spill(plain, (), None, PLAIN, self)
        except _results.Unfinished:
            raise
        except _results.DependencyFailed as dep:
            _results.fail_not_made(fut, copy_exc(dep.exc))
            return
        except MemoryError:  # out of shared memory while copying an array: as it is
            raise
        except ser.MessageTooBig as exc:  # says what to do already
            raise TypeError(f"cannot send the arguments of {what or method}(): {exc}") \
                from exc
        except PICKLING_FAILURES as exc:
            # The failed encode's frames (in ``exc``'s traceback) hold its encoder, and
            # with it the shared copies made of ordinary arrays so far: let them go now,
            # keeping the traceback's lines. (An error kept in a cycle, as a pool's
            # future that holds it, kept them until the garbage collector ran.)
            traceback.clear_frames(exc.__traceback__)
            if method == "__init_actor__":  # (class, args, kwargs, config): the user's
                args, kwargs = args[1], args[2]  # are the spawn's arguments
            raise arguments_error(what or method, exc, args, kwargs,
                                  lambda part: ser.encode_part(part, self)) from exc
        cid = self._next_id
        self._next_id = cid + 1
        self.ledger.commit(enc, self)
        self.pending[cid] = fut
        if what:
            self.pending_meta[cid] = what
        if stream is not None:
            self.streams[cid] = stream
            stream.conn, stream.cid = self, cid
            # Its reply ends it (no item comes after): the connection forgets it then,
            # or it would keep the receiver, and the items it still buffers (their
            # blocks leased from the actor), for as long as the connection lives.
            fut.add_done_callback(lambda _f: self.streams.pop(cid, None))
        _leases.counters["calls_sent"] += 1
        self._send(CALL, flags, cid, payload, fds)
        fut.conn, fut.cid = self, cid  # (cancelling it now cancels the call: ``cancel``)

    def send_encoded(self, parts, fds, lease, flags: int, what: str = ""):
        """Send a call encoded for several connections at once (``_multicast``).

        Args:
            parts: its frame's payload for this connection (buffers, back to back).
            fds: the fds that go with it.
            lease: what ``Ledger.commit`` records for it here (grants, new regions).
            flags: its frame flags.
            what: how errors name the call.

        Returns:
            Its future, as ``call`` returns; or None when this connection cannot take a
            call encoded elsewhere now (it is closed, or holds calls back behind an
            unfinished result): make that call with ``call``.
        """
        if self.closed or self.held:
            return None
        fut = _CallFuture(loop=self.loop)
        cid = self._next_id
        self._next_id = cid + 1
        self.ledger.commit(lease, self)
        self.pending[cid] = fut
        if what:
            self.pending_meta[cid] = what
        _leases.counters["calls_sent"] += 1
        self._send(CALL, flags, cid, parts, fds)
        fut.conn, fut.cid = self, cid
        return fut

    def close_after_call(self, fut: asyncio.Future, fds: list[int]) -> None:
        """Close ``fds`` (which call ``fut`` passes on) in this process once its frame is
        written: as the frame last queued, when the call was sent; when the call ends
        (answered, so written; or failed unsent), when it is held behind an unfinished
        result (``_hold``) and its frame not queued yet."""
        if fut.conn is self and not fut.done():
            self.close_after_send(fds)
            return

        def ended(f: asyncio.Future) -> None:
            if f.conn is self and not self.closed:  # sent, then cancelled or failed: its
                self.close_after_send(fds)  # frame may still wait in the queue, ahead
            else:  # of the last one (answered: written long since; never sent)
                for fd in fds:
                    close_fd(fd)
        fut.add_done_callback(ended)

    def reply(self, cid: int, value: Any, what: str = "") -> None:
        if self.closed:
            return
        if self.reply_waits:
            self._wait_before_reply(cid)
        try:
            payload, fds, enc, flags = ser.encode(value, self)
        except MemoryError as exc:  # out of shared memory: the caller gets it as it is
            self.reply_error(cid, exc)
            return
        except REPLY_PICKLING_FAILURES as exc:
            mistake = ser.result_mistake(value)
            deep = too_deep(exc)
            where = "" if deep or mistake else \
                culprit_at([("result", value)], exc, lambda part: ser.encode_part(part, self),
                           REPLY_PICKLING_FAILURES)
            if mistake is not None:
                exc = TypeError(mistake)
            err = TypeError(f"the result of {what or 'the call'} cannot be sent back: "
                            f"{where}{exc}" + (f". It is {TOO_DEEP}" if deep else ""))
            err.__cause__ = exc
            self.reply_error(cid, err)
            # ``err`` -> its cause's traceback -> this frame -> ``err``: a cycle that would
            # keep the result's arrays (and the caller's blocks among them) leased until
            # the actor's garbage collector next runs, however idle the actor is.
            del err
            return
        if flags == PLAIN and not (_leases.pending_releases or self._releases or
                                   self._forwards) and self.write_small(RESULT, PLAIN, cid,
                                                                        payload):
            return  # the common reply: builtin scalars, nothing to ride ahead of it
        self.ledger.commit(enc, self)
        try:
            self._send(RESULT, flags, cid, payload, fds)
        except Exception as exc:  # not queued: the caller must still hear of it
            err = TypeError(f"the result of {what or 'the call'} cannot be sent back: {exc}")
            err.__cause__ = exc
            self.reply_error(cid, err)
            del err  # (the cycle above)

    def reply_error(self, cid: int, exc: BaseException) -> None:
        """Send ``exc`` as call ``cid``'s error reply; never raises.

        An exception too big for a frame goes as a short copy of itself
        (``_remote_errors.encode_exception``); should even that fail, as a
        ``RemoteError`` carrying its type name and a short text.
        """
        if self.closed:
            return
        if self.reply_waits:
            self._wait_before_reply(cid)
        try:
            self._send(ERROR, 0, cid, remote_errors.encode_exception(exc), ())
        except BaseException as err:  # (its pickling raised even KeyboardInterrupt: its
            # text goes, as on Ray, not that, which ended the actor as if interrupted)
            logger.exception("actorshm: the error reply of a call to %s could not be sent",
                             self.label)
            self._send(ERROR, 0, cid, remote_errors.encode_failure(exc, err), ())

    def _wait_before_reply(self, cid: int) -> None:
        """Wait for what call ``cid``'s arguments asked (``ser.reply_waits_for``)."""
        for fn, items in self.reply_waits.pop(cid, {}).items():
            try:
                fn(items)
            except Exception:  # (a broken CUDA context): the reply goes all the same
                logger.exception("actorshm: waiting before the reply to %s failed",
                                 self.label)

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every call made on this connection and still unanswered with a copy of
        ``exc``: those sent (their replies, should any come, are dropped as a cancelled
        call's are) and those held back (never sent: ``_send_held`` drops them)."""
        pending, self.pending = self.pending, {}
        self.pending_meta.clear()
        for fut in (*pending.values(), *(entry[0] for entry in self.held)):
            if not fut.done():
                fut.set_exception(copy_exc(exc))
                # All at once: an awaited one raises, one nobody awaits any more must not
                # print "exception was never retrieved" (the caller has moved on, often
                # after an earlier error).
                fut.exception()

    def say_leaving(self, seconds: float) -> None:
        """Tell the peer (the driver, or an actor linked to this one) that this actor
        process is stopping, and that its clean-up, ``atexit`` functions included,
        takes at most ``seconds`` (``_actor_process``). Ahead of frames held back: it
        must not wait on them."""
        self.write_urgent(HEADER.pack(LEAVING_PAYLOAD.size, LEAVING, 0, 0, 0)
                          + LEAVING_PAYLOAD.pack(seconds))

    def _send(self, kind: int, flags: int, cid: int, payload, fds, close_fds=None) -> None:
        """Queue one frame (``kind`` 0: none, just the pending releases) and write."""
        if _leases.pending_releases:
            # What this queues on this connection rides on this very frame (below): no
            # separate release frame is scheduled for it.
            was, self._release_scheduled = self._release_scheduled, True
            try:
                _leases.dispatch_releases()
            finally:
                self._release_scheduled = was
        parts = payload if type(payload) is list else [payload]
        if self._releases or self._forwards:
            if self._forwards:
                rel = _dumps((list(self._releases.items()), list(self._forwards.items())), 5)
                self._forwards.clear()
            else:
                rel = _dumps(list(self._releases.items()), 5)
            self._releases.clear()
            _leases.counters["releases_sent"] += 1
            if kind:  # they ride ahead of this frame's payload (HAS_RELEASES)
                flags |= HAS_RELEASES
                parts = [_RLEN.pack(len(rel)), rel, *parts]
            else:
                self.queue_whole(HEADER.pack(len(rel), RELEASE, 0, 0, 0) + rel)
        if kind and not fds and close_fds is None and sum(map(len, parts)) < SMALL_FRAME and \
                self.write_small(kind, flags, cid, b"".join(parts)):
            return  # (a small frame, nothing queued ahead of it: the short way)
        self.write_frame(kind, flags, cid, parts, fds, close_fds)

    # -- receiving -------------------------------------------------------------
    def _on_eof(self) -> None:
        self.host.connection_eof(self)

    def _protocol_error(self, why: str) -> None:
        logger.error("actorshm: protocol error on %s: %s; closing that connection",
                     self.label, why)
        self.close(ActorDiedError(
            f"the connection to {self.label} was closed after a protocol error: {why}"),
            peer_gone=False)

    def _frame(self, kind: int, flags: int, cid: int, payload, fds) -> None:
        if flags & HAS_RELEASES:
            # Releases ride ahead of the payload: <I length, pickle>.
            mv = memoryview(payload)
            if len(mv) < 4:
                self._protocol_error("truncated releases")
                return
            (rlen,) = _RLEN.unpack_from(mv)
            if 4 + rlen > len(mv):
                self._protocol_error("truncated releases")
                return
            if not self._apply_releases(mv[4:4 + rlen]):
                return
            payload = mv[4 + rlen:]
            flags &= ~HAS_RELEASES
        if kind == RESULT and flags == PLAIN and not fds:
            # The common reply (builtin scalars, nothing riding ahead): straight to its call.
            fut = self.pending.pop(cid, None)
            if fut is not None:
                what = self.pending_meta.pop(cid, "")
                try:
                    value = _loads(payload)
                except Exception as exc:
                    result_undecodable(fut, what, exc)
                    return
                if not fut.done():
                    fut.set_result(value)
                return
        if fds and kind != CALL and kind != RESULT and kind != ITEM:  # only these carry fds
            for fd in fds:
                close_fd(fd)
            self._protocol_error(f"a frame of kind {kind} carried {len(fds)} file descriptor(s)")
            return
        if kind == CALL:
            _leases.counters["calls_received"] += 1
            try:
                waits = {} if flags & HAS_BLOCKS else None
                call = list(ser.decode(payload, fds, self, flags, waits))
                if waits:
                    self.reply_waits[cid] = waits
                method, args, kwargs = call[:3] if len(call) in (3, 4) else (None, None, None)
            except ProtocolError as exc:
                self._protocol_error(str(exc))
                return
            except BaseException as exc:
                # Anything else was raised by the arguments' own unpickling code (a
                # class missing here, a __setstate__ that fails, even with a
                # CancelledError or SystemExit): that call fails, the connection and
                # the actor carry on.
                if isinstance(exc, (pickle.UnpicklingError, EOFError)):
                    self._protocol_error(f"undecodable call: {exc!r}")
                    return
                err = undeserializable_arguments(f"{type(exc).__name__}: {exc}")
                err.__cause__ = exc
                self.reply_error(cid, err)
                # (as for a result that cannot be sent: ``err`` -> its cause's traceback
                # -> this frame -> ``err``, a cycle, and the traceback's frames hold the
                # arguments rebuilt so far, their leases with them)
                del err
                return
            if len(call) not in (3, 4) or (len(call) == 4 and type(call[3]) is not dict) \
                    or type(method) is not str or type(args) is not tuple \
                    or type(kwargs) is not dict:
                self._protocol_error("malformed call")
                return
            del args, kwargs  # the host drops the arguments as soon as the call is done,
            # so a lease on an argument goes back before (with) the reply
            self.host.handle_call(self, cid, call)
        elif kind == RESULT or kind == ERROR:
            fut = self.pending.pop(cid, None)
            what = self.pending_meta.pop(cid, "")
            if fut is None:
                # a reply for a cancelled or unknown call: drop it, but decode so leases
                # come back
                if kind == RESULT:
                    try:
                        ser.decode(payload, fds, self, flags)
                    except ProtocolError as exc:
                        self._protocol_error(str(exc))
                    except UNPICKLING_ERRORS:
                        pass
                return
            if kind == RESULT:
                try:
                    value = ser.decode(payload, fds, self, flags)
                except ProtocolError as exc:
                    self._protocol_error(str(exc))
                    if not fut.done():  # popped above: closing did not fail it
                        fut.set_exception(copy_exc(self.close_exc))
                    return
                except UNPICKLING_ERRORS as exc:
                    result_undecodable(fut, what, exc)
                    return
                if not fut.done():
                    fut.set_result(value)
            else:
                exc = remote_errors.decode_exception(payload, what)
                if not fut.done():
                    fut.set_exception(exc)
                    if type(exc) in self.failed_types:  # one "never retrieved" per kind
                        fut.exception()  # of error per connection, not one per call
                    self.failed_types.add(type(exc))
        elif kind == ITEM or kind == CANCEL or kind == CREDIT:
            self._control_frame(kind, flags, cid, payload, fds)
        elif kind == RELEASE:
            self._apply_releases(payload)
        elif kind == LEAVING:
            ok = len(payload) == LEAVING_PAYLOAD.size
            seconds = LEAVING_PAYLOAD.unpack(payload)[0] if ok else -1.0
            if not 0.0 <= seconds < 1e6:  # (nan too)
                self._protocol_error("bad leaving notice")
                return
            self.leaving = seconds
            leaving = getattr(self.host, "connection_leaving", None)
            if leaving is not None:
                leaving(self)
        elif kind == RETIRE:
            try:
                key = pickle.loads(payload)
                _leases.source_gone(self, tuple(key))
            except Exception as exc:
                self._protocol_error(f"bad retire frame: {exc!r}")
        else:
            for fd in fds:
                close_fd(fd)
            self._protocol_error(f"unknown frame kind {kind}")
