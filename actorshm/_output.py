"""Forwarding an actor's stdout and stderr to the driver's, line by line."""

from __future__ import annotations

import os
import re
import sys


_LINE_END = re.compile(rb"(\r|\n)")


class OutputForwarder:
    """Copies an actor's stdout/stderr to the driver's, each line prefixed as Ray does.

    A carriage return ends a line too, and what a progress bar writes after its last
    ``\r`` (its state) is forwarded at once: each update is a line of its own in the
    driver's output. A line longer than ``max_line`` is forwarded in pieces, so output
    without line ends costs bounded memory and time.
    """

    max_line = 64 << 10

    def __init__(self, rec: ActorRecord, stream, which: str) -> None:
        self.rec = rec
        self.stream = stream
        self.fd = stream.fileno()
        self.which = which
        self.partial = b""
        self.after_cr = False  # the last line forwarded ended with (or after) a "\r"
        self.closed = False

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
        if self.after_cr and data[:1] == b"\n":  # (a \r\n split between two reads)
            data = data[1:]
        parts = _LINE_END.split(data.replace(b"\r\n", b"\n"))
        # A carriage return ends a line too, but for the empty one before it: a progress
        # bar writes "\r" + its state, and what follows its last "\r" is that state,
        # shown now rather than at its next update.
        lines = [t for t, end in zip(parts[0:-1:2], parts[1::2]) if t or end == b"\n"]
        self.partial = parts[-1]
        self.after_cr = len(parts) > 1 and parts[-2] == b"\r"
        if self.partial and self.after_cr:
            lines.append(self.partial)
            self.partial = b""
        while len(self.partial) > self.max_line:
            cut = self.max_line  # (not inside a UTF-8 character: back to its first byte)
            while cut > self.max_line - 4 and self.partial[cut] & 0xC0 == 0x80:
                cut -= 1
            lines.append(self.partial[:cut])
            self.partial = self.partial[cut:]
        if not lines:
            return
        prefix = f"({self.rec.cls_name} pid={self.rec.pid}) "
        text = "".join(prefix + ln.decode(errors="replace") + "\n" for ln in lines)
        if self.which == "stderr":
            self.rec.stderr_tail.extend(ln.decode(errors="replace") + "\n" for ln in lines)
            if self.rec.stderr_capture is not None:
                self.rec.stderr_capture.extend(ln.decode(errors="replace") + "\n"
                                               for ln in lines)
        out = sys.stderr if self.which == "stderr" else sys.stdout
        try:
            try:
                out.write(text)
            except UnicodeEncodeError:  # (the driver's stdout is ASCII or latin-1, say):
                enc = out.encoding or "ascii"  # shown escaped, as its stderr would, not lost
                out.write(text.encode(enc, "backslashreplace").decode(enc))
            out.flush()
        except Exception:  # pragma: no cover
            pass

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
            if self.rec.conn is not None:
                self.rec.conn.loop.remove_reader(self.fd)
        except Exception:  # the loop is closing
            pass
        self.stream.close()
