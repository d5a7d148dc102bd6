"""Framing and messages over a Unix socket pair.

A frame is a 16-byte header followed by a pickled payload::

    uint32 payload length | uint8 kind | uint8 flags | uint16 fd count | uint64 call id

Flags: ``HAS_BLOCKS`` (the payload starts with a block table) and ``PLAIN`` (a plain
pickle of builtins), see ``_serialization``; ``HAS_RELEASES`` (leases given back, and
forward notices, ride ahead of the payload).

File descriptors (arena fds, brokered sockets) ride as SCM_RIGHTS ancillary data on the
``sendmsg`` that carries the first byte of their frame; the receiver queues them in
arrival order and hands each frame the number its header announces. Sockets are pairs
made by the driver and inherited or passed over existing pairs: there is no listening
socket and no path in the filesystem, so no other process can connect or inject frames.
A malformed or truncated frame closes that one connection with a logged error.

``Connection`` is symmetric: either side can make calls and answer them. The host
object (the driver's runtime or an actor process's worker) answers calls and is told
when a connection closes.
"""

from __future__ import annotations

import array
import asyncio
import inspect
import logging
import os
import pickle
import socket
import struct
import threading
from typing import Any

from . import _serialization as ser
from . import _leases
from ._errors import ActorDiedError, ProtocolError

logger = logging.getLogger("actorshm")

HEADER = struct.Struct("<IBBHQ")
HSIZE = HEADER.size
HAS_RELEASES = 4  # frame flag: releases ride ahead of the payload (<I length, pickle)
_RLEN = struct.Struct("<I")
_dumps = pickle.dumps
CALL, RESULT, ERROR, RELEASE, RETIRE = 1, 2, 3, 4, 5
MAX_FRAME = (1 << 31) - 1
MAX_FDS_PER_SEND = 250  # Linux caps SCM_RIGHTS at 253 fds per message
RECV_SIZE = 1 << 18
ANC_SIZE = socket.CMSG_SPACE(MAX_FDS_PER_SEND * 4)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_CLOEXEC = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))  # received fds never leak to exec
# One receive buffer per thread, reused by every connection of that thread's event loop:
# allocating 256 KiB per recvmsg costs more than the syscall itself.
_recv_tls = threading.local()


def _recv_view() -> memoryview:
    view = getattr(_recv_tls, "view", None)
    if view is None:
        view = _recv_tls.view = memoryview(bytearray(RECV_SIZE))
    return view


def _copy_exc(exc: BaseException) -> BaseException:
    """A fresh instance per waiter, so tracebacks do not pile up on one object."""
    try:
        new = type(exc)(*exc.args)
    except Exception:
        return exc
    return new


class Connection:
    """One end of a socket pair, speaking actorshm frames, driven by the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: Any,
                 sock: socket.socket | None = None, label: str = "peer") -> None:
        self.loop = loop
        self.host = host
        self.label = label
        self.sock: socket.socket | None = None
        self.fd = -1
        self.pending: dict[int, asyncio.Future] = {}
        self.pending_meta: dict[int, str] = {}
        # Blocks leased to the peer: key -> [block, grants, upstreams we told that we
        # passed it on (``_leases.forwarded``), how many holders the peer passed it on to]
        self.grants: dict[tuple, list] = {}
        self.sent_regions: set[tuple] = set()  # regions we introduced to the peer
        self.received_regions: set[tuple] = set()  # regions the peer introduced to us
        self.closed = False
        self.close_exc: BaseException | None = None
        self._next_id = 1
        self._out: list[list] = []  # [data, fds or None, fds to close after sending]
        self._writing = False
        self._corked = 0
        self._releases: dict[tuple, int] = {}
        self._forwards: dict[tuple, int] = {}  # forward notices to send: key -> +n / -n
        self._eof = False
        # Frames that pass on a block wait for the forward notice to its upstream
        # (``hold``): each hold is [position in _out, notices pending]; only frames
        # before the first hold's position are written.
        self._holds: list[list[int]] = []
        self._release_scheduled = False
        self._burst = False
        self._burst_flush = False
        self._inbuf = bytearray()
        self._fds: list[int] = []
        self.peer_id: int | None = None
        if sock is not None:
            self.attach(sock)

    def __repr__(self) -> str:
        return f"<Connection {self.label}{' closed' if self.closed else ''}>"

    # -- lifecycle -------------------------------------------------------------
    def attach(self, sock: socket.socket) -> None:
        """Start using ``sock`` (a connection may buffer frames before it has one)."""
        if self.closed:
            sock.close()
            return
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self._rview = _recv_view()  # the thread that reads it: this loop's
        self._rviews = [self._rview]
        self.loop.add_reader(self.fd, self._on_readable)
        if self._out:
            self._flush()

    def close(self, exc: BaseException | None = None, *, peer_gone: bool = True) -> None:
        """Close the connection and fail every call waiting on it with ``exc``.

        ``peer_gone``: the peer has exited or closed its end, so it holds none of the
        blocks we leased it any more. False when we close while it may live on (we stop,
        or it broke the protocol).
        """
        if self.closed:
            return
        self.closed = True
        self.close_exc = exc if exc is not None else ActorDiedError(
            f"the connection to {self.label} is closed")
        if self.sock is not None:
            self._unwatch()
            self.sock.close()
        for fd in self._fds:
            _close_fd(fd)
        self._fds.clear()
        out, self._out = self._out, []
        self._holds = []
        for item in out:
            for fd in item[2] or ():
                _close_fd(fd)
        waiting = [cb for item in out if len(item) > 3 for cb in item[3]]
        pending, self.pending = self.pending, {}
        self.pending_meta.clear()
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(_copy_exc(self.close_exc))
        # The peer's leases come back, except for blocks that may still be in use: those
        # it passed on (processes downstream of it may hold them), and, when it may live
        # on, a peer's blocks we passed to it. Those we keep, and the forward notices we
        # sent for them upstream stand.
        kept, ours = [], []
        for g in self.grants.values():
            if g[3] > 0:
                kept.append(g[0])
            elif g[2]:
                if peer_gone:
                    _leases.unforwarded(g[0].key, g[2])
                else:
                    ours.append(g[0])
        self.grants.clear()
        if kept or ours:
            _leases.quarantine(kept + ours)
        if kept:
            self.loop.call_later(0.5, self._warn_kept, len(kept))
        self._releases.clear()
        self._forwards.clear()
        _leases.connection_closed(self)  # and the memory it brought in is let go
        try:
            self.host.connection_closed(self)
        except Exception:  # pragma: no cover
            logger.exception("actorshm: error while closing %s", self.label)
        # Whoever waited for frames that will never be written now (last: a callback may
        # close other connections): ``peer_gone`` tells whether that still matters.
        _run_callbacks(waiting, peer_gone)

    # -- sending ---------------------------------------------------------------
    def call(self, method: str, args: tuple, kwargs: dict, what: str = "") -> asyncio.Future:
        """Send a call now and return a future for its reply.

        Raises ``TypeError`` (before anything is sent) when an argument cannot be
        serialized.
        """
        fut = self.loop.create_future()
        if self.closed:
            fut.set_exception(_copy_exc(self.close_exc))
            return fut
        try:
            payload, fds, enc, flags = ser.encode((method, args, kwargs), self)
        except Exception as exc:
            raise TypeError(
                f"cannot send the arguments of {what or method}(): {exc}. Arguments must be "
                "picklable (cloudpickle); pass data, not open files, locks or sockets."
            ) from exc
        cid = self._next_id
        self._next_id = cid + 1
        ser.commit(enc)
        self.pending[cid] = fut
        if what:
            self.pending_meta[cid] = what
        _leases.counters["calls_sent"] += 1
        self._send(CALL, flags, cid, payload, fds)
        return fut

    def reply(self, cid: int, value: Any, what: str = "") -> None:
        if self.closed:
            return
        try:
            payload, fds, enc, flags = ser.encode(value, self)
        except Exception as exc:
            if inspect.isgenerator(value) or inspect.isasyncgen(value):
                exc = TypeError(f"it is a generator; actorshm methods do not stream results "
                                "yet: return a list instead")
            err = TypeError(f"the result of {what or 'the call'} cannot be sent back: {exc}")
            err.__cause__ = exc
            self.reply_error(cid, err)
            return
        ser.commit(enc)
        self._send(RESULT, flags, cid, payload, fds)

    def reply_error(self, cid: int, exc: BaseException) -> None:
        if self.closed:
            return
        payload = ser.encode_exception(exc)
        self._send(ERROR, 0, cid, payload, ())

    def queue_release(self, key: tuple, n: int) -> None:
        if self.closed:
            return
        self._releases[key] = self._releases.get(key, 0) + n
        if not self._release_scheduled:
            self._release_scheduled = True
            self.loop.call_soon(self._send_releases)

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
        item = [HEADER.pack(len(notice), RELEASE, 0, 0, 0) + notice, None, None]
        if not self._holds:
            self._out.append(item)
        else:  # ahead of the frames held back, behind those that may go
            self._out.insert(self._holds[0][0], item)
            for h in self._holds:
                h[0] += 1
        self.flush_now()
        return item if any(it is item for it in self._out) else None

    def hold(self) -> list:
        """Hold back the frames queued from now on until ``unhold(returned)``."""
        pos = len(self._out)
        if self._holds and self._holds[-1][0] == pos:
            h = self._holds[-1]
            h[1] += 1
        else:
            h = [pos, 1]
            self._holds.append(h)
        return h

    def unhold(self, h: list) -> None:
        if self.closed:
            return
        h[1] -= 1
        if h[1] == 0:
            self._holds.remove(h)
            if not self._corked:
                self.flush_now()

    def flush_now(self) -> None:
        """Write what is queued now, corked or not, as far as the socket takes it."""
        if self._out and self.sock is not None and not self._writing and not self._eof \
                and not self.closed:
            self._flush()

    @staticmethod
    def after_item(item: list, callback) -> None:
        """Call ``callback(True)`` once the queued frame ``item`` is written; if it never
        will be, ``callback(peer_gone)`` when the connection closes."""
        if len(item) > 3:
            item[3].append(callback)
        else:
            item.append([callback])

    def send_retire(self, key: tuple) -> None:
        if not self.closed:
            payload = pickle.dumps(key, protocol=5)
            self._send(RETIRE, 0, 0, payload, ())

    def _send(self, kind: int, flags: int, cid: int, payload, fds, close_fds=None) -> None:
        """Queue one frame (``kind`` 0: none, just the pending releases) and write."""
        if _leases._releases:
            _leases.dispatch_releases()
        out = self._out
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
                out.append([HEADER.pack(len(rel), RELEASE, 0, 0, 0) + rel, None, None])
        if kind:
            size = 0
            for part in parts:
                size += len(part)
            if size > MAX_FRAME:
                raise ValueError(f"message of {size} bytes exceeds the frame limit")
            header = HEADER.pack(size, kind, flags, len(fds), cid)
            if size < 65536:
                out.append([b"".join((header, *parts)), list(fds) or None, close_fds])
            else:
                out.append([header, list(fds) or None, None])
                for part in parts:
                    out.append([part, None, None])
                out[-1][2] = close_fds
        if self.sock is not None and not self._writing and not self._corked:
            if self._burst:
                # A second frame in the same loop iteration: a burst (pipelined calls).
                # The first frame went out at once; the rest go together in one sendmsg
                # when this iteration's callback returns, instead of one syscall each.
                if not self._burst_flush:
                    self._burst_flush = True
                    self.loop.call_soon(self._end_burst)
            else:
                self._burst = True
                self.loop.call_soon(self._end_burst)
                self._burst_flush = True
                self._flush()

    def _end_burst(self) -> None:
        self._burst = False
        self._burst_flush = False
        if self._out and self.sock is not None and not self._writing and not self._corked \
                and not self.closed:
            self._flush()

    def close_after_send(self, fds: list[int]) -> None:
        """Close ``fds`` in this process once the frame last queued has been written."""
        if self._out:
            item = self._out[-1]
            item[2] = list(item[2] or ()) + list(fds)
        else:
            for fd in fds:
                _close_fd(fd)

    def _flush(self) -> None:
        written: list = []  # callbacks of frames written, run once the queue is consistent
        try:
            self._write_out(written)
        finally:
            if written:
                _run_callbacks(written, True)

    def _write_out(self, written: list) -> None:
        out = self._out
        sock = self.sock
        while out:
            limit = self._holds[0][0] if self._holds else len(out)
            if limit <= 0:
                break  # the rest is held back (``hold``)
            bufs = []
            fds: list[int] = []
            nbytes = 0
            for i in range(limit):
                item = out[i]
                if item[1]:
                    if len(fds) + len(item[1]) > MAX_FDS_PER_SEND and bufs:
                        break
                    fds.extend(item[1])
                bufs.append(item[0])
                nbytes += len(item[0])
                if len(bufs) >= 64 or nbytes >= (4 << 20):
                    break
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            try:
                sent = sock.sendmsg(bufs, anc)
            except (BlockingIOError, InterruptedError):
                self._wait_writable()
                return
            except OSError:  # EPIPE / ECONNRESET: the peer is gone
                self._broken()
                return
            # Every fd of the frames handed to sendmsg went with its first byte.
            for item in out[: len(bufs)]:
                item[1] = None
            short = sent < nbytes
            while sent and out:
                item = out[0]
                n = len(item[0])
                if sent >= n:
                    sent -= n
                    out.pop(0)
                    for h in self._holds:
                        h[0] -= 1
                    for fd in item[2] or ():
                        _close_fd(fd)
                    if len(item) > 3:
                        written.extend(item[3])
                else:
                    item[0] = memoryview(item[0])[sent:]
                    sent = 0
            if short:
                self._wait_writable()
                return
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self.fd)

    def _unwatch(self) -> None:
        try:
            self.loop.remove_reader(self.fd)
            if self._writing:
                self.loop.remove_writer(self.fd)
        except Exception:  # the loop is closing
            pass
        self._writing = False

    def _broken(self) -> None:
        if self.sock is not None and not self.closed:
            self._unwatch()
            self._corked += 1  # write nothing more; the host decides when to close
            self._eof = True
            self.host.connection_eof(self)

    def _wait_writable(self) -> None:
        if not self._writing:
            self._writing = True
            self.loop.add_writer(self.fd, self._on_writable)

    def _on_writable(self) -> None:
        self._flush()

    def cork(self) -> None:
        self._corked += 1

    def uncork(self) -> None:
        self._corked -= 1
        if not self._corked and self._out and not self._writing and self.sock is not None \
                and not self.closed:
            self._flush()

    # -- receiving -------------------------------------------------------------
    def drain(self) -> None:
        """Read and handle what the peer wrote before it went away (its process exited)."""
        while not self.closed and self.sock is not None and not self._eof:
            if not self._on_readable():
                return

    def _on_readable(self) -> bool:
        """Read what the socket has and handle every whole frame; False when it had none."""
        try:
            nread, anc, flags, _ = self.sock.recvmsg_into(self._rviews, ANC_SIZE,
                                                             _CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # ECONNRESET: the peer died with data unread; same as EOF
            self._broken()
            return False
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self._fds.extend(fds)
        if flags & _MSG_CTRUNC:
            self._protocol_error("file descriptors were truncated")
            return False
        if not nread:
            self._broken()
            return False
        # The common case: this read holds whole frames only, parsed straight out of the
        # receive buffer (each payload a view that ``_dispatch`` decodes at once). A frame
        # cut off at the end of a read is kept in ``_inbuf``, and the frames that span
        # reads are copied out of it.
        view = self._rview
        buf = self._inbuf
        if buf:
            buf += view[:nread]
            data = buf
            n = len(buf)
        else:
            data = view
            n = nread
        pos = 0
        self._corked += 1  # replies made while dispatching go out together, afterwards
        try:
            while n - pos >= HSIZE:
                plen, kind, flags, nfds, cid = HEADER.unpack_from(data, pos)
                if not CALL <= kind <= RETIRE or plen > MAX_FRAME or nfds > 4096:
                    self._protocol_error(f"bad frame header (kind {kind}, {plen} bytes)")
                    return
                start = pos + HSIZE
                end = start + plen
                if end > n:
                    break
                if nfds:
                    if nfds > len(self._fds):
                        self._protocol_error("a frame announced fds it did not carry")
                        return
                    fds = self._fds[:nfds]
                    del self._fds[:nfds]
                else:
                    fds = ()
                pos = end
                if flags & HAS_RELEASES:
                    start = self._take_releases(data, start, end)
                    if start < 0:
                        return
                    flags &= ~HAS_RELEASES
                self._dispatch(kind, flags, cid, data[start:end], fds)
                if self.closed:
                    return
        finally:
            if not self.closed:
                if buf:
                    del buf[:pos]
                elif pos < n:
                    buf += view[pos:n]
                self.uncork()
        return True

    def _take_releases(self, data, start: int, end: int) -> int:
        """Apply the releases riding ahead of a frame's payload; where the payload starts."""
        if end - start < 4:
            self._protocol_error("truncated releases")
            return -1
        (rlen,) = _RLEN.unpack_from(data, start)
        if start + 4 + rlen > end:
            self._protocol_error("truncated releases")
            return -1
        if not self._apply_releases(data[start + 4:start + 4 + rlen]):
            return -1
        return start + 4 + rlen

    def _apply_releases(self, payload) -> bool:
        """Leases the peer gave back, and its forward notices (``_leases.forwarded``)."""
        try:
            items = pickle.loads(payload)
            grants = self.grants
            if type(items) is tuple:
                items, forwards = items
                for key, n in forwards:
                    g = grants.get(key)
                    if g is not None:
                        g[3] += n
            for key, n in items:
                g = grants.get(key)
                if g is not None:
                    g[1] -= n
                    if g[1] <= 0:
                        del grants[key]
                        if g[2]:
                            _leases.unforwarded(key, g[2])
        except Exception as exc:
            self._protocol_error(f"bad release frame: {exc!r}")
            return False
        _leases.counters["releases_received"] += 1
        return True

    def _protocol_error(self, why: str) -> None:
        logger.error("actorshm: protocol error on %s: %s; closing that connection",
                     self.label, why)
        self.close(ActorDiedError(
            f"the connection to {self.label} was closed after a protocol error: {why}"),
            peer_gone=False)

    def _warn_kept(self, n: int) -> None:
        if getattr(self.host, "_closing", False):
            return  # everything stops: nobody is left to use them
        logger.warning(
            "actorshm: %s ended while processes it passed %d shared block(s) of this "
            "process's to may still use them; this process keeps those blocks (not "
            "recycled) for as long as it runs. See docs/shared-memory.md.", self.label, n)

    def _dispatch(self, kind: int, flags: int, cid: int, payload: bytes, fds) -> None:
        if kind == CALL:
            _leases.counters["calls_received"] += 1
            try:
                call = list(ser.decode(payload, fds, self, flags))
                method, args, kwargs = call if len(call) == 3 else (None, None, None)
            except ProtocolError as exc:
                self._protocol_error(str(exc))
                return
            except Exception as exc:
                # Anything else was raised by the arguments' own unpickling code (a
                # class missing here, a __setstate__ that fails): that call fails, the
                # connection and the actor carry on.
                if isinstance(exc, (pickle.UnpicklingError, EOFError)):
                    self._protocol_error(f"undecodable call: {exc!r}")
                    return
                err = TypeError(f"the actor could not deserialize the call's arguments: "
                                f"{type(exc).__name__}: {exc}")
                err.__cause__ = exc
                self.reply_error(cid, err)
                return
            if len(call) != 3 or type(method) is not str or type(args) is not tuple \
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
                    except Exception:
                        pass
                return
            if kind == RESULT:
                try:
                    value = ser.decode(payload, fds, self, flags)
                except ProtocolError as exc:
                    self._protocol_error(str(exc))
                    return
                except Exception as exc:
                    if not fut.done():
                        err = TypeError(f"the result of {what or 'the call'} could not be "
                                        f"deserialized here: {type(exc).__name__}: {exc}")
                        err.__cause__ = exc
                        fut.set_exception(err)
                    return
                if not fut.done():
                    fut.set_result(value)
            else:
                exc = ser.decode_exception(payload, what)
                if not fut.done():
                    fut.set_exception(exc)
        elif kind == RELEASE:
            self._apply_releases(payload)
        elif kind == RETIRE:
            try:
                key = pickle.loads(payload)
                _leases.source_gone(self, tuple(key))
            except Exception as exc:
                self._protocol_error(f"bad retire frame: {exc!r}")
        else:
            for fd in fds:
                _close_fd(fd)
            self._protocol_error(f"unknown frame kind {kind}")


def _run_callbacks(callbacks: list, ok: bool) -> None:
    for cb in callbacks:
        try:
            cb(ok)
        except Exception:  # a bug: logged, and the others still run
            logger.exception("actorshm: error in a frame-written callback")


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
