"""Reading frames: what the socket has, parsed into whole frames (``FrameReader``).

A part of ``_framing.FramedSocket`` (its base class), kept here so that each module
stays one idea: it uses the socket, the receive buffer, the fds received and the
cork of the framed socket, and hands each whole frame to ``_frame``.
"""

from __future__ import annotations

import array
import errno
import os
import re
import resource
import socket
from time import perf_counter as _clock

from ._util import off_stdio
from ._wire import (ANC_SIZE, CALL, CANCEL, HEADER, HSIZE, LAST_KIND, MARK,
                    MAX_FDS_PER_FRAME, MAX_FLAGS, MAX_FRAME)

_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_CLOEXEC = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))  # received fds never leak to exec
_unpack_header = HEADER.unpack_from
_KIND_OFFSET = 4  # where a header's kind byte lies (``_wire.HEADER``: "<IBBHHQ")
# The bytes of a CANCEL frame's header from its kind to its marker (any flags, no fds),
# found in one C-level scan of a read. A match inside a payload only makes a call wait
# for the end of its read.
_CANCEL_HEADER = re.compile(re.escape(bytes([CANCEL])) + b"[\\x00-\\xff]" +  # kind, flags
                            re.escape(HEADER.pack(0, CANCEL, 0, 0, 0)[6:10]))  # nfds, mark


def close_fd(fd: int) -> None:
    """Close ``fd``, ignoring an fd that is already closed."""
    try:
        os.close(fd)
    except OSError:
        pass


def _fd_shortage() -> str:
    """Why the kernel cut a read's fds short, where this process is out of fds (the
    usual cause: it could not install them)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))  # (one fd more: EMFILE?)
        return ""
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            return ""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (f": this process is out of file descriptors (its limit, ulimit -n, is "
            f"{limit}), so the shared-memory arenas sent to it could not be opened. Each "
            "arena this process owns or maps from a peer holds one fd: drop arrays you "
            "no longer need, use fewer larger arrays, or raise the limit")


class FrameReader:
    """Reads frames for ``FramedSocket``: see the module's docstring."""

    # Whether the frame being handled began in an earlier read (a frame larger than the
    # socket's buffer comes in many): what its sender wrote after it (a cancel of the
    # call it carries) may be read only after it, once the sender could write again.
    frame_spanned = False

    @staticmethod
    def _bad_header(data, pos: int) -> str:
        plen, kind, flags, nfds, mark, cid = _unpack_header(data, pos)
        what = "no frame marker" if mark != MARK else \
            f"kind {kind}, flags {flags:#x}, {plen} bytes, {nfds} fds"
        return (f"bad frame header ({what}): the stream lost its place, as after a "
                "truncated frame")

    def _fds_owned(self, data, pos: int, n: int) -> bool:
        """Whether the fds received and not yet taken belong to the frame cut off at
        ``pos`` (the writer sends a frame's fds with a sendmsg that starts with its
        header, so they come with the read that has its first byte); if not, a
        protocol error."""
        groups = self._fd_groups
        if len(groups) == 1:
            if n - pos >= HSIZE:
                nfds = HEADER.unpack_from(data, pos)[3]
                got, cut = groups[0]
                if nfds == len(got) or (cut is not None and nfds > len(got)):
                    return True
            elif n > pos:
                return True  # its header is not whole yet: checked once it is
        self._protocol_error(f"{sum(len(g) for g, _ in groups)} file descriptor(s) came "
                             "with no frame that announced them")
        return False

    def drain(self) -> None:
        """Read and handle what the peer wrote before it went away (its process exited),
        also after a write found it gone (``_broken``) before a read had."""
        while not self.closed and self.sock is not None:
            if not self._on_readable():
                return

    def _on_readable(self) -> bool:
        """Read what the socket has and handle every whole frame; False when it had none.

        The kernel ends a read right after bytes that carried fds, so the frames written
        after a frame with fds (an arena's first use) wait for another read: they are
        read now (``_follow_fds``), as they would have been in one read without fds. (An
        actor that finished a long sync call reads its socket before it starts the next
        queued call, so that a cancel of that call is seen first: a cancel written after
        a call that introduced an arena was missed, and the cancelled call ran.)
        """
        try:
            nread, anc, flags, _ = self.sock.recvmsg_into(self._rviews, ANC_SIZE,
                                                             _CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # ECONNRESET: the peer died with data unread; same as EOF
            self._broken()
            return False
        carried = bool(anc or flags & _MSG_CTRUNC)  # fds (some, maybe, dropped)
        if carried:
            # A read carries the fds of one sendmsg, which the writer starts with the
            # frame they belong to: they are that frame's, kept as one group (its frame
            # may end reads later, after the next frame's fds came).
            self._anc_seen = True
            got = array.array("i")
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
            cut = None
            if flags & _MSG_CTRUNC:
                # The kernel could not install every fd (this process is out of them)
                # and dropped the rest. Their frame is read all the same, its missing
                # fds as -1: the blocks of the arenas they would open fail (that call or
                # result fails, naming the cause), and the connection lives on.
                cut = _fd_shortage() or ": the kernel dropped them (a read was cut short)"
            if got and min(got) <= 2:  # (the program closed its standard streams)
                got = [off_stdio(fd, keep=True) for fd in got]
            if got or cut is not None:
                self._fd_groups.append((list(got), cut))
        if not nread:
            self._broken()
            return False
        self.host.read_at = _clock()  # (where a worker's burst of sync calls starts)
        # The common case: this read holds whole frames only, parsed straight out of the
        # receive buffer (each payload a view that ``_frame`` decodes at once). A frame
        # cut off at the end of a read is kept in ``_inbuf``, and the frames that span
        # reads are copied out of it.
        view = self._rview
        buf = self._inbuf
        spanned = bool(buf)  # (the first frame began in an earlier read)
        if buf:
            buf += view[:nread]
            data = buf
            n = len(buf)
        else:
            data = view
            n = nread
        pos = 0
        # (what ``cancel_behind`` looks at: this read, the place in it, a read ended by fds)
        self._rdata, self._rn, self._cancel_at, self._carried = data, n, -1, carried
        self._corked += 1  # replies made while dispatching go out together, afterwards
        try:
            while n - pos >= HSIZE:
                plen, kind, flags, nfds, mark, cid = _unpack_header(data, pos)
                # A few integer comparisons catch a header read from the middle of a
                # frame (the stream lost its place): no marker, or fields out of range.
                if mark != MARK or not CALL <= kind <= LAST_KIND or flags > MAX_FLAGS \
                        or plen > MAX_FRAME or nfds > MAX_FDS_PER_FRAME:
                    self._protocol_error(self._bad_header(data, pos))
                    return False
                start = pos + HSIZE
                end = start + plen
                if end > n:
                    break
                if nfds:
                    fds, cut = self._fd_groups.popleft() if self._fd_groups else ([], None)
                    if len(fds) != nfds:
                        if cut is None or len(fds) > nfds:
                            for fd in fds:  # (the rest close with the connection)
                                close_fd(fd)
                            self._protocol_error(
                                f"a frame announced {nfds} fds and came with {len(fds)}")
                            return False
                        fds += [-1] * (nfds - len(fds))  # (cut short: see above)
                        self.fds_why = cut
                else:
                    fds = ()
                pos = self._rpos = end
                if spanned:  # (rare: set only around the frame that spanned reads)
                    self.frame_spanned = True
                    self._frame(kind, flags, cid, data[start:end], fds)
                    self.frame_spanned = spanned = False
                else:
                    self._frame(kind, flags, cid, data[start:end], fds)
                if self.closed:
                    return False
            if self._fd_groups and not self._fds_owned(data, pos, n):
                return False
        finally:
            if spanned:
                self.frame_spanned = False
            self._rdata = None
            if not self.closed:
                if buf:
                    del buf[:pos]
                elif pos < n:
                    buf += view[pos:n]
            try:
                # Calls of this read that waited for its end may start, unless the frames
                # written after them come in the reads that follow (``_follow_fds``).
                if self.deferred and (self.closed or not (carried or self._following)):
                    self._read_ended()
            finally:
                if not self.closed:
                    self.uncork()
        if carried and not self._following:
            if self._follow_fds():
                # Cut short with frames maybe left (a cancel of a call read): the host
                # starts no queued call before the loop has read this socket again.
                cut = getattr(self.host, "read_cut_short", None)
                if cut is not None:
                    cut()
            if self.deferred:
                self._read_ended()
        return True

    _following = False  # in ``_follow_fds``
    deferred = False  # the host queued a call until its reads end (``Host.read_ended``)
    _rdata = None  # the read being handled (``cancel_behind``), its length, ...
    _rn = _rpos = 0  # ... the end of the frame being handled in it, ...
    _cancel_at = -1  # ... where the next CANCEL header lies in it (its length: none) ...
    _carried = False  # ... and whether it carried fds (its last frame: the one with them)

    def cancel_behind(self) -> bool:
        """Whether a CANCEL frame may lie behind the frame being handled, written after
        it: later in this read, or in the reads that follow one that carried fds (the
        kernel ends a read with the frame that carried them). A worker queues a sync call
        until the end of the read (``Host.read_ended``) when so, so that a cancel written
        right after the call wins."""
        if self._carried:
            return True
        data, pos, n = self._rdata, self._rpos, self._rn
        if data is None or n - pos < HSIZE:
            return False
        at = self._cancel_at
        if at < pos:  # (not looked past this frame yet: the first look of this read)
            m = _CANCEL_HEADER.search(data, pos + _KIND_OFFSET, n)
            at = self._cancel_at = m.start() - _KIND_OFFSET if m is not None else n
        return at < n

    def _read_ended(self) -> None:
        self.deferred = False
        self.host.read_ended()

    _anc_seen = False  # the last read carried fds
    fds_why = ""  # why the fds of the last frame whose fds were cut short are missing (-1)

    def _follow_fds(self) -> bool:
        """Read on after a read that carried fds, while reads carry fds (at most 64: a
        peer that keeps sending fds cannot starve the loop). True when it stopped at
        that cap, frames maybe still in the socket."""
        self._following = True
        try:
            for _ in range(64):
                if self.closed or self.sock is None:
                    return False
                self._anc_seen = False
                if not self._on_readable() or not self._anc_seen:
                    return False
            return True
        finally:
            self._following = False
