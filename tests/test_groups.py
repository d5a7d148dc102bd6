"""ActorGroup: broadcast calls, results in member order, failures, shared arrays, spawning."""

import asyncio
import pickle
import sys
import threading
import time

import numpy as np
import pytest

import actorshm
from actorshm import ActorDiedError, ActorError, ActorGroup, ActorGroupError
from actors import Counter, Faulty, InitFailsOnce, PoolWorker, SubCounter
from compat import timeout
from waits import until


async def test_call_every_member_results_in_member_order(rt):
    g = await ActorGroup.spawn(PoolWorker, 3)
    assert len(g) == 3
    assert [h for h in g] == [g[0], g[1], g[2]] and len({h.pid for h in g}) == 3
    tags = await asyncio.gather(*(h.work(0) for h in g))
    fut = g.work("x")  # sent now: an awaitable of every result
    assert await fut == [(t, "x") for t, _ in tags]
    assert await g[1:].work(1) == [(tags[1][0], 1), (tags[2][0], 1)]
    assert isinstance(g[1:], ActorGroup) and len(g[1:]) == 2
    assert pickle.loads(pickle.dumps(g)) == g
    with pytest.raises(AttributeError, match="no public method 'nope'"):
        g.nope
    assert "work" in dir(g)


async def test_groups_and_pools_work_inside_an_actor(rt):
    caller, g = await asyncio.gather(PoolWorker.spawn(9), ActorGroup.spawn(PoolWorker, 2))
    tags = [t for t, _ in await g.work(0)]
    direct, mapped = await caller.broadcast(g, "hi")  # the group pickles
    assert direct == [(t, "hi") for t in tags]
    assert [v for _, v in mapped] == [0, 1, 2]


async def test_members_of_different_classes(rt):
    c, w = await asyncio.gather(Counter.spawn(0), PoolWorker.spawn(7))
    g = ActorGroup([c, w])
    with pytest.raises(AttributeError, match="member 1 .*PoolWorker.* no public method 'incr'"):
        g.incr
    assert "incr" not in dir(g)


async def test_failure_names_the_failed_members_after_every_call_ended(rt):
    g = await ActorGroup.spawn(PoolWorker, 3)
    tags = [t for t, _ in await g.work(0)]
    slow = g.work("late", 0.4)  # member 1 dies while the others are busy
    await asyncio.sleep(0.1)
    await g[1].kill()
    with pytest.raises(ActorGroupError) as info:
        await slow
    err = info.value
    assert err.failed == [1]
    assert isinstance(err, ActorError) and isinstance(err.exceptions[0], ActorDiedError)
    # the await waited for the slow members: their results are there
    assert err.results == [(tags[0], "late"), None, (tags[2], "late")]
    assert "1 of 3 calls of PoolWorker.work failed: member 1 (actor PoolWorker id=" in str(err)
    if sys.version_info >= (3, 11):
        assert isinstance(err, ExceptionGroup)  # noqa: F821
        match, rest = err.split(ActorDiedError)
        assert isinstance(match, ActorGroupError) and match.failed == [1] and rest is None


async def test_partial_failure_keeps_the_remote_exception_type(rt):
    g = ActorGroup([await PoolWorker.spawn(i) for i in range(3)])
    with pytest.raises(ActorGroupError) as info:
        await g.fail_if_tag(2)  # the same argument for all: only member 2 has tag 2
    err = info.value
    assert err.failed == [2] and isinstance(err.exceptions[0], ValueError)
    assert err.results == [0, 1, None]
    assert "member 2" in str(err) and "ValueError: tag 2 fails" in str(err)
    assert pickle.loads(pickle.dumps(err)).failed == [2]


async def test_group_call_from_a_thread_without_a_loop_blocks_on_the_results(rt):
    g = ActorGroup([await PoolWorker.spawn(i) for i in range(3)])

    def failing():
        with pytest.raises(ActorGroupError) as info:
            g.fail_if_tag(1).result(timeout=10)
        return info.value

    # a driver thread without an event loop, as a single call from a thread
    assert await asyncio.to_thread(lambda: g.work("b").result(timeout=10)) == [
        (0, "b"), (1, "b"), (2, "b")]
    err = await asyncio.to_thread(failing)
    assert err.failed == [1] and isinstance(err.exceptions[0], ValueError)
    assert err.results == [0, None, 2] and "member 1 (actor PoolWorker" in str(err)
    # cancelled from the thread, every member's call is cancelled
    slow = await asyncio.to_thread(lambda: g.work("slow", 30))
    await asyncio.sleep(0.1)
    assert [c["active"] for c in await g.counts()] == [1, 1, 1]
    assert slow.cancel()
    for _ in range(200):
        if not any(c["active"] for c in await g.counts()):
            break
        await asyncio.sleep(0.02)
    assert [c["active"] for c in await g.counts()] == [0, 0, 0]


async def test_a_group_call_cancelled_from_a_thread_settles_quietly(rt, caplog):
    """Its members' calls, cancelled in turn, settled the cancelled future again: making
    an ActorGroupError of their CancelledErrors raised TypeError ('Cannot nest
    BaseExceptions') in concurrent.futures' callback, which logged it."""
    g = ActorGroup([await PoolWorker.spawn(i) for i in range(2)])

    def cancel_in_thread():
        fut = g.work("slow", 30)
        time.sleep(0.1)
        return fut.cancel(), fut.cancelled()

    assert await asyncio.to_thread(cancel_in_thread) == (True, True)
    for _ in range(200):
        if not any(c["active"] for c in await g.counts()):
            break
        await asyncio.sleep(0.02)
    assert [c["active"] for c in await g.counts()] == [0, 0]
    assert "exception calling callback" not in caplog.text
    assert "Cannot nest" not in caplog.text


async def test_group_call_awaited_on_a_threads_own_loop_wakes_it(rt):
    g = ActorGroup([await PoolWorker.spawn(i) for i in range(2)])

    def own_loop():  # a thread with an event loop of its own: awaited there
        async def go():
            start = time.monotonic()
            out = await asyncio.wait_for(g.work("a"), 10)  # (the timer would wake it)
            return out, time.monotonic() - start
        return asyncio.run(go())

    out, took = await asyncio.to_thread(own_loop)
    assert out == [(0, "a"), (1, "a")] and took < 5


async def test_group_call_in_a_sync_method_running_in_a_thread_can_block(rt):
    from actors import ThreadedCaller
    g = ActorGroup([await PoolWorker.spawn(i) for i in range(2)])
    t = await ThreadedCaller.spawn()  # max_concurrency=2: its sync methods run in threads
    assert await t.group_and_wait(g, "t") == [(0, "t"), (1, "t")]


async def test_shared_array_goes_by_reference_to_every_member(rt):
    g = await ActorGroup.spawn(PoolWorker, 4)
    a = actorshm.zeros(1 << 18)  # 2 MiB, shared
    before = actorshm.stats()
    assert await g.write_at(a, 0, 1.0) == [True] * 4
    for i, h in enumerate(g):  # every member sees (and writes) the same memory
        await h.write_at(a, i + 1, i + 1)
    assert list(a[:5]) == [1.0, 1.0, 2.0, 3.0, 4.0]
    s = actorshm.stats()
    assert s["bytes_copied"] == before["bytes_copied"]  # 0 bytes copied
    assert s["bytes_zero_copy"] - before["bytes_zero_copy"] == 8 * a.nbytes


async def test_ordinary_array_is_copied_once_for_the_whole_group(rt):
    g = await ActorGroup.spawn(PoolWorker, 3)
    a = np.ones(1 << 17)  # 1 MiB, not shared
    before = actorshm.stats()
    assert await g.sum(a) == [float(1 << 17)] * 3
    assert await g.sum([a, {"k": (a,)}][1]["k"][0]) == [float(1 << 17)] * 3
    s = actorshm.stats()
    assert s["bytes_copied"] - before["bytes_copied"] == 2 * a.nbytes  # once per call
    # ... and by reference to the two other members, as one call per member would count
    # it and as a group call counts a tensor or an array deep in an object (it counted
    # all three by reference too: copied once and passed by reference to every member)
    assert s["bytes_zero_copy"] - before["bytes_zero_copy"] == 4 * a.nbytes
    assert s["arrays_zero_copy"] - before["arrays_zero_copy"] == 4
    # the shared copy goes home once every member dropped it
    for _ in range(200):
        if actorshm.stats()["blocks_live"] <= before["blocks_live"]:
            break
        await asyncio.sleep(0.02)
    assert actorshm.stats()["blocks_live"] <= before["blocks_live"]


async def test_a_group_call_counts_an_ordinary_tensor_as_an_ordinary_array(rt):
    # the ndarray, copied once for the group, was counted by reference for every member
    # as well (one more than the tensor, and than the members that got it by reference)
    torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    g = await ActorGroup.spawn(PoolWorker, 3)
    moved = []
    for x in (np.ones(1 << 16), torch.ones(1 << 16, dtype=torch.float64)):
        before = actorshm.stats()
        assert await g.sum(x) == [float(1 << 16)] * 3
        s = actorshm.stats()
        moved.append(tuple(s[k] - before[k] for k in (
            "bytes_copied", "arrays_copied", "bytes_zero_copy", "arrays_zero_copy")))
    assert moved[0] == moved[1] == (1 << 19, 1, 2 << 19, 2)
    # the same when the members' calls are encoded one by one, later: from another
    # thread, and waiting for an argument (a call's result) first. (They were counted by
    # reference for all three members; adjusting after the calls, from the process's
    # counters, could take other calls' arrays for them and drive the counters below 0.)
    x = np.ones(1 << 16)
    counter = await Counter.spawn(0)
    for call in (lambda: asyncio.to_thread(lambda: g.sum(x).result(30)),
                 lambda: g.write_at(x, counter.incr(0), 1.0)):
        before = actorshm.stats()
        await call()
        s = actorshm.stats()
        assert tuple(s[k] - before[k] for k in ("bytes_copied", "arrays_copied",
                                                "bytes_zero_copy", "arrays_zero_copy")) == \
            (1 << 19, 1, 2 << 19, 2)


async def test_what_recurs_in_a_group_call_arrives_once_as_in_a_single_call(rt):
    g = await ActorGroup.spawn(PoolWorker, 2)
    x, lst = np.ones(1000), [1, 2]
    cyc: list = [1]
    cyc.append(cyc)  # a list that holds itself: no RecursionError
    msg = [x, x, [lst, lst], cyc]
    assert await g[0].aliases(msg) == (True, True, True)
    before = actorshm.stats()["bytes_copied"]
    assert await g.aliases(msg) == [(True, True, True)] * 2
    assert actorshm.stats()["bytes_copied"] - before == x.nbytes  # one copy, not two


async def test_cancelling_a_group_call_ends_the_await_at_once(rt):
    g = await ActorGroup.spawn(PoolWorker.options(max_pending_calls=1), 2)
    fut = g.work(1, 30)
    await asyncio.sleep(0.05)
    with pytest.raises(actorshm.PendingCallsLimitError):
        g.work(2)  # one call per member is unanswered
    fut.cancel()  # cancels every member's call (as cancelling each call would), at once:
    after = g.work(2)  # no member call is left unanswered, so a new one may go out
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(fut, 5)
    assert await asyncio.wait_for(after, 10) == [(0, 2), (0, 2)]


async def test_spawn_overlaps_start_up(tmp_path):
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=1.0):
        g = await ActorGroup.spawn(PoolWorker.options(max_concurrency=2), 3, 0, 1.0)
        times = await g.init_times()
        # every __init__ (1 s each) started before the first one ended
        assert max(s for s, _ in times) < min(e for _, e in times)
        await g.kill()
        with pytest.raises(ActorGroupError):
            await g.work(1)


async def test_spawn_failure_stops_the_others(rt, tmp_path):
    with pytest.raises(ActorGroupError) as info:
        await ActorGroup.spawn(InitFailsOnce, 3, str(tmp_path / "marker"))
    err = info.value
    assert len(err.failed) == 1 and isinstance(err.exceptions[0], KeyError)
    assert "1 of 3 actors failed to start (InitFailsOnce.__init__)" in str(err)
    assert "the 2 that started were stopped" in str(err)
    assert all(not r["alive"] for r in rt.actors())
    with pytest.raises(ActorGroupError, match="3 of 3"):
        await ActorGroup.spawn(Faulty, 3, True)


async def test_bad_input_is_a_clear_error(rt):
    c = await Counter.spawn(0)
    with pytest.raises(ValueError, match="at least one actor"):
        ActorGroup([])
    with pytest.raises(TypeError, match="item 1 is of type str, not an actor handle"):
        ActorGroup([c, "x"])
    with pytest.raises(TypeError, match="@actor class"):
        await ActorGroup.spawn(int, 2)
    with pytest.raises(ValueError, match="n must be >= 1"):
        await ActorGroup.spawn(Counter, 0)
    with pytest.raises(TypeError, match="n must be an int"):
        await ActorGroup.spawn(Counter, 2.0)
    with pytest.raises(ValueError, match="one name"):
        await ActorGroup.spawn(Counter.options(name="c"), 2)
    # an actor option passed to spawn (Ray's spelling read as ours): said before any
    # process starts, not by each member's __init__ in its actor
    started = len(actorshm.current_runtime().actors())
    with pytest.raises(TypeError, match=r"ActorGroup\.spawn\(\) got name=\.\.\.: actor "
                                        r"option\(s\), which Counter\.__init__ does not "
                                        r"take.*`await ActorGroup\.spawn\(Counter\.options"):
        await ActorGroup.spawn(Counter, 2, name="c")
    with pytest.raises(TypeError, match=r"Counter\.spawn\(\) got num_cpus=\.\.\., "
                                        r"max_restarts=\.\.\.: .*`await Counter\.options\("
                                        r"num_cpus=\.\.\., max_restarts=\.\.\.\)\.spawn"):
        await Counter.spawn(1, num_cpus=2, max_restarts=1)
    assert len(actorshm.current_runtime().actors()) == started  # (none was started)
    g = ActorGroup([c])
    with pytest.raises(AttributeError, match=r"group\.incr\.remote: a group's method is "
                                             r"called directly.*`await group\.incr\(\.\.\.\)`"):
        g.incr.remote
    with pytest.raises(AttributeError, match=r"Counter\.options\(\.\.\.\)\.remote: an "
                                             r"actorshm actor is started with `await Counter"):
        Counter.options(name="x").remote()
    with pytest.raises(TypeError):  # cannot be serialized: raised by the call, nothing sent
        g.echo(threading.Lock())
    assert await g.incr() == [1]


async def test_spawn_takes_an_undecorated_subclass_of_an_actor_class(rt):
    # ``SubCounter.spawn()`` works, so ActorGroup.spawn must not ask to decorate it
    g = await ActorGroup.spawn(SubCounter, 2, 5)
    assert await g.kind() == ["SubCounter", "SubCounter"]
    assert await g.incr() == [6, 6]


async def test_a_spawn_cancelled_twice_leaves_no_actor_running(rt, tmp_path):
    # A second cancel (an outer time-out on top of the first) reached the spawn while it
    # waited for its cancelled starts to end: the members already started were never
    # killed, and ran on with no handle to them.
    from actors import Staggered
    task = asyncio.ensure_future(ActorGroup.spawn(Staggered, 4, str(tmp_path / "t"), 2, 3.0))
    async with timeout(20):  # (two members start, two sleep in __init__)
        while len([r for r in rt.actors() if r["alive"]]) < 4 or \
                len(list(tmp_path.iterdir())) < 4:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.sleep(0)  # (it waits for the cancelled starts now)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert await until(lambda: not any(r["alive"] for r in rt.actors()), timeout=10), \
        rt.actors()


async def test_cancelled_spawn_leaves_no_actor_running(rt):
    task = asyncio.ensure_future(ActorGroup.spawn(PoolWorker, 3, 0, 2.0))  # __init__: 2 s
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    for _ in range(200):
        if not any(r["alive"] for r in rt.actors()):
            break
        await asyncio.sleep(0.02)
    assert len(rt.actors()) == 3 and not any(r["alive"] for r in rt.actors())
