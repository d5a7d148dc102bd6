"""Framing: frames cut anywhere by the socket, releases riding ahead of frames, big frames."""

import asyncio
import gc
import socket

import numpy as np
import pytest

import actorshm
from actorshm import _protocol as P
from actors import Arrays, Counter


class _Recorder:
    """A connection host that records calls and answers each with its arguments."""

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


async def _wire_bytes(loop, calls):
    """The bytes a Connection writes for ``calls``, read off the other end of its socket."""
    a, b = socket.socketpair()
    sender = P.Connection(loop, _Recorder(), a, "sender")
    futs = [sender.call(m, args, {}) for m, args in calls]
    await asyncio.sleep(0.05)
    b.setblocking(False)
    data = b""
    while True:
        try:
            chunk = b.recv(1 << 20)
        except BlockingIOError:
            break
        data += chunk
    for f in futs:
        f.cancel()
    sender.close()
    b.close()
    return data


@pytest.mark.parametrize("piece", [1, 7, 16, 4096])
async def test_frames_cut_anywhere_arrive_whole(piece):
    loop = asyncio.get_running_loop()
    big = bytes(range(256)) * 80  # spans many reads when it comes in pieces
    calls = [("plain", (1, 2.5, "x")), ("big", (big,)), ("obj", ({"k": [1, (2, 3)]},)),
             ("plain", (None,))]
    data = await _wire_bytes(loop, calls)
    c, d = socket.socketpair()
    host = _Recorder()
    receiver = P.Connection(loop, host, c, "receiver")
    d.setblocking(False)
    with d:
        for i in range(0, len(data), piece):
            await loop.sock_sendall(d, data[i:i + piece])
            if i % (piece * 16) == 0:
                await asyncio.sleep(0)  # let the receiver read a partial frame
        for _ in range(200):
            if len(host.calls) == len(calls):
                break
            await asyncio.sleep(0.01)
    assert [(m, args) for m, args, _ in host.calls] == calls
    assert not receiver.closed
    receiver.close()


async def test_big_in_band_arguments_round_trip(rt):
    c = await Counter.spawn()
    blob = np.random.default_rng(0).bytes(3 << 20)  # many reads each way
    for _ in range(3):
        assert await c.echo(blob) == blob
    assert await c.incr() == 1


async def test_releases_ride_ahead_of_the_reply(rt):
    w = await Arrays.spawn()
    await w.sum(actorshm.zeros(1 << 16))  # warm up: the block exists, and is back
    live = actorshm.stats()["blocks_live"]
    allocs = actorshm.stats()["pool_allocs"]
    for i in range(50):
        a = actorshm.zeros(1 << 16)
        a[0] = i
        # The actor drops its argument before it replies, and its release rides ahead of
        # the reply: once the reply is here, nothing but `a` holds the block.
        assert await w.sum(a) == i
        del a
        assert actorshm.stats()["blocks_live"] == live
    assert actorshm.stats()["pool_allocs"] == allocs  # the same block, 50 times


async def test_bad_releases_close_only_that_connection(rt):
    loop = asyncio.get_running_loop()
    c, d = socket.socketpair()
    host = _Recorder()
    receiver = P.Connection(loop, host, c, "receiver")
    junk = b"\xff\xff\x00\x00not a pickle"  # says 65535 bytes of releases follow
    frame = P.HEADER.pack(len(junk), P.CALL, P.HAS_RELEASES, 0, 1) + junk
    with d:
        d.sendall(frame)
        for _ in range(100):
            if receiver.closed:
                break
            await asyncio.sleep(0.01)
    assert receiver.closed and "truncated releases" in str(receiver.close_exc)
    assert not host.calls


async def test_a_message_over_the_frame_limit_fails_before_anything_is_sent(rt, monkeypatch):
    from actorshm import _serialization
    w = await Arrays.spawn()
    a = actorshm.zeros(1000)
    assert await w.sum(a) == 0.0
    live = actorshm.stats()["blocks_live"]
    monkeypatch.setattr(_serialization, "MAX_MESSAGE", 10_000)
    for big in (b"x" * 20_000, [a, b"x" * 20_000]):
        with pytest.raises(TypeError, match="over actorshm's 2 GiB frame limit"):
            w.echo(big)
    monkeypatch.undo()
    assert await w.sum(a) == 0.0
    del a, big
    gc.collect()
    assert actorshm.stats()["blocks_live"] == live - 1  # no grant was left behind
