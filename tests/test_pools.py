"""ActorPool: load balancing with one call per actor in flight, ordering, deaths, members."""

import asyncio
import threading

import pytest

import actorshm
from actorshm import ActorDiedError, ActorPool
from compat import TimeoutError, timeout
from actors import Counter, FlakyStart, Phoenix, PoolWorker
from call_actors import Relay


def work(a, v):
    return a.work(v)


async def workers(n):
    return await asyncio.gather(*(PoolWorker.spawn(i) for i in range(n)))


def _inputs_one_cancelled(first, last):
    """Three futures as a pool's inputs: ``first``, a cancelled one, ``last``."""
    loop = asyncio.get_running_loop()
    inputs = [loop.create_future() for _ in range(3)]
    inputs[0].set_result(first)
    inputs[1].cancel()
    inputs[2].set_result(last)
    return inputs


async def _until_idle(ws):
    """Wait (2 s at most) until no call runs in the PoolWorkers ``ws``."""
    for w in ws:
        for _ in range(100):
            if (await w.counts())["active"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await w.counts())["active"] == 0


async def test_map_yields_in_input_order_and_spreads_work(rt):
    ws = await workers(2)
    pool = ActorPool(ws)
    delays = [0.2, 0.0, 0.1, 0.0, 0.0, 0.05]  # later items finish first
    out = [r async for r in pool.map(lambda a, v: a.work(v, delays[v]), range(6))]
    assert [v for _, v in out] == list(range(6))
    assert {tag for tag, _ in out} == {0, 1}


async def test_map_unordered_yields_in_completion_order(rt):
    pool = ActorPool(await workers(2))
    delays = [1.0, 0.0, 0.0, 0.0]  # item 0 holds one actor; the other does 1, 2, 3
    out = [v async for _, v in pool.map_unordered(lambda a, v: a.work(v, delays[v]),
                                                   range(4))]
    assert out == [1, 2, 3, 0]


async def test_one_call_per_actor_in_flight(rt):
    ws = await workers(3)  # each allows 8 concurrent calls: only the pool limits them
    pool = ActorPool(ws)
    futs = [pool.submit(lambda a, v: a.work(v, 0.02), v) for v in range(12)]
    assert len(await asyncio.gather(*futs)) == 12
    counts = await asyncio.gather(*(w.counts() for w in ws))
    assert [c["peak"] for c in counts] == [1, 1, 1]
    assert sum(c["calls"] for c in counts) == 12


async def test_submit_starts_at_once_and_returns_an_awaitable(rt):
    c = await Counter.spawn(0)
    pool = ActorPool([c])
    f1 = pool.submit(lambda a, v: a.record(v), 1)
    f2 = pool.submit(lambda a, v: a.record(v), 2)  # queued until the first is done
    assert not f2.done()
    assert await f2 == 2 and await f1 == 1
    assert await c.get_log() == [1, 2]  # queued work runs in submission order

    async def two_calls(a, v):  # an async fn may make several calls on its actor
        return await a.incr(v) + await a.incr(v)
    assert await pool.submit(two_calls, 5) == 5 + 10


async def test_errors_reach_the_awaitable_and_the_pool_goes_on(rt):
    pool = ActorPool(await workers(2))
    with pytest.raises(ValueError, match="bad value 3"):
        async for _ in pool.map(lambda a, v: a.fail_if(v, 3), range(6)):
            pass
    # a fn that returns no awaitable
    with pytest.raises(TypeError, match="must return an awaitable"):
        await pool.submit(lambda a, v: v, 1)
    # everything cancelled and freed: the pool is usable again, both actors free
    assert sorted([v async for v in pool.map(lambda a, v: a.fail_if(v, -1), range(4))]) \
        == [0, 1, 2, 3]
    assert pool.has_free()


async def test_a_failed_map_item_is_freed_with_no_collector_run(rt):
    # The error's traceback kept the frame that took the item's result, and that frame
    # the item, which keeps the error: a reference cycle per failed item, the caller's
    # frames in it (their arrays with them) until the garbage collector ran.
    import gc
    pool = ActorPool(await workers(1))
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(ValueError, match="bad value 0"):
            async for _ in pool.map(lambda a, v: a.fail_if(v, 0), [0]):
                pass
        await asyncio.sleep(0.05)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycles = [type(o).__name__ for o in gc.garbage if isinstance(o, asyncio.Future)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycles == []


async def test_many_queued_items_that_fail_at_once_each_fail_and_the_pool_goes_on(rt):
    # An item whose fn fails at once frees its actor for the next item at once: 3,000 of
    # them queued behind a busy actor must not recurse (RecursionError lost an actor).
    pool = ActorPool(await workers(1))
    busy = pool.submit(lambda a, v: a.work(v, 0.3), "busy")
    bad = [pool.submit(lambda a, v: v, i) for i in range(3000)]
    assert await busy == (0, "busy")
    done, pending = await asyncio.wait(bad, timeout=10)
    assert not pending
    assert all(isinstance(f.exception(), TypeError) for f in done)
    assert await asyncio.wait_for(pool.submit(work, "after"), 10) == (0, "after")
    assert pool.has_free()


async def test_member_dying_mid_map_fails_with_actor_died_not_a_hang(rt):
    ws = await workers(2)
    pool = ActorPool(ws)

    async def consume():
        return [r async for r in pool.map(lambda a, v: a.die_if(v, 3), range(8))]
    with pytest.raises(ActorDiedError):
        await asyncio.wait_for(consume(), 10)
    assert len(pool) == 1  # the dead member left the pool
    survivor = list(pool)[0]
    assert await asyncio.wait_for(
        pool.submit(lambda a, v: a.work(v), 9), 10) == (await survivor.work(0))[:1] + (9,)
    # the last member dies too: queued and new work fail instead of waiting forever
    f1 = pool.submit(lambda a, v: a.die_if(v, v), 1)
    f2 = pool.submit(lambda a, v: a.work(v), 2)
    with pytest.raises(ActorDiedError):
        await asyncio.wait_for(f1, 10)
    with pytest.raises(ActorDiedError, match="every actor of this ActorPool has died"):
        await asyncio.wait_for(f2, 10)
    with pytest.raises(ActorDiedError, match="has died"):
        pool.submit(lambda a, v: a.work(v), 3)


async def test_a_member_killed_mid_item_fails_that_item_only(rt):
    # kill() fails the member's call at once, before the kill's task marks the actor
    # dead for good: the pool took it for a member that would restart, gave it the next
    # item, and that one failed too.
    a, b = await workers(2)
    pool = ActorPool([a, b])
    futs = [pool.submit(lambda m, v: m.work(v, 0.5), v) for v in range(4)]
    async with timeout(10):  # (items 0 and 1 run)
        while (await b.counts())["active"] == 0:
            await asyncio.sleep(0.01)
    await b.kill()
    out = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
    assert [i for i, r in enumerate(out) if isinstance(r, ActorDiedError)] == [1], out
    assert len(pool) == 1


async def test_another_actors_death_raised_by_a_member_keeps_the_member(rt):
    # Errors keep their type: a member whose method awaited a dead actor raises
    # ActorDiedError too, but it lives, and stays in the pool.
    members = await asyncio.gather(Relay.spawn(), Relay.spawn())
    gone = await Relay.spawn()
    await gone.kill()
    pool = ActorPool(members)
    for f in [pool.submit(lambda a, v: a.call_back(v), gone) for _ in range(4)]:
        with pytest.raises(ActorDiedError):
            await asyncio.wait_for(f, 10)
    assert len(pool) == 2
    out = [r async for r in pool.map(lambda a, v: a.ping(), range(4))]
    assert out == ["pong"] * 4


async def test_a_member_that_restarts_stays_and_gets_work_again(rt):
    members = await asyncio.gather(Phoenix.spawn(0), Phoenix.spawn(1))  # max_restarts=1
    pool = ActorPool(members)
    with pytest.raises(ActorDiedError):
        await asyncio.wait_for(pool.submit(lambda a, v: a.crash(), None), 10)
    assert len(pool) == 2  # it restarts: still a member; its next call waits for it
    tags = {r[0] async for r in pool.map(lambda a, v: a.hit(), range(20))}
    assert tags == {0, 1}
    one = ActorPool([members[0]])  # out of restarts now: its death is for good
    with pytest.raises(ActorDiedError):
        await asyncio.wait_for(one.submit(lambda a, v: a.crash(), None), 10)
    assert len(one) == 0
    with pytest.raises(ActorDiedError, match="has died"):
        one.submit(lambda a, v: a.hit(), None)


async def test_a_member_whose_restart_dies_while_starting_stays_and_gets_the_queue(
        rt, tmp_path):
    # Between a restarted process dying while it starts and the next restart, calls on
    # the actor fail at once: the pool neither drops the member (restarts are left) nor
    # burns its queue on it; the queued work waits for the restart that works.
    marker = tmp_path / "crash-next-start"
    a = await FlakyStart.spawn(str(marker))  # max_restarts=3
    pid1 = await a.ping()
    pool = ActorPool([a])
    marker.write_text("x")  # the first restart's __init__ crashes; the second works
    with pytest.raises(ActorDiedError):
        await asyncio.wait_for(pool.submit(lambda h, v: h.crash(), None), 10)
    first = pool.submit(lambda h, v: h.ping(), 0)  # waits for the restart that dies
    queued = [pool.submit(lambda h, v: h.ping(), v) for v in range(1, 6)]
    with pytest.raises(ActorDiedError):  # a call pending at a death fails (at most once)
        await asyncio.wait_for(first, 10)
    assert len(pool) == 1
    pids = await asyncio.wait_for(asyncio.gather(*queued), 20)
    assert len(set(pids)) == 1 and pids[0] != pid1 and not marker.exists()


async def test_a_member_whose_restarts_all_die_while_starting_leaves_at_the_last(
        rt, tmp_path):
    marker = tmp_path / "crash-every-start"
    a = await FlakyStart.spawn(str(marker), False)  # max_restarts=3, each restart dies
    pool = ActorPool([a])
    marker.write_text("x")
    futs = [pool.submit(lambda h, v: h.crash(), None)]
    futs += [pool.submit(lambda h, v: h.ping(), v) for v in range(12)]
    out = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30)
    assert all(isinstance(e, ActorDiedError) for e in out)
    # the death, then one call per restart that died (each waited for its restart),
    # then the member left, dead for good, and the rest failed at once
    died = [str(e) for e in out if "every actor" not in str(e)]
    assert len(died) == 4 and "code 9" in died[0] and all("code 3" in d for d in died[1:])
    assert len(pool) == 0


async def test_leaving_map_early_cancels_the_work_in_flight(rt):
    pool = ActorPool(await workers(2))
    delays = {0: 0.0, 1: 30.0}
    async for _ in pool.map_unordered(lambda a, v: a.work(v, delays.get(v, 0)), range(2)):
        break  # item 1 sleeps 30 s in its actor: leaving cancels it
    for _ in range(100):
        if pool.has_free() and len(pool._idle) == 2:
            break
        await asyncio.sleep(0.02)
    out = await asyncio.wait_for(
        asyncio.gather(*(pool.submit(work, v) for v in range(4))), 10)
    assert [v for _, v in out] == [0, 1, 2, 3]


@pytest.mark.parametrize("method", ["map", "map_unordered"])
async def test_leaving_a_kept_map_early_cancels_the_work_in_flight(rt, method):
    # The iterator kept in a variable: Python would keep an async generator (and its
    # calls) open until it is dropped; leaving the loop must end it all the same.
    pool = ActorPool(await workers(2))
    results = getattr(pool, method)(lambda a, v: a.work(v, 0.0 if v == 0 else 30.0),
                                    range(6))
    async for _ in results:
        break  # items 1 and 2 sleep 30 s in their actors, 3 waits: leaving cancels them
    for _ in range(100):
        if pool.has_free() and len(pool._idle) == 2:
            break
        await asyncio.sleep(0.02)
    assert len(pool._idle) == 2 and not pool._queue
    assert [r async for r in results] == []  # ended: a later loop gets nothing
    out = await asyncio.wait_for(asyncio.gather(*(pool.submit(work, v) for v in range(2))), 10)
    assert sorted(v for _, v in out) == [0, 1]


@pytest.mark.parametrize("method", ["map", "map_unordered"])
async def test_a_map_cut_by_a_time_out_says_so_when_asked_for_more(rt, method):
    # A time-out while waiting for a result ends the results (their work is cancelled):
    # a poller that goes on must not take that for the end of every result, as it did.
    pool = ActorPool(await workers(2))
    it = aiter(getattr(pool, method)(lambda a, v: a.work(v, 0.5), range(6)))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(it), 0.05)
    await asyncio.sleep(0)  # (the event loop turns: the loop counts as left)
    with pytest.raises(RuntimeError, match="timed out.*asyncio.wait"):
        await anext(it)
    results = getattr(pool, method)(lambda a, v: a.work(v, 0.5), range(6))
    with pytest.raises(TimeoutError):
        async with timeout(0.05):
            async for _ in results:
                pass
    with pytest.raises(RuntimeError, match="were stopped"):  # also in a later loop
        [r async for r in results]
    # the way the error gives: a task waited on keeps the results going
    it = aiter(getattr(pool, method)(lambda a, v: a.work(v, 0.2), range(3)))
    t = asyncio.ensure_future(anext(it))
    assert not (await asyncio.wait({t}, timeout=0.01))[0]
    assert sorted([(await t)[1]] + [v for _, v in [r async for r in it]]) == [0, 1, 2]


async def test_a_map_loop_dropped_in_another_threads_loop_ends_on_its_own_loop(rt):
    # A garbage collection may drop a loop over the results in any thread: their work
    # is this loop's, and it is cancelled here (debug mode refuses any other thread).
    asyncio.get_running_loop().set_debug(True)
    pool = ActorPool(await workers(2))
    results = pool.map(lambda a, v: a.work(v, 0.0 if v == 0 else 30.0), range(4))
    kept = [results.__aiter__()]
    assert (await kept[0].__anext__())[1] == 0  # items 1 to 3 sleep or wait: in flight

    async def drop():
        kept.clear()  # (the last reference: dropped here, on this thread's loop)
    t = threading.Thread(target=asyncio.run, args=(drop(),))
    t.start()
    while t.is_alive():
        await asyncio.sleep(0.01)
    for _ in range(100):
        if len(pool._idle) == 2:
            break
        await asyncio.sleep(0.02)
    assert len(pool._idle) == 2 and not pool._queue
    assert [r async for r in results] == []


async def test_cancelling_a_submit_frees_its_actor(rt):
    (w,) = await workers(1)
    pool = ActorPool([w])
    f = pool.submit(lambda a, v: a.work(v, 30), 1)
    queued = pool.submit(work, 2)
    await asyncio.sleep(0.05)
    f.cancel()
    assert await asyncio.wait_for(queued, 10) == (0, 2)



async def test_cancelling_a_submit_cancels_its_call_at_once(rt):
    # (a call left pending until the next loop iteration: a direct call to the actor
    # made just after the cancel was refused by its max_pending_calls=1)
    w = await PoolWorker.options(max_pending_calls=1).spawn()
    pool = ActorPool([w])
    f = pool.submit(lambda a, v: a.work(v, 30), 1)
    await asyncio.sleep(0.05)
    f.cancel()
    assert await asyncio.wait_for(w.work(2), 10) == (0, 2)


async def test_a_pool_inside_an_actor_lets_a_dead_member_go(rt):
    # The driver's word on the death (its answer to the actor's request to connect)
    # came back as a remote error, read as an error the member's method raised: the
    # member stayed, and failed every later map
    from actors import PoolOwner
    a, b = await workers(2)
    owner = await PoolOwner.spawn([a, b])
    assert (await owner.run([1, 2]))[1] == 2
    await b.kill()
    results = [await asyncio.wait_for(owner.run([1, 2, 3, 4]), 20) for _ in range(3)]
    assert all(size == 1 for _, size in results)  # (the first map may fail: b's item)
    assert results[-1] == ([(0, 1), (0, 2), (0, 3), (0, 4)], 1)


async def test_push_remove_pop_idle(rt):
    a, b, c = await workers(3)
    pool = ActorPool([a])
    pool.push(b)
    assert list(pool) == [a, b] and len(pool) == 2
    with pytest.raises(ValueError, match="already"):
        pool.push(b)
    busy = pool.submit(lambda h, v: h.work(v, 0.2), 1)  # runs on a
    idle = pool.pop_idle()
    assert idle == b and list(pool) == [a]
    pool.remove(a)  # busy: its call still finishes
    assert await busy == (0, 1)
    with pytest.raises(ValueError, match="no actors left"):
        pool.submit(work, 1)
    pool.push(c)
    assert await pool.submit(work, 5) == (2, 5)
    assert pool.pop_idle() == c and pool.pop_idle() is None
    with pytest.raises(ValueError, match="not in this pool"):
        pool.remove(a)


async def test_a_member_pushed_back_while_busy_still_gets_one_call_at_a_time(rt):
    (w,) = await workers(1)
    pool = ActorPool([w])
    first = pool.submit(lambda a, v: a.work(v, 0.3), 1)
    pool.remove(w)
    pool.push(w)  # back while its call runs: the next item waits for that call
    second = pool.submit(lambda a, v: a.work(v, 0.0), 2)
    assert await asyncio.gather(first, second) == [(0, 1), (0, 2)]
    assert (await w.counts())["peak"] == 1


async def test_removing_the_last_member_fails_queued_work(rt):
    (w,) = await workers(1)
    pool = ActorPool([w])
    running = pool.submit(lambda a, v: a.work(v, 0.2), 1)
    queued = pool.submit(work, 2)
    pool.remove(w)
    with pytest.raises(ValueError, match="no actors left"):
        await queued
    assert await running == (0, 1)


async def test_bad_input_is_a_clear_error(rt):
    c = await Counter.spawn(0)
    with pytest.raises(ValueError, match="at least one actor"):
        ActorPool([])
    with pytest.raises(TypeError, match="not an actor handle"):
        ActorPool([c, 3])
    with pytest.raises(TypeError, match="not one handle"):
        ActorPool(c)
    with pytest.raises(TypeError, match="not int"):
        ActorPool(3)
    with pytest.raises(ValueError, match="twice"):
        ActorPool([c, c])
    pool = ActorPool([c])
    with pytest.raises(TypeError, match="must be callable"):
        pool.submit("incr", 1)
    # Ray's spellings, and a plain `for` over results, say how it is done here
    for ray_name in ("get_next", "get_next_unordered", "has_next"):
        with pytest.raises(AttributeError, match=rf"ActorPool\.{ray_name}: here `submit` "
                                                 "returns the result's awaitable"):
            getattr(pool, ray_name)
    with pytest.raises(AttributeError, match="'ActorPool' object has no attribute 'nope'"):
        pool.nope
    for way in ("map", "map_unordered"):
        with pytest.raises(TypeError, match=rf"results of ActorPool\.{way}\(\) come "
                                            rf"asynchronously: .*`async for r in pool\.{way}"):
            for _ in getattr(pool, way)(lambda a, v: a.incr(v), [1]):
                pass
    with pytest.raises(TypeError, match="actor handle"):
        pool.push("x")
    assert "ActorPool 1 actors" in repr(pool)
    assert actorshm.ActorPool.__module__ == "actorshm"


async def test_map_checks_fn_and_values_at_the_call(rt):
    pool = ActorPool([await Counter.spawn(0)])
    # raised by the call itself, before any `async for`, naming the method and the fix
    with pytest.raises(TypeError, match=r"ActorPool\.map\(fn, values\): fn must be "
                                        r"callable, like `lambda actor, v"):
        pool.map(5, [1])
    with pytest.raises(TypeError, match=r"ActorPool\.map_unordered\(fn, values\): fn "
                                        r"must be callable.* not NoneType"):
        pool.map_unordered(None, [1])
    for method in ("map", "map_unordered"):
        with pytest.raises(TypeError, match=rf"ActorPool\.{method}\(fn, values\): values "
                                            r"must be an iterable.* not int; for one "
                                            r"value use `await pool\.submit"):
            getattr(pool, method)(lambda a, v: a.incr(v), 5)
    # values are still read lazily: only when iterated
    read = []

    def values():
        read.append(1)
        yield 1
    it = pool.map(lambda a, v: a.incr(v), values())
    assert read == []
    assert [r async for r in it] == [1] and read == [1]


async def test_an_error_of_values_comes_after_the_results_before_it(rt):
    # The window was filled eagerly, so a generator's error was raised before the
    # results of the values it had given: Python's map yields those first.
    pool = ActorPool(await workers(2))

    def values():
        yield from range(4)
        raise KeyError("input ran dry")
    for method in ("map", "map_unordered"):
        got = []
        with pytest.raises(KeyError, match="input ran dry"):
            async for r in getattr(pool, method)(work, values()):
                got.append(r[1])
        assert sorted(got) == [0, 1, 2, 3], (method, got)
    assert (await pool.submit(work, 9))[1] == 9  # (the pool goes on)


async def test_submit_from_a_thread_without_a_loop_says_what_to_do(rt):
    c = await Counter.spawn(0)
    pool = ActorPool([c])

    def submit():
        with pytest.raises(RuntimeError, match=r"ActorPool\.submit needs a running event "
                                               r"loop.*run_coroutine_threadsafe"):
            pool.submit(lambda a, v: a.incr(v), 1)

    await asyncio.to_thread(submit)
    assert pool.has_free() and await pool.submit(lambda a, v: a.incr(v), 2) == 2


async def test_an_fn_that_raises_a_base_exception_keeps_its_member(rt):
    # fn(actor, v) reading an input future that was cancelled raises CancelledError (a
    # BaseException): the pool only caught Exception, so the member was taken and never
    # given back; the item, and all work after it, waited forever.
    (w,) = await workers(1)
    pool = ActorPool([w])
    inputs = _inputs_one_cancelled(10, 30)
    futs = [pool.submit(lambda a, f: a.work(f.result(), 0.05), f) for f in inputs]
    done, pending = await asyncio.wait(futs, timeout=20)
    assert not pending
    assert futs[0].result() == (0, 10) and futs[1].cancelled() and futs[2].result() == (0, 30)

    class Stop(BaseException):
        pass

    def bad(a, v):
        raise Stop(v)
    busy = pool.submit(lambda a, v: a.work(v, 0.2), "busy")
    failed = pool.submit(bad, 1)  # dispatched from a callback, when busy ends
    assert await asyncio.wait_for(busy, 20) == (0, "busy")
    with pytest.raises(Stop):
        await asyncio.wait_for(failed, 20)
    assert await asyncio.wait_for(pool.submit(work, 2), 20) == (0, 2)
    assert pool.has_free() and len(pool) == 1

    def stops(a, v):  # (next() of an exhausted iterator: no future can hold it)
        raise StopIteration(v)
    with pytest.raises(RuntimeError, match="StopIteration"):
        await asyncio.wait_for(pool.submit(stops, 3), 20)
    assert await asyncio.wait_for(pool.submit(work, 4), 20) == (0, 4)


async def test_a_pool_in_an_actor_keeps_members_whose_call_took_a_failed_result(rt):
    # Inside an actor nothing tells whether a member lives, so a call that failed with an
    # ActorDiedError counted as its member's death, even one never made because its
    # argument, another actor's failed call, carried that error: each such item threw a
    # live member out, then "every actor of this ActorPool has died".
    from actors import PoolOwner
    ws = await workers(2)
    dead = await PoolWorker.spawn(9)
    await dead.kill()
    owner = await PoolOwner.spawn(ws)
    errors, size = await asyncio.wait_for(owner.run_on_failed_result(dead, 4), 60)
    assert errors == ["ActorDiedError"] * 4 and size == 2
    out, size = await asyncio.wait_for(owner.run(list(range(4))), 60)
    assert sorted(v for _, v in out) == [0, 1, 2, 3] and size == 2


async def test_the_last_member_removed_fails_work_with_value_error_after_a_death(rt):
    # pools.md: "When the last member is removed, queued work fails with ValueError";
    # once any member had died, it failed with the old death's ActorDiedError instead.
    a, b = await workers(2)
    pool = ActorPool([a, b])
    await a.kill()
    for _ in range(20):  # (an item given to a fails, and a leaves)
        if len(pool) == 1:
            break
        try:
            await asyncio.wait_for(pool.submit(work, 1), 20)
        except ActorDiedError:
            pass
    assert len(pool) == 1
    busy = pool.submit(work, "busy")
    queued = pool.submit(work, "queued")
    pool.remove(b)
    with pytest.raises(ValueError, match="removed"):
        await asyncio.wait_for(queued, 20)
    with pytest.raises(ValueError, match="removed"):
        pool.submit(work, "later")
    assert await asyncio.wait_for(busy, 20) == (1, "busy")


@pytest.mark.parametrize("method", ["map", "map_unordered"])
async def test_aclose_from_another_task_stops_a_map_being_iterated(rt, method):
    # It raised Python's "aclose(): asynchronous generator is already running" and
    # stopped nothing: the consumer went on and got every result.
    import time
    ws = await workers(2)
    pool = ActorPool(ws)
    m = getattr(pool, method)(lambda a, v: a.work(v, 2.0), range(6))

    async def consume():
        return [r async for r in m]
    t = asyncio.ensure_future(consume())
    await asyncio.sleep(0.3)  # (two items running, the rest queued)
    t0 = time.monotonic()
    await m.aclose()
    assert await asyncio.wait_for(t, 20) == [] and time.monotonic() - t0 < 1.5
    await _until_idle(ws)  # the calls in flight were cancelled in the actors
    assert [v async for _, v in pool.map(work, range(3))] == [0, 1, 2]  # (the pool works on)


@pytest.mark.parametrize("method", ["map", "map_unordered"])
async def test_a_cancelled_item_of_a_map_is_an_error_not_the_loops_cancellation(rt, method):
    # The item's cancellation came out of the `async for` as a bare CancelledError,
    # which asyncio.timeout, TaskGroup and wait_for take for their own cancel.
    (w,) = await workers(1)
    pool = ActorPool([w])
    inputs = _inputs_one_cancelled(1, 3)
    got = []
    with pytest.raises(actorshm.ActorError, match="was cancelled"):
        async for _, v in getattr(pool, method)(lambda a, f: a.work(f.result()), inputs):
            got.append(v)
    assert 1 in got and 2 not in got
    assert await asyncio.wait_for(pool.submit(work, 4), 20) == (0, 4)


async def test_aclose_from_another_thread_closes_the_map_on_its_own_loop(rt):
    # Suspended at its yield, the map was closed on the calling thread's loop: its
    # cleanup cancelled the other loop's futures from the wrong thread (asyncio's debug
    # mode refuses that).
    asyncio.get_running_loop().set_debug(True)
    ws = await workers(2)
    pool = ActorPool(ws)
    m = pool.map(lambda a, v: a.work(v, 0.2 if v == 0 else 3.0), range(6))
    errors = []

    def closer():
        try:
            asyncio.run(m.aclose())
        except BaseException as exc:
            errors.append(repr(exc))
    async for _ in m:  # (suspended at its yield while the thread closes it)
        t = threading.Thread(target=closer)
        t.start()
        await asyncio.to_thread(t.join, 20)
        break
    assert not errors, errors
    await _until_idle(ws)  # the calls in flight were cancelled in the actors


async def test_aclose_from_another_thread_holds_while_the_loop_goes_on(rt):
    # Made while the map sat at its yield, the close was scheduled on the map's loop;
    # asked for its next result first, the map was running when the close came, which
    # then failed without a word, and every result came.
    ws = await workers(2)
    pool = ActorPool(ws)
    m = pool.map(lambda a, v: a.work(v, 0.05), range(40))
    got = []
    async for _, v in m:
        got.append(v)
        if v == 0:
            t = threading.Thread(target=lambda: asyncio.run(m.aclose()))
            t.start()
            t.join()  # (blocking: this loop does not turn before the next step)
    assert got == [0]
