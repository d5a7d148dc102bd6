"""Frames over a Unix socket: the write queue, holds, corking, reads and SCM_RIGHTS.

``FramedSocket`` moves ``_wire`` frames and knows nothing of what they mean, except that
a call is never held back to go with others. Writing: frames queue in ``_out`` and go
out in as few ``sendmsg`` calls as the socket takes; file descriptors ride as SCM_RIGHTS
ancillary data on the ``sendmsg`` that carries the first byte of their frame. A frame's
fds may be closed here once it is written (``close_after_send``), and a callback may
wait for it (``after_item``). Frames can be held back (``hold``) until something that
must go first is out, and the writer can be corked while a burst is made. Reading: what
the socket has is parsed into whole frames, each handed to ``_frame`` with the number of
fds its header announces (received fds queue in arrival order).

"Flush" here means one thing: write what is queued to the socket, as far as it takes it.
A subclass (``_protocol.Connection``) gives frames their meaning, and decides what a
broken socket (``_on_eof``) and a malformed frame (``_protocol_error``) lead to.
"""

from __future__ import annotations

import array
import asyncio
import collections
import logging
import os
import socket
import struct
import threading

from ._framereader import FrameReader, close_fd
from ._wire import ANC_SIZE, CALL, HEADER, MARK, MAX_FRAME, RECV_SIZE  # noqa: F401

logger = logging.getLogger("actorshm")


# One receive buffer per thread, reused by every connection of that thread's event loop:
# allocating 256 KiB per recvmsg costs more than the syscall itself.
_recv_tls = threading.local()


_pack_header = struct.Struct.pack.__get__(HEADER)  # the marker given by the caller

# The rest of a burst (frames made in one loop iteration after the first: an actor's
# replies to the calls of one read, a stream's items) goes out every this many queued
# buffers, and when the iteration's callback returns: the peer starts on the first ones
# while the rest are made. A call is never held back: it is written when it is made.
BURST_ITEMS = 16

# The most buffers one sendmsg takes (the system's IOV_MAX, 1024 on Linux): frames queued
# together go in as few writes as that allows, so the peer reads them together (the
# cancels made in one turn reach a queued call before the slot it waits for frees).
try:
    _IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024
if _IOV_MAX < 16:
    _IOV_MAX = 1024

# A frame under this many bytes is queued as one buffer (header and payload joined) and
# may go the short way (``write_small``); a bigger one is queued part by part, uncopied.
SMALL_FRAME = 65536


def _recv_view() -> memoryview:
    view = getattr(_recv_tls, "view", None)
    if view is None:
        view = _recv_tls.view = memoryview(bytearray(RECV_SIZE))
    return view


class OutItem:
    """One buffer in the write queue: (part of) a frame, with what goes or waits with it.

    Attributes:
        data: the bytes still to write.
        fds: fds to send with its first byte, or None (cleared once handed to sendmsg).
        close_fds: fds to close in this process once it is written, or None.
        callbacks: ``callback(ok)`` to run once it is written (``after_item``), or None.
    """

    __slots__ = ("data", "fds", "close_fds", "callbacks")

    def __init__(self, data, fds=None, close_fds=None) -> None:
        self.data = data
        self.fds = fds
        self.close_fds = close_fds
        self.callbacks: list | None = None


class Hold:
    """Frames queued at ``pos`` and after wait until ``count`` reaches zero (``unhold``)."""

    __slots__ = ("pos", "count")

    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.count = 1


class FramedSocket(FrameReader):
    """One end of a socket pair, moving frames, driven by the event loop.

    Args:
        loop: the event loop that watches the socket.
        label: how errors name the peer.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, label: str) -> None:
        self.loop = loop
        self.label = label
        self.sock: socket.socket | None = None
        self.fd = -1
        self.closed = False
        self._out: list[OutItem] = []
        self._writing = False
        self._corked = 0
        self._eof = False
        # Frames that pass on a block wait for the forward notice to its upstream
        # (``hold``): only frames before the first hold's position are written.
        self._holds: list[Hold] = []
        self._burst = False
        self._burst_flush = False
        self._inbuf = bytearray()
        # The fds received and not yet taken by their frame: one group per read, each
        # (fds, why they were cut short or None) (``FrameReader``).
        self._fd_groups: collections.deque = collections.deque()

    # -- what a subclass provides ------------------------------------------------
    def _frame(self, kind: int, flags: int, cid: int, payload, fds) -> None:
        """Handle one whole frame read from the socket."""
        raise NotImplementedError

    def _on_eof(self) -> None:
        """The socket broke or the peer closed its end (nothing more is written)."""
        raise NotImplementedError

    def _protocol_error(self, why: str) -> None:
        """The peer sent something malformed (it must close the connection)."""
        raise NotImplementedError

    # -- lifecycle -------------------------------------------------------------
    def attach(self, sock: socket.socket, read: bool = True) -> None:
        """Start using ``sock`` (a connection may buffer frames before it has one);
        ``read=False``: write only, until ``start_reading``."""
        if self.closed:
            sock.close()
            return
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self._rview = _recv_view()  # the thread that reads it: this loop's
        self._rviews = [self._rview]
        if read:
            self.loop.add_reader(self.fd, self._on_readable)
        if self._out:
            self._flush()

    def start_reading(self) -> None:
        """Read what comes on a socket attached with ``read=False``."""
        if self.sock is not None and not self.closed and not self._eof:
            self.loop.add_reader(self.fd, self._on_readable)

    def _close_socket(self) -> list:
        """Stop reading and writing, close the socket and every fd still queued here.

        Returns:
            The callbacks of frames that will never be written (``after_item``).
        """
        if self.sock is not None:
            self._unwatch()
            self.sock.close()
        for fds, _ in self._fd_groups:
            for fd in fds:
                close_fd(fd)
        self._fd_groups.clear()
        out, self._out = self._out, []
        self._holds = []
        for item in out:
            for fd in item.close_fds or ():
                close_fd(fd)
        return [cb for item in out if item.callbacks for cb in item.callbacks]

    # -- writing ---------------------------------------------------------------
    def write_frame(self, kind: int, flags: int, cid: int, parts: list, fds,
                    close_fds=None) -> None:
        """Queue one frame (``kind`` 0: none) and write what may go now.

        Args:
            kind, flags, cid: its header (``_wire``).
            parts: buffers that make its payload, back to back.
            fds: fds to send with it.
            close_fds: fds to close here once it is written.

        Raises:
            ValueError: the payload is over ``MAX_FRAME`` (nothing is queued).
        """
        out = self._out
        if kind:
            size = 0
            for part in parts:
                size += len(part)
            if size > MAX_FRAME:
                raise ValueError(f"message of {size} bytes exceeds the frame limit")
            header = _pack_header(size, kind, flags, len(fds), MARK, cid)
            if size < SMALL_FRAME:
                out.append(OutItem(b"".join((header, *parts)), list(fds) or None, close_fds))
            else:
                out.append(OutItem(header, list(fds) or None))
                for part in parts:
                    out.append(OutItem(part))
                out[-1].close_fds = close_fds
        if self.sock is None or self._writing:
            return
        if self._corked:
            # A call goes now, corked or not (with what is queued ahead of it): "sent
            # when made" holds even if the caller then blocks its event loop.
            if kind == CALL and not self._eof:  # (a broken connection: no more writes)
                self._flush()
        elif self._burst:
            # A second frame in the same loop iteration: a burst (an actor's replies to
            # one read's calls). The first frame went out at once; the rest go together,
            # one sendmsg per ``BURST_ITEMS`` queued buffers and one when this
            # iteration's callback returns, instead of one syscall each; a call now.
            if kind == CALL or len(out) >= BURST_ITEMS:
                self._flush()
            elif not self._burst_flush:
                self._burst_flush = True
                self.loop.call_soon(self._end_burst)
        else:
            if kind != CALL:  # (calls go at once in a burst too: none starts one)
                self._burst = self._burst_flush = True
                self.loop.call_soon(self._end_burst)
            self._flush()

    def write_small(self, kind: int, flags: int, cid: int, payload: bytes) -> bool:
        """Queue a small frame without fds, and write it at once when the writer is idle:
        ``write_frame`` with less work per frame, for the common call and reply. False
        when it cannot go that way (frames held back, no socket yet, a big payload): then
        the caller queues it with ``write_frame``."""
        if len(payload) >= SMALL_FRAME or self.sock is None or self._holds:
            return False
        frame = _pack_header(len(payload), kind, flags, 0, MARK, cid) + payload
        if self._corked or self._writing:
            self._out.append(OutItem(frame))
            # as in ``write_frame``: a call goes now (not to a broken connection)
            if kind == CALL and not self._writing and not self._eof:
                self._flush()
            return True
        if self._burst:  # as in ``write_frame``: the rest of a burst goes together
            if kind != CALL or self._out:
                self._out.append(OutItem(frame))
                if kind == CALL or len(self._out) >= BURST_ITEMS:
                    self._flush()
                elif not self._burst_flush:
                    self._burst_flush = True
                    self.loop.call_soon(self._end_burst)
                return True
            # (a call with nothing queued ahead of it: straight to the socket, below)
        elif self._out:
            return False
        elif kind != CALL:  # (calls go at once in a burst too: none starts one)
            self._burst = self._burst_flush = True
            self.loop.call_soon(self._end_burst)
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # EPIPE / ECONNRESET: the peer is gone
            self._broken()
            return True
        if sent < len(frame):
            self._out.append(OutItem(memoryview(frame)[sent:]))
            self._wait_writable()
        return True

    def queue_whole(self, frame: bytes) -> None:
        """Queue a whole, ready-made frame (header included) behind the others."""
        self._out.append(OutItem(frame))

    def write_urgent(self, frame: bytes) -> OutItem | None:
        """Queue a whole frame ahead of the frames held back, and write now, corked or not.

        Returns:
            Its queue item while it is still queued (the socket is full), else None.
        """
        item = OutItem(frame)
        if not self._holds:
            self._out.append(item)
        else:  # ahead of the frames held back, behind those that may go
            self._out.insert(self._holds[0].pos, item)
            for h in self._holds:
                h.pos += 1
        self.flush_now()
        return item if any(it is item for it in self._out) else None

    def _end_burst(self) -> None:
        self._burst = False
        self._burst_flush = False
        if self._out and self.sock is not None and not self._writing and not self._corked \
                and not self.closed:
            self._flush()

    def hold(self) -> Hold:
        """Hold back the frames queued from now on until ``unhold(returned)``."""
        pos = len(self._out)
        if self._holds and self._holds[-1].pos == pos:
            h = self._holds[-1]
            h.count += 1
        else:
            h = Hold(pos)
            self._holds.append(h)
        return h

    def unhold(self, h: Hold) -> None:
        """Let the frames that ``h`` held back go (once every hold on them is gone)."""
        if self.closed:
            return
        h.count -= 1
        if h.count == 0:
            self._holds.remove(h)
            if not self._corked:
                self.flush_now()

    def flush_now(self) -> None:
        """Write what is queued now, corked or not, as far as the socket takes it."""
        if self._out and self.sock is not None and not self._writing and not self._eof \
                and not self.closed:
            self._flush()

    @staticmethod
    def after_item(item: OutItem, callback) -> None:
        """Call ``callback(True)`` once the queued frame ``item`` is written; if it never
        will be, ``callback(peer_gone)`` when the connection closes."""
        if item.callbacks is None:
            item.callbacks = [callback]
        else:
            item.callbacks.append(callback)

    def close_after_send(self, fds: list[int]) -> None:
        """Close ``fds`` in this process once the frame last queued has been written."""
        if self._out:
            item = self._out[-1]
            item.close_fds = list(item.close_fds or ()) + list(fds)
        else:
            for fd in fds:
                close_fd(fd)

    def cork(self) -> None:
        """Queue frames without writing them, until as many ``uncork`` calls."""
        self._corked += 1

    def uncork(self) -> None:
        """Undo one ``cork``; the last one writes what was queued meanwhile."""
        self._corked -= 1
        if not self._corked and self._out and not self._writing and self.sock is not None \
                and not self.closed:
            self._flush()

    def _flush(self) -> None:
        out = self._out
        if len(out) == 1 and not self._holds:  # the common case: one frame, nothing with it
            item = out[0]
            if item.fds is None and item.close_fds is None and item.callbacks is None:
                try:
                    sent = self.sock.send(item.data)
                except (BlockingIOError, InterruptedError):
                    self._wait_writable()
                    return
                except OSError:  # EPIPE / ECONNRESET: the peer is gone
                    self._broken()
                    return
                if sent < len(item.data):
                    item.data = memoryview(item.data)[sent:]
                    self._wait_writable()
                    return
                out.clear()
                if self._writing:
                    self._writing = False
                    self.loop.remove_writer(self.fd)
                return
        written: list = []  # callbacks of frames written, run once the queue is consistent
        try:
            self._write_out(written)
        finally:
            if written:
                run_callbacks(written, True)

    def _write_out(self, written: list) -> None:
        out = self._out
        sock = self.sock
        while out:
            limit = self._holds[0].pos if self._holds else len(out)
            if limit <= 0:
                break  # the rest is held back (``hold``)
            bufs = []
            fds: list[int] = []
            nbytes = 0
            for i in range(limit):
                item = out[i]
                if item.fds:
                    # A frame's fds go with a sendmsg that starts with its header, so
                    # the reader knows whose they are (``_check_fds``).
                    if bufs:
                        break
                    fds = item.fds
                bufs.append(item.data)
                nbytes += len(item.data)
                if len(bufs) >= _IOV_MAX or nbytes >= (4 << 20):
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
                item.fds = None
            short = sent < nbytes
            done = 0  # the items written whole, dropped from the queue at once
            while sent and done < len(out):
                item = out[done]
                n = len(item.data)
                if sent >= n:
                    sent -= n
                    done += 1
                    if item.close_fds:
                        for fd in item.close_fds:
                            close_fd(fd)
                    if item.callbacks:
                        written.extend(item.callbacks)
                else:
                    item.data = memoryview(item.data)[sent:]
                    sent = 0
            if done:
                del out[:done]
                for h in self._holds:
                    h.pos -= done
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
        if self.sock is not None and not self.closed and not self._eof:
            self._unwatch()
            self._corked += 1  # write nothing more; the owner decides when to close
            self._eof = True
            self._on_eof()

    def _wait_writable(self) -> None:
        if not self._writing:
            self._writing = True
            self.loop.add_writer(self.fd, self._on_writable)

    def _on_writable(self) -> None:
        self._flush()



def run_callbacks(callbacks: list, ok: bool) -> None:
    """Run frame-written callbacks, each guarded: a failing one is logged."""
    for cb in callbacks:
        try:
            cb(ok)
        except Exception:  # a bug: logged, and the others still run
            logger.exception("actorshm: error in a frame-written callback")
