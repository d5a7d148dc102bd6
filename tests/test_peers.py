"""Actors talking to actors: handles passed on, named actors, brokered connections,
and a peer that breaks the protocol."""

import asyncio
import socket

import pytest

import actorshm
from actorshm import ActorDiedError
from actors import Caller, Counter


async def test_handles_pass_and_call_directly(rt_each):
    c = await Counter.spawn(10)
    caller = await Caller.spawn(c)
    assert await caller.call_other(1) == 11
    assert await caller.call_handle(c, 2) == 13
    back = await caller.make_handle_list()
    assert back == [c] and await back[0].incr(1) == 14


async def test_an_actors_first_call_to_a_peer_is_sent_when_made(rt, tmp_path):
    # The link to a new peer was attached only once the driver's answer was read on the
    # caller's event loop: a method that made its first call to a peer and then blocked
    # its loop held that call back until it returned (later calls left at once).
    from actors import Marker
    caller, marker = await Caller.spawn(), await Marker.spawn()
    for i in range(2):  # (the first call on a new link, then one on the link made)
        assert await caller.call_then_block(marker.mark, str(tmp_path / f"m{i}"), 20)


async def test_a_first_call_made_behind_a_held_driver_call_reaches_its_peer(rt, tmp_path):
    # The link's socket end, sent to the driver with the call that asks for the link,
    # was closed as soon as that call was made: held behind a spawn waiting for its
    # argument's result, it then went without it (EBADF: the actor's connection to the
    # driver broke) or with whatever file took its number (the call failed, "gone").
    from actors import Marker
    caller, counter, marker = await Caller.spawn(), await Counter.spawn(), \
        await Marker.spawn()
    # (nor does its answer wait for the held call: it was read only after it)
    assert await caller.link_behind_a_held_spawn(counter, marker, str(tmp_path / "m")) == \
        (marker.pid, False)
    assert await caller.call_method(marker.mark, str(tmp_path / "m2")) == marker.pid


async def test_a_link_whose_ask_failed_is_asked_for_again(rt, tmp_path):
    # (the half-made link stayed registered: every later call to that actor hung)
    from actors import Marker
    caller, marker = await Caller.spawn(), await Marker.spawn()
    assert await caller.link_after_a_failed_ask(marker, str(tmp_path / "m")) == marker.pid


async def test_nested_error_and_death_through_actor(rt):
    c = await Counter.spawn()
    caller = await Caller.spawn(c)
    await c.kill()
    with pytest.raises(ActorDiedError):
        await caller.call_other(1)


async def test_named_actors(rt):
    c = await Counter.options(name="ctr").spawn(0)
    same = await actorshm.get_actor("ctr")
    assert same == c and await same.incr(3) == 3
    with pytest.raises(ValueError, match="already exists"):
        await Counter.options(name="ctr").spawn(0)
    with pytest.raises(ValueError, match="no live actor named 'missing'"):
        await actorshm.get_actor("missing")
    caller = await Caller.spawn()
    assert await caller.by_name("ctr", 2) == 5


async def test_actor_spawns_actor(rt):
    caller = await Caller.spawn()
    child, value = await caller.spawn_child(41)
    assert value == 42 and await child.incr(1) == 43


@pytest.mark.parametrize("block", [False, True])
async def test_a_spawn_cancelled_inside_an_actor_leaves_nothing_running(rt, block):
    # As in the driver: the driver's start is stopped, or (the reply already sent, which
    # the actor drops) the actor it started is killed. It was left running, unreachable.
    caller = await Caller.spawn()
    assert await caller.spawn_cancelled(0.01 if not block else 2.0, block) == "cancelled"
    for _ in range(250):
        alive = [a for a in rt.actors() if a["class"] == "Counter" and a["alive"]]
        if not alive:
            break
        await asyncio.sleep(0.02)
    assert not alive
    assert (await caller.spawn_child(1))[1] == 2  # (later spawns work)


async def test_spawns_under_way_when_their_actor_dies_leave_nothing_running(rt, tmp_path):
    # The actor that asked can never get the handles: they were left running, unreachable
    # by anyone, until the runtime closed.
    marker = tmp_path / "slow"
    marker.touch()
    caller = await Caller.spawn()
    fut = caller.spawn_slow(str(marker), 2)
    deadline = asyncio.get_running_loop().time() + 30
    while len([a for a in rt.actors() if a["class"] == "SlowStart" and a["alive"]]) < 2:
        assert asyncio.get_running_loop().time() < deadline, rt.actors()
        await asyncio.sleep(0.02)
    await caller.kill()
    with pytest.raises(ActorDiedError):
        await fut
    deadline = asyncio.get_running_loop().time() + 20
    while [a for a in rt.actors() if a["class"] == "SlowStart" and a["alive"]]:
        assert asyncio.get_running_loop().time() < deadline, rt.actors()
        await asyncio.sleep(0.05)
    caller = await Caller.spawn()
    assert (await caller.spawn_child(1))[1] == 2  # (later spawns work)


async def test_malformed_frame_closes_only_that_connection(rt, caplog):
    c = await Counter.spawn()
    caller = await Caller.spawn(c)
    assert await caller.call_other(1) == 1  # caller now has a direct connection to c
    # Inject garbage on brokered connections to c, as a buggy peer would.
    rec = rt._actors[c.actor_id]
    from actorshm._serialization import PassFd
    garbage = [
        b"\xff" * 7 + b"garbage that is not a frame" * 3,                   # bad header
        b"\x10\x00\x00\x00\x01\x00\x00\x00" + b"\x00" * 8 + b"not a pickle....",  # bad body
        b"\x10\x00\x00\x00\x01\x00\x01\x00" + b"\x00" * 8 + b"x" * 16,       # missing fd
        b"\x10\x00\x00\x00\x01\x01\x00\x00" + b"\x00" * 8 + b"y" * 16,       # bad table
    ]
    for junk in garbage:
        a, b = socket.socketpair()
        with a:
            await rec.conn.call("__accept_peer__", (PassFd(b.fileno()), 999, None), {})
            b.close()
            a.sendall(junk)
            a.settimeout(5)
            await asyncio.sleep(0.2)
            assert a.recv(100) == b""  # the actor closed that connection
    assert await c.incr() == 2  # and is otherwise fine
    assert await caller.call_other(1) == 3


async def test_truncated_frame_from_actor_to_driver(rt):
    c = await Counter.spawn()
    rec = rt._actors[c.actor_id]
    # Frames the driver receives that are garbage: the connection closes, the driver lives,
    # the actor is reported dead with a message that says why.
    rec.conn._frame(99, 0, 0, b"", ())
    with pytest.raises(ActorDiedError, match="protocol error"):
        await c.incr()
    other = await Counter.spawn()
    assert await other.incr() == 1
