"""Calls users control: cancellation that reaches the actor, streaming methods,
re-entrant chains refused at once, and no "never retrieved" noise."""

import asyncio
import gc
import os
import time

import numpy as np
import pytest

import actorshm
from compat import TimeoutError, noted, timeout
import reentrant_cases
from call_actors import Relay, Worker
from waits import until


def _pending(rt, h):
    return rt._actors[h.actor_id].conn.pending


async def _last_log_entry(w, want=("count-finally", "acount-finally"), limit=5.0):
    """The last entry of ``w``'s log once it is one of ``want`` (or after ``limit`` s)."""
    deadline = time.monotonic() + limit
    while True:
        last = (await asyncio.wait_for(w.get_log(), limit) or [None])[-1]
        if last in want or time.monotonic() > deadline:
            return last
        await asyncio.sleep(0.02)


# -- cancellation -------------------------------------------------------------------
async def test_cancelled_async_call_is_cancelled_in_the_actor(rt):
    w = await Worker.spawn()
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(w.awork(30), 0.2)
    assert time.monotonic() - t0 < 5  # the caller's await ends at once, not after 30 s
    # the actor was told: its method got CancelledError, and the next call runs now
    assert await asyncio.wait_for(w.get_log(), 5) == ["cancelled"]
    assert _pending(rt, w) == {}


async def test_asyncio_timeout_and_task_cancel_reach_the_actor(rt):
    w = await Worker.spawn()
    with pytest.raises(TimeoutError):
        async with timeout(0.1):
            await w.awork(30)
    fut = asyncio.ensure_future(w.awork(30))
    await asyncio.sleep(0.1)
    fut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fut
    assert await asyncio.wait_for(w.get_log(), 5) == ["cancelled", "cancelled"]


async def test_queued_call_never_runs_once_cancelled(rt):
    w = await Worker.spawn()
    busy = w.work(0.5)
    queued = w.record("queued")
    await asyncio.sleep(0.05)
    queued.cancel()
    assert await busy == 0.5
    assert await w.record("next") == "next"
    assert await w.get_log() == [("work", 0.5), "next"]


async def _cancelled_while_queued_never_runs(w, args) -> None:
    """Each of ``args`` goes to a call queued behind a sync call, then cancelled: it
    never runs, and the next call does."""
    for arg in args:
        busy = w.work(0.5)
        queued = w.record(arg)
        await asyncio.sleep(0.05)
        queued.cancel()
        assert await busy == 0.5
        assert await w.record("next") == "next"
        assert await w.get_log() == [("work", 0.5), "next"]
        await w.clear_log()


async def test_queued_call_that_brings_a_new_arena_never_runs_once_cancelled(rt):
    # Before: the call's frame carried the arena's fd, and the kernel ends a read right
    # after such bytes; the cancel written after it waited for a later read, and the
    # actor started the cancelled call in the slot the sync call freed, before it.
    w = await Worker.spawn()  # (shared, or copied into shared memory)
    await _cancelled_while_queued_never_runs(w, (actorshm.zeros(1 << 20),
                                                 np.zeros(1 << 20)))


async def test_queued_call_spilled_to_shared_memory_never_runs_once_cancelled(rt):
    # A big pickle goes through a block of our pool (``spill``): cancelled while queued,
    # the call never runs, and its block comes home all the same.
    w = await Worker.spawn()
    before = actorshm.stats()
    await _cancelled_while_queued_never_runs(w, (b"x" * (4 << 20), ["y" * (1 << 20)]))
    assert actorshm.stats()["messages_spilled"] - before["messages_spilled"] == 2
    gc.collect()
    # (no more than at the start: none of ours left behind)
    assert await until(lambda: actorshm.stats()["blocks_live"] <= before["blocks_live"])


async def test_queued_call_too_large_for_one_read_never_runs_once_cancelled(rt, monkeypatch):
    # Before: the caller could write the cancel only after the call's last bytes, which
    # the actor read after its sync call ended; it started the call as soon as it had
    # it whole, and read the cancel behind it too late.
    from actorshm import _serialization
    monkeypatch.setattr(_serialization, "SPILL_MIN", 1 << 40)  # (not through shared memory)
    w = await Worker.spawn()  # (in band)
    await _cancelled_while_queued_never_runs(w, (b"x" * (4 << 20),
                                                 [np.zeros(2000) for _ in range(60)]))


async def test_a_sync_call_cancelled_before_the_actor_read_it_never_runs(rt):
    # An idle actor read a call, the call behind it and the cancel of that one at once
    # (its loop was busy, or the calls came on a new link from another actor): it ran
    # the first, then started the second before it handled the cancel behind it.
    # Also when the call brought a region new to the actor: the kernel ends a read with
    # the frame that carried its fd, and the cancel came in the next read.
    w = await Worker.spawn()
    for i, arg in enumerate(["second", "second", np.ones(9 << 20, np.uint8),
                             np.ones(17 << 20, np.uint8)]):
        await w.block_loop_later(0.05, 0.3)  # (no call holds a slot meanwhile)
        await asyncio.sleep(0.1)
        first, second = w.record("first"), w.record(arg)
        second.cancel()
        assert await first == "first"
        assert await w.record("next") == "next"
        assert await w.get_log() == ["first", "next"], i
        await w.clear_log()


async def test_calls_each_bringing_a_new_region_cancelled_as_made_never_run(rt):
    # Each call's frame carried the fd of a region new to the actor, so the kernel ended
    # a read with each, and the actor stopped following reads after 64: it started the
    # 65th call, queued, before it read that call's cancel, which was still unread.
    w = await Worker.spawn()
    arrays = [actorshm.empty(4 << 20, np.uint8) for _ in range(72)]  # (each its own)
    busy = w.work(0.5)
    for a in arrays:
        w.record(a).cancel()  # (cancelled before the next call is made, as the docs say)
    assert await asyncio.wait_for(busy, 10) == 0.5
    assert await w.record("next") == "next"
    assert await w.get_log() == [("work", 0.5), "next"]


async def test_a_stream_whose_consumer_died_while_it_was_queued_never_starts(rt):
    # The actor started it anyway, once its slot was free: the generator made its
    # run-ahead items for nobody, then waited at its yield for good (its finally never
    # ran; its task, credit and last item kept until the actor's end).
    import signal
    w, v = await Worker.spawn(), await Relay.spawn()
    busy = w.awork(0.6)  # (holds w's one slot)
    consumer = asyncio.ensure_future(v.total(w, 100))  # w.count(100), queued behind
    await asyncio.sleep(0.3)
    os.kill(v.pid, signal.SIGKILL)
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(consumer, 10)
    assert await asyncio.wait_for(busy, 10) == 0.6
    await asyncio.sleep(0.2)
    log = await w.get_log()
    assert not any(type(e) is tuple and e[0] == "made" for e in log) or \
        "count-finally" in log, log


async def test_hundreds_of_queued_calls_cancelled_at_once_never_run(rt):
    # The cancels of one turn go out in one write, so the actor reads them together:
    # none of the queued calls starts in the slot the cancelled running call frees.
    w = await Worker.spawn()
    for _ in range(3):
        calls = [w.awork(1.0) for _ in range(800)]
        await asyncio.sleep(0.2)
        for c in calls:
            c.cancel()
        await asyncio.sleep(0.2)
        assert await w.get_log() == ["cancelled"]
        await w.clear_log()


async def test_a_burst_of_short_sync_calls_reads_cancels_as_it_runs(rt):
    # Calls of 1 ms read together ran back to back, the actor reading nothing until the
    # last had run (each alone too short to count as holding the loop): cancelled 50 ms
    # in, all 400 ran. Now it reads between calls every 2 ms.
    w = await Worker.spawn()
    calls = [w.spin(0.001) for _ in range(400)]
    await asyncio.sleep(0.05)
    for c in calls:
        c.cancel()
    ran = len(await w.get_log())
    assert ran < 250, ran  # (about 50)


async def test_thousands_of_queued_calls_cancelled_in_reverse_order_end_at_once(rt):
    # Each cancel looked for its call by scanning the queue: 30,000 queued calls
    # cancelled last first kept the actor busy for seconds before its next call.
    w = await Worker.spawn()
    first = w.awork(60)  # holds the slot (not the loop): the calls behind it queue
    calls = [w.awork(0) for _ in range(30000)]
    await asyncio.sleep(0.1)
    for c in reversed(calls):
        c.cancel()
    first.cancel()
    start = time.monotonic()
    assert await w.record("next") == "next"
    took = time.monotonic() - start
    assert await w.get_log() == ["cancelled", "next"]
    assert took < 5.0, took  # (~0.3 s; over 10 s before)


async def test_running_sync_call_finishes_and_its_result_is_dropped(rt):
    w = await Worker.spawn()
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(w.work(1.5), 0.1)
    assert time.monotonic() - t0 < 1.2
    assert _pending(rt, w) == {}
    assert await w.record("after") == "after"  # the actor is healthy
    assert await w.get_log() == [("work", 1.5), "after"]


async def test_timed_out_calls_leave_no_pending_entries(rt):
    w = await Worker.spawn()
    for _ in range(50):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(w.awork(60), 0.001)
    await asyncio.sleep(0)
    assert _pending(rt, w) == {}
    assert await asyncio.wait_for(w.record(1), 5) == 1


async def test_cancel_frees_a_pending_calls_slot(rt):
    w = await Worker.options(max_pending_calls=1).spawn()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(w.awork(30), 0.1)
    assert await asyncio.wait_for(w.record(2), 5) == 2


async def test_cancellation_inside_actors_and_cascading(rt):
    w = await Worker.spawn()
    r = await Relay.spawn()
    # a time-out inside an actor reaches the actor it called
    assert await r.timeout_on(w, 30, 0.1) == "timed out"
    assert await asyncio.wait_for(w.get_log(), 5) == ["cancelled"]
    # cancelling the outer call cancels the call it is waiting on
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(r.forward(w, 30), 0.2)
    assert await asyncio.wait_for(w.get_log(), 5) == ["cancelled", "cancelled"]


# -- streaming methods --------------------------------------------------------------
async def test_sync_and_async_generators_stream(rt):
    w = await Worker.spawn()
    assert [x async for x in w.count(5)] == [0, 1, 2, 3, 4]
    assert [x async for x in w.acount(3)] == [0, 1, 2]
    assert [x async for x in w.count(0)] == []
    assert await w.record("ok") == "ok"


async def test_items_arrive_as_yielded(rt):
    w = await Worker.spawn()
    t0 = time.monotonic()
    async for x in w.acount(3, 1.0):
        first = time.monotonic() - t0
        break
    assert x == 0 and first < 2.5  # not after the whole 3 s


async def test_bounded_run_ahead_with_a_slow_consumer(rt):
    w = await Worker.options(max_concurrency=2).spawn()
    s = w.acount.options(run_ahead=4)(1000)
    assert await s.__anext__() == 0
    await asyncio.sleep(0.5)
    made = await w.made()
    # the item taken and at most 4 ahead (the consumer gives credit back two at a time)
    assert 3 <= made <= 5
    n = 1 + len([x async for x in s])
    assert n == 1000
    for ahead in (1, 2, 3):  # credit goes back for each item taken: exactly that many
        for gen in (w.count, w.acount):
            await w.clear_log()
            s = gen.options(run_ahead=ahead)(1000)
            for _ in range(3):
                await s.__anext__()
            await asyncio.sleep(0.3)
            assert await w.made() == 3 + ahead, (gen, ahead)
            await s.aclose()
    with pytest.raises(ValueError, match="run_ahead"):
        w.acount.options(run_ahead=0)


async def test_default_run_ahead_is_16(rt):
    w = await Worker.options(max_concurrency=2).spawn()
    s = w.acount(1000)
    assert await s.__anext__() == 0
    await asyncio.sleep(0.5)
    assert 9 <= await w.made() <= 17
    await s.aclose()


@pytest.mark.parametrize("how", ["break", "break, the stream kept", "aclose", "exception"])
async def test_leaving_early_runs_the_generators_finally(rt, how):
    w = await Worker.spawn()
    if how == "break":
        async for x in w.count(1000):
            if x == 2:
                break
    elif how == "break, the stream kept":
        s = w.count(1000)
        async for x in s:
            if x == 2:
                break
        assert await _last_log_entry(w) == "count-finally"
        assert [x async for x in s] == []  # it ended
    elif how == "aclose":
        s = w.count(1000)
        await s.__anext__()
        await s.aclose()
    else:
        with pytest.raises(KeyError):
            async for x in w.acount(1000):
                raise KeyError(x)
    # (a dropped iterator's cancel goes out at the event loop's next turn: a call made
    # at once may run before the generator's finally)
    assert await _last_log_entry(w) in ("count-finally", "acount-finally")
    assert sum(1 for e in await w.get_log() if isinstance(e, tuple)) < 100


@pytest.mark.parametrize("how", ["timeout", "task cancelled"])
async def test_a_loop_cancelled_while_waiting_stops_the_stream(rt, how):
    # the error (a traceback) or the cancelled task keeps the loop's frame alive: the
    # stream stops anyway, not only once they are dropped
    w = await Worker.options(max_concurrency=4).spawn()
    kept = []

    async def consume():
        async for _ in w.acount(1000, 1.0):
            pass
    if how == "timeout":
        try:
            async with timeout(0.3):
                await consume()
        except TimeoutError as exc:
            kept.append(exc)
    else:
        kept.append(asyncio.ensure_future(consume()))
        await asyncio.sleep(0.3)
        kept[0].cancel()
    assert await _last_log_entry(w) == "acount-finally"
    assert await w.made() <= 1
    kept.clear()


async def test_a_stream_cut_by_a_time_out_says_so_when_asked_for_more(rt):
    # A time-out while waiting for an item stops the stream (the generator is closed in
    # the actor): a poller that goes on must not take that for the stream's end.
    w = await Worker.spawn()
    it = aiter(w.acount(5, 0.5))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(it), 0.05)
    await asyncio.sleep(0)  # (the event loop turns: the loop counts as left)
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="timed out.*asyncio.wait"):
        await anext(it)
    assert await _last_log_entry(w) == "acount-finally"
    # the way the error gives: a task waited on keeps the stream
    it = aiter(w.acount(3, 0.2))
    t = asyncio.ensure_future(anext(it))
    assert not (await asyncio.wait({t}, timeout=0.01))[0]
    assert await t == 0 and [x async for x in it] == [1, 2]


async def test_an_iteration_handed_on_is_not_a_loop_left(rt):
    # aiter() and a loop over the same stream in turn, without the event loop turning
    # in between, go on with the same generator (as for any async iterator)
    w = await Worker.spawn()
    s = w.count(5)
    first = await anext(aiter(s))
    rest = [x async for x in s]
    assert [first, *rest] == [0, 1, 2, 3, 4]
    s = w.count(1000)
    it = aiter(s)
    assert await anext(it) == 0
    await it.aclose()  # (what the stream's aclose does)
    assert await _last_log_entry(w) == "count-finally"


async def test_a_second_task_awaiting_the_same_stream_is_told_not_left_hanging(rt):
    w = await Worker.spawn()
    s = w.acount(3, 0.2)  # (nothing has arrived when both tasks ask)
    results = await asyncio.wait_for(
        asyncio.gather(anext(s), anext(s), return_exceptions=True), 10)
    assert results[0] == 0
    assert isinstance(results[1], RuntimeError) and "one consumer" in str(results[1])
    assert [x async for x in s] == [1, 2]  # the stream itself carries on
    # a second loop turned away leaves the first loop's stream running
    s = w.acount(5, 0.1)

    async def second():
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="one consumer"):
            async for _ in s:
                pass
    first, _ = await asyncio.wait_for(asyncio.gather(_items(s), second()), 10)
    assert first == [0, 1, 2, 3, 4]


async def test_a_second_task_asking_as_an_item_wakes_the_first_is_told_too(rt):
    # Between an item's arrival (the first task's wait resolved) and that task resuming,
    # a second task's anext() took the item: it was not told it is a second consumer,
    # and the first lost the item without a word.
    w = await Worker.spawn()
    s = w.acount(20, 0.02)
    first, second, refused = [], [], []

    async def a():
        async for x in s:
            first.append(x)

    async def b():
        while not s.fut.done() or s.inbox.items:
            waiter = s.inbox.waiter  # (the first task's wait, resolved by an item)
            if s.inbox.items and waiter is not None and waiter.done():
                try:
                    second.append(await anext(s))
                except RuntimeError as exc:
                    refused.append(str(exc))
            await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(a(), b()), 20)
    assert first == list(range(20)) and second == []
    assert refused and all("one consumer" in r for r in refused)


async def _items(stream):
    return [x async for x in stream]


async def test_a_stream_misused_says_how_to_use_it(rt):
    w = await Worker.spawn()
    s = w.count(3)
    with pytest.raises(TypeError, match="async for"):
        for _ in s:
            pass
    with pytest.raises(TypeError, match="cannot be sent to another process"):
        await w.record(s)
    assert [x async for x in s] == [0, 1, 2]  # (the stream itself is fine)
    with pytest.raises(TypeError, match=r"returned a coroutine without awaiting it"):
        await w.forgot_await()


async def test_error_mid_stream_after_its_items(rt):
    w = await Worker.spawn()
    got = []
    with pytest.raises(ValueError, match="failed after 3"):
        async for x in w.fails_after(3):
            got.append(x)
    assert got == [0, 1, 2]
    assert await w.record("ok") == "ok"


async def test_death_mid_stream_raises_actor_died(rt):
    w = await Worker.spawn()
    got = []
    with pytest.raises(actorshm.ActorDiedError):
        async for x in w.dies_after(2):
            got.append(x)
    assert got == [0, 1]


async def test_a_consumer_keeps_no_item_of_a_stream_whose_producer_died(rt):
    # The stream's error, raised itself, took the consumer's frame into its traceback
    # and kept it (its last item: a whole batch) alive, for as long as the dead
    # producer's connection kept the stream: gc.collect() did not free it.
    w, r = await Worker.spawn(), await Relay.spawn()
    assert await r.until_death(w, 3) == 3
    async def nothing_held():
        return not (await rt.memory()).rows
    assert await until(nothing_held), (await rt.memory()).rows


async def test_stream_of_arrays_by_reference_blocks_recycled(rt):
    w = await Worker.spawn()
    before = await w.stats()
    n = 0
    async for a in w.arrays(64, 1 << 20):
        assert actorshm.is_shared(a) and a[0] == n % 256
        n += 1
        del a
    after = await w.stats()
    assert n == 64
    assert after["bytes_copied"] == before["bytes_copied"]
    assert after["pool_reuses"] - before["pool_reuses"] >= 32  # blocks came back


async def test_a_stream_left_after_its_end_gives_back_the_items_it_had_not_taken(rt):
    # A stream whose generator had ended (every item sent, within its run-ahead) kept
    # the items it had not handed out, their blocks leased from the producer, for as
    # long as the connection lived, when its loop was left (``break``) or it was dropped
    # unread: the producer's blocks_live grew with each such stream, and the
    # connection kept each streaming call's receiver, even of one read to its end.
    from actorshm._streams import Inbox
    w = await Worker.spawn()
    base = (await w.stats())["blocks_live"]
    left, kept, dropped = (w.arrays(5, 4096) for _ in range(3))
    await w.stats()  # (answered after the three streams ended: all of them is here)
    async for a in left:
        break
    async for a in kept:  # ``kept`` itself stays referenced
        break
    del a, left, dropped
    gc.collect()

    async def all_back():
        return (await w.stats())["blocks_live"] == base
    assert await until(all_back), ((await w.stats())["blocks_live"], base)
    for _ in range(30):
        assert [x async for x in w.count(2)] == [0, 1]
    gc.collect()
    assert sum(type(o) is Inbox for o in gc.get_objects()) <= 2  # (isinstance would ask
    # every object its __class__: a deprecated torch object warns)
    assert kept is not None


async def test_a_stream_dropped_by_another_thread_while_read_ends_cleanly():
    # Leaving a stream from another thread (a garbage collection there of the loop
    # that left it) drops its buffered items; landing between the reader's check for
    # an item and its take, it raised IndexError. (The interleaving is forced.)
    import collections
    import threading
    from actorshm._streams import CallStream

    class Items(collections.deque):
        def __bool__(self):
            if len(self):
                t = threading.Thread(target=s._left)
                t.start()
                t.join()
                return True
            return False
    s = CallStream("A.gen")
    fut = asyncio.get_running_loop().create_future()
    s.start(fut)
    s.inbox.items = Items([1, 2])
    fut.set_result(None)  # (the generator ended, two items still buffered)
    with pytest.raises(StopAsyncIteration):
        await s.__anext__()


async def test_streams_inside_actors(rt):
    w = await Worker.spawn()
    r = await Relay.spawn()
    assert await r.total(w, 10) == 45
    assert await r.first(w, 1000) == 0  # returns from inside its `async for`
    assert await _last_log_entry(w) == "count-finally"  # the generator was closed


async def test_a_stream_waiting_for_credit_leaves_the_actor_free(rt):
    w = await Worker.spawn()  # max_concurrency=1: one slot
    s = w.count.options(run_ahead=2)(1000)
    assert await s.__anext__() == 0
    # the generator waits at its yield for credit, out of the slot: other calls run
    assert await asyncio.wait_for(w.record("meanwhile"), 10) == "meanwhile"
    assert await w.made() == 3  # still bounded: the item taken, 2 ahead
    assert [x async for x in s][:3] == [1, 2, 3]
    log = await w.get_log()
    assert log[-1] == "count-finally" and "meanwhile" in log


async def test_calls_run_between_a_streams_items(rt):
    w = await Worker.spawn()
    got = []
    async for x in w.acount(20, 0.02):
        if x == 0:  # waits behind the item being made, not behind the whole stream
            assert await asyncio.wait_for(w.record("mid"), 10) == "mid"
        got.append(x)
    assert got == list(range(20))
    log = await w.get_log()
    assert log.index("mid") < log.index(("made", 17)) < log.index("acount-finally")


async def test_aclose_runs_the_finally_before_the_next_call(rt):
    w = await Worker.spawn()
    s = w.acount(1000)
    await s.__anext__()
    await asyncio.sleep(0.2)  # the generator waits at its yield, out of the slot
    await s.aclose()
    # the cancel went out first: the generator took a slot ahead of this call to close
    assert (await asyncio.wait_for(w.get_log(), 10))[-1] == "acount-finally"


async def test_a_stream_is_stopped_when_its_consumer_actor_dies(rt):
    w = await Worker.spawn()
    r = await Relay.spawn()
    fut = r.hold_stream(w, 1000)
    for _ in range(100):
        if await w.made() >= 16:  # 16 made, one taken: waiting for credit
            break
        await asyncio.sleep(0.02)
    await r.kill()
    with pytest.raises(actorshm.ActorDiedError):
        await fut
    assert await _last_log_entry(w) == "acount-finally"


async def test_awaiting_a_stream_says_to_iterate(rt):
    w = await Worker.spawn()
    with pytest.raises(TypeError, match="async for"):
        await w.count(3)
    assert await w.record(1) == 1


# -- re-entrant chains --------------------------------------------------------------
async def test_reentrant_chain_raises_at_once(rt):
    await reentrant_cases.chain_is_refused_at_once(limit=1.0)


async def test_reentrant_chain_through_a_stream_raises_at_once(rt):
    await reentrant_cases.a_chain_through_a_stream_is_refused_at_once(limit=5.0)


async def test_reentrant_chain_through_every_slot_raises(rt):
    await reentrant_cases.every_slot_waiting_refuses_the_call_back(limit=5.0)


async def test_call_back_into_a_full_actor_whose_other_call_ends_waits(rt):
    await reentrant_cases.a_call_back_into_a_slot_that_frees_waits(limit=5.0)


# -- no noise -------------------------------------------------------------------------
async def test_many_calls_failing_at_once_print_nothing(rt, capfd, caplog):
    w = await Worker.spawn()
    futs = [w.work(0.2) for _ in range(50)]
    await asyncio.sleep(0.05)
    await w.kill()
    del futs
    gc.collect()
    await asyncio.sleep(0.1)
    gc.collect()
    assert "never retrieved" not in caplog.text
    assert "never retrieved" not in capfd.readouterr().err


# -- results as arguments -------------------------------------------------------------
async def test_unfinished_call_as_argument_is_resolved_in_order(rt):
    w = await Worker.spawn()
    other = await Worker.spawn()
    slow = w.work(0.3)
    first = other.record({"nested": [slow, (slow,)]})
    then = other.record("after")  # made later: runs later on `other`, though ready now
    assert await first == {"nested": [0.3, (0.3,)]}
    assert await then == "after"
    assert await other.get_log() == [{"nested": [0.3, (0.3,)]}, "after"]
    # a finished call's awaitable passes as its result too
    assert await other.record(slow) == 0.3


async def test_failed_call_as_argument_fails_the_call(rt):
    w = await Worker.spawn()
    other = await Worker.spawn()
    bad = w.fails_nonstream()
    with pytest.raises(ValueError, match="no"):
        await other.record(bad)
    assert await other.get_log() == []


async def test_a_failed_call_as_argument_fails_the_call_with_that_error_as_it_was(rt):
    # Its copy was made with type(exc)(*exc.args): an __init__ that formats its message
    # formatted it again ("code=code=4"), and the remote traceback and note were lost.
    from actors import Faulty, FormatsError
    f = await Faulty.spawn()
    w = await Worker.spawn()
    bad = f.rebuilt_by_state("formats")
    for aw in (w.record(bad), w.record([bad])):
        with pytest.raises(FormatsError) as info:
            await aw
        e = info.value
        assert str(e) == "code=4" and e.code == 4
        assert "rebuilt_by_state" in str(e.__cause__)  # the remote traceback
        assert noted(e, "rebuilt_by_state")
    assert await w.get_log() == []


async def test_plain_future_as_argument_says_await_it_first(rt):
    w = await Worker.spawn()
    fut = asyncio.get_running_loop().create_future()
    with pytest.raises(TypeError, match="await it first") as caught:
        w.record(fut)
    # (its own advice, without the general one for arguments that fail to pickle)
    assert "must be picklable" not in str(caught.value)
    fut.cancel()


async def test_call_results_as_arguments_inside_actors(rt):
    w = await Worker.spawn()
    other = await Worker.spawn()
    r = await Relay.spawn()
    assert await r.pass_along(w, other) == 0.2


async def test_calls_failing_alike_print_one_message_not_one_each(rt, caplog):
    w = await Worker.spawn()
    futs = [w.fails_nonstream() for _ in range(30)]
    await asyncio.wait(futs)
    del futs
    gc.collect()
    assert caplog.text.count("never retrieved") <= 1


async def test_call_back_into_an_actor_busy_with_another_call_waits(rt):
    # A's earlier call made the call to B without waiting for it: no deadlock, no error
    a = await Relay.spawn()
    b = await Relay.spawn()
    await a.set_self(a)
    assert await a.fire_and_return(b) == "sent"
    assert await a.hold(0.3) == "held"  # B's call back to A arrives meanwhile and waits
    assert await asyncio.wait_for(b.last(), 5) == "pong"


async def test_cancelling_the_task_that_awaits_a_call(rt):
    w = await Worker.spawn()

    async def go():
        return await w.awork(30)

    t = asyncio.create_task(go())
    await asyncio.sleep(0.2)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert await asyncio.wait_for(w.get_log(), 5) == ["cancelled"]


async def test_cancelled_sync_call_in_a_thread_pool_actor_is_dropped(rt):
    w = await Worker.options(max_concurrency=2).spawn()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(w.work(0.5), 0.05)
    assert await asyncio.wait_for(w.record("meanwhile"), 5) == "meanwhile"
    await asyncio.sleep(0.8)
    assert await w.get_log() == ["meanwhile", ("work", 0.5)]
    assert _pending(rt, w) == {}


async def test_a_burst_of_quick_sync_calls_larger_than_a_read_is_answered(rt):
    # Before: the calls queued behind one that came in several reads were started by
    # _finished calling _start calling _finished...: with a thousand or so queued, a
    # RecursionError in the actor's callback, and the calls were never answered.
    w = await Worker.spawn()
    futs = [w.record(b"y" * 200) for _ in range(20000)]
    assert len(await asyncio.wait_for(asyncio.gather(*futs), 30)) == 20000
    await w.clear_log()
