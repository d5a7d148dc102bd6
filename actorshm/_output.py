"""Forwarding an actor's stdout and stderr to the driver's, line by line.

Where the driver's stdout or stderr is a pipe or a socket, the lines are written by one
thread of the driver (``_Writer``), not on its event loop: one that nobody reads (a pipe
whose reader stalled, ``| less`` left open) blocks that thread's write, and with it the
actors printing (as a full pipe blocks any program's print), never the loop that serves
every other call. Anything else (a terminal, a file, a notebook's stream, which routes
a thread's output by the thread) is written to at once, as before.
"""

from __future__ import annotations

import atexit
import collections
import io
import os
import stat
import sys
import threading


class OutputForwarder:
    """Copies an actor's stdout/stderr to the driver's, each line prefixed as Ray does.

    A carriage return ends a line too (progress bars update in place), and a line longer
    than ``max_line`` is forwarded in pieces, so output without line ends costs bounded
    memory and time. While the writer thread is ``_Writer.HIGH`` bytes behind (a driver
    stdout that is a pipe nobody reads), the actor's pipe is not read (``pause``) until
    it caught up.
    """

    max_line = 64 << 10

    def __init__(self, rec: ActorRecord, stream, which: str, loop=None) -> None:
        self.rec = rec
        self.stream = stream
        self.fd = stream.fileno()
        self.which = which
        self.loop = loop  # (None: not read from a loop, only ``drain``ed)
        self.partial = b""
        self.closed = False
        self.paused = False

    def on_readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        self._emit(data)

    def _emit(self, data: bytes) -> None:
        data = self.partial + data
        *lines, self.partial = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        while len(self.partial) > self.max_line:
            lines.append(self.partial[:self.max_line])
            self.partial = self.partial[self.max_line:]
        if not lines:
            return
        prefix = f"({self.rec.cls_name} pid={self.rec.pid}) "
        text = "".join(prefix + ln.decode(errors="replace") + "\n" for ln in lines)
        if self.which == "stderr":
            self.rec.stderr_tail.extend(ln.decode(errors="replace") + "\n" for ln in lines)
        out = sys.stderr if self.which == "stderr" else sys.stdout
        if not _may_block(out):
            try:
                out.write(text)
                out.flush()
            except Exception:  # pragma: no cover
                pass
        elif _writer.put(out, text, self) and not self.closed:
            self.paused = True
            try:
                self.loop.remove_reader(self.fd)
            except Exception:  # the loop is closing
                pass

    def resume(self) -> None:
        """The writer caught up: read the pipe again (on the loop)."""
        if self.paused and not self.closed:
            self.paused = False
            self.loop.add_reader(self.fd, self.on_readable)

    def drain(self) -> None:
        while not self.closed:
            try:
                data = os.read(self.fd, 65536)
            except (BlockingIOError, OSError):
                return
            if not data:
                self.close()
                return
            self._emit(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.partial:
            self._emit(b"\n")
        try:
            if self.loop is not None:
                self.loop.remove_reader(self.fd)
        except Exception:  # the loop is closing
            pass
        self.stream.close()


def _may_block(out) -> bool:
    """Whether a write to ``out`` may wait on a reader: a file object of a pipe or a
    socket (not a notebook's stream, whose ``fileno`` may be the kernel's own pipe)."""
    if not isinstance(out, io.TextIOWrapper):
        return False
    try:
        mode = os.fstat(out.fileno()).st_mode
    except Exception:  # no file of its own
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class _Writer:
    """The thread that writes forwarded lines to the driver's stdout and stderr."""

    HIGH = 1 << 20  # bytes waiting to be written past which forwarders stop reading
    LOW = 256 << 10  # and below which they read again

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.lines: collections.deque = collections.deque()
        self.pending = 0  # bytes queued or being written
        self.paused: list[OutputForwarder] = []
        self.thread: threading.Thread | None = None

    def put(self, out, text: str, fwd: OutputForwarder) -> bool:
        """Queue ``text`` for ``out``; whether ``fwd`` should stop reading for now."""
        with self.cond:
            if self.thread is None:
                # A daemon, so that it never keeps the process alive itself; what it
                # has yet to write is waited for at a runtime's close and at exit.
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="actorshm-output")
                self.thread.start()
                atexit.register(self.flush, None)
            self.lines.append((out, text))
            self.pending += len(text)
            self.cond.notify_all()
            if self.pending > self.HIGH and fwd.loop is not None:
                self.paused.append(fwd)
                return True
        return False

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.lines:
                    self.cond.wait()
                out, text = self.lines.popleft()
            try:
                out.write(text)
                out.flush()
            except Exception:  # a closed stdout (``| head``): the lines go nowhere
                pass
            with self.cond:
                self.pending -= len(text)
                resume = ()
                if self.pending <= self.LOW and self.paused:
                    resume, self.paused = self.paused, []
                self.cond.notify_all()
            for fwd in resume:
                try:
                    fwd.loop.call_soon_threadsafe(fwd.resume)
                except Exception:  # its loop has closed
                    pass

    def flush(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for as long as it takes, as a print to
        a full pipe does) for every queued line to be written."""
        with self.cond:
            return self.cond.wait_for(lambda: self.pending == 0, timeout)


_writer = _Writer()


def _forked() -> None:
    """In a child made by ``os.fork``: the lines queued are the parent's to write, and
    the thread that wrote them was not copied."""
    global _writer
    _writer = _Writer()


os.register_at_fork(after_in_child=_forked)


def flush_output(timeout: float | None = None) -> bool:
    """Wait (up to ``timeout`` seconds; None: until done) until the actors' output
    forwarded so far is written to this process's stdout and stderr; whether it was."""
    return _writer.flush(timeout)
