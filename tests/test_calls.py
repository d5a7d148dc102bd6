"""Calls: spawning, ordering, concurrency, exceptions, what can be sent."""

import asyncio
import concurrent.futures
import gc
import os
import sys
import threading
import time

import pytest

from actorshm import RemoteError
import actorshm
from compat import noted, timeout
from actors import (BreaksOnArrival, CalledBack, Caller, CallsBack, Concurrent, Counter,
                    Decorated,
                    CustomError, Faulty, FormatsError, KwOnlyError, NewKwError,
                    NoArgsError, PathError, PoolWorker, RefusesReduceError, SlotsError,
                    TwoArgsError)


async def test_spawn_call_and_local_use(rt_each):
    c = await Counter.spawn(5)
    fut = c.incr(2)
    assert await fut == 7
    assert await c.incr() == 8
    assert c.pid != os.getpid() and await c.pid_() == c.pid
    local = Counter(5)  # decorating keeps the class usable locally
    assert local.incr(1) == 6


async def test_unknown_attribute_raises_at_once(rt):
    c = await Counter.spawn()
    with pytest.raises(AttributeError, match="no public method 'nope'"):
        c.nope
    with pytest.raises(AttributeError):
        c._private


async def test_call_is_sent_without_await(rt):
    c = await Counter.spawn()
    futs = [c.record(i) for i in range(5)]
    await asyncio.sleep(0.5)  # the calls ran although nobody awaited them yet
    log_fut = c.get_log()
    assert await log_fut == [0, 1, 2, 3, 4]
    assert [await f for f in futs] == [0, 1, 2, 3, 4]


async def test_every_call_is_sent_when_made_even_if_the_caller_then_blocks(rt):
    # Several calls made in one go, then the caller's event loop blocks (its own work,
    # or a bug): each call is already on its way, the actor runs all of them.
    s = await PoolWorker.spawn()
    a = actorshm.zeros(4)
    futs = [s.write_at(a, i, i + 1) for i in range(4)]
    deadline = time.monotonic() + 10
    while a[3] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # blocks the event loop: nothing more is written from here
    assert list(a) == [1, 2, 3, 4]
    assert await asyncio.gather(*futs) == [True] * 4
    # ... and right after a cancel (the call takes the cancel made before it along)
    slow = s.work(1, 5.0)
    await asyncio.sleep(0.1)
    slow.cancel()
    fut = s.write_at(a, 0, 9)
    deadline = time.monotonic() + 10
    while a[0] != 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a[0] == 9 and await fut
    # ... and from a sync method, back over the connection it is being called on
    c, b = await CalledBack.spawn(), await CallsBack.spawn()
    assert await c.run(b, c, actorshm.zeros(1)) == 1.0


async def test_order_with_max_concurrency_1(rt):
    c = await Counter.spawn()
    futs = []
    for i in range(60):
        if i % 3 == 0:
            futs.append(c.async_record(i, 0.001 * (i % 5)))
        elif i % 3 == 1:
            futs.append(c.slow_record(i, 0.0005))
        else:
            futs.append(c.record(i))
    await asyncio.gather(*futs)
    assert await c.get_log() == list(range(60))


async def test_async_methods_interleave_up_to_max_concurrency(rt):
    a = await Concurrent.spawn()
    results = await asyncio.gather(*(a.work(0.2) for _ in range(8)))
    assert max(results) == 4  # never more than max_concurrency at once
    assert await a.peak_() == 4


async def test_sync_methods_in_threads_do_not_stall_loop(rt):
    a = await Concurrent.spawn()
    blocking = [a.blocking(1.0) for _ in range(2)]
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    assert await a.ping() == "pong"  # answered while two sync calls block their threads
    assert time.monotonic() - t0 < 0.8
    idents = await asyncio.gather(*blocking)
    assert len(set(idents)) == 2


async def test_same_exception_type_with_remote_traceback(rt):
    f = await Faulty.spawn()
    with pytest.raises(ValueError, match="bad value") as info:
        await f.value_error()
    assert "value_error" in str(info.value.__cause__)  # the remote traceback text
    with pytest.raises(CustomError):
        await f.custom()
    with pytest.raises(RemoteError, match="Unpicklable") as info:
        await f.unpicklable()
    assert "unpicklable" in str(info.value)
    assert await f.ok() == "ok"  # the actor is unaffected


async def test_an_exception_whose_init_cannot_take_back_its_args_keeps_its_type(rt):
    # Pickle rebuilds an exception with cls(*args): a keyword-only __init__, one with no
    # parameters, or one with more than it passes up refused that, and the caller got
    # RemoteError although the type pickles.
    f = await Faulty.spawn()
    with pytest.raises(KwOnlyError, match="code=4") as info:
        await f.not_rebuilt_by_init("kw")
    assert info.value.code == 4 and "not_rebuilt_by_init" in str(info.value.__cause__)
    with pytest.raises(NoArgsError, match="a fixed message"):
        await f.not_rebuilt_by_init("none")
    with pytest.raises(ValueError, match="1-2") as info:
        await f.not_rebuilt_by_init("two")
    assert type(info.value) is TwoArgsError and (info.value.a, info.value.b) == (1, 2)


async def test_an_exception_group_keeps_its_members_types_on_the_local_backend(rt):
    # (tests/test_ray.py has the TaskGroup case on both backends; this one runs on 3.10
    # too, with the backport's groups, which keep their members in their __dict__)
    f = await Faulty.spawn()
    with pytest.raises(Exception) as info:
        await f.raise_plain_group()
    group = info.value
    assert type(group).__name__ == "ExceptionGroup" and group.message == "grp"
    two, key = group.exceptions
    assert type(two) is TwoArgsError and (two.a, two.b) == (1, 2) and type(key) is KeyError


async def test_an_exception_pickle_does_not_rebuild_as_it_was_keeps_type_and_message(rt):
    # Rebuilt by its state where pickle's cls(*args) gives something else, or fails
    # elsewhere than __init__: each came back with a wrong message, or as RemoteError.
    f = await Faulty.spawn()
    with pytest.raises(FormatsError) as info:  # cls(*args) gave "code=code=4"
        await f.rebuilt_by_state("formats")
    assert str(info.value) == "code=4" and info.value.code == 4
    assert "rebuilt_by_state" in str(info.value.__cause__)
    assert noted(info.value, "rebuilt_by_state")
    with pytest.raises(FileNotFoundError) as info:  # errno, strerror, filename kept
        await f.rebuilt_by_state("path")
    e = info.value
    assert type(e) is PathError and str(e) == "[Errno 2] no such thing: '/x'"
    assert (e.errno, e.strerror, e.filename, e.filename2) == (2, "no such thing", "/x", None)
    with pytest.raises(SlotsError, match="code=4") as info:  # a __slots__ value kept
        await f.rebuilt_by_state("slots")
    assert info.value.code == 4
    with pytest.raises(NewKwError, match="code=4") as info:  # __new__ takes no args
        await f.rebuilt_by_state("new")
    assert info.value.code == 4
    with pytest.raises(RefusesReduceError, match="refused"):  # __reduce__ raises
        await f.rebuilt_by_state("reduce")
    assert await f.ok() == "ok"


async def test_init_exception_raised_from_spawn(rt):
    with pytest.raises(KeyError, match="init failed on purpose"):
        await Faulty.spawn(fail=True)


async def test_unserializable_argument_is_type_error_before_sending(rt):
    c = await Counter.spawn()
    with pytest.raises(TypeError, match="Counter.echo"):
        c.echo(threading.Lock())
    assert await c.incr() == 1


async def test_argument_failing_to_unpickle_in_actor_is_type_error(rt):
    c = await Counter.spawn(0)
    with pytest.raises(TypeError, match="could not deserialize.*RuntimeError"):
        await c.echo(BreaksOnArrival())
    assert await c.incr(1) == 1  # the actor is unaffected, and ran the bad call once only
    assert await c.incr(1) == 2


async def test_an_argument_whose_module_the_actor_cannot_import_names_the_fix(rt, tmp_path,
                                                                           monkeypatch):
    c = await Counter.spawn(0)
    (tmp_path / "driver_only_mod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # after the spawn: the actor lacks it
    import driver_only_mod
    with pytest.raises(TypeError, match=r"cannot import 'driver_only_mod'.*sys\.path.*"
                                        r"register_pickle_by_value\(driver_only_mod\)"):
        await c.echo(driver_only_mod.Thing())
    assert await c.incr(1) == 1


@pytest.mark.parametrize("kind,name", [("cancel", "CancelledError"),
                                       ("genexit", "GeneratorExit"),
                                       ("kbi", "KeyboardInterrupt"), ("exit", "SystemExit")])
async def test_an_argument_raising_a_base_exception_as_it_unpickles_fails_alone(rt, kind,
                                                                               name):
    c = await Counter.spawn(0)
    futs = [c.record(i) for i in range(20)] + [c.echo(BreaksOnArrival(kind))] + \
        [c.record(i) for i in range(20, 40)]
    out = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30)
    assert isinstance(out[20], TypeError) and f"deserialize the call's arguments: {name}" \
        in str(out[20])
    assert out[:20] + out[21:] == list(range(40))  # the others answered, the actor lives
    with pytest.raises(TypeError, match=name):
        await asyncio.wait_for(Counter.spawn(BreaksOnArrival(kind)), 30)


@pytest.mark.parametrize("kind", ["cancel", "genexit"])
async def test_a_result_raising_cancelled_error_as_it_unpickles_fails_alone(rt, kind):
    f = await Faulty.spawn()
    futs = [f.ok(), f.breaking(kind), f.ok()]
    out = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30)
    assert out[0] == out[2] == "ok"
    assert isinstance(out[1], TypeError) and "could not be deserialized here" in str(out[1])
    got = []
    with pytest.raises(TypeError, match="an item of Faulty.breaking_items could not be "
                                        "deserialized here"):
        async for x in f.breaking_items(kind):
            got.append(x)
    assert got == [1] and await asyncio.wait_for(f.ok(), 30) == "ok"


async def test_a_method_closing_stdout_leaves_no_traceback_at_exit(capfd):
    async with actorshm.Runtime(shutdown_grace=1.0):
        f = await Faulty.spawn()
        assert await f.close_stdout() and await f.ok() == "ok"
    assert "Traceback" not in capfd.readouterr().err


async def test_a_child_forked_in_a_method_leaves_when_it_returns(rt):
    f = await Faulty.spawn()
    for _ in range(3):
        child = await f.fork_and_return()
        assert child > 0 and await f.ok() == "ok"  # the parent's answer; one answer
        for _ in range(100):  # it exited on returning, rather than run a second actor
            try:
                with open(f"/proc/{child}/stat") as st:
                    if st.read().split(")")[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the forked child {child} still runs")


async def test_a_forked_child_leaving_with_sys_exit_or_in_a_stream_leaves_quietly(rt):
    f = await Faulty.spawn()
    for _ in range(3):
        assert await asyncio.wait_for(f.fork_and_exit(), 30) > 0
        assert await asyncio.wait_for(f.ok(), 30) == "ok"  # the parent's loop is intact
    items = [x async for x in f.fork_in_stream()]
    assert len(items) == 1 and items[0] > 0  # the parent's item only
    assert await asyncio.wait_for(f.ok(), 30) == "ok"


async def test_actor_whose_init_arguments_fail_stops_cleanly(rt, capfd):
    with pytest.raises(TypeError, match="could not deserialize"):
        await Counter.spawn(BreaksOnArrival())
    await asyncio.sleep(0.3)
    assert "Traceback" not in capfd.readouterr().err


async def test_unserializable_result_is_type_error(rt):
    f = await Faulty.spawn()
    with pytest.raises(TypeError, match="cannot be sent back"):
        await f.bad_result()
    assert await f.ok() == "ok"
    with pytest.raises(TypeError, match="is a streaming method: iterate it with `async for"):
        await f.stream(3)
    assert [x async for x in f.stream(3)] == [0, 1, 2]
    assert await f.ok() == "ok"


async def test_sync_method_in_thread_can_wait_on_calls(rt):
    from actors import ThreadedCaller
    c = await Counter.spawn(1)
    t = await ThreadedCaller.spawn()
    assert await t.call_and_wait(c, 2) == 3
    # the driver, from a thread of its own
    result = await asyncio.to_thread(lambda: c.incr(1).result(timeout=10))
    assert result == 4


async def test_a_call_made_after_kill_fails_while_the_kill_settles(rt):
    # Made once the kill's task had asked the actor to settle, the call was sent and,
    # answered in that moment, succeeded (about half the time); from a thread, a call
    # made right after kill() did too when the loop ran the kill's task in between.
    for _ in range(10):
        a = await Counter.spawn(5)
        kill = a.kill()
        await asyncio.sleep(0.0003)  # (the kill's task asks the actor to settle)
        with pytest.raises(actorshm.ActorDiedError, match="kill"):
            await a.incr(1)
        await kill


async def test_a_call_an_actor_makes_after_its_kill_of_another_fails(rt):
    # Inside an actor too, the call made on the link right after kill() was answered.
    from call_actors import Relay, Worker
    relay = await Relay.spawn()
    for delay in (0, 0, 0.0003):
        out = await relay.kill_then_call(await Worker.spawn(), delay)
        assert "killed by actorshm kill()" in out, out


async def test_a_method_whose_lookup_raises_fails_its_call_only(rt):
    # The actor looked the method up unguarded: the error left the call unanswered, and
    # (raised at the end of a read) stopped the connection from writing at all.
    from actors import LookupFails
    h = await LookupFails.spawn()
    boom, ok = h.boom(), h.ok(1)
    with pytest.raises(LookupError, match="no boom today"):
        await asyncio.wait_for(boom, 10)
    assert await asyncio.wait_for(ok, 10) == 1
    assert await asyncio.wait_for(h.ok(2), 10) == 2


async def test_kill_from_a_thread_with_no_event_loop_goes_through(rt):
    # A driver thread, and a sync method of an actor with max_concurrency > 1 (a thread
    # of its pool), have no event loop running: there h.kill() and group.kill() returned
    # a coroutine, which nothing ran, and the actors lived on.
    from actors import ThreadLoopUser
    a, b, c, d = [await Counter.spawn(5) for _ in range(4)]

    def thread():
        b.kill()  # never waited for: it goes through all the same
        done = a.kill()
        after = a.incr(1)  # made after the kill: it fails, as on the loop
        return done, done.result(timeout=10), after.exception(timeout=10)
    done, result, after = await asyncio.to_thread(thread)
    assert isinstance(done, concurrent.futures.Future) and result is None
    assert isinstance(after, actorshm.ActorDiedError) and "kill" in str(after)
    user = await ThreadLoopUser.spawn()
    assert await user.kill_and_wait(c) == ("ThreadCallFuture", None)
    assert await user.kill_and_wait(actorshm.ActorGroup([d])) == ("ThreadCallFuture", None)
    for h in a, c, d:
        with pytest.raises(actorshm.ActorDiedError, match="kill"):
            await h.incr()
    async with timeout(10):
        while True:  # (b's kill may still be under way)
            try:
                await b.incr()
            except actorshm.ActorDiedError as exc:
                assert "kill" in str(exc)
                break
            await asyncio.sleep(0.02)


async def test_a_result_holding_an_unfinished_call_says_to_await_it(rt):
    c = await Caller.spawn(await Counter.spawn())
    with pytest.raises(TypeError, match=r"cannot be sent back.*await it first"):
        await c.return_unawaited(1)


def test_calls_from_another_thread_can_be_awaited_there_and_fail_once_closed():
    got = {}

    async def main():
        c = await Counter.spawn(10)

        def thread():
            async def inner():  # an event loop of this thread's own
                got["awaited"] = await c.incr(1)
            asyncio.run(inner())
            got["blocked"] = c.incr(1).result(10)
        t = threading.Thread(target=thread)
        t.start()
        await asyncio.get_running_loop().run_in_executor(None, t.join)
        return c

    c = actorshm.run(main())
    assert got == {"awaited": 11, "blocked": 12}
    late = []  # a call from a thread once the runtime has closed
    t = threading.Thread(target=lambda: late.append(c.incr(1)))
    t.start()
    t.join()
    with pytest.raises(actorshm.ActorDiedError, match="runtime closed"):
        late[0].result(5)


async def test_blocking_on_a_call_where_nothing_can_block_says_what_to_do(rt, capfd):
    c = await Counter.spawn(0)
    on_loop = await Caller.spawn()  # sync methods run on its event loop
    with pytest.raises(asyncio.InvalidStateError, match="await"):
        await on_loop.block_on(c)
    # the call given up on fails later: the actor prints no "exception was never
    # retrieved" traceback for it (its caller already had the error that says why)
    with pytest.raises(asyncio.InvalidStateError, match="await"):
        await on_loop.block_on(c, "x")  # (incr fails: 0 + "x")
    await asyncio.sleep(0.3)
    assert "never retrieved" not in capfd.readouterr().err
    with pytest.raises(TypeError, match=r"block on it with \.result\(\) first"):
        await (await Caller.options(max_concurrency=3).spawn()).return_unfinished(c)
    threaded = await Caller.options(max_concurrency=3).spawn()
    assert await threaded.block_on(c) >= 1  # there, blocking is what works
    assert await on_loop.call_handle(c, 1) >= 2  # and the actor is fine


async def test_a_failed_call_is_freed_when_dropped_with_no_collector_run(rt):
    # Its error's traceback kept the frame of the future's own result(), and that
    # frame the future: every failed call was a reference cycle, its arguments and
    # the caller's frames kept (with their shared blocks) until a collection.
    import weakref
    c = await Counter.spawn(0)
    gc.disable()
    try:
        fut = c.incr("x")  # (0 + "x" fails)
        ref = weakref.ref(fut)
        try:
            await fut
        except TypeError:
            pass
        del fut
        for _ in range(3):  # (the loop lets go of its wake-up callback's arguments)
            await asyncio.sleep(0)
        assert ref() is None
    finally:
        gc.enable()


async def test_a_failed_calls_traceback_starts_at_the_await(rt):
    # A frame of actorshm's own (the call future's result()) stood between the caller's
    # `await` and the error in every failed call's traceback.
    import traceback
    c = await Counter.spawn(0)
    with pytest.raises(TypeError) as info:
        await c.incr("x")
    frames = traceback.extract_tb(info.value.__traceback__)
    assert [f.name for f in frames] == ["test_a_failed_calls_traceback_starts_at_the_await"]
    fut = c.incr(2)
    result = fut.result  # (taken before the call finished, called after)
    assert await fut == 2 and result() == 2


async def test_a_class_that_cannot_travel_by_value_is_named_with_the_fix(rt):
    # a class of __main__ (a script, a notebook) travels by value; one holding a lock
    # cannot, and the error is about the class, not about __init__'s arguments
    cls = type("LockHolder", (), {"__module__": "__main__", "lock": threading.Lock(),
                                  "ping": lambda self: "pong"})
    actorshm.actor(cls)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(TypeError, match=r"actor class LockHolder cannot be sent.*module"):
        await cls.spawn()
    await asyncio.sleep(0.2)  # (its process is being reaped)
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert await (await Counter.spawn(1)).incr(1) == 2  # the runtime is fine


def test_spawning_from_another_threads_event_loop_works():
    got = {}

    async def main():
        def thread():
            async def inner():  # an event loop of this thread's own
                c = await Counter.spawn(5)
                got["incr"] = await c.incr(1)
            asyncio.run(inner())
        t = threading.Thread(target=thread)
        t.start()
        await asyncio.get_running_loop().run_in_executor(None, t.join)
    actorshm.run(main())
    assert got == {"incr": 6}


def test_a_runtime_another_thread_opens_does_not_take_this_threads_spawns():
    # A thread opens a runtime on a loop of its own while the main one is open: spawns
    # and current_runtime() on the main loop stay with the main runtime, so their actors
    # live on when the thread's runtime closes.
    got = {}

    async def main():
        loop = asyncio.get_running_loop()
        ours = actorshm.current_runtime()
        opened, finish = threading.Event(), threading.Event()

        def thread():
            async def inner():
                async with actorshm.Runtime() as theirs:
                    got["theirs"] = await (await Counter.spawn(100)).incr(1)
                    got["theirs_current"] = actorshm.current_runtime() is theirs
                    opened.set()
                    await asyncio.get_running_loop().run_in_executor(None, finish.wait)
            asyncio.run(inner())
        t = threading.Thread(target=thread)
        t.start()
        try:
            assert await loop.run_in_executor(None, opened.wait, 60)
            got["ours_current"] = actorshm.current_runtime() is ours
            c = await Counter.spawn(5)
        finally:
            finish.set()
            await loop.run_in_executor(None, t.join)
        got["after"] = await asyncio.wait_for(c.incr(1), 30)  # the thread's runtime closed
    actorshm.run(main())
    assert got == {"theirs": 101, "theirs_current": True, "ours_current": True, "after": 6}


def test_a_stream_from_another_thread_says_which_loop_iterates_it():
    got = {}

    async def main():
        c = await Counter.spawn(0)
        loop = asyncio.get_running_loop()

        def thread():
            async def inner():  # an event loop of this thread's own
                with pytest.raises(TypeError) as err:
                    c.logged_stream(3)
                got["message"] = str(err.value)

            async def consume():
                return [x async for x in c.logged_stream(3)]
            asyncio.run(inner())
            got["handed"] = asyncio.run_coroutine_threadsafe(consume(), loop).result(30)
        t = threading.Thread(target=thread)
        t.start()
        await loop.run_in_executor(None, t.join)
        got["after"] = await c.incr(1)  # nothing was left running in the actor
    actorshm.run(main())
    assert "runtime's event loop" in got["message"]
    assert "run_coroutine_threadsafe" in got["message"]
    assert got["handed"] == [0, 1, 2] and got["after"] == 1


def test_killing_from_another_threads_event_loop_works():
    got, errors = {}, []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        rt = actorshm.current_runtime()
        idle = [await Counter.spawn(5) for _ in range(4)]
        busy = await Faulty.spawn()
        pending = busy.hang()

        def thread():
            async def inner():  # an event loop of this thread's own
                for h in idle:
                    await h.kill()
                await asyncio.wait_for(busy.kill(), 5)
            try:
                asyncio.run(inner())
            except BaseException as exc:
                errors.append(exc)
        t = threading.Thread(target=thread)
        t.start()
        await loop.run_in_executor(None, t.join)
        for call in (idle[0].incr(1), pending):
            with pytest.raises(actorshm.ActorDiedError, match="kill"):
                await call
        # The runtime's loop waits for each exit itself (its supervisor, its close): a
        # kill that waited on the thread's loop had bound the exit event to that loop,
        # and the runtime's own wait failed ("bound to a different event loop").
        for h in (*idle, busy):
            await asyncio.wait_for(rt.record(h._actor_id).exited.wait(), 5)
        await asyncio.sleep(0.3)
        gc.collect()
        got["alive"] = [row["alive"] for row in rt.actors()]
    actorshm.run(main())
    assert got == {"alive": [False] * 5}
    assert errors == []


async def test_a_cancelled_spawn_says_so_in_the_actors_record(rt):
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(Faulty.spawn(), 0.001)
    (record,) = rt.actors()
    assert "its spawn was cancelled" in record["death"] and not record["alive"]


async def test_an_actor_whose_loop_cannot_make_tasks_answers_its_calls_with_the_error(rt):
    # The call was left unanswered, and its slot taken for good: the actor answered
    # nothing more (an eager task factory under uvloop on Python 3.13)
    from actors import TaskFactorySetter
    a = await TaskFactorySetter.spawn()
    await a.break_tasks()
    with pytest.raises(RuntimeError, match="could not start a task.*set_task_factory"):
        await asyncio.wait_for(a.aping(1), 10)
    assert await asyncio.wait_for(a.ping(2), 10) == 2
    with pytest.raises(RuntimeError, match="could not start a task"):
        async with timeout(10):
            async for _ in a.agen():
                pass
    assert await asyncio.wait_for(a.ping(3), 10) == 3


async def test_a_class_sent_by_value_keeps_its_file_in_remote_tracebacks(rt):
    # A class the actor cannot import (the driver's script, here a local class) travels
    # by value; its remote traceback named "<dynamic-code>" with no source line
    @actorshm.actor
    class Local:
        def fail(self):
            raise ValueError("sent by value")  # the line the traceback quotes

    a = await Local.spawn()
    with pytest.raises(ValueError, match="sent by value") as info:
        await a.fail()
    text = str(info.value.__cause__)
    assert f'File "{__file__}"' in text and "# the line the traceback quotes" in text


async def test_methods_made_by_decorators_and_descriptors_are_called_as_written(rt):
    # functools.wraps around an async def is awaited (its coroutine is no result), around
    # a generator streams; partialmethod and singledispatchmethod are methods; a nested
    # class, a class attribute and a property are not.
    d = await Decorated.spawn()
    assert await d.fetch(1) == 2
    assert [x async for x in d.count(3)] == [0, 1, 2]
    # (a wrapper that is itself async, or an async generator, is what it is)
    assert await d.blocking(3) == 6
    assert [x async for x in d.items()] == [1, 2, 3]
    assert await d.double(4) == 8
    assert (await d.describe(1), await d.describe("x")) == ("an int", "something")
    for member in ("Config", "dtype", "state"):
        with pytest.raises(AttributeError, match="no public method"):
            getattr(d, member)


async def test_an_object_of_a_class_without_a_module_travels(rt):
    # (a class made by type() in code run by exec with globals that lack __name__ has no
    # __module__ at all: a check of argument types by module must not fail on it)
    ns: dict = {}
    exec("Point = type('Point', (), {'__init__': lambda self, x: setattr(self, 'x', x)})",
         ns)
    point_cls = ns["Point"]
    with pytest.raises(AttributeError):
        point_cls.__module__
    c = await Counter.spawn()
    back = await c.echo(point_cls(3))
    assert back.x == 3


async def test_an_exception_holding_a_pipe_end_comes_back_as_its_text(rt):
    # pickled, the pipe end arrived as its fd's number, and dropping the error closed
    # that fd of the driver's (an actor's socket: that actor was reported dead)
    c = await Counter.spawn()
    with pytest.raises(actorshm.RemoteError, match="ValueError: .*boom"):
        await c.raise_with_a_pipe_end()
    gc.collect()
    await asyncio.sleep(0.05)
    assert await c.pipe_works() == 1  # (the actor's own end untouched, its socket too)


def test_a_managers_proxy_failing_in_the_actor_says_why():
    # A multiprocessing manager's proxy connects to its manager with the actor's
    # authentication key: the actor's AuthenticationError ("digest sent was rejected")
    # named nothing a user could act on. (Checked on the message alone: a real manager
    # leaves multiprocessing's resource tracker running in the test process.)
    from actorshm._errors import undeserializable_arguments
    err = undeserializable_arguments("AuthenticationError: digest sent was rejected")
    assert "could not deserialize the call's arguments: AuthenticationError" in str(err)
    assert "manager's proxy connects to its manager with the actor process's " \
           "authentication key" in str(err) and "keep the shared state in an actor" in str(err)
