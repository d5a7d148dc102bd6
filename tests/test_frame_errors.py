"""What cannot be sent, and frames that are wrong: clear errors, never a hang or a leak."""

import asyncio
import os
import socket
import struct

import numpy as np
import pytest

import actorshm
from actorshm import _protocol as P
from actorshm import _encoding, _shm
from actorshm import _wire as W
from actors import Arrays, BigInitError, BigKwError, Counter, Faulty, Oversized
from recorder import Recorder
from waits import until


def _fd_count():
    return len(os.listdir("/proc/self/fd"))


# -- what cannot be sent: the error says why, and only why --------------------------------

async def test_the_frame_limit_error_gives_no_unrelated_advice(rt, monkeypatch):
    c = await Counter.spawn()
    monkeypatch.setattr(_encoding, "MAX_MESSAGE", 10_000)
    with pytest.raises(TypeError, match="frame limit") as info:
        c.echo(b"x" * 20_000)
    assert "picklable" not in str(info.value) and "open files" not in str(info.value)
    monkeypatch.undo()
    assert await c.incr() == 1


async def test_arguments_nested_too_deeply_say_so_and_how_to_fix_it(rt):
    c = await Counter.spawn()
    deep = inner = []
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(TypeError, match=r"nested too deeply.*setrecursionlimit") as info:
        c.echo(deep)
    assert "open files" not in str(info.value) and ".." not in str(info.value)
    assert await c.incr() == 1  # nothing was sent; the actor carries on


async def test_a_result_nested_too_deeply_says_so_and_how_to_fix_it(rt):
    # (the arguments' error said so; the result's only "excessively deep recursion")
    f = await Faulty.spawn()
    with pytest.raises(TypeError, match=r"Faulty.nested cannot be sent back: .*nested too "
                                        r"deeply.*setrecursionlimit"):
        await f.nested(5000)
    assert await f.nested(3) == [[[[]]]]


async def test_what_cannot_be_sent_is_named_by_where_it_lies(rt):
    # Pickling names only the kind of object it could not take; deep in a call's
    # arguments, a result or a stream's item, the error says where it lies too.
    import threading
    from actors import Box
    torch = pytest.importorskip("torch")
    a = await Arrays.spawn()
    big = np.ones(1 << 18)  # (an ordinary array before it: copied, and let go again)
    before = actorshm.stats()
    with pytest.raises(TypeError, match=r"Arrays.unsendable_with\(\): at args\[1\]\['h'\]"
                                        r"\[1\]\.x, cannot pickle '_thread.lock' object"):
        a.unsendable_with([big, list(range(300_000))], {"h": [big, Box(threading.Lock())]})
    # The search pickles the parts with nothing done: no copy counted, nothing spilled,
    # as for any message that was not sent
    after = actorshm.stats()
    for key in ("bytes_copied", "arrays_copied", "messages_spilled", "bytes_spilled"):
        assert after[key] == before[key], key
    with pytest.raises(TypeError, match=r"at kwargs\['b'\]\[1\], a tensor that requires "
                                        r"grad and is not a leaf.*detach"):
        a.unsendable_with(1, b=(1, torch.ones(2, requires_grad=True) * 2))
    with pytest.raises(TypeError, match=r"unsendable_deep cannot be sent back: at "
                                        r"result\['rows'\]\[1\]\.x, cannot pickle"):
        await a.unsendable_deep()
    items = []
    with pytest.raises(TypeError, match=r"unsendable_items cannot be sent: at "
                                        r"item\['rows'\]\[1\]\.x, cannot pickle"):
        async for x in a.unsendable_items():
            items.append(x)
    assert items == [1]
    # The one argument, or the result, as a whole: nothing more to say.
    with pytest.raises(TypeError) as info:
        a.unsendable_with(threading.Lock())
    assert " at " not in str(info.value)
    with pytest.raises(TypeError, match=r"cannot be sent back: at result\[1\], cannot"):
        await a.unsendable_with(None)
    del big, info
    await until(lambda: actorshm.stats()["blocks_live"] == 0)  # the searches kept nothing


class _NoDict:
    def __init__(self):
        object.__setattr__(self, "x", __import__("threading").Lock())

    def __getattribute__(self, name):
        if name == "__dict__":
            raise RuntimeError("no __dict__ here")
        return object.__getattribute__(self, name)


def test_the_search_for_where_is_bounded_and_never_replaces_the_error():
    import threading
    import cloudpickle
    from actorshm._culprit import at
    lock = threading.Lock()
    cyclic = [1]
    cyclic += [cyclic, lock]  # (every level fails alike: the search stops at its bound)
    for root in (_NoDict(), cyclic):
        with pytest.raises(Exception) as info:
            cloudpickle.dumps(root)
        assert at([("args[0]", root), ("args[1]", 2)], info.value, cloudpickle.dumps) == ""
    deep = {"a": [0] * 1000 + [{"b": (1, lock)}]}
    with pytest.raises(TypeError) as info:
        cloudpickle.dumps(deep)
    assert at([("args[0]", 1), ("args[1]", deep)], info.value, cloudpickle.dumps) == \
        "at args[1]['a'][1000]['b'][1], "


async def test_a_cancelled_error_raised_while_pickling_fails_that_message_alone(rt):
    # Raised by a __reduce__, it cancels nothing: the actor sent no reply (sync and async
    # methods, errors) and stopped answering; an argument raised it from the call.
    from actors import CancelsPickling
    a = await Arrays.spawn()
    pid = a.pid
    with pytest.raises(TypeError, match=r"cannot send the arguments of Arrays.echo\(\): a "
                                        r"__reduce__ raised CancelledError"):
        a.echo(CancelsPickling())
    for call in (lambda: a.cancels_pickling("result"), a.cancels_pickling_async):
        with pytest.raises(TypeError, match="cannot be sent back: a __reduce__ raised"):
            await asyncio.wait_for(call(), 30)
        assert await asyncio.wait_for(a.echo(1), 30) == 1
    with pytest.raises(Exception) as info:  # (sent by its state: its own type or a
        await asyncio.wait_for(a.cancels_pickling("error"), 30)  # RemoteError)
    assert "raised" in str(info.value) and not isinstance(info.value, TimeoutError)
    with pytest.raises(TypeError, match="an item of Arrays.cancels_pickling_items cannot "
                                        "be sent: a __reduce__ raised"):
        async for _ in a.cancels_pickling_items():
            pass
    assert await asyncio.wait_for(a.echo(2), 30) == 2 and a.pid == pid
    # A group call encodes once for all members: the same TypeError
    b = await Arrays.spawn()
    with pytest.raises(TypeError, match=r"at args\[0\]\[1\], a __reduce__ raised Cancelled"):
        await actorshm.ActorGroup([a, b]).echo([1, CancelsPickling()])
    # In an actor (Ctrl-C is the driver's), a KeyboardInterrupt raised by a result's
    # pickling is that pickling's too: the call fails, the actor lives (it ended "killed
    # by SIGINT", though no signal was sent)
    with pytest.raises(TypeError, match=r"cannot be sent back: at result\['rows'\]\[1\], a "
                                        r"__reduce__ raised KeyboardInterrupt"):
        await asyncio.wait_for(a.cancels_pickling("interrupting result"), 30)
    assert await asyncio.wait_for(a.echo(3), 30) == 3 and a.pid == pid


async def test_a_pool_call_that_cannot_be_sent_lets_its_array_copies_go_at_once(rt):
    # (the pool's future held the error, whose traceback held the failed encoder's frames
    # in a cycle: the shared copy of each ordinary array stayed until gc ran)
    import gc
    import threading
    from actors import Box
    a = await Arrays.spawn()
    pool = actorshm.ActorPool([a])
    gc.disable()
    try:
        for _ in range(3):
            with pytest.raises(TypeError, match="cannot pickle"):
                await pool.submit(lambda h, v: h.unsendable_with(*v),
                                  (np.ones(1 << 18), Box(threading.Lock())))
            assert actorshm.stats()["blocks_live"] == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", ["r", "rb", "w", "r+b"])
async def test_an_open_file_argument_is_refused_with_what_to_pass(rt, tmp_path, mode):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    c = await Counter.spawn()
    with open(path, mode) as f:
        with pytest.raises(TypeError, match="open file") as info:
            c.echo(f)
        with pytest.raises(TypeError, match="open file"):
            c.echo({"nested": [f]})
    text = str(info.value)
    assert "data.txt" in text and "path" in text and "read()" in text
    assert await c.incr() == 1  # nothing was sent; the actor carries on
    assert await c.echo(str(path)) == str(path)


async def test_an_open_file_result_is_an_error_the_caller_gets(rt, tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    o = await Oversized.spawn()
    # `open` itself travels (a builtin); the file object it returns is made in the actor.
    with pytest.raises(TypeError, match="open file"):
        await o.call(open, str(path))
    assert await o.ok() == "ok"


async def test_out_of_budget_while_copying_an_argument_is_a_memory_error(rt):
    w = await Arrays.spawn()
    pool = _shm.pool()
    old = pool.budget
    pool.budget = pool.reserved + (4 << 20)
    try:
        with pytest.raises(actorshm.SharedMemoryError, match="shm_budget") as info:
            w.echo(np.ones(64 << 20, np.uint8))  # an ordinary array: copied to shared memory
        assert isinstance(info.value, MemoryError)
        assert "picklable" not in str(info.value)
    finally:
        pool.budget = old
    assert await w.echo(3) == 3


async def test_a_big_message_goes_through_the_socket_when_shared_memory_is_full(rt):
    # A pickle over 256 KiB is spilled into our pool; with no room there, the socket
    # takes it as before: no MemoryError for an argument that holds no array.
    w = await Arrays.spawn()
    shared = actorshm.zeros(3)
    pool = _shm.pool()
    old = pool.budget
    pool.budget = pool.reserved + (1 << 20)
    before = actorshm.stats()["messages_spilled"]
    try:
        for big in (b"x" * (4 << 20), [shared, "y" * (4 << 20)],
                    [np.ones(2), b"z" * (4 << 20)], {"k": bytearray(4 << 20)}):
            back = await w.echo(big)
            assert type(back) is type(big) and len(back) == len(big)
    finally:
        pool.budget = old
    assert actorshm.stats()["messages_spilled"] == before


async def test_out_of_budget_while_copying_a_result_is_a_memory_error(rt):
    o = await Oversized.spawn()
    await o.call(_shm.set_budget, 4 << 20)  # the actor's budget only
    with pytest.raises(actorshm.SharedMemoryError, match="shm_budget"):
        await o.call(np.ones, 8 << 20, np.uint8)  # an ordinary array result: copied there
    assert await o.ok() == "ok"


# -- replies that cannot be sent or read: the caller always gets an error -----------------

@pytest.mark.parametrize("method", ["raise_big", "araise_big"])
async def test_an_error_reply_over_the_frame_limit_reaches_the_caller(rt, method):
    o = await Oversized.spawn()
    assert await o.lower_frame_limit(100_000)
    # The exception carries a 1 MB array, pickled in band: over the (lowered) limit.
    with pytest.raises(ValueError, match="payload") as info:
        await asyncio.wait_for(getattr(o, method)(1_000_000), 10)
    assert "frame limit" in str(info.value) or "frame limit" in "".join(
        getattr(info.value, "__notes__", []))
    for _ in range(3):  # the actor's only slot was given back
        assert await asyncio.wait_for(o.ok(), 10) == "ok"


async def test_an_error_reply_over_the_frame_limit_keeps_a_type_whose_init_takes_no_message(
        rt):
    # The cut-short copy was made with type(exc)(message): a keyword-only __init__
    # refused it, and the caller got RemoteError.
    o = await Oversized.spawn()
    assert await o.lower_frame_limit(100_000)
    with pytest.raises(BigKwError, match="payload.*frame limit"):
        await asyncio.wait_for(o.raise_big_kw(1_000_000), 10)
    assert await asyncio.wait_for(o.ok(), 10) == "ok"


async def test_a_big_error_from_init_reaches_spawn_before_the_actor_exits(rt):
    # The actor exits right after its __init__ fails: the error reply (bigger than the
    # socket's buffer) was cut off by the exit, and spawn said ActorDiedError.
    for n in (1_000_000, 8_000_000):
        with pytest.raises(ValueError, match="^x{100}"):
            await asyncio.wait_for(BigInitError.spawn(n), 30)


async def test_a_reply_the_frame_writer_refuses_becomes_an_error_reply(rt):
    o = await Oversized.spawn()
    assert await o.lower_framing_limit_only(100_000)
    with pytest.raises(TypeError, match="cannot be sent back.*frame limit"):
        await asyncio.wait_for(o.call(bytes, 200_000), 10)
    # An error reply the writer refuses: the last resort, its type name and text.
    with pytest.raises(actorshm.RemoteError, match="ValueError.*could not be sent back"):
        await asyncio.wait_for(o.raise_big(200_000), 10)
    assert await asyncio.wait_for(o.ok(), 10) == "ok"


async def test_a_result_frame_that_fails_to_decode_fails_its_call():
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    host = Recorder()
    conn = P.Connection(loop, host, a, "peer")
    fut = conn.call("f", (1,), {})
    other = conn.call("g", (2,), {})
    # A RESULT for call 1 whose block table is not a pickle: a protocol error.
    junk = P.LEN.pack(5) + b"\xff" * 5 + b"."
    with b:
        b.sendall(P.HEADER.pack(len(junk), P.RESULT, W.HAS_BLOCKS, 0, 1) + junk)
        for f in (fut, other):
            with pytest.raises(actorshm.ActorDiedError, match="protocol error"):
                await asyncio.wait_for(f, 5)
    assert conn.closed and not conn.pending


# -- file descriptors a frame does not announce ----------------------------------------

def _release_frame(nfds=0):
    body = b"\x80\x05]\x94."  # pickle of []: no releases
    return P.HEADER.pack(len(body), P.RELEASE, 0, nfds, 0) + body


async def _receiver_of(frames_with_fds, settle=lambda conn: conn.closed):
    """A Connection fed ``(frame bytes, fds to send with it)`` on a raw socket; returns
    it once ``settle(conn)`` holds, and the fd count before it was made."""
    loop = asyncio.get_running_loop()
    fd0 = _fd_count()
    a, b = socket.socketpair()
    conn = P.Connection(loop, Recorder(), a, "peer")
    fut = conn.call("f", (), {})
    with b:
        for frame, fds in frames_with_fds:
            try:
                socket.send_fds(b, [frame], fds) if fds else b.sendall(frame)
            except OSError:  # it closed its end: the rest is not read
                break
            await asyncio.sleep(0)
        await until(lambda: settle(conn))
    return conn, fut, fd0


async def test_fds_a_frame_does_not_announce_close_the_connection_and_are_closed():
    r, w = os.pipe()
    try:
        frames = [(_release_frame(0), [r, w, r, w, r]) for _ in range(40)]
        conn, fut, fd0 = await _receiver_of(frames)
        assert conn.closed and "file descriptor" in str(conn.close_exc)
        with pytest.raises(actorshm.ActorDiedError, match="protocol error"):
            await asyncio.wait_for(fut, 5)
        assert _fd_count() == fd0  # every fd received was closed
    finally:
        os.close(r)
        os.close(w)


async def test_fds_on_a_frame_kind_that_carries_none_are_a_protocol_error():
    r, w = os.pipe()
    try:
        conn, fut, fd0 = await _receiver_of([(_release_frame(2), [r, w])])
        assert conn.closed and "file descriptor" in str(conn.close_exc)
        assert _fd_count() == fd0
    finally:
        os.close(r)
        os.close(w)


async def test_announced_fds_of_a_frame_cut_across_reads_are_kept_for_it():
    # A frame whose fds arrive with its first bytes, and the rest later, is fine.
    r, w = os.pipe()
    try:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        host = Recorder()
        conn = P.Connection(loop, host, a, "peer")
        data = await _call_bytes(loop, [("f", (1,))])
        with b:
            for cut in (3, P.HSIZE + 2):  # the header itself cut, then the payload
                hdr = bytearray(data[:P.HSIZE])
                hdr[6:8] = (1).to_bytes(2, "little")  # it announces one fd
                whole = bytes(hdr) + data[P.HSIZE:]
                socket.send_fds(b, [whole[:cut]], [r])
                await asyncio.sleep(0.05)
                assert not conn.closed
                b.sendall(whole[cut:])
                assert await until(lambda: len(host.calls) == 1 or conn.closed)
                assert not conn.closed and host.calls.pop()[1] == (1,)
        conn.close()
    finally:
        os.close(r)
        os.close(w)


async def _call_bytes(loop, calls):
    """The bytes a Connection writes for ``calls``."""
    a, b = socket.socketpair()
    sender = P.Connection(loop, Recorder(), a, "sender")
    futs = [sender.call(m, args, {}) for m, args in calls]
    await asyncio.sleep(0.05)
    data = b.recv(1 << 20)
    for f in futs:
        f.cancel()
    sender.close()
    b.close()
    return data


# -- a stream that lost its place --------------------------------------------------------

_EMPTY_RELEASES = b"\x80\x05]\x94."  # pickle of []: a release frame with nothing in it
_RELEASE_LEN = P.HSIZE + len(_EMPTY_RELEASES)


async def _feed_after_truncated_frame(swallowed, rest, caplog):
    """A truncated release frame whose header claims ``swallowed`` bytes more than its
    payload, then ``rest``: the reader takes those bytes of ``rest`` as the end of it."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    conn = P.Connection(loop, Recorder(), a, "peer")
    fut = conn.call("f", (), {})
    head = P.HEADER.pack(len(_EMPTY_RELEASES) + swallowed, P.RELEASE, 0, 0, 0)
    with b:
        b.sendall(head + _EMPTY_RELEASES + rest)
        await until(lambda: conn.closed)
    return conn, fut


async def test_a_header_read_from_the_middle_of_a_frame_closes_the_connection(caplog):
    # The bytes the reader lands on look like a header (a known kind, a length it then
    # waits for) but have no frame marker: without one, the call waits forever.
    lookalike = struct.Struct("<IBBHHQ").pack(1 << 20, P.RESULT, 0, 0, 0, 1)
    body = __import__("pickle").dumps(lookalike, 5)
    at = body.index(lookalike)
    valid = P.HEADER.pack(len(body), P.RESULT, W.PLAIN, 0, 99) + body  # for no call
    conn, fut = await _feed_after_truncated_frame(P.HSIZE + at, valid, caplog)
    assert conn.closed and "frame marker" in str(conn.close_exc)
    with pytest.raises(actorshm.ActorDiedError, match="protocol error"):
        await asyncio.wait_for(fut, 5)
    assert any("truncated frame" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("swallowed", [k for k in range(1, 3 * _RELEASE_LEN)
                                       if k % _RELEASE_LEN])
async def test_a_truncated_frame_followed_by_valid_ones_closes_the_connection(
        swallowed, caplog):
    valid = (P.HEADER.pack(len(_EMPTY_RELEASES), P.RELEASE, 0, 0, 0) + _EMPTY_RELEASES) * 5
    # (A multiple of _RELEASE_LEN would land on a header: nothing to detect.)
    conn, fut = await _feed_after_truncated_frame(swallowed, valid, caplog)
    assert conn.closed and "protocol error" in str(conn.close_exc)
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(fut, 5)


class _KeepsOpenOnEof(Recorder):
    """A host that, as the driver does while an actor exits, keeps a connection open a
    while after its peer went away."""

    def __init__(self):
        super().__init__()
        self.eofs = 0

    def connection_eof(self, conn):
        self.eofs += 1


@pytest.mark.parametrize("cork", [False, True])
async def test_a_call_made_after_the_peer_went_away_is_not_written_nor_reported_twice(
        cork):
    # A broken connection writes nothing more: not even a call, which otherwise goes
    # out at once, corked or not; and its end is reported to the host once.
    a, b = socket.socketpair()
    host = _KeepsOpenOnEof()
    conn = P.Connection(asyncio.get_running_loop(), host, a, "caller")
    try:
        b.close()
        await until(lambda: host.eofs)
        assert host.eofs == 1
        if cork:
            conn.cork()
        fut = conn.call("ping", (), {})
        await asyncio.sleep(0.05)
        assert host.eofs == 1
        assert not fut.done() or fut.exception() is not None
        fut.cancel()
    finally:
        conn.close()


_CUT_FDS = '''
import array, asyncio, os, resource, socket, sys, types
from actorshm._framing import FramedSocket, _recv_view
from actorshm._wire import CALL, HEADER

class Reader(FramedSocket):
    def __init__(self):
        super().__init__(asyncio.new_event_loop(), "test")
        self.host = types.SimpleNamespace(read_at=0)
        self.got, self.err = [], None
    def _frame(self, kind, flags, cid, payload, fds):
        self.got.append((cid, [-1 if fd < 0 else os.fstat(fd).st_size >> 20 for fd in fds]))
    def _on_eof(self):
        self.err = "eof"
    def _protocol_error(self, why):
        self.err, self.closed = why, True

ours, theirs = socket.socketpair()
theirs.setblocking(False)
r = Reader()
r.sock, r.fd = theirs, theirs.fileno()
r._rview = _recv_view()
r._rviews = [r._rview]

def memfd(mib):
    fd = os.memfd_create("t")
    os.ftruncate(fd, mib << 20)
    return fd

# Frame 1 (two fds, a payload of several reads), then frame 2 (one fd): the fds of one
# sendmsg come with one read, so frame 2's may come before frame 1 is whole.
ours.sendmsg([HEADER.pack(100_000, CALL, 0, 2, 1), b"x" * 100_000],
             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd(1), memfd(2)]))])
ours.sendmsg([HEADER.pack(10, CALL, 0, 1, 2), b"y" * 10],
             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd(3)]))])
spare = os.open(os.devnull, os.O_RDONLY)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fill = []
while True:  # no fd left
    try:
        fill.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
if sys.argv[1] == "one":
    os.close(fill.pop())  # room for one of frame 1's two fds
    while not r.closed and r._on_readable():
        pass
else:  # room for frame 2's fd only after frame 1's were cut
    r._follow_fds = lambda: None
    r._on_readable()
    os.close(spare)
    while not r.closed and r._on_readable():
        pass
print(r.got, r.err)
'''


@pytest.mark.parametrize("how, got", [
    ("one", [(1, [1, -1]), (2, [-1])]),  # frame 1 got one of its fds, frame 2 none
    ("later", [(1, [-1, -1]), (2, [3])]),  # an fd was free again for frame 2's
])
def test_fds_the_kernel_dropped_fail_their_frame_alone_and_others_keep_theirs(tmp_path,
                                                                             how, got):
    # Out of fds, the kernel drops those a message carries: the connection closed (a
    # protocol error). The frame is read with them as -1, and a frame whose payload
    # spans reads must not take the next frame's fds (it took frame 2's arena as its
    # own, and frame 2 then had none: the connection closed after all).
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _CUT_FDS, how], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{got} None"


def test_a_message_with_more_new_arenas_than_one_send_carries_is_refused_before_sending():
    # 260 new arenas (arrays of 4 MiB or more, each its own) in one call: Linux refuses a
    # sendmsg of over 253 fds, and the connection was taken for broken: the actor lost.
    # (Checked on the encoder: a real run needs a GiB of shared memory.)
    from actorshm._encoding import Encoding, MessageTooBig, add_fd
    enc = Encoding()
    enc._start(None)
    assert [add_fd(enc, 100 + i) for i in range(W.MAX_FDS_PER_SEND)][-1] == \
        W.MAX_FDS_PER_SEND - 1
    with pytest.raises(MessageTooBig, match=r"more than 250 shared-memory arenas new to "
                                            r"the receiver.*send them in several calls"):
        add_fd(enc, 1)
    assert len(enc.fds) == W.MAX_FDS_PER_SEND  # (nothing added past the limit)
    assert W.ANC_SIZE >= socket.CMSG_SPACE(W.MAX_FDS_PER_SEND * 4)  # a reader takes them all
