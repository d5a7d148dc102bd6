"""Child-process ends of the floors and peers the benchmarks compare against.

Run as ``python -m benchmarks._peers KIND FD``: an echo server on an inherited socket.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

HEADER = struct.Struct("<Q")  # 8-byte length prefix, the same shape as any framed protocol


class _Echo(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()

    def connection_made(self, transport) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while len(buf) - pos >= 8:
            (n,) = HEADER.unpack_from(buf, pos)
            if len(buf) - pos < 8 + n:
                break
            self.t.write(bytes(buf[pos:pos + 8 + n]))
            pos += 8 + n
        del buf[:pos]


async def _uvloop_echo(fd: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(_Echo, socket.socket(fileno=fd))
    await asyncio.Future()


def _blocking_echo(fd: int) -> None:
    s = socket.socket(fileno=fd)
    while True:
        d = s.recv(65536)
        if not d:
            return
        s.sendall(d)


def pipe_echo(conn) -> None:
    """multiprocessing.Pipe peer: receives pickled objects, answers with a tiny one."""
    while True:
        try:
            obj = conn.recv()
        except EOFError:
            return
        if obj is None:
            return
        conn.send(getattr(obj, "shape", 0))


def main() -> None:
    kind, fd = sys.argv[1], int(sys.argv[2])
    if kind == "uvloop":
        import uvloop
        uvloop.run(_uvloop_echo(fd))
    else:
        _blocking_echo(fd)


if __name__ == "__main__":
    main()


def torch_producer(q_full, q_free, bufs, n):  # pragma: no cover - needs torch
    """PyTorch's buffer-return pattern: fill a shared tensor, send it, get it back later."""
    for i in range(n):
        idx = q_free.get()
        bufs[idx][::4096] = i % 255
        q_full.put(idx)
    q_full.put(None)


def torch_consumer(q_full, q_free, bufs, q_result, warm=5):  # pragma: no cover
    """Consumes batches; reports seconds per batch after ``warm`` batches."""
    import time
    seen, t0 = 0, None
    while True:
        idx = q_full.get()
        if idx is None:
            q_result.put((time.perf_counter() - t0) / max(seen - warm, 1))
            return
        bufs[idx][0] = 1
        q_free.put(idx)
        seen += 1
        if seen == warm:
            t0 = time.perf_counter()
