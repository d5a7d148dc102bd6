"""Group calls encoded once for every member (``_multicast``): leases, regions, fallbacks."""

import asyncio
import types

import numpy as np
import pytest

import actorshm
from actorshm import ActorDiedError, ActorGroup, ActorGroupError
from actorshm import _serialization, _shm
from actors import Arrays, Counter, PoolWorker
from waits import until


def _ledger(rt, h):
    return rt._actors[h._actor_id].conn.ledger


async def test_a_group_call_is_encoded_once(rt, monkeypatch):
    g = await ActorGroup.spawn(PoolWorker, 4)
    a = actorshm.zeros(1000)
    encoded = []
    real = _serialization.encode

    def counting(obj, conn):
        if type(obj) is tuple and obj[0] == "sum":
            encoded.append(conn)
        return real(obj, conn)

    monkeypatch.setattr(_serialization, "encode", counting)
    assert await g.sum(a) == [0.0] * 4
    assert await g.sum(a) == [0.0] * 4
    assert len(encoded) == 2  # once per group call, not once per member


async def test_one_lease_per_member_and_each_region_introduced_once_per_member(rt):
    g = await ActorGroup.spawn(Arrays, 3)
    a = actorshm.zeros(1000)
    b = actorshm.zeros(1 << 22)  # (its own arena)
    key = _shm.find_block(a).key
    assert await g[0].sum(a) == 0.0  # member 0 knows a's region already, the others not
    assert await g.keep(a) == [True] * 3  # each member got the fd it lacked, and only it
    for h in g:
        assert {k: gr.count for k, gr in _ledger(rt, h).grants.items()} == {key: 1}
        assert _shm.find_block(a).region.key in _ledger(rt, h).sent_regions
    out = await g.echo([b, a, b])  # a region every member knows, and one none does
    assert all(np.shares_memory(x, b) and np.shares_memory(y, a) for x, y, _ in out)
    for h in g:
        assert _shm.find_block(b).region.key in _ledger(rt, h).sent_regions
    assert await g.drop() == [True] * 3
    del out
    assert await until(lambda: all(not _ledger(rt, h).grants for h in g))


async def test_each_member_maps_the_arena_once(rt):
    g = await ActorGroup.spawn(PoolWorker, 3)
    a = actorshm.zeros(1000)
    assert await g[1].sum(a) == 0.0
    mapped = [s["arenas_mapped"] for s in await g.stats()]
    for _ in range(3):
        assert await g.sum(a) == [0.0] * 3
    after = [s["arenas_mapped"] for s in await g.stats()]
    assert [x - y for x, y in zip(after, mapped)] == [1, 0, 1]


async def test_a_member_dying_mid_call_fails_alone_and_the_block_goes_home(rt):
    g = await ActorGroup.spawn(PoolWorker, 3)
    a = actorshm.zeros(1 << 16)
    live = actorshm.stats()["blocks_live"]
    call = g.work(a, 0.5)
    await asyncio.sleep(0.1)
    assert all(_ledger(rt, h).grants for h in g)  # each member holds its lease
    await g[1].kill()
    with pytest.raises(ActorGroupError) as info:
        await call
    err = info.value
    assert err.failed == [1] and isinstance(err.exceptions[0], ActorDiedError)
    assert [r is None for r in err.results] == [False, True, False]
    assert np.shares_memory(err.results[0][1], a) and np.shares_memory(err.results[2][1], a)
    del err, info, call
    assert await until(lambda: not _ledger(rt, g[0]).grants and not _ledger(rt, g[2]).grants)
    del a
    assert await until(lambda: actorshm.stats()["blocks_live"] < live)


async def test_an_ordinary_array_deep_in_an_object_is_copied_once_per_group_call(rt):
    g = await ActorGroup.spawn(Counter, 3)
    box = types.SimpleNamespace(a=np.arange(1 << 15, dtype=np.float64))  # not shared
    before = actorshm.stats()
    out = await g.echo(box)
    s = actorshm.stats()
    assert s["bytes_copied"] - before["bytes_copied"] == box.a.nbytes  # once, not 3 times
    assert s["bytes_zero_copy"] - before["bytes_zero_copy"] == 2 * box.a.nbytes  # the rest
    assert all(np.array_equal(o.a, box.a) for o in out)
    assert np.shares_memory(out[0].a, out[1].a) and np.shares_memory(out[1].a, out[2].a)


async def test_a_big_message_is_spilled_once_for_every_member(rt):
    # Its pickle goes into one block of our pool, leased to each member, and home.
    g = await ActorGroup.spawn(Counter, 3)
    box = types.SimpleNamespace(text="é" * (1 << 20), a=actorshm.zeros(4))
    await g.echo(0)
    before = actorshm.stats()
    for _ in range(3):
        out = await g.echo(box)
        assert all(o.text == box.text and np.shares_memory(o.a, box.a) for o in out)
    s = actorshm.stats()
    assert s["messages_spilled"] - before["messages_spilled"] == 3  # once per group call
    assert s["bytes_spilled"] - before["bytes_spilled"] >= 3 * len(box.text)
    assert s["pool_allocs"] - before["pool_allocs"] <= 1  # then reused
    del out
    assert await until(lambda: actorshm.stats()["blocks_live"] <= before["blocks_live"])


async def test_a_group_call_made_member_by_member_counts_each_spill_once(rt):
    # An fd riding along: the call cannot be encoded once for all, and the spill of the
    # encoding given up must not be counted beside each member's own.
    import os
    from actorshm._serialization import PassFd
    g = await ActorGroup.spawn(Counter, 3)
    r, w = os.pipe()
    try:
        before = actorshm.stats()
        out = await g.echo((PassFd(r), b"x" * (1 << 20)))
        s = actorshm.stats()
    finally:
        os.close(w)
        os.close(r)
    assert all(blob == b"x" * (1 << 20) for _, blob in out)  # (each fd is the actor's)
    assert s["messages_spilled"] - before["messages_spilled"] == 3
    assert s["bytes_spilled"] - before["bytes_spilled"] < 4 << 20


async def test_a_small_array_in_band_is_a_copy_for_every_member(rt):
    g = await ActorGroup.spawn(Counter, 3)
    box = types.SimpleNamespace(a=np.arange(16, dtype=np.float64))  # small: in band
    before = actorshm.stats()
    out = await g.echo(box)
    s = actorshm.stats()
    assert all(np.array_equal(o.a, box.a) for o in out)
    assert not np.shares_memory(out[0].a, out[1].a)  # each member got its own copy
    assert s["bytes_copied"] - before["bytes_copied"] == 3 * box.a.nbytes
    assert s["arrays_copied"] - before["arrays_copied"] == 3
    assert s["bytes_zero_copy"] == before["bytes_zero_copy"]


async def test_a_call_held_on_one_member_keeps_its_order_there(rt):
    c0, c1, other = await asyncio.gather(*(Counter.spawn(0) for _ in range(3)))
    slow = other.slow_record(1, 0.3)
    first = c0.record(slow)  # held on c0's connection until `slow` is done
    both = ActorGroup([c0, c1]).record(2)
    assert await first == 1 and await both == [2, 2]
    assert await c0.get_log() == [1, 2] and await c1.get_log() == [2]


async def test_an_unfinished_result_as_argument_goes_to_every_member(rt):
    g, other = await asyncio.gather(ActorGroup.spawn(Counter, 3), Counter.spawn(0))
    assert await g.echo(other.slow_record(5, 0.2)) == [5, 5, 5]
    a = actorshm.zeros(1000)
    counted = []
    for group_call in (True, False):
        before = actorshm.stats()["bytes_zero_copy"]
        slow = other.slow_record(6, 0.2)
        if group_call:  # one call per member, each held until `slow` is done
            out = await g.echo((a, slow))
        else:
            out = await asyncio.gather(*(h.echo((a, slow)) for h in g))
        assert [x[1] for x in out] == [6, 6, 6] and np.shares_memory(out[2][0], a)
        counted.append(actorshm.stats()["bytes_zero_copy"] - before)
    # counted as its member calls count: nothing more for the encoding it gave up
    assert counted[0] == counted[1]


async def test_a_cancelled_call_as_argument_fails_the_group_call_naming_it(rt):
    # Each member's call failed with a CancelledError, which the group's error (an
    # ExceptionGroup) cannot hold: a TypeError in a callback, and the await never ended
    g, other = await asyncio.gather(ActorGroup.spawn(Counter, 2), Counter.spawn(0))
    dep = other.slow_record(1, 5.0)
    dep.cancel()
    with pytest.raises(ActorGroupError, match="given as an argument was cancelled") as info:
        await asyncio.wait_for(g.echo(dep), 10)
    assert info.value.failed == [0, 1]
    assert await g.echo(3) == [3, 3]


async def test_cancelling_a_group_call_cancels_every_members_call(rt):
    g = await ActorGroup.spawn(PoolWorker, 3)
    fut = g.work(actorshm.zeros(100), 30)
    await asyncio.sleep(0.1)
    fut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(fut, 5)

    async def idle():
        return [c["active"] for c in await g.counts()] == [0, 0, 0]

    for _ in range(100):
        if await idle():
            break
        await asyncio.sleep(0.05)
    assert await idle()
    assert await until(lambda: all(not _ledger(rt, h).grants for h in g))


async def test_an_actor_passes_a_block_it_received_on_to_its_group(rt):
    caller, g = await asyncio.gather(PoolWorker.spawn(9), ActorGroup.spawn(PoolWorker, 3))
    tags = [t for t, _ in await g.work(0)]
    a = actorshm.zeros(1 << 14)
    live = actorshm.stats()["blocks_live"]
    direct, _ = await caller.broadcast(g, a)  # the driver's block, relayed by `caller`
    assert [t for t, _ in direct] == tags
    assert all(np.shares_memory(x, a) for _, x in direct)
    del direct, a
    assert await until(lambda: actorshm.stats()["blocks_live"] < live)
