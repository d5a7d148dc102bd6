"""A bare connection host, and helpers, for tests that drive ``_protocol.Connection``
over a socket pair."""

import asyncio
import os
import socket

from actorshm import _protocol as P
from actorshm import _serialization as ser


class Recorder:
    """A connection host that records calls and answers each with its arguments."""

    closing = False

    def __init__(self):
        self.calls = []
        self.closed = []

    def handle_call(self, conn, cid, call):
        method, args, kwargs = call
        call.clear()
        self.calls.append((method, args, kwargs))
        conn.reply(cid, args)

    def connection_eof(self, conn):
        conn.close()

    def connection_closed(self, conn):
        self.closed.append(conn)


def connection_pair(loop):
    """A sender and a receiver connection over a socket pair, in this process."""
    a, b = socket.socketpair()
    return (P.Connection(loop, Recorder(), a, "sender"),
            P.Connection(loop, Recorder(), b, "receiver"))


def trip(msg, sender, receiver):
    """``msg`` encoded on ``sender`` and decoded on ``receiver`` (the frame's payload and
    fds as they would arrive): (what arrived, its frame flags, the encoder)."""
    payload, fds, enc, flags = ser.encode(msg, sender)
    sender.ledger.commit(enc, sender)
    data = b"".join(bytes(p) for p in payload) if type(payload) is list else payload
    return ser.decode(data, [os.dup(fd) for fd in fds], receiver, flags), flags, enc


async def receive_raw(frame: bytes):
    """A connection that reads ``frame`` (header included) off its socket: (it, its host),
    once it closed or a second passed."""
    c, d = socket.socketpair()
    host = Recorder()
    receiver = P.Connection(asyncio.get_running_loop(), host, c, "receiver")
    with d:
        d.sendall(frame)
        for _ in range(100):
            if receiver.closed:
                break
            await asyncio.sleep(0.01)
    return receiver, host
