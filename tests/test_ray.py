"""The API contract on both backends (local and Ray), and what is Ray's own.

Contract tests take the ``backend`` fixture and run twice: on the local backend and on
a local Ray started once for this module. Tests of behaviour that only shared memory
gives (write-through of array arguments, block recycling) live in test_arrays.py and run
on the local backend only: on Ray, arrays pass through Ray's object store as read-only
copies (see docs/ray.md), which the Ray-only tests below pin down.
"""

import asyncio
import collections
import dataclasses
import gc
import io
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import actorshm  # noqa: E402
from actorshm._ray import ray_env  # noqa: E402
from actorshm._errors import RemoteTraceback  # noqa: E402

ray_env()  # what a runtime that starts Ray sets: Ray binds 127.0.0.1, deaths fail calls at once
from compat import TimeoutError, noted  # noqa: E402
from waits import until  # noqa: E402
from actors import (Arrays, BreaksOnArrival, Caller, Concurrent, Counter,  # noqa: E402
                    CustomError, EnvReader, Faulty, FormatsError, KwOnlyError, PathError, Phoenix,
                    PoolWorker, Probe, Quirks, SlowStart, ThreadedCaller, TwoArgsError)
import reentrant_cases  # noqa: E402
from call_actors import Relay, Worker  # noqa: E402
from ray_actors import (ArrayUser, Batch, SlotLog, SlowCloser, Streamer,  # noqa: E402
                        ThreadCanceller, Ticker)

ray = pytest.importorskip("ray", reason="the Ray backend tests need Ray: "
                                        "pip install 'actorshm[ray]'")

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::ResourceWarning")


@pytest.fixture(scope="module")
def ray_session():
    """One small local Ray for the module (starting Ray takes seconds)."""
    from ray.job_config import JobConfig
    if not ray.is_initialized():  # actors import tests/*.py as the driver does
        ray.init(address="local", include_dashboard=False, object_store_memory=256 << 20,
                 log_to_driver=False, num_cpus=2,
                 job_config=JobConfig(code_search_path=[os.path.dirname(__file__)]))
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_leaked_processes(ray_session, no_leaked_processes):
    """Ray's own processes (started once for the module) are not a test's leak."""
    yield


@pytest.fixture(params=["local", "ray"])
def backend(request):
    return request.param


@pytest.fixture
async def art(backend):
    """A runtime of the test's backend."""
    opts = {"shutdown_grace": 1.0} if backend == "local" else {}
    async with actorshm.Runtime(backend=backend, **opts) as runtime:
        yield runtime


def ray_only(backend, why):
    if backend != "ray":
        pytest.skip(why)


async def items_before(stream, error, match=None):
    """The items ``stream`` gave before it raised ``error`` (matching ``match``)."""
    got = []
    with pytest.raises(error, match=match):
        async for x in stream:
            got.append(x)
    return got


async def _first_error(stream):
    async for _ in stream:
        pass


# -- Runtime -------------------------------------------------------------------------
async def test_current_runtime_is_the_open_runtime(art, backend):
    assert actorshm.current_runtime() is art
    assert isinstance(art, actorshm.Runtime) and art.backend == backend
    assert set(actorshm.stats()) >= {"bytes_copied", "bytes_zero_copy", "pool_allocs",
                                     "pool_reuses", "blocks_live"}


async def test_stats_has_the_same_keys_in_a_process_that_allocated_nothing(art):
    # An actor that made no shared array (on Ray, none ever does unless its code asks)
    # reports every key, shm_budget included, as a fresh process does.
    a = await Arrays.spawn()
    assert set(await a.stats()) == set(actorshm.stats())
    fresh = subprocess.run([sys.executable, "-c",
                            "import actorshm; print(sorted(actorshm.stats()))"],
                           capture_output=True, text=True, check=True).stdout
    assert "'shm_budget'" in fresh and "'arenas_owned'" in fresh


def test_unknown_backend_and_local_only_options_on_ray_are_refused():
    with pytest.raises(ValueError, match="backend"):
        actorshm.Runtime(backend="dask")
    with pytest.raises(TypeError, match="shutdown_grace"):
        actorshm.Runtime(backend="ray", shutdown_grace=1.0)
    with pytest.raises(TypeError, match=r"address=\.\.\.\) takes a Ray cluster's address "
                                        r"as a str.*not int"):
        actorshm.Runtime(backend="ray", address=5)
    # the options API.md lists are checked as locally, then left to Ray
    for kw, err in (({"start_method": "fork"}, ValueError), ({"shm_budget": -1}, ValueError),
                    ({"shm_budget": "1G"}, TypeError)):
        with pytest.raises(err):
            actorshm.Runtime(backend="ray", **kw)
        with pytest.raises(err):
            actorshm.Runtime(**kw)
    rt = actorshm.Runtime(backend="ray", start_method="forkserver", shm_budget=1 << 30)
    assert rt.backend == "ray" and "start_method" not in rt.ray_init_options


BAD_VALUE_SCRIPT = textwrap.dedent("""
    import asyncio, os
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import actorshm

    async def main():
        try:
            async with actorshm.Runtime(backend="ray", num_cpus="x"):
                pass
        except ValueError as exc:
            print("refused:", exc)
        try:
            async with actorshm.Runtime(backend="ray", start_metod="spawn"):
                pass
        except TypeError as exc:
            print("unknown:", exc)
        import ray
        print("up", ray.is_initialized())

    asyncio.run(main())
""")


def test_options_ray_init_refuses_are_a_value_or_type_error_naming_them(tmp_path):
    # (Ray's words: an AssertionError for a bad value, a RuntimeError for an unknown
    # keyword)
    out = _run_script(tmp_path, "bad_options.py", BAD_VALUE_SCRIPT)
    assert "refused: ray.init refused a value among the options of Runtime(backend='ray', " \
        "num_cpus)" in out and "up False" in out, out
    assert "unknown: Runtime(backend='ray'): Unknown keyword argument" in out, out
    assert "start_metod" in out, out


@pytest.mark.parametrize("budget", [2e9, 8 << 30, 1000, float("inf"), True, "1G"])
def test_shm_budget_on_ray_is_checked_as_on_the_local_backend(budget):
    def outcome(backend):
        try:
            actorshm.Runtime(backend=backend, shm_budget=budget)
        except (TypeError, ValueError) as exc:
            return type(exc), str(exc)
        return None
    assert outcome("ray") == outcome("local")
    if budget == 1000:  # (below one 4 MiB arena)
        err, msg = outcome("ray")
        assert err is ValueError and "at least 4194304" in msg


def test_ray_backend_without_ray_says_how_to_install_it():
    code = textwrap.dedent("""
        import asyncio, sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import actorshm
        async def main():
            await actorshm.Runtime(backend="ray").start()
        try:
            asyncio.run(main())
        except ImportError as exc:
            assert "actorshm[ray]" in str(exc), exc
        else:
            raise SystemExit("no ImportError")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ray_backend_on_an_older_ray_says_which_it_needs():
    # (Ray 2.9 failed every spawn, and streams on async actors failed before 2.57)
    from actorshm import _ray
    _ray.check_ray_version(ray.__version__)  # (this one is recent enough)
    _ray.check_ray_version("3.0.0.dev0")
    with pytest.raises(ImportError, match=r"needs Ray 2\.57 or later, and this is Ray "
                                          r"2\.56\.1.*pip install -U 'ray>=2\.57'"):
        _ray.check_ray_version("2.56.1")


def test_importing_actorshm_imports_no_ray():
    code = "import sys, actorshm; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- Actors --------------------------------------------------------------------------
async def test_spawn_call_and_order(art):
    c = await Counter.spawn(5)
    assert await c.incr(2) == 7
    futs = [c.record(i) for i in range(40)]  # sent now, in this order
    assert await asyncio.gather(*futs) == list(range(40))
    assert await c.get_log() == list(range(40))
    assert c.pid == await c.pid_() != os.getpid()
    assert Counter(1).incr() == 2  # the class still makes plain instances


async def test_num_cpus_sets_every_thread_count_variable(art):
    names = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"]
    e = await EnvReader.spawn()
    assert await e.get(names) == dict.fromkeys(names, "1")  # the default: one thread


async def test_init_error_is_raised_by_spawn_with_its_type(art):
    with pytest.raises(KeyError, match="init failed on purpose"):
        await Faulty.spawn(fail=True)


async def test_a_cancelled_spawn_leaves_no_actor_and_frees_its_name(art, tmp_path):
    # On Ray the actor went only once Ray collected its handle: its name stayed taken
    # meanwhile, and it ran on while anything held the handle (here: the time-out,
    # whose traceback holds the spawn's frames).
    marker = tmp_path / "slow"
    marker.touch()
    with pytest.raises(asyncio.TimeoutError) as cut:
        await asyncio.wait_for(SlowStart.options(name="cut-short").spawn(str(marker), 5.0),
                               0.5)
    marker.unlink()
    h = await SlowStart.options(name="cut-short").spawn(str(marker))
    assert await h.rec(1) == 1
    assert [r["name"] for r in art.actors() if r["alive"]] == ["cut-short"]
    assert cut.value is not None


async def test_init_runs_on_the_actors_event_loop(art):
    t = await Ticker.spawn()
    for _ in range(100):
        if await t.ticks_() > 3:
            break
        await asyncio.sleep(0.02)
    assert await t.ticks_() > 3  # the task __init__ started keeps running


async def test_unknown_method_raises_attribute_error_at_once(art):
    c = await Counter.spawn()
    with pytest.raises(AttributeError, match="no public method 'nope'"):
        c.nope


async def test_names_and_get_actor(art):
    c = await Counter.options(name="ctr").spawn(10)
    same = await actorshm.get_actor("ctr")
    assert await same.incr() == 11 and same == c and same.name == "ctr"
    with pytest.raises(ValueError, match="no live actor named 'ghost'"):
        await actorshm.get_actor("ghost")
    with pytest.raises(ValueError, match="no live actor named 123"):
        await actorshm.get_actor(123)
    with pytest.raises(ValueError, match="already exists"):
        await Counter.options(name="ctr").spawn(0)
    assert await same.incr() == 12  # the first one is unaffected
    await c.kill()
    with pytest.raises(ValueError, match="no live actor named 'ctr'"):
        await actorshm.get_actor("ctr")


async def test_the_name_of_an_actor_that_died_for_good_is_free_again_soon(art):
    # Ray kept a crashed actor's name taken for 40 s and more (a respawn under it
    # failed "already exists"), though get_actor already said it was gone
    f = await Faulty.options(name="crashes").spawn()
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(f.exit(3), 30)
    for _ in range(100):
        try:
            again = await asyncio.wait_for(Faulty.options(name="crashes").spawn(), 30)
            break
        except ValueError:
            await asyncio.sleep(0.1)
    else:
        pytest.fail("the name stayed taken 10 s after the death")
    assert await again.ok() == "ok"


async def test_get_actor_answers_while_a_long_sync_method_runs(art):
    c = await Counter.options(name="busy").spawn(0)
    busy = c.slow_record(1, 4.0)
    await asyncio.sleep(0.5)  # (the sync method holds the actor's loop now)
    t0 = time.monotonic()
    same = await asyncio.wait_for(actorshm.get_actor("busy"), 30)
    assert time.monotonic() - t0 < 3.0 and same == c
    assert await busy == 1


async def test_handles_pickle_and_work_inside_actors(art):
    c = await Counter.options(name="shared").spawn(0)
    again = pickle.loads(pickle.dumps(c))
    assert await again.incr(1) == 1
    caller = await Caller.spawn(c)
    assert await caller.call_other(2) == 3           # handle given to __init__
    assert await caller.call_handle(c, 3) == 6       # handle given to a call
    assert await caller.by_name("shared", 4) == 10   # get_actor inside an actor
    child, first = await caller.spawn_child(100)     # spawned inside an actor
    assert first == 101 and await child.incr(1) == 102
    assert await caller.make_handle_list() == [c]    # handles come back as results


async def test_max_concurrency_lets_async_methods_interleave(art):
    a = await Concurrent.spawn()
    peaks = await asyncio.gather(*(a.work(0.2) for _ in range(4)))
    assert max(peaks) > 1
    one = await Counter.spawn()
    t0 = time.monotonic()
    await asyncio.gather(one.async_record(1, 0.2), one.async_record(2, 0.2))
    assert time.monotonic() - t0 >= 0.39  # max_concurrency=1: one after the other
    assert await one.get_log() == [1, 2]


async def test_sync_method_in_a_thread_may_wait_for_another_actor(art):
    c = await Counter.spawn(0)
    t = await ThreadedCaller.spawn()
    assert await t.call_and_wait(c, 5) == 5


# (on the local backend: test_control.py runs the same cases)
async def test_a_reentrant_call_raises_at_once(art, backend):
    ray_only(backend, "test_control.py")
    await reentrant_cases.chain_is_refused_at_once(limit=20.0)


async def test_a_reentrant_call_through_a_stream_raises_at_once(art, backend):
    ray_only(backend, "test_control.py")
    await reentrant_cases.a_chain_through_a_stream_is_refused_at_once(limit=20.0)


async def test_a_call_back_waits_only_when_every_slot_waits_for_it(art, backend):
    ray_only(backend, "test_control.py")
    await reentrant_cases.a_call_back_into_a_slot_that_frees_waits(limit=10.0)
    await reentrant_cases.every_slot_waiting_refuses_the_call_back(limit=10.0)


async def test_unfinished_calls_as_arguments_are_sent_with_their_results_in_order(art):
    w, other = await asyncio.gather(Worker.spawn(), Worker.spawn())
    slow = w.work(0.3)
    first = other.record({"nested": [slow, (slow,)]})
    then = other.record("after")  # made later: runs later on `other`, though ready now
    assert await first == {"nested": [0.3, (0.3,)]}
    assert await then == "after"
    assert await other.get_log() == [{"nested": [0.3, (0.3,)]}, "after"]
    assert await other.record(slow) == 0.3  # a finished call's awaitable: its result
    bad = w.fails_nonstream()  # a failed one fails the call, which never runs
    with pytest.raises(ValueError, match="no"):
        await other.record(bad)
    waiting = other.record(w.work(0.3))  # cancelled while it waits: never runs
    await asyncio.sleep(0.05)
    waiting.cancel()
    assert await other.record("last") == "last"
    assert (await other.get_log())[-2:] == [0.3, "last"]


async def test_a_call_waiting_for_its_arguments_ends_at_its_cancel_or_its_actors_kill(art):
    w, other = await asyncio.gather(Worker.spawn(), Worker.spawn())
    dep = w.work(5.0)
    waiting = other.record(dep)
    await asyncio.sleep(0.05)
    waiting.cancel()  # its turn on `other` is given up now, not once `dep` is in
    later = other.record("later")
    done, _ = await asyncio.wait([later, dep], return_when=asyncio.FIRST_COMPLETED)
    assert later in done and await later == "later"
    held = other.record(dep)
    await asyncio.sleep(0.05)
    await other.kill()  # it fails now, not once `dep` is in
    done, _ = await asyncio.wait([held, dep], return_when=asyncio.FIRST_COMPLETED)
    assert held in done and not dep.done()
    with pytest.raises(actorshm.ActorDiedError, match="killed"):
        await held
    dep.cancel()


async def test_an_argument_call_cancelled_before_the_wait_fails_the_call_saying_so(art):
    # The call it was given to has not yet started waiting for it (same loop step). Not
    # with a CancelledError: that reads as the awaiting task's own cancellation (a
    # TaskGroup dropped the failure silently; a group call hung)
    w, other = await asyncio.gather(Worker.spawn(), Worker.spawn())
    dep = w.work(5.0)
    waiting = other.record(dep)
    dep.cancel()
    with pytest.raises(actorshm.ActorError, match="given as an argument was cancelled"):
        await waiting
    dep = w.awork(5.0)
    stream = other.count(dep)
    dep.cancel()
    with pytest.raises(actorshm.ActorError, match="given as an argument was cancelled"):
        await asyncio.wait_for(stream.__anext__(), 3.0)
    assert await other.record("after") == "after"


async def test_a_stream_takes_unfinished_calls_as_arguments(art):
    w, other = await asyncio.gather(Worker.spawn(), Worker.spawn())
    assert [x async for x in other.acount(w.record(3), w.work(0.1))] == [0, 1, 2]
    with pytest.raises(ValueError, match="no"):  # a failed one: the stream never starts
        async for _ in other.count(w.fails_nonstream()):
            pass
    dep = w.awork(5.0)
    left = other.count(dep)
    await asyncio.sleep(0.05)
    await left.aclose()  # left before it started: its turn is given up now
    later = other.record("later")
    done, _ = await asyncio.wait([later, dep], return_when=asyncio.FIRST_COMPLETED)
    assert later in done
    held = other.count(dep)
    await asyncio.sleep(0.05)
    await other.kill()  # it fails now, not once `dep` is in
    with pytest.raises(actorshm.ActorDiedError, match="killed"):
        await asyncio.wait_for(held.__anext__(), 3.0)
    assert not dep.done()
    dep.cancel()


async def test_results_as_arguments_are_replaced_as_deep_as_they_are_found():
    # (in-process: the Ray client looks for call futures eight containers down)
    from actorshm._ray import _with_results
    from actorshm._results import CallFuture, futures_in
    f = CallFuture()
    f.set_result(7)
    deep = f
    for _ in range(8):
        deep = [deep]
    assert futures_in((deep,)) == [f]
    args, kwargs = _with_results((deep,), {"k": deep})
    for got in (args[0], kwargs["k"]):
        for _ in range(8):
            got = got[0]
        assert got == 7


async def test_unfinished_calls_as_arguments_inside_actors(art):
    r, w = await asyncio.gather(Relay.spawn(), Worker.spawn())
    assert await r.pass_along(w, w) == 0.2


async def test_a_plain_future_as_an_argument_says_to_await_it(art):
    w = await Worker.spawn()
    fut = asyncio.get_running_loop().create_future()
    with pytest.raises(TypeError, match="await it first"):
        w.record(fut)
    fut.cancel()
    assert await w.record(1) == 1


async def test_env_option_reaches_the_actor(art):
    p = await Probe.options(env={"ACTORSHM_PROBE": "yes"}).spawn()
    assert await p.env("ACTORSHM_PROBE") == "yes"


async def test_leaving_the_runtime_gives_idle_shared_memory_back(backend):
    async with actorshm.Runtime(backend=backend):
        arrs = [actorshm.empty(8 << 20, np.uint8) for _ in range(4)]
        del arrs
        gc.collect()
    st = actorshm.stats()
    assert st["blocks_live"] == 0
    assert st["arenas_owned"] == 0 and st["arena_bytes_owned"] == 0


# -- Errors --------------------------------------------------------------------------
async def test_method_errors_keep_their_type_and_remote_traceback(art):
    f = await Faulty.spawn()
    with pytest.raises(ValueError, match="bad value") as info:
        await f.value_error()
    cause = info.value.__cause__
    assert "value_error" in str(cause) and "Traceback" in str(cause)
    with pytest.raises(CustomError):
        await f.custom()
    with pytest.raises(actorshm.RemoteError, match="Unpicklable"):
        await f.unpicklable()
    assert await f.ok() == "ok"
    # a type that pickles, whose __init__ cannot take back its args: still its type
    with pytest.raises(KwOnlyError, match="code=4") as info:
        await f.not_rebuilt_by_init("kw")
    assert info.value.code == 4
    with pytest.raises(TwoArgsError, match="1-2"):
        await f.not_rebuilt_by_init("two")
    # one pickle rebuilds with another message, an OSError with its own __init__
    with pytest.raises(FormatsError) as info:
        await f.rebuilt_by_state("formats")
    assert str(info.value) == "code=4"
    with pytest.raises(PathError) as info:
        await f.rebuilt_by_state("path")
    assert str(info.value) == "[Errno 2] no such thing: '/x'" and info.value.errno == 2


async def test_an_exception_class_pickled_by_value_is_the_callers_own(art):
    # A class defined in the script (``__main__``) or in a function travels by value: the
    # exception must come back as the caller's class, or ``except LocalError:`` misses.
    class LocalError(Exception):
        pass

    @actorshm.actor
    class Raiser:
        def __init__(self, fail=False):
            if fail:
                raise LocalError("in __init__")

        def boom(self):
            raise LocalError("in a method")

        def items(self):
            yield 1
            raise LocalError("in a stream")

    with pytest.raises(LocalError, match="in __init__"):
        await Raiser.spawn(True)
    r = await Raiser.spawn()
    with pytest.raises(LocalError, match="in a method"):
        await r.boom()
    assert await items_before(r.items(), LocalError, "in a stream") == [1]


async def test_a_cached_method_of_a_class_sent_by_value_is_cached_in_the_actor(art):
    # functools.lru_cache names its wrapper by module and name, which the actor's process
    # cannot look up for a class of the script or of a function: it could not spawn.
    import functools

    @actorshm.actor
    class Cached:
        def __init__(self):
            self.runs = 0

        @functools.lru_cache(maxsize=8, typed=True)
        def square(self, x):
            self.runs += 1
            return x * x

        @functools.cache
        def twice(self, x):
            self.runs += 1
            return 2 * x

        def count(self):
            return self.runs, type(self).square.cache_parameters()

    c = await Cached.spawn()
    assert [await c.square(3), await c.square(3), await c.twice(4), await c.twice(4)] == \
        [9, 9, 8, 8]
    assert await c.count() == (2, {"maxsize": 8, "typed": True})  # (cached there)
    assert Cached().square(5) == 25  # (and here, as the class it is)
    # One whose name finds another object (``fast = lru_cache()(slow)``) goes by value:
    # named, it failed to pickle locally, and on Ray it arrived as the bare function.
    import actors
    c2 = await asyncio.wait_for(Counter.spawn(), 30)
    fast = await c2.echo(actors.fast_square)
    assert fast(3) == 9 and fast.cache_parameters() == {"maxsize": 16, "typed": False}


async def test_an_actors_exit_or_interrupt_does_not_end_the_caller(art):
    with pytest.raises(actorshm.ActorDiedError, match=r"exited in __init__.*sys.exit\(3\)"):
        await Faulty.spawn("exit")
    f = await Faulty.spawn()
    with pytest.raises(actorshm.RemoteError, match="KeyboardInterrupt: pressed in the actor"):
        await f.interrupt()
    assert await f.ok() == "ok"


async def test_unserializable_argument_is_a_type_error_before_sending(art):
    import threading
    c = await Counter.spawn()
    with pytest.raises(TypeError):
        c.echo(threading.Lock())
    assert await c.incr() == 1
    # Worded alike on both backends: what pickling refused, where it lies, what to do
    # (on Ray, not its report on the whole payload with the host's internal names)
    fix = r"cannot pickle '_thread.lock' object\. Arguments must be picklable.*pass data"
    with pytest.raises(TypeError, match=r"^cannot send the arguments of Counter.echo\(\): at "
                                        r"args\[0\]\['s'\]\[1\], " + fix) as info:
        c.echo({"s": [1, threading.Lock()]})
    assert "_ray_host" not in str(info.value) and len(str(info.value)) < 300
    with pytest.raises(TypeError, match=r"^cannot send the arguments of Counter\.(__init__|"
                                        r"spawn)\(\): at kwargs\['start'\]\[0\], " + fix):
        await Counter.spawn(start=[threading.Lock()])
    assert await c.incr() == 2
    # a CancelledError raised by an argument's __reduce__ cancels nothing: the same error
    from actors import CancelsPickling
    with pytest.raises(TypeError, match=r"at args\[0\]\[1\], a __reduce__ raised Cancelled"):
        c.echo([1, CancelsPickling()])
    # (Ray's report on what it cannot serialize wraps sys.stdout and sys.stderr again each
    # time, colorama's; hundreds of failed calls later, a write recursed past Python's
    # limit and the driver died: they are put back)
    streams = sys.stdout, sys.stderr
    with pytest.raises(TypeError):
        c.echo({"s": [threading.Lock()]})
    assert (sys.stdout, sys.stderr) == streams
    assert await c.incr() == 3


async def test_an_error_whose_pickling_raises_keyboard_interrupt_comes_back_as_text(art):
    # (on Ray the call failed as cancelled, naming Ray's internals, and the actor never
    # answered again)
    a = await Arrays.spawn()
    pid = a.pid
    with pytest.raises(actorshm.RemoteError, match=r"InterruptsPicklingError: raised"):
        await asyncio.wait_for(a.cancels_pickling("interrupt"), 60)
    assert await asyncio.wait_for(a.echo(3), 60) == 3 and a.pid == pid


async def test_spawn_arguments_are_checked_as_a_calls_are(art):
    # (on Ray a spawn's arguments went unchecked: a tensor in an autograd graph arrived
    # as a leaf, its graph silently dropped; an open file as a StringIO)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"cannot send the arguments of Counter\.(__init__|"
                                        r"spawn)\(\): a tensor that requires grad.*detach"):
        await Counter.spawn(torch.ones(2, requires_grad=True) * 2)
    with open(__file__) as f:
        with pytest.raises(TypeError, match=r"the open file .* cannot be sent.*path"):
            await Counter.spawn(f)
    c = await Counter.spawn(torch.ones(2, requires_grad=True))  # a leaf goes
    assert await c.echo(5) == 5


class RefusesPickling:
    """Its pickling raises an error that is neither a TypeError nor says "pickle"."""

    def __init__(self, error=RuntimeError):
        self.error = error

    def __reduce__(self):
        raise self.error("not today")


async def test_an_argument_whose_own_pickling_raises_is_a_type_error_before_sending(art):
    # Whatever an argument's ``__reduce__`` raises, the call (and the spawn) raises
    # TypeError at once, as the contract says, on Ray as locally.
    c = await Counter.spawn()
    for error in (RuntimeError, ValueError, KeyError):
        with pytest.raises(TypeError, match="not today"):
            c.echo(RefusesPickling(error))
        with pytest.raises(TypeError, match="not today"):
            c.echo(x=[RefusesPickling(error)])
        with pytest.raises(TypeError, match="not today"):
            await asyncio.wait_for(Counter.spawn(RefusesPickling(error)), 60)
    s = await Streamer.spawn()
    with pytest.raises(TypeError, match="not today"):
        s.count(3, RefusesPickling())
    assert await c.incr() == 1
    assert await asyncio.wait_for(s.ping(), 30) == "pong"


async def test_an_argument_that_cannot_be_rebuilt_in_the_actor_fails_that_call_only(art):
    # On Ray, the actor's calls from one caller run in the order made: a call that Ray
    # failed before it reached the actor's code must not keep the next one waiting.
    c = await Counter.spawn()
    with pytest.raises(TypeError, match="could not deserialize.*RuntimeError"):
        await asyncio.wait_for(c.echo(BreaksOnArrival()), 30)
    assert await asyncio.wait_for(c.incr(), 30) == 1
    s = await Streamer.spawn()
    with pytest.raises(TypeError, match="could not deserialize.*RuntimeError"):
        async for _ in s.count(3, BreaksOnArrival()):
            pass
    assert await asyncio.wait_for(s.ping(), 30) == "pong"


async def test_an_argument_whose_module_the_actor_cannot_import_names_the_fix(
        art, tmp_path, monkeypatch):
    c = await Counter.spawn()
    (tmp_path / "driver_only_ray_mod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # after the spawn: the actor lacks it
    import driver_only_ray_mod
    with pytest.raises(TypeError, match=r"cannot import 'driver_only_ray_mod'.*"
                                        r"register_pickle_by_value"):
        await asyncio.wait_for(c.echo(driver_only_ray_mod.Thing()), 30)
    assert await asyncio.wait_for(c.incr(), 30) == 1


async def test_an_actor_class_the_actor_cannot_import_is_named(art, tmp_path, monkeypatch):
    """The class travels with __init__'s arguments: its failing import read as "the
    actor could not deserialize the call's arguments", even with no arguments given
    (locally, then on Ray)."""
    (tmp_path / "driver_only_ray_actors.py").write_text(
        "import actorshm\n@actorshm.actor\nclass Hidden:\n    def f(self):\n"
        "        return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import driver_only_ray_actors
    finally:
        sys.path.remove(str(tmp_path))  # the actor is spawned without it
    monkeypatch.setitem(sys.modules, "driver_only_ray_actors", driver_only_ray_actors)
    with pytest.raises(TypeError, match=r"could not deserialize its class Hidden \(module "
                                        r"'driver_only_ray_actors'\) or the arguments of "
                                        r"its __init__: .*ModuleNotFoundError.*"
                                        r"register_pickle_by_value"):
        await asyncio.wait_for(driver_only_ray_actors.Hidden.spawn(), 60)


async def test_spawn_arguments_that_cannot_be_rebuilt_in_the_actor_are_a_type_error(art):
    with pytest.raises(TypeError, match="could not deserialize.*RuntimeError"):
        await asyncio.wait_for(Counter.spawn(BreaksOnArrival()), 60)
    assert await (await Counter.spawn(1)).incr() == 2


async def test_a_result_that_cannot_be_rebuilt_here_is_a_type_error(art):
    f = await Faulty.spawn()
    with pytest.raises(TypeError, match="could not be deserialized.*RuntimeError"):
        await f.call(BreaksOnArrival)  # made in the actor, it cannot be rebuilt here
    assert await f.ok() == "ok"


async def test_a_streams_items_are_made_in_the_actors_slots(art):
    # max_concurrency=1: an item is made neither while a call runs nor with one beside it
    s = await SlotLog.spawn()
    running = s.slow()
    assert [x async for x in s.items(1)] == [0]
    await running
    assert (await s.take_log())[0] == ["slow-start", "slow-end", "item-start", "item-end"]
    it = s.items(1)
    first = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0.1)
    await s.quick()
    await first
    assert (await s.take_log())[0] == ["item-start", "item-end", "quick"]
    running = s.slow()
    assert [x async for x in s.sync_items(1)] == [0]
    await running
    assert (await s.take_log())[0] == ["slow-start", "slow-end", "sync-item"]
    # max_concurrency=2: two calls and a stream never run three at once
    s2 = await SlotLog.options(max_concurrency=2).spawn()
    calls = [s2.slow(0.3), s2.slow(0.3)]
    assert [x async for x in s2.items(2, 0.1)] == [0, 0]
    await asyncio.gather(*calls)
    assert (await s2.take_log())[1] == 2


async def test_kill_fails_pending_and_later_calls_promptly(art):
    c = await Counter.spawn()
    pending = c.slow_record(1, 30)
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    forgotten = c.slow_record(2, 30)  # (nobody awaits it: no "never retrieved" for it)
    await asyncio.sleep(0.2)
    await c.kill()
    with pytest.raises(actorshm.ActorDiedError, match="kill"):  # (Ray's: "unexpectedly")
        await asyncio.wait_for(pending, 5)
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(c.incr(), 5)
    assert time.monotonic() - t0 < 5
    assert forgotten.done() and not forgotten._log_traceback


async def test_kill_from_a_thread_with_no_event_loop_goes_through(art):
    # (a driver thread; a sync method of an actor with max_concurrency > 1): it returned
    # a coroutine, which nothing ran
    from actors import ThreadLoopUser
    a, c = await Counter.spawn(), await Counter.spawn()

    def thread():
        done = a.kill()
        return type(done).__name__, done.result(timeout=20)
    assert await asyncio.to_thread(thread) == ("ThreadCallFuture", None)
    user = await ThreadLoopUser.spawn()
    assert await user.kill_and_wait(c) == ("ThreadCallFuture", None)
    for h in a, c:
        with pytest.raises(actorshm.ActorDiedError):
            await asyncio.wait_for(h.incr(), 10)


async def test_calls_made_during_a_restart_another_threads_loop_saw_are_answered(art,
                                                                                  tmp_path):
    # On Ray the restart was watched on the loop of the call that saw the death, a
    # thread's own: when that loop ended, the calls held for the restart were sent at
    # once, failed, and their answers went to the closed loop ("Event loop is closed"
    # printed, the calls never answered); a call from a thread's loop during a restart
    # seen here was answered on this loop, its own never woken.
    import threading
    from ray_actors import SlowRestart
    h = await SlowRestart.spawn(str(tmp_path / "marker"))
    await h.ping()
    saw, made = threading.Event(), threading.Event()

    def thread():
        async def go():
            with pytest.raises(actorshm.ActorDiedError):
                await h.crash_soon()
            saw.set()
            made.wait(20)  # (until this loop's calls are made, then this loop ends)
            await asyncio.sleep(0.01)
        asyncio.run(go())
    t = threading.Thread(target=thread)
    t.start()
    saw.wait(30)  # (holding this loop: the thread's loop hears of the death first)
    held = [h.ping() for _ in range(3)]
    made.set()
    await asyncio.to_thread(t.join)
    assert await asyncio.wait_for(asyncio.gather(*held), 30) == ["pong"] * 3
    # and a call from a thread's own loop, during a restart this loop saw
    with pytest.raises(actorshm.ActorDiedError):
        await h.crash_soon()

    async def from_thread():
        return await asyncio.wait_for(h.ping(), 30)
    assert await asyncio.to_thread(asyncio.run, from_thread()) == "pong"


async def test_an_answer_after_a_threads_loop_ended_prints_nothing(art, capfd, caplog):
    # (on Ray: "Exception in callback ... RuntimeError: Event loop is closed", once for
    # each call a thread's own loop timed out or never awaited)
    from ray_actors import SlowRestart
    h = await SlowRestart.spawn(os.devnull)

    async def thread_loop():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(h.slow(0.6), 0.1)
        h.slow(0.3)  # (never awaited)
    await asyncio.to_thread(asyncio.run, thread_loop())
    await asyncio.sleep(1.2)
    assert await h.ping() == "pong"
    assert "Event loop is closed" not in capfd.readouterr().err + caplog.text


async def test_calls_from_other_threads_pending_at_a_kill_say_it_was_the_kill(art):
    # (on Ray they failed later, as Ray saw the death: "the actor died unexpectedly")
    c = await Counter.spawn()
    await c.incr()
    plain = await asyncio.to_thread(lambda: c.slow_record(1, 30))  # (no loop there)

    async def thread_loop():
        return await asyncio.gather(c.slow_record(2, 30), return_exceptions=True)
    looped = asyncio.ensure_future(asyncio.to_thread(asyncio.run, thread_loop()))
    await asyncio.sleep(0.5)
    await c.kill()
    for err in (await asyncio.to_thread(plain.exception, 20),
                (await asyncio.wait_for(looped, 20))[0]):
        assert isinstance(err, actorshm.ActorDiedError) and "kill" in str(err), err


async def test_an_actor_spawned_and_killed_leaves_a_summary_row_only(art, backend):
    # On Ray the runtime kept each dead actor's handle (Ray's actor handle with it, some
    # 64 KB) and its call numbers for its whole life: a runtime that spawns and kills
    # actors grew without bound. The local backend keeps a summary row, and so now does
    # Ray's, with the same fields.
    def handles_kept():
        return [h for h in getattr(art, "_spawned", ())]
    keys = []
    for i in range(4):
        c = await Counter.options(name=f"short-lived-{i}").spawn()
        assert await c.incr() == 1
        await c.kill()
        keys.append(c._actor_id)
        with pytest.raises(actorshm.ActorDiedError):
            await asyncio.wait_for(c.incr(), 10)  # (a killed handle's calls fail still)
        del c

    async def forgotten():
        return not handles_kept()
    assert await until(forgotten, 10), handles_kept()
    rows = {r["id"]: r for r in art.actors()}
    for k in keys:
        assert not rows[k]["alive"] and "kill" in rows[k]["death"], rows[k]
    assert sorted(rows[k]["name"] for k in keys) == [f"short-lived-{i}" for i in range(4)]
    if backend == "ray":
        from actorshm._ray import CLIENT
        assert not {k.key for k in keys} & set(CLIENT._seqs)
        assert all(rows[k]["id"].handle is None for k in keys)  # (Ray's handle is let go)


async def test_calls_name_their_ray_tasks_only_where_ray_metrics_are_off(art, backend,
                                                                         monkeypatch):
    # Ray records its task metrics under each task's name: with a name per call (the
    # call's identity, Ray's cheapest way to carry it) the caller's and the actor's
    # memory grew by ~2.5 KB per call for good. A Ray the runtime starts has its
    # metrics off; where they are on, calls carry their identity in their argument.
    ray_only(backend, "Ray task names")
    from actorshm import _ray
    assert os.environ["RAY_enable_metrics_collection"] == "0" and _ray.names_in_tasks()
    first = await Counter.spawn()
    assert first._actor_id.named  # (the fast way, metrics off)
    monkeypatch.setattr(_ray.CLIENT, "_names_ok", None)  # (asked again, then restored)
    monkeypatch.setenv("RAY_enable_metrics_collection", "1")
    c = await Counter.spawn()
    assert not c._actor_id.named
    assert [await c.incr(), await c.incr(2)] == [1, 3]
    assert await first.incr() == 1
    # Off here, but in a Ray this process joined (a cluster): its setting is unknown,
    # and its actors' memory grew per call, so calls carry their facts in arguments.
    monkeypatch.setenv("RAY_enable_metrics_collection", "0")
    monkeypatch.setattr(_ray.CLIENT, "_names_ok", None)
    monkeypatch.setattr(_ray, "_ray_started_here", lambda: False)
    joined = await Counter.spawn()
    assert not joined._actor_id.named and await joined.incr(5) == 5


async def test_a_handle_whose_ray_is_gone_fails_without_starting_a_ray(art, backend,
                                                                      monkeypatch):
    # A call on a handle after its runtime shut its Ray down went to Ray, whose
    # auto-init started a new local Ray (then failed with "Can't find actor"), unless
    # the close had marked that actor killed (it no longer lists actors dead for good).
    # A handle without its Ray handle whose kill was forgotten (10,000 kills later)
    # crashed with AttributeError.
    ray_only(backend, "Ray's auto-init")
    from actorshm import _ray
    c = await Counter.spawn()
    monkeypatch.setattr(_ray, "ray_up", lambda: False)
    with pytest.raises(actorshm.ActorDiedError, match="runtime closed"):
        await c.incr()
    with pytest.raises(actorshm.ActorDiedError, match="runtime closed"):
        async for _ in c.logged_stream(2):
            pass
    monkeypatch.undo()
    assert await c.incr() == 1
    stale = _ray.RayActorId(None, "stale-handle-key", frozenset())
    monkeypatch.setattr(_ray.CLIENT, "_dead", {})  # (its kill forgotten; restored after)
    with pytest.raises(actorshm.ActorDiedError, match="runtime closed"):
        await _ray.CLIENT.call(stale, "incr", (), {}, "Counter.incr")


async def test_a_restart_slower_than_its_wait_is_listed_dead_yet_killed_at_close(
        art, backend, tmp_path, monkeypatch):
    # Given up on (its restart took longer than the runtime waits), an actor that may
    # yet come back was forgotten like a dead one: the runtime's close left it running.
    ray_only(backend, "the Ray runtime's wait for a restart")
    from actorshm import _ray_events
    monkeypatch.setattr(_ray_events, "RESTART_WAIT", 1.0)
    marker = tmp_path / "slow"
    async with actorshm.Runtime(backend=backend) as inner:  # (joins; closing kills its own)
        s = await SlowStart.options(max_restarts=1).spawn(str(marker), 4.0)
        assert await s.rec(1) == 1
        marker.touch()
        os.kill(s.pid, signal.SIGKILL)

        async def given_up():
            return [r["alive"] for r in inner.actors()] == [False]
        assert await until(given_up, 20), inner.actors()
        assert await asyncio.wait_for(s.rec(2), 60) == 2  # it came back after all
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(s.rec(3), 30)


async def test_kill_returns_once_the_process_is_gone_and_streams_fail_in_the_loop(art):
    # As API.md has it: kill() ends the process; a stream's call returns an iterator,
    # and the actor's death raises in the `async for`.
    for _ in range(2):
        c = await Counter.spawn()
        pid = c.pid
        await c.kill()
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split(") ")[1][0] in "ZX"  # at most a zombie left
        except FileNotFoundError:
            pass
    s = await Streamer.spawn()
    await s.kill()
    it = s.count(3)
    with pytest.raises(actorshm.ActorDiedError):
        async for _ in it:
            pass


async def test_a_result_is_not_lost_to_the_exit_of_the_call_queued_behind_it(art):
    # calls run one at a time in order: the first finished, so its caller gets its result
    for ending in ("crash", "exit"):
        f = await Faulty.spawn()
        first = f.ok()
        last = f.call(os._exit, 1) if ending == "crash" else f.exit(3)
        results = await asyncio.wait_for(
            asyncio.gather(first, last, return_exceptions=True), 30)
        assert results[0] == "ok", (ending, results)
        assert isinstance(results[1], actorshm.ActorDiedError), (ending, results)


async def test_a_crash_raises_actor_died(art):
    f = await Faulty.spawn()
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(f.exit(3), 10)
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(f.ok(), 10)


async def test_max_restarts_brings_the_actor_back(art):
    p = await Phoenix.spawn("a")
    assert (await p.hit())[:2] == ("a", 1)
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(p.crash(), 10)
    for _ in range(100):  # calls made while it restarts may fail; then it answers
        try:
            tag, calls, _ = await asyncio.wait_for(p.hit(), 10)
            break
        except actorshm.ActorDiedError:
            await asyncio.sleep(0.1)
    assert (tag, calls) == ("a", 1)  # a fresh instance, built with the same arguments
    assert [(await p.hit())[1] for _ in range(3)] == [2, 3, 4]
    new_pid = (await p.hit())[2]
    for _ in range(100):
        if p.pid == new_pid:
            break
        await asyncio.sleep(0.05)
    assert p.pid == new_pid  # the handle's pid follows the restart


async def test_get_actor_finds_a_named_actor_while_it_restarts(art):
    # its name stays its own until it is dead for good (on Ray, asking right after its
    # death failed while Ray restarted it: "no live actor named ...")
    p = await Phoenix.options(name="phoenix").spawn("a")
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(p.crash(), 10)
    again = await asyncio.wait_for(actorshm.get_actor("phoenix"), 60)
    for _ in range(100):  # calls made while it restarts may fail; then it answers
        try:
            assert (await asyncio.wait_for(again.hit(), 10))[:2] == ("a", 1)
            break
        except actorshm.ActorDiedError:
            await asyncio.sleep(0.1)
    else:
        pytest.fail("the restarted actor never answered")


@pytest.mark.parametrize("leave", ["cancel", "aclose"])
async def test_a_stream_left_while_queued_never_runs(art, leave):
    """A stream left (its wait for the first item cancelled, or aclose()) while it is
    queued behind a sync method never starts, as a queued call never runs: on Ray its
    generator made its first item (and ran its finally) once that method ended."""
    c = await Counter.spawn()
    for i in range(3):  # (on Ray it depended on which message the actor's loop took first)
        busy = c.slow_record(i, 0.5)
        s = c.logged_stream(3)
        first = asyncio.ensure_future(s.__aiter__().__anext__())  # (a loop's wait)
        await asyncio.sleep(0.1)  # (both in the actor, the stream behind the running call)
        if leave == "cancel":
            first.cancel()
        else:
            await asyncio.wait_for(s.aclose(), 10)
        await asyncio.gather(first, return_exceptions=True)
        assert await asyncio.wait_for(busy, 10) == i
    await asyncio.sleep(0.3)
    assert await asyncio.wait_for(c.get_log(), 10) == [0, 1, 2]


def test_a_sync_method_starts_once_the_tasks_that_ended_have_handed_over():
    """On Ray, a new actor's first sync method could start in the loop step in which a
    Ray task (the unpickling of a queued call's arguments) ended, before the callback
    that hands its outcome to Ray's thread, which waited, holding the cancel of the
    queued call until the method ended (docs/ray.md, "Cancelling a call")."""
    from actorshm._ray_loop import TaskWatch
    loop = asyncio.new_event_loop()
    handed = []

    async def main():
        watch = TaskWatch(asyncio.get_running_loop())

        async def unpickle():
            return "arguments"
        task = asyncio.ensure_future(unpickle())
        task.add_done_callback(lambda t: handed.append(t.result()))  # (as Ray's, after)
        await asyncio.sleep(0)  # the task runs to its end in this step
        assert task.done() and handed == []  # ended; its outcome not handed over yet
        await watch.settled()
        assert handed == ["arguments"]
        await watch.settled()  # (nothing left to wait for)
        late = asyncio.ensure_future(asyncio.sleep(0.05))
        await asyncio.wait_for(watch.settled(), 1)  # a task still running is no wait
        assert not late.done()
        await late
        # A task factory set later (an actor's __init__ may) still makes the tasks, and
        # the watch, put back in front, keeps them.
        made = []
        asyncio.get_running_loop().set_task_factory(
            lambda loop, coro, **kw: made.append(1) or asyncio.Task(coro, loop=loop, **kw))
        watch.keep()
        task = asyncio.ensure_future(unpickle())
        task.add_done_callback(lambda t: handed.append("again"))
        await asyncio.sleep(0)
        await watch.settled()
        assert made == [1] and handed == ["arguments", "again"]

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def test_a_runtime_left_open_closes_as_its_event_loop_shuts_down(backend):
    # asyncio.run() returning with a runtime open left its actors alive and out of
    # reach until the process exited
    opts = {"shutdown_grace": 1.0} if backend == "local" else {}
    rt = actorshm.Runtime(backend=backend, **opts)

    async def forgetful():
        await rt.start()
        c = await Counter.spawn()
        assert await c.incr() == 1
        return c

    c = await asyncio.to_thread(asyncio.run, forgetful())  # (a loop of its own)
    assert rt.closing  # (a Ray runtime had no `closing` to ask)
    where = "closed as the event loop it was opened on shut down"
    with pytest.raises(actorshm.ActorDiedError, match=f"stopped because its runtime {where}"):
        await asyncio.wait_for(c.incr(), 30)
    with pytest.raises(RuntimeError, match=f"this actorshm Runtime {where}"):
        await rt.get_actor("nobody")


async def test_a_local_actors_handle_in_a_ray_runtime_says_it_cannot_be_used(backend):
    """A local-backend actor's handle given to a Ray actor failed each call there with
    an AttributeError about the actor id ('int' object has no attribute 'streams')."""
    ray_only(backend, "two runtimes of different backends")
    async with actorshm.Runtime(shutdown_grace=1.0):
        local = await Counter.spawn()
        async with actorshm.Runtime(backend="ray"):
            caller = await Caller.spawn()
            with pytest.raises(actorshm.ActorDiedError, match="runtime of the local backend"):
                await asyncio.wait_for(caller.call_handle(local, 1), 30)
            assert await asyncio.wait_for(caller.pid_of(local), 30) == local.pid
        assert await local.incr() == 1  # (it is fine where it belongs)


async def test_a_handle_passed_on_after_a_restart_has_the_new_pid(art):
    """The handle pickled what it was made with: given to an actor after a restart, its
    ``pid`` there was the dead process's, while the driver's said the new one."""
    p = await Phoenix.spawn("a")
    old = p.pid
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(p.crash(), 10)
    for _ in range(100):  # calls made while it restarts may fail; then it answers
        try:
            new = (await asyncio.wait_for(p.hit(), 10))[2]
            break
        except actorshm.ActorDiedError:
            await asyncio.sleep(0.1)
    for _ in range(100):
        if p.pid == new:
            break
        await asyncio.sleep(0.05)
    assert p.pid == new != old
    caller = await Caller.spawn()
    assert await asyncio.wait_for(caller.pid_of(p), 30) == new
    assert f"pid={new}" in repr(p)


async def test_a_restart_fails_pending_calls_at_once_and_later_calls_wait_in_order(art):
    p = await Phoenix.options(max_restarts=-1).spawn("a")
    await p.hit()
    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(actorshm.ActorDiedError):
            await asyncio.wait_for(p.crash(), 10)
        # API.md: "promptly (well under a second after the death)" (Ray took ~1.5 s
        # where it restarts the actor: it waited for a cause of death that never came)
        assert time.monotonic() - t0 < 1.0
        # Made after the death: they wait for the new process, then run in call order
        # (on Ray they failed while Ray had yet to see the death, and the new process
        # took whichever call Ray delivered first as the start of the order).
        calls = [p.hit() for _ in range(8)]
        got = await asyncio.wait_for(asyncio.gather(*calls), 60)
        assert [n for _, n, _ in got] == list(range(1, 9))


async def test_sigterm_ends_the_actor_and_its_calls_fail_promptly(art):
    # On Ray a worker that gets SIGTERM waits for its calls in flight before leaving, and
    # the runtime keeps calls pending on every actor (to learn of its death): the process
    # stayed, answering nothing, and every later call hung.
    c = await Counter.spawn()
    assert await c.incr() == 1
    running = c.slow_record(1, 0.5)
    await asyncio.sleep(0.1)
    os.kill(c.pid, signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(actorshm.ActorDiedError):
        for _ in range(100):  # (on Ray, the calls made while it leaves may still run)
            await asyncio.wait_for(c.incr(), 10)
            await asyncio.sleep(0.05)
    assert time.monotonic() - t0 < 10
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(c.incr(), 10)
    try:  # a running sync call finishes on Ray (the process waits for it) or fails
        assert await asyncio.wait_for(running, 10) == 1
    except actorshm.ActorDiedError:
        pass


async def test_calls_made_before_the_pending_ones_failed_run_after_the_restart(art):
    # Calls made as the first pending call fails, while the ones queued behind it have
    # yet to fail: on Ray the new process waited for those lost calls' turns for ever.
    p = await Phoenix.options(max_restarts=-1).spawn("a")
    for _ in range(3):
        _, _, pid = await p.hit()
        running, queued = p.nap(0.3), [p.hit() for _ in range(5)]
        await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(actorshm.ActorDiedError):
            await asyncio.wait_for(running, 10)
        later = [p.hit() for _ in range(10)]
        got = await asyncio.wait_for(asyncio.gather(*later), 60)
        assert [n for _, n, _ in got] == list(range(1, 11))
        lost = await asyncio.gather(*queued, return_exceptions=True)
        assert all(isinstance(x, actorshm.ActorDiedError) for x in lost)


async def test_an_open_stream_at_a_restart_holds_back_no_later_call(art):
    # A stream left open (an older call) and a call that finished after it: on Ray the
    # new process waited for that finished call's turn for ever (about 1 round in 3).
    p = await Phoenix.options(max_restarts=-1).spawn("a")
    for _ in range(3):
        stream = p.hits(1000)
        await stream.__anext__()
        _, _, pid = await p.hit()
        os.kill(pid, signal.SIGKILL)
        calls = []
        deadline = time.monotonic() + 30  # (a loaded machine restarts slowly)
        while len(calls) < 50 or (time.monotonic() < deadline and sum(
                c.done() and not c.exception() for c in calls) < 25):
            calls.append(asyncio.ensure_future(p.hit()))  # before, during, after
            await asyncio.sleep(0.004)
        got = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
        ran = [x[1] for x in got if not isinstance(x, actorshm.ActorDiedError)]
        assert len(ran) >= 25 and ran == sorted(ran)  # those made after the death: in order
        del stream


async def test_a_resync_passes_the_turns_of_calls_that_will_not_come():
    # A restarted host is told that of a caller's calls before 10**7 only 3 may still
    # come (and those already waiting): the others pass in one step, not one by one.
    from actorshm._ray_host import _Turns
    loop = asyncio.get_running_loop()
    turns = _Turns(0)
    waiting = {seq: loop.create_future() for seq in (5, 9_999_999)}
    turns.waiters.update(waiting)
    turns.consume(0)
    turns.resync(10**7, [3])
    assert turns.next == 3 and not turns.skip
    turns.advance()  # 3 started: 4 passes, 5 (waiting) is woken
    assert turns.next == 5 and waiting[5].done()
    turns.advance()
    assert turns.next == 9_999_999 and waiting[9_999_999].done()
    turns.advance()
    assert turns.next == 10**7
    turns.resync(6, [])  # a late copy of an older resync changes nothing
    assert turns.next == 10**7


async def test_a_stream_made_during_a_restart_holds_back_no_call(art):
    # A stream made right after a death may fail on Ray (sent before Ray saw the death);
    # the call after it must not wait for its turn on the new process.
    p = await Phoenix.options(max_restarts=-1).spawn("a")
    for _ in range(3):
        with pytest.raises(actorshm.ActorDiedError):
            await asyncio.wait_for(p.crash(), 10)
        first, stream, last = p.hit(), p.hits(3), p.hit()
        try:
            items = [n async for _, n, _ in stream]
        except actorshm.ActorDiedError:
            items = []
        n1, n2 = [n for _, n, _ in await asyncio.wait_for(asyncio.gather(first, last), 30)]
        assert n1 == 1
        if items:  # it ran: it started before the last call (which may run between items)
            assert items[0] == 2 and sorted(items + [n2]) == [2, 3, 4, 5]
        else:
            assert n2 == 2


async def test_a_call_cancelled_while_its_actor_restarts_never_runs(art, tmp_path):
    # API.md: "a call still queued there never runs". Locally a call made during a
    # restart waits in the driver (until the new process is there), then in the new
    # process (until its __init__ returns): a sync method ran all the same.
    for concurrency in (1, 3):
        marker = tmp_path / f"slow{concurrency}"
        a = await SlowStart.options(max_concurrency=concurrency).spawn(str(marker))
        marker.write_text("")
        died = asyncio.Event()
        unsubscribe = art.on_actor_event(lambda ev: ev.kind == "died" and died.set())
        os.kill(a.pid, signal.SIGKILL)
        await asyncio.wait_for(died.wait(), 30)
        unsubscribe()
        at_once, later = a.rec("cancelled at once"), a.rec("cancelled later")
        at_once.cancel()
        await asyncio.sleep(1.2)  # the new process is starting, or in its __init__
        later.cancel()
        assert await asyncio.wait_for(a.rec("next"), 60) == "next"
        assert await a.getlog() == ["next"]
        await a.kill()


async def test_kill_during_a_restart_fails_the_calls_waiting_for_it(art):
    p = await Phoenix.options(max_restarts=-1).spawn("a")
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(p.crash(), 10)
    waiting = p.hit()
    await p.kill()
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(waiting, 10)
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(p.hit(), 10)


async def test_calls_made_after_an_unseen_death_wait_for_the_restart(art):
    p = await Phoenix.options(max_restarts=-1).spawn("a")
    await p.hit()
    os.kill(p.pid, signal.SIGKILL)  # no call pending: the caller sees nothing
    await asyncio.sleep(0.3)
    got = await asyncio.wait_for(asyncio.gather(*[p.hit() for _ in range(5)]), 60)
    assert [n for _, n, _ in got] == [1, 2, 3, 4, 5]


async def test_a_stream_starts_after_the_calls_made_before_it(art):
    c = await Counter.spawn()
    for _ in range(3):
        first, second, stream = c.record(1), c.record(2), c.logged_stream(2)
        assert await asyncio.gather(first, second) == [1, 2]
        assert [x async for x in stream] == [0, 1]
    assert await c.get_log() == [1, 2, "stream"] * 3


async def test_a_reply_does_not_wait_for_the_call_after_it(art):
    # The quick call and the slow one reach the actor together while its loop is busy:
    # the quick call's result must not wait until the slow one (run right after it) ends.
    c = await Counter.spawn()
    await c.stall(0.5)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    quick, slow = c.record(2), c.slow_record(3, 2.0)
    assert await quick == 2
    assert loop.time() - t0 < 1.5
    assert await slow == 3


async def test_a_result_outlives_a_later_call_that_ends_the_actor(art):
    for _ in range(3):  # (on Ray, the result was lost about one time in three)
        f = await Faulty.spawn()
        first, quick, dying = f.call(time.sleep, 0.3), f.ok(), f.exit_later(0.5)
        assert await asyncio.wait_for(quick, 10) == "ok"  # it finished before the exit
        with pytest.raises(actorshm.ActorDiedError):
            await asyncio.wait_for(dying, 10)
        assert await first is None


async def test_max_pending_calls_refuses_without_sending(art):
    c = await Counter.options(max_pending_calls=2).spawn()
    a, b = c.slow_record(1, 0.3), c.record(2)
    with pytest.raises(actorshm.PendingCallsLimitError):
        c.record(3)
    assert await asyncio.gather(a, b) == [1, 2]
    assert await c.record(4) == 4
    assert await c.get_log() == [1, 2, 4]


# -- Lifecycle events ------------------------------------------------------------------
async def next_event(stream, timeout=30):
    return await asyncio.wait_for(stream.__anext__(), timeout)


async def test_events_report_a_death_without_a_call_and_kill(art, backend):
    seen = []
    art.on_actor_event(seen.append)
    stream = art.events()
    c = await Counter.options(name="watched").spawn(0)
    pid = c.pid
    os.kill(pid, signal.SIGKILL)  # nobody calls it
    ev = await next_event(stream)
    assert ev.kind == "died" and ev.actor_id == c.actor_id and ev.handle == c
    assert ev.cls_name == "Counter" and ev.name == "watched" and ev.pid == pid
    assert not ev.will_restart and ev.restarts == 0
    assert "SIGKILL" in ev.reason if backend == "local" else ev.reason.startswith("Ray: ")
    assert not ev.killed
    await asyncio.sleep(0)  # callbacks run on the loop, after the stream got it
    assert seen == [ev]
    d = await Counter.spawn(0)
    await d.kill()
    ev = await next_event(stream)
    assert ev.kind == "died" and ev.actor_id == d.actor_id and "kill()" in ev.reason
    assert ev.killed
    await stream.aclose()


async def test_a_kill_made_inside_an_actor_is_reported_as_a_kill(art, backend):
    # On Ray the actor's process records its kill(), not the driver's: the event said
    # Ray's words with killed=False, and a program replacing dead actors brought back
    # the one it had killed.
    from call_actors import Relay, Worker
    stream = art.events()
    relay, target = await Relay.spawn(), await Worker.spawn()
    assert "kill" in await asyncio.wait_for(relay.kill_then_call(target, 0), 60)
    ev = await next_event(stream)
    assert (ev.kind, ev.actor_id, ev.killed) == ("died", target.actor_id, True), ev
    assert "kill()" in ev.reason
    await stream.aclose()


async def test_a_kill_during_a_restart_is_reported_as_the_kill(art, tmp_path):
    # On Ray the last "died" event gave Ray's words for the restart it cut short
    # ("Ray: it was killed by `ray.kill`"), not "kill()" as for every other kill.
    marker = tmp_path / "slow"
    s = await SlowStart.options(max_restarts=1).spawn(str(marker), 3.0)
    marker.touch()  # its restart takes 3 s
    stream = art.events()
    os.kill(s.pid, signal.SIGKILL)
    ev = await next_event(stream)
    assert ev.kind == "died" and ev.will_restart
    await s.kill()
    ev = await next_event(stream)
    assert ev.kind == "died" and not ev.will_restart and "kill()" in ev.reason
    assert ev.killed
    await stream.aclose()


async def test_events_report_actors_spawned_inside_actors(art):
    stream = art.events()
    caller = await Caller.spawn(None)
    child, _ = await caller.spawn_child(0)  # (on Ray the runtime learns of it shortly)
    os.kill(child.pid, signal.SIGKILL)
    ev = await next_event(stream)
    assert ev.kind == "died" and ev.actor_id == child.actor_id and ev.cls_name == "Counter"


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
async def test_events_report_a_restart_and_its_handle_works(art, sig):
    stream = art.events()
    p = await Phoenix.spawn("t")  # max_restarts=1
    pid1 = p.pid
    os.kill(pid1, getattr(signal, sig))
    if sig == "SIGTERM":
        # On Ray a process that gets SIGTERM leaves gracefully; a runtime that looked
        # again only after its restart (a loop busy meanwhile) saw neither event.
        time.sleep(2.5)
    died = await next_event(stream)
    assert (died.kind, died.pid, died.will_restart, died.restarts) == ("died", pid1, True, 0)
    restarted = await next_event(stream)
    assert restarted.kind == "restarted" and restarted.restarts == 1
    assert restarted.pid != pid1 and restarted.pid == p.pid
    assert (await restarted.handle.hit())[0] == "t"
    os.kill(p.pid, signal.SIGKILL)  # no restarts left: gone for good
    ev = await next_event(stream)
    assert ev.kind == "died" and not ev.will_restart


async def test_events_end_when_the_runtime_closes_without_reporting_it(backend):
    opts = {"shutdown_grace": 1.0} if backend == "local" else {}
    async with actorshm.Runtime(backend=backend, **opts) as rt:
        stream = rt.events()
        await Counter.spawn(0)
    assert [ev async for ev in stream] == []  # ended, with no "died" for the shutdown


# -- Seeing inside: stats, memory, stacks --------------------------------------------------
async def test_stats_memory_and_stacks_of_every_actor(art, backend):
    c = await Counter.spawn(0)
    for i in range(3):
        await c.record(i)
    st = await art.stats()
    assert st["actors"][c.actor_id]["calls_received"] >= 3
    # rt.actors() names the same ids (debugging.md: the pids and names behind stats)
    row, = [r for r in art.actors() if r["id"] in st["actors"]]
    assert row["id"] == c.actor_id and row["pid"] == c.pid
    assert st["total"]["calls_received"] >= 3 and st["unresponsive"] == []
    report = await art.memory()
    assert isinstance(report, actorshm.MemoryReport) and report.unresponsive == []
    assert ("object store" in str(report)) == (backend == "ray")
    stuck = c.slow_record(1, 2.0)  # a sync method: the actor's loop is blocked
    await asyncio.sleep(0.5)
    out = io.StringIO()
    text = await art.dump_stacks(file=out)
    assert "slow_record" in text and text == out.getvalue()
    assert f"pid={c.pid}" in text
    assert await stuck == 1
    # A timeout that is no number of seconds is the caller's mistake, said at once (every
    # actor was reported unresponsive, or, for stacks, the actor blamed).
    for ask in (art.stats, art.memory, art.dump_stacks):
        with pytest.raises(TypeError, match=r"\(timeout=\.\.\.\) must be a number of seconds"):
            await ask(timeout="5")
        for bad in (0, -1, float("nan")):
            with pytest.raises(ValueError, match=r"must be more than 0 seconds"):
                await ask(timeout=bad)
        for fine in (None, np.float32(5), np.int64(5)):  # (None: no limit)
            await ask(timeout=fine)
    # so is a path where a stream goes (an AttributeError about 'write', after the wait)
    for bad in ("stacks.txt", pathlib.Path("stacks.txt")):
        with pytest.raises(TypeError, match=r"dump_stacks\(file=\.\.\.\) takes a stream.*open"):
            await art.dump_stacks(file=bad)
    with pytest.raises(TypeError, match=r"takes a stream to print to .*not int 3$"):
        await art.dump_stacks(file=3)


async def test_stacks_show_a_pending_async_call_awaited_coroutine_by_coroutine(art):
    # On Ray each call runs in a task whose outer coroutines are compiled (Cython):
    # walking the task from its top found no frame, and the call was left out.
    c = await Counter.spawn(0)
    waiting = c.async_record(7, 3.0)
    await asyncio.sleep(1.0)
    text = await art.dump_stacks(file=io.StringIO())
    assert "in async_record" in text and "await asyncio.sleep(delay)" in text
    assert await waiting == 7


async def test_stacks_show_a_stream_waiting_in_its_generator(art):
    # The runner awaits ``gen.__anext__()``, an object that does not name its
    # generator: the walk stopped there and the generator's frames were left out.
    s = await Streamer.spawn()
    it = aiter(s.count(1, first_after=3.0))
    first = asyncio.ensure_future(anext(it))
    await asyncio.sleep(1.0)
    text = await art.dump_stacks(file=io.StringIO())
    assert "in count" in text and "await asyncio.sleep(first_after)" in text
    assert await first == 0
    await it.aclose()


@pytest.mark.parametrize("threads", [1, 2])
async def test_a_method_raising_stop_iteration_fails_its_call(art, threads):
    q = await Quirks.options(max_concurrency=threads).spawn()
    # A future cannot carry StopIteration: the call fails as a coroutine would (PEP 479).
    with pytest.raises(RuntimeError, match="stop_iteration raised StopIteration") as info:
        await asyncio.wait_for(q.stop_iteration(), 30)
    assert "StopIteration" in repr(info.value.__cause__)  # itself, or its remote traceback
    assert await asyncio.wait_for(q.ping(), 30) == "pong"


async def test_keyboard_interrupt_in_a_stream_ends_it_and_the_actor_lives(art):
    f = await Faulty.spawn()  # (as from a plain method: the actor lives)
    assert await items_before(f.interrupt_stream(), actorshm.RemoteError,
                              "pressed in the stream") == [1]
    assert await asyncio.wait_for(f.ok(), 30) == "ok"


@pytest.mark.parametrize("concurrency", [1, 2])
@pytest.mark.parametrize("kind, name", [("genexit", "GeneratorExit"),
                                        ("group", "BaseExceptionGroup")])
async def test_a_base_exception_of_a_stream_is_a_remote_error(art, concurrency, kind,
                                                              name):
    """A generator that raises a BaseException other than SystemExit fails its stream
    with RemoteError naming it, as a plain method does (not with Ray's own error type,
    and not, in a thread of a max_concurrency > 1 actor, by hanging its consumer)."""
    f = await Faulty.options(max_concurrency=concurrency).spawn()
    assert await asyncio.wait_for(
        items_before(f.base_error_stream(kind), actorshm.RemoteError, f"^{name}: "), 10) == [1]
    assert await asyncio.wait_for(f.ok(), 30) == "ok"


@pytest.mark.parametrize("concurrency", [1, 2])
@pytest.mark.parametrize("kind, name", [("genexit", "GeneratorExit"),
                                        ("group", "BaseExceptionGroup")])
async def test_a_base_exception_of_a_method_is_a_remote_error(art, concurrency, kind, name):
    """Also from a sync method run in a thread (max_concurrency > 1): a GeneratorExit
    that came back through the thread's future closed the awaiting coroutine on Ray,
    and the caller got Ray's RayTaskError text instead."""
    f = await Faulty.options(max_concurrency=concurrency).spawn()
    with pytest.raises(actorshm.RemoteError, match=f"^{name}: "):
        await asyncio.wait_for(f.raise_base_error(kind), 10)
    assert await asyncio.wait_for(f.ok(), 30) == "ok"


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_result_made_by_mistake_says_what_to_change(art, concurrency):
    """A sync method that returns a generator or coroutine object, or a call it did not
    await, fails with the TypeError that says what to change, on both backends (Ray
    awaited a sync method's coroutine or unfinished call behind its back, and its
    errors said only that a generator or a lock cannot be pickled)."""
    f = await Faulty.options(max_concurrency=concurrency).spawn()
    for kind, says in [("generator", "make the method itself a generator"),
                       ("async generator", "make the method itself a generator"),
                       ("coroutine", "returned a coroutine without awaiting it")]:
        with pytest.raises(TypeError, match=f"the result of Faulty.made_by_mistake cannot "
                                            f"be sent back: .*{says}"):
            await asyncio.wait_for(f.made_by_mistake(kind), 30)
    c = await Caller.options(max_concurrency=concurrency).spawn(await Counter.spawn())
    with pytest.raises(TypeError, match="cannot be sent back: .*(await it first|"
                                        r"block on it with \.result\(\) first)"):
        await asyncio.wait_for(c.return_unawaited(1), 30)
    assert await asyncio.wait_for(f.ok(), 30) == "ok"


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_sys_exit_in_a_stream_ends_the_actor(art, concurrency):
    """sys.exit() in a generator ends the process as in any method: the stream, then
    every later call, fails with ActorDiedError, promptly (on Ray the process stayed, and
    later calls waited for ever)."""
    f = await Faulty.options(max_concurrency=concurrency).spawn()
    assert await asyncio.wait_for(
        items_before(f.exit_in_stream(4), actorshm.ActorDiedError), 10) == [1]
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(f.ok(), 10)


async def test_a_cancelled_error_of_the_methods_own_fails_its_call(art):
    """Only the caller's cancel goes unanswered: a CancelledError the method raised, or
    got from a task cancelled in the actor, is its error (not an Exception: RemoteError)."""
    q = await Quirks.spawn()
    with pytest.raises(actorshm.RemoteError, match="raised by the method itself"):
        await asyncio.wait_for(q.own_cancel(), 30)
    job = q.wait_job()
    await asyncio.sleep(0.3)
    assert await q.stop_job()
    with pytest.raises(actorshm.RemoteError, match="CancelledError"):
        await asyncio.wait_for(job, 30)
    assert await items_before(q.stream_own_cancel(), actorshm.RemoteError,
                              "raised in the stream") == [1]
    assert await asyncio.wait_for(q.ping(), 30) == "pong"


# -- Pools and groups -------------------------------------------------------------------
async def test_actor_pool(art):
    ws = [await PoolWorker.spawn(i) for i in range(2)]
    pool = actorshm.ActorPool(ws)
    out = [v async for v in pool.map(lambda h, v: h.work(v, 0.05), range(6))]
    assert [v for _, v in out] == list(range(6)) and {t for t, _ in out} == {0, 1}
    done = sorted([v async for _, v in pool.map_unordered(lambda h, v: h.work(v), range(4))])
    assert done == [0, 1, 2, 3]
    assert await pool.submit(lambda h, v: h.work(v), "x") in [(0, "x"), (1, "x")]
    assert [(await w.counts())["peak"] for w in ws] == [1, 1]  # one call per actor


async def test_actor_pool_keeps_members_that_live(art):
    # A member that raised another actor's death (errors keep their type) lives; one
    # that max_restarts brings back stays too, and takes work again.
    member, gone = await Relay.spawn(), await Relay.spawn()
    await gone.kill()
    pool = actorshm.ActorPool([member])
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(pool.submit(lambda h, v: h.call_back(v), gone), 30)
    assert len(pool) == 1 and await pool.submit(lambda h, v: h.ping(), None) == "pong"

    async def via_the_dead(h, v):  # the other death, raised here in the driver
        await v.ping()
        return await h.ping()

    with pytest.raises(actorshm.ActorDiedError, match="killed"):
        await asyncio.wait_for(pool.submit(via_the_dead, gone), 30)
    assert len(pool) == 1 and await pool.submit(lambda h, v: h.ping(), None) == "pong"
    await member.kill()
    p = await Phoenix.spawn("a")  # max_restarts=1
    pool = actorshm.ActorPool([p])
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(pool.submit(lambda h, v: h.crash(), None), 30)
    assert len(pool) == 1
    assert (await asyncio.wait_for(pool.submit(lambda h, v: h.hit(), None), 60))[:2] \
        == ("a", 1)
    with pytest.raises(actorshm.ActorDiedError):  # out of restarts: dead for good,
        await asyncio.wait_for(pool.submit(lambda h, v: h.crash(), None), 30)
    with pytest.raises(actorshm.ActorDiedError):  # and gone by its next call at most
        await asyncio.wait_for(pool.submit(lambda h, v: h.hit(), None), 60)
    assert len(pool) == 0


async def test_an_actor_dead_for_good_stays_unreachable_once_forgotten(art):
    # On Ray, the watch that found the actor dead for good made the client forget its
    # call numbers, and with them the death a call had seen: the actor then read as
    # reachable, and an ActorPool whose member's call failed just then kept the dead
    # member, whose next call failed at once (2 runs in 8 of a pool script under load).
    f = await Faulty.spawn()
    pid = f.pid
    with pytest.raises(actorshm.ActorDiedError):
        await asyncio.wait_for(f.exit_later(0), 30)
    assert await until(lambda: [r["alive"] for r in art.actors() if r["pid"] == pid] ==
                       [False], 30)
    await asyncio.sleep(0.5)  # (Ray's restart watch, which ends once Ray says dead)
    assert f._client.reachable(f._actor_id) is False
    with pytest.raises(actorshm.ActorDiedError, match="died|exited"):
        await asyncio.wait_for(f.ok(), 30)
    await f.kill()  # (a kill after its death: its calls still say why it died)
    with pytest.raises(actorshm.ActorDiedError, match="died|exited"):
        await asyncio.wait_for(f.ok(), 30)


async def test_actor_group(art):
    g = await actorshm.ActorGroup.spawn(PoolWorker, 3)
    tags = [t for t, _ in await g.work(0)]
    arr = np.arange(1000.0)
    assert await g.work(arr[:3].tolist()) == [(t, [0.0, 1.0, 2.0]) for t in tags]
    slow = g.work("late", 0.4)
    await asyncio.sleep(0.1)
    await g[1].kill()
    with pytest.raises(actorshm.ActorGroupError) as info:
        await slow
    assert info.value.failed == [1]
    assert isinstance(info.value.exceptions[0], actorshm.ActorDiedError)


async def test_awaiting_a_stream_names_its_method_in_the_advice(art):
    """The TypeError for `await h.count(3)` says how to iterate that method, by name, on
    both backends (Ray's said `handle.method(...)`)."""
    s = await Streamer.spawn()
    with pytest.raises(TypeError, match=r"async for item in handle\.count\(\.\.\.\)"):
        await s.count(3)
    assert [x async for x in s.count(2)] == [0, 1]


async def test_a_group_call_of_a_streaming_method_is_refused(art):
    g = await actorshm.ActorGroup.spawn(Streamer, 2)
    with pytest.raises(TypeError, match="streaming method.*nothing was sent"):
        g.count(3)
    for h in g:  # (not a nested async comprehension: Python 3.10 refuses those)
        assert [x async for x in h.count(2)] == [0, 1]


async def test_a_group_call_from_a_thread_blocks_or_is_awaited_there(art):
    g = actorshm.ActorGroup([await PoolWorker.spawn(i) for i in range(2)])
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, lambda: g.work("b").result(timeout=60)) == [
        (0, "b"), (1, "b")]

    async def in_own_loop():
        return await g.work("a")
    assert await loop.run_in_executor(None, lambda: asyncio.run(in_own_loop())) == [
        (0, "a"), (1, "a")]
    t = await ThreadedCaller.spawn()  # a sync method in a thread of the actor's
    assert await t.group_and_wait(g, "t") == [(0, "t"), (1, "t")]


async def test_a_call_made_in_a_plain_thread_is_awaitable_in_its_own_loop(art):
    c = await Counter.spawn(0)
    loop = asyncio.get_running_loop()
    # Block on it in the thread, or await it in an event loop of that thread's own.
    assert await loop.run_in_executor(None, lambda: c.incr(5).result(timeout=60)) == 5

    async def in_own_loop():
        return await c.incr(2)
    assert await loop.run_in_executor(None, lambda: asyncio.run(in_own_loop())) == 7
    assert await c.incr(1) == 8


# -- Cancellation and streaming --------------------------------------------------------
async def test_cancel_stops_a_running_async_call_and_a_queued_one(art):
    c = await Counter.spawn()
    running = asyncio.ensure_future(c.async_record(1, 30))
    queued = asyncio.ensure_future(c.record(2))
    await asyncio.sleep(0.3)
    running.cancel()
    queued.cancel()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(c.slow_record(3, 1.0), 0.3)  # a sync call finishes there
    assert await asyncio.wait_for(c.record(4), 10) == 4
    assert await c.get_log() == [3, 4]


async def test_a_cancelled_sync_call_in_a_thread_keeps_its_slot_until_it_returns(art):
    # max_concurrency=2: sync methods run in threads, which a cancel cannot stop; the
    # cancelled one holds its slot until it returns, so no third call runs beside it
    s = await SlotLog.options(max_concurrency=2).spawn()
    cancelled = asyncio.ensure_future(s.blocking(3.0))
    other = s.blocking(3.0)
    await asyncio.sleep(1.0)  # (both running: a slow start would leave one queued)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.gather(s.slow(0.2), s.slow(0.2), other)
    log, peak = await s.take_log()
    assert log[:2] == ["blocking-start"] * 2 and peak == 2, log
    assert log.index("slow-start") > log.index("blocking-end"), log


async def test_a_sync_generators_steps_run_beside_other_calls_in_threads(art):
    # max_concurrency=2: a sync generator's step runs in a thread, as a sync method
    # does, so a call in the other slot runs beside it rather than after it
    s = await SlotLog.options(max_concurrency=2).spawn()
    it = s.slow_sync_items(3, 2.0)
    first = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    await s.slow(0.01)
    assert time.monotonic() - t0 < 1.2  # (on the loop: after the step, 1.7 s)
    assert await first == 0
    await asyncio.sleep(0.3)  # (its second step runs: left, it closes after that step)
    await it.aclose()
    log = []
    for _ in range(100):  # (locally aclose may return before its finally ran)
        got, peak = await s.take_log()
        log += got
        if "sync-closed" in log:
            break
        await asyncio.sleep(0.05)
    assert peak == 2 and log[-1] == "sync-closed", log
    assert log.count("sync-step-start") == log.count("sync-step-end"), log


async def test_a_call_made_in_a_thread_can_be_cancelled(art):
    c = await Counter.spawn()
    t = await ThreadCanceller.spawn()
    assert await t.cancel_queued(c) == 1
    assert await c.record(3) == 3
    assert await c.get_log() == [1, 3]  # the cancelled call never ran


async def test_streaming_methods(art):
    s = await Streamer.spawn()
    assert [x async for x in s.count(5)] == [0, 1, 2, 3, 4]
    async for x in s.count(3):  # the actor answers other calls while a stream is open
        assert await asyncio.wait_for(s.ping(), 10) == "pong"
    assert [x async for x in s.sync_count(4)] == [0, 1, 4, 9]
    assert await items_before(s.fail_after(3), KeyError, "stream failed on purpose") == \
        [0, 1, 2]
    arrays = [a async for a in s.arrays(3, 1000)]
    assert [int(a[0]) for a in arrays] == [0, 1, 2]


@pytest.mark.parametrize("held", [False, True])
async def test_calls_an_actors_death_ends_report_nothing_unawaited(art, held):
    # A call pending at the death, and one held for its result (given it as an
    # argument): nobody awaiting them, asyncio reported each as "exception was never
    # retrieved" (on Ray both, locally the held one), where the local backend's calls
    # waiting on the dead actor's connection fail quietly (its runtime reports deaths).
    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    c, dying = await Counter.spawn(0), await Counter.spawn(0)
    inner = dying.slow_record(1, 30)
    fut = c.echo(inner) if held else inner  # (never awaited)
    del inner
    await asyncio.sleep(0.5)
    os.kill(dying.pid, signal.SIGKILL)
    for _ in range(200):
        if fut.done():
            break
        await asyncio.sleep(0.05)
    assert fut.done() and not fut.cancelled()
    del fut
    gc.collect()
    await asyncio.sleep(0.1)
    assert errors == []


@pytest.mark.parametrize("leave", ["break", "aclose"])
async def test_a_stream_left_after_its_generator_raised_reports_nothing(art, leave):
    # The generator's error had reached the caller, who left before taking it: asyncio
    # reported it as "exception was never retrieved", with its traceback.
    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    s = await Streamer.spawn()
    it = s.fail_after(1)
    async for x in it:
        await asyncio.sleep(0.5)  # (the error arrives meanwhile)
        break
    if leave == "aclose":
        await it.aclose()
    del it
    await asyncio.sleep(0.1)
    gc.collect()
    await asyncio.sleep(0.1)
    assert x == 0 and errors == []


async def test_a_failed_stream_leaves_no_reference_cycle(art):
    # On Ray the stream's error stayed in a local of the frame it was raised from, which
    # its traceback keeps: a cycle per failed stream, the consumer's frames in it (their
    # arrays with them) until the garbage collector ran.
    s = await Streamer.spawn()
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(KeyError):
            async for _ in s.fail_after(2):
                pass
        await asyncio.sleep(0.1)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycles = sorted({type(o).__name__ for o in gc.garbage
                         if isinstance(o, BaseException) or type(o).__module__.startswith(
                             ("actorshm", "asyncio"))})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycles == []


@pytest.mark.parametrize("kept", [False, True])
async def test_leaving_a_stream_early_stops_the_generator(art, kept):
    s = await Streamer.spawn()
    stream = s.count(1000, 0.01)
    async for x in stream:
        if x == 2:
            break
    if not kept:
        del stream
    for _ in range(100):
        if await s.closed_() == [1000]:
            break
        await asyncio.sleep(0.05)
    assert await s.closed_() == [1000]  # its finally block ran
    assert await s.produced_() < 1000
    assert await s.ping() == "pong"


async def test_an_iteration_handed_on_is_not_a_loop_left(art):
    s = await Streamer.spawn()
    stream = s.count(5)
    first = await anext(aiter(stream))
    assert [first, *[x async for x in stream]] == [0, 1, 2, 3, 4]
    assert await s.closed_() == [5]


async def test_a_second_task_awaiting_the_same_stream_is_told(art):
    s = await Streamer.spawn()
    # (the first item comes late, so both tasks are waiting when it does)
    stream = s.count(3, 0.05, first_after=0.3)
    results = await asyncio.wait_for(
        asyncio.gather(anext(stream), anext(stream), return_exceptions=True), 30)
    assert results[0] == 0
    assert isinstance(results[1], RuntimeError) and "one consumer" in str(results[1])
    assert [x async for x in stream] == [1, 2]


async def test_a_stream_whose_actor_dies_raises_actor_died(art):
    s = await Streamer.spawn()
    assert await items_before(s.die_after(3), actorshm.ActorDiedError) == [0, 1, 2]


async def test_cancelling_a_task_that_iterates_a_stream_stops_the_generator(art):
    s = await Streamer.spawn()

    async def consume():
        async for _ in s.count(1000, 0.01):
            pass
    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if await s.closed_() == [1000]:
            break
        await asyncio.sleep(0.05)
    assert await s.closed_() == [1000]


async def test_a_stream_cut_by_a_time_out_says_so_when_asked_for_more(art):
    s = await Streamer.spawn()
    it = aiter(s.count(5, 0.0, 0.5))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(it), 0.05)
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="timed out.*asyncio.wait"):
        await anext(it)


async def test_stream_runs_a_bounded_number_of_items_ahead(art):
    s = await Streamer.spawn()
    stream = s.count(1000)
    assert await stream.__anext__() == 0
    await asyncio.sleep(1.0)
    assert await s.produced_() <= 40  # 16 ahead (and a little slack), not 1000
    await stream.aclose()


async def test_run_ahead_bounds_the_items_made_ahead(art):
    s = await Streamer.spawn()
    stream = s.count.options(run_ahead=4)(1000)
    assert await stream.__anext__() == 0
    await asyncio.sleep(1.0)
    assert await s.produced_() <= 8  # (Ray ignored it: 17)
    await stream.aclose()
    with pytest.raises(TypeError, match="run_ahead applies to streaming methods"):
        s.produced_.options(run_ahead=4)  # refused as on the local backend


async def test_after_aclose_the_next_call_runs_after_the_generators_finally(art):
    s = await Streamer.spawn()
    stream = s.count(1000, 0.01)
    assert await stream.__anext__() == 0
    await stream.aclose()
    assert await s.closed_() == [1000]  # (on Ray, not yet: aclose did not wait)


async def test_aclose_returns_once_the_generators_finally_ran(art, backend):
    # With max_concurrency > 1 the next call does not wait for a slot behind the
    # finally: aclose() itself must wait (Ray ended the stream before the finally ran).
    ray_only(backend, "docs/ray.md: `await it.aclose()` returns once the finally ran")
    s = await SlowCloser.spawn()
    stream = s.count(1000)
    assert await stream.__anext__() == 0
    await asyncio.wait_for(stream.aclose(), 30)
    assert await s.closed_() == [1000]


async def test_streams_are_not_counted_in_max_pending_calls(art):
    s = await Streamer.options(max_pending_calls=1).spawn()
    first = s.count(3)  # a stream: not a pending call (on Ray it was counted)
    assert await s.ping() == "pong"
    assert [x async for x in first] == [0, 1, 2]


# -- Arrays on Ray ---------------------------------------------------------------------
async def test_arrays_on_ray_are_read_only_copies(art, backend):
    ray_only(backend, "the local backend shares arrays (test_arrays.py)")
    a = await ArrayUser.spawn()
    big = np.ones(1 << 20)
    small = np.ones(10)
    assert await a.total(big) == float(1 << 20)
    assert await a.writable(big) is False and await a.writable(small) is False
    with pytest.raises(ValueError, match="read-only"):
        await a.scale_in_place(small, 2)
    assert small[0] == 1
    out = await a.make(1 << 18)
    assert out[-1] == (1 << 18) - 1
    # Results are read-only views at every size (docs/ray.md); a copy is writable.
    assert not out.flags.writeable and not (await a.make(5)).flags.writeable
    mine = np.array(out)
    mine[0] = 7


async def test_arrays_inside_an_object_arrive_read_only_on_ray(art, backend):
    ray_only(backend, "the local backend shares arrays (test_arrays.py)")
    a = await ArrayUser.spawn()
    base = np.arange(1000, dtype=np.float64)
    # Ray gives the contiguous one read-only by itself; numpy pickles the others by value
    batch = Batch(plain=base, strided=base[::2], when=base.astype("M8[s]"),
                  rec=np.zeros(10, [("x", "i4")]).view(np.recarray),
                  nested=Batch(strided=base[::3]))
    assert await a.writable_attrs(batch) == {
        "plain": False, "strided": False, "when": False, "rec": False,
        "nested": {"strided": False}}


_TABLE = np.arange(4.0)  # a module's own array, in the actor as here


class _OwnPickling:
    """Pickled its own way: rebuilt over the receiver's own table, not a copy."""

    def __init__(self):
        self.table, self.w = _TABLE, np.zeros(2)

    def __getstate__(self):
        return {"w": self.w}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.table = _TABLE


def _tagged():
    pass


def test_freezing_received_arrays_leaves_the_receivers_own_alone():
    # What the actor gets for an object with its own pickling, or for a function (sent
    # by name), may hold arrays of its own (a module's table): they must stay writable.
    from actorshm._ray_host import freeze_arrays
    _tagged.cache = np.zeros(3)
    received = pickle.loads(pickle.dumps(_OwnPickling()))
    freeze_arrays([received, _tagged, Batch(x=np.zeros(2))])
    assert _TABLE.flags.writeable and _tagged.cache.flags.writeable
    frozen = Batch(x=np.zeros(2), inner=Batch(y=np.zeros(2)))  # plain objects: read-only
    freeze_arrays((frozen,))
    assert not frozen.x.flags.writeable and not frozen.inner.y.flags.writeable


class _MadeUpAttributes(dict):
    """A config dict whose missing attributes are made up (as addict's ``Dict``)."""

    def __getattr__(self, name):
        return self.setdefault(name, _MadeUpAttributes())


def test_freezing_received_arrays_skips_classes_modules_and_look_alikes():
    # It took whatever had ``flags``, ``setflags`` and ``dtype`` for an array, so a numpy
    # scalar type (np.float32 as a dtype argument), np.ndarray itself or an addict-style
    # dict failed the call ("unbound method generic.setflags()"); and it walked a module
    # (pickled by name: the actor's own), freezing the actor's module-level arrays.
    import types
    from actorshm._ray_host import freeze_arrays
    module = types.ModuleType("_table_module")
    module.TABLE = np.zeros(3)
    freeze_arrays([np.float32, {"dtype": np.int64}, np.ndarray, np, module,
                   _MadeUpAttributes(lr=0.1), np.zeros(2).sum, np.float64(1.0)])
    assert module.TABLE.flags.writeable
    kept = np.zeros(2)
    freeze_arrays({"config": _MadeUpAttributes(x=kept)})  # (a dict: its values are seen)
    assert not kept.flags.writeable


async def test_numpy_types_and_modules_travel_as_arguments(art, backend):
    a = await Counter.spawn(0)
    assert await a.echo(np.float32) is np.float32
    assert await a.echo({"dtype": np.int64, "cls": np.ndarray}) == \
        {"dtype": np.int64, "cls": np.ndarray}
    assert await a.echo(np) is np
    assert (await Counter.spawn(np.float16)) is not None


@dataclasses.dataclass
class _Holder:
    item: object


_Pair = collections.namedtuple("_Pair", "a b")


async def test_a_tensor_in_an_autograd_graph_is_refused_before_sending(art, backend):
    # Ray's own pickling would send it as a new leaf, silently cut from its graph. (In a
    # dataclass or a namedtuple too: on Ray the check looked into plain containers only.)
    torch = pytest.importorskip("torch")
    a = await ArrayUser.spawn()
    non_leaf = torch.ones(3, requires_grad=True) * 2
    for arg in (non_leaf, {"batch": [non_leaf]}, _Holder(non_leaf), _Pair(1, non_leaf)):
        with pytest.raises(TypeError, match=r"ArrayUser.total.*detach\(\)"):
            a.total(arg)
    assert await a.total(non_leaf.detach().numpy()) == 6.0  # the actor is unaffected


async def test_a_result_or_item_in_an_autograd_graph_fails_its_call(art):
    pytest.importorskip("torch")
    a = await ArrayUser.spawn()
    with pytest.raises(TypeError, match=r"result of ArrayUser.graph cannot be sent back.*"
                                        r"detach\(\)"):
        await a.graph()
    got = await items_before(a.graph_items(), TypeError,
                             r"item of ArrayUser.graph_items cannot be sent")
    assert [x.tolist() for x in got] == [[1.0]]
    assert await a.total(np.ones(2)) == 2.0


async def test_a_result_that_cannot_be_pickled_or_an_open_file_argument(art):
    a = await ArrayUser.spawn()
    with pytest.raises(TypeError, match=r"the result of ArrayUser.lock cannot be sent back"):
        await a.lock()
    with pytest.raises(TypeError, match=r"result of ArrayUser.bad_reduce cannot be sent back: "
                                        r"no pickling this on purpose"):
        await a.bad_reduce()
    assert await items_before(a.lock_items(), TypeError,
                              r"an item of ArrayUser.lock_items cannot be sent") == [1]
    # with the actor's traceback, and where it was raised, on both backends
    for call in (a.lock(), _first_error(a.lock_items())):
        try:
            await call
        except TypeError as exc:
            assert isinstance(exc.__cause__, RemoteTraceback), exc.__cause__
            if sys.version_info >= (3, 11):
                assert noted(exc, "ArrayUser.lock"), exc
        else:
            raise AssertionError("no error")
    with open(__file__) as f, pytest.raises(TypeError, match="open file .* pass its path"):
        a.total(f)
    with pytest.raises(TypeError, match="Runtime cannot be sent .* pass actor handles"):
        a.total(art)
    # A pipe's end pickled as its fd number, which named another file there: the driver
    # closed an actor's socket with the copy it was sent back (and its close then hung)
    import multiprocessing
    ours, theirs = multiprocessing.Pipe()
    for arg in ([{"end": ours}], _Holder(ours)):
        with pytest.raises(TypeError, match="multiprocessing Connection .* not travel"):
            a.total(arg)
    with pytest.raises(TypeError, match="result of ArrayUser.pipe_end cannot be sent back: "
                                        "a multiprocessing Connection"):
        await a.pipe_end()
    ours.send(1)
    assert theirs.recv() == 1  # (untouched)
    assert await a.total(np.ones(2)) == 2.0


async def test_objects_that_work_in_one_process_only_are_refused_with_what_to_use(art):
    # multiprocessing's queues, locks and values raised their own advice ("through
    # inheritance"), which leads nowhere with actors.
    import multiprocessing
    # (made with "fork", whose locks need no resource tracker process; nothing is forked)
    ctx = multiprocessing.get_context("fork")
    a = await ArrayUser.spawn()
    for obj, says in [
            (ctx.Queue(), r"multiprocessing Queue reaches only the processes that "
                          r"inherit it .* make an actor the queue"),
            (ctx.Lock(), r"multiprocessing Lock .*max_concurrency=1"),
            (ctx.Value("i", 0), r"multiprocessing Value or Array .* actorshm\.zeros")]:
        for arg in (obj, {"deep": [obj]}):
            with pytest.raises(TypeError, match=says):
                await a.total(arg)
    # what those modules hold as data travels, and so does an object that holds an
    # asyncio lock for its own use (it pickles as a copy, as any object does)
    from multiprocessing.managers import Namespace
    holder = Namespace(lock=asyncio.Lock(), event=asyncio.Event(), n=1)
    err, ns, held = await a.echo([asyncio.QueueEmpty("none"), Namespace(x=1), holder])
    assert type(err) is asyncio.QueueEmpty and ns.x == 1 and held.n == 1
    assert type(held.lock) is asyncio.Lock and not held.lock.locked()
    assert await a.total(np.ones(2)) == 2.0


async def test_a_shared_array_on_ray_warns_that_writes_do_not_come_back(art, backend):
    ray_only(backend, "on the local backend shared arrays are written through")
    a = await ArrayUser.spawn()
    arr = actorshm.zeros(1000)
    with pytest.warns(RuntimeWarning, match="not seen by the caller"):
        assert await a.total(arr) == 0.0


# -- Ray only -------------------------------------------------------------------------
async def test_calls_carry_their_identity_in_rays_task_name(art, backend):
    ray_only(backend, "Ray's task names")
    c = await Counter.spawn(0)
    assert c._actor_id.named  # this Ray gives tasks their names: no argument for it
    first = [c.record(i) for i in range(5)]
    c._actor_id.named = False  # as on a Ray whose tasks cannot read their names
    second = [c.record(i) for i in range(5, 10)]
    assert await asyncio.gather(*first, *second) == list(range(10))
    assert await c.get_log() == list(range(10))  # one order across both ways of calling
    c._actor_id.named = True
    assert await c.echo({"k": [1, 2.5, "x"]}) == {"k": [1, 2.5, "x"]}


async def test_a_tensor_whose_dtype_torch_cannot_pickle_is_refused_before_sending(art, backend):
    ray_only(backend, "Ray passes tensors by torch's pickling; the local backend does not")
    torch = pytest.importorskip("torch")
    dtype = torch.float8_e4m3fn
    try:
        pickle.loads(pickle.dumps(torch.zeros(1, dtype=dtype)))
        pytest.skip(f"this torch pickles {dtype} tensors")
    except Exception:
        pass
    c = await Counter.spawn()
    with pytest.raises(TypeError, match=r"float8_e4m3fn tensor cannot travel.*view"):
        c.echo([torch.zeros(3, dtype=dtype)])
    assert await asyncio.wait_for(c.incr(), 30) == 1
    bits = await c.echo(torch.ones(3, dtype=dtype).view(torch.uint8))  # the way round
    assert bits.view(dtype).float().tolist() == [1.0, 1.0, 1.0]
    # Deeper than the checks before sending look, the actor fails to rebuild it: that
    # call fails with the same advice (it was torch's bare AttributeError).
    with pytest.raises(TypeError, match=r"could not deserialize.*dtype that torch's own "
                                        r"pickling cannot rebuild.*view\(torch.uint8\)"):
        await asyncio.wait_for(c.echo([[[[[torch.zeros(3, dtype=dtype)]]]]]), 30)
    a = await ArrayUser.spawn()
    with pytest.raises(TypeError, match=r"result of ArrayUser.graph could not be "
                                        r"deserialized.*view\(torch.uint8\)"):
        await asyncio.wait_for(a.graph("float8_e4m3fn", depth=5), 30)
    assert await asyncio.wait_for(c.incr(), 30) == 2


async def test_an_untyped_storage_is_refused_on_ray_before_sending(art, backend):
    # torch's own pickling cannot rebuild an untyped storage: the call failed only in
    # the actor, blaming a dtype the tensor did not have, and Ray logged a traceback
    torch = pytest.importorskip("torch")
    try:
        pickle.loads(pickle.dumps(torch.zeros(1).untyped_storage()))
        pytest.skip("this torch pickles untyped storages")
    except AttributeError:
        pass
    c = await Counter.spawn()
    st = torch.zeros(4).untyped_storage()
    if backend == "local":
        assert (await c.echo([st]))[0].nbytes() == 16  # (locally storages travel)
    else:
        with pytest.raises(TypeError, match=r"arguments of Counter.echo\(\): a "
                                            r"torch.UntypedStorage cannot travel on the Ray"
                                            r".*set_\(storage\)"):
            c.echo([st])
    a = await ArrayUser.spawn()
    got = await items_before(a.storage_items(0), TypeError, r"item of ArrayUser."
                             r"storage_items cannot be sent: a torch.UntypedStorage") \
        if backend == "ray" else [x async for x in a.storage_items(0)]
    assert got[0] == 1
    if backend == "ray":  # deeper than the checks look: an item that fails to rebuild
        got = await items_before(a.storage_items(5), TypeError,
                                 r"an item of ArrayUser.storage_items could not be "
                                 r"deserialized.*UntypedStorage")
        assert got == [1]
    assert await asyncio.wait_for(c.incr(), 30) == 1


async def test_a_quantized_tensor_travels_on_both_backends(art):
    # On Ray the check of which dtypes torch can pickle made its sample with
    # torch.empty, which a quantized dtype refuses: a quantized tensor (which torch
    # pickles with its quantizer) was refused as one that torch cannot rebuild.
    torch = pytest.importorskip("torch")
    c = await Counter.spawn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch deprecates making quantized tensors)
        packed = [getattr(torch, n) for n in ("quint4x2", "quint2x4") if hasattr(torch, n)]
        for dtype in (torch.qint8, torch.quint8, torch.qint32, *packed):
            q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 2.0, 0.0]), 0.5, 1, dtype)
            (back,) = await asyncio.wait_for(c.echo([q]), 30)
            assert back.dtype == dtype and back.is_quantized
            assert back.q_scale() == pytest.approx(0.5) and back.q_zero_point() == 1
            assert back.dequantize().tolist() == q.dequantize().tolist()


async def test_tensors_on_ray_are_copies_and_shared_ones_warn(art, backend):
    ray_only(backend, "on the local backend a tensor argument is written through")
    torch = pytest.importorskip("torch")
    import actorshm.torch as at
    a = await ArrayUser.spawn()
    t = at.zeros(3)
    with pytest.warns(RuntimeWarning, match="shared tensor .* not seen by the caller"):
        assert await a.fill(t, 7.0) == 21.0
    assert t.tolist() == [0.0, 0.0, 0.0]  # the actor wrote to a copy
    model = at.share_module(torch.nn.Linear(2, 2))
    before = model.bias.tolist()
    with pytest.warns(RuntimeWarning, match="share_module"):
        await a.step(model)
    assert model.bias.tolist() == before
    dtype = torch.float8_e4m3fn
    try:
        pickle.loads(pickle.dumps(torch.zeros(1, dtype=dtype)))
    except Exception:  # what Ray cannot rebuild: refused in the actor, the call fails
        with pytest.raises(TypeError, match=r"result of ArrayUser.graph .*float8_e4m3fn"):
            await a.graph("float8_e4m3fn")


async def test_sparse_tensors_and_modules_holding_them_are_arguments(art):
    # On Ray the check for shared tensors asked a sparse tensor for its storage, which
    # it has none of: the call raised NotImplementedError before it was sent.
    torch = pytest.importorskip("torch")
    a = await ArrayUser.spawn()
    coo = torch.eye(3).to_sparse()
    assert await a.dense(coo) == torch.eye(3).tolist()
    with warnings.catch_warnings():  # ("Sparse CSR tensor support is in beta state")
        warnings.simplefilter("ignore", UserWarning)
        csr = torch.eye(2).to_sparse_csr()
    assert await a.dense(csr) == torch.eye(2).tolist()
    m = torch.nn.Module()
    m.register_buffer("mask", torch.eye(2).to_sparse())
    assert await a.dense(m) == {"mask": torch.eye(2).tolist()}


def test_run_with_backend_ray(ray_session):
    async def main():
        assert actorshm.current_runtime().backend == "ray"
        c = await Counter.spawn(1)
        return await c.incr(1)
    assert actorshm.run(main(), backend="ray") == 2


CLUSTER_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {tests!r})
    import numpy as np
    from ray.cluster_utils import Cluster
    import actorshm
    from ray_actors import ArrayUser
    from actors import Caller, Counter

    cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 2}})
    cluster.add_node(num_cpus=2)

    async def main():
        # num_cpus=2 each, two CPUs per node: Ray must put them on different nodes.
        a = await ArrayUser.options(num_cpus=2).spawn()
        b = await ArrayUser.options(num_cpus=2).spawn()
        nodes = {{await a.node(), await b.node()}}
        assert len(nodes) == 2, nodes
        arr = np.arange(1 << 18, dtype=np.float64)
        assert await a.total(arr) == await b.total(arr) == float(arr.sum())
        out = await b.make(1000)
        assert await a.total(out) == float(out.sum())
        c = await Counter.spawn(0)
        caller = await Caller.spawn(c)
        assert await caller.call_other(5) == 5
        print("nodes", len(nodes))

    try:
        actorshm.run(main(), backend="ray", address=cluster.address, log_to_driver=False)
    finally:
        cluster.shutdown()
""")


def _run_script(tmp_path, name: str, template: str, env: dict | None = None,
                args: list | None = None) -> str:
    """Run a script that starts a Ray of its own; return its stdout (it must succeed)."""
    script = tmp_path / name
    script.write_text(template.format(tests=os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, str(script), *(args or [])],
                         capture_output=True, text=True,
                         timeout=120, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


NESTED_SCRIPT = textwrap.dedent("""
    import asyncio, os, pickle, sys, warnings
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {tests!r})
    import actorshm
    from actors import Caller, Counter, EnvReader

    async def main():
        outer = actorshm.current_runtime()
        import ray  # (Ray is up before main's first spawn: run's runtime started it)
        print("outer cpus", ray.cluster_resources()["CPU"])
        async with actorshm.Runtime(backend="ray", num_cpus=2, include_dashboard=False,
                                    runtime_env={{"env_vars": {{"MYVAR": "mine"}}}}):
            e = await EnvReader.spawn()
            print("inner env", (await e.get(["MYVAR"]))["MYVAR"])
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                async with actorshm.Runtime(backend="ray", namespace="other"):
                    pass
            print("warned", [str(w.message)[:60] for w in seen])
            c = await Counter.spawn(1)
        try:
            await c.incr(1)
        except actorshm.ActorDiedError:
            print("stale call ActorDiedError")
        assert actorshm.current_runtime() is outer
        c2 = await Counter.spawn(5)  # the outer runtime starts a Ray of its own now
        print("outer", await c2.incr(1))
        caller = await Caller.spawn()
        try:  # (Ray's C++ code ended the driver, pickling a handle of another session)
            await asyncio.wait_for(caller.call_handle(c, 1), 30)
        except actorshm.ActorDiedError:
            print("stale handle in an actor ActorDiedError")
        try:
            await asyncio.wait_for(pickle.loads(pickle.dumps(c)).incr(1), 30)
        except actorshm.ActorDiedError:
            print("stale unpickled ActorDiedError")
        await c.kill()  # a handle of the Ray session that ended: already gone
        print("stale kill returned")

    actorshm.run(main(), backend="ray", num_cpus=2, include_dashboard=False,
                 log_to_driver=False)
""")


def test_a_runtime_main_opens_inside_run_starts_ray_with_its_own_options(tmp_path):
    # Before: run() connected to Ray first, so the inner runtime's options (its
    # runtime_env, an address, a namespace) were silently dropped; and kill() on a
    # handle of an earlier Ray session raised Ray's own ActorHandleNotFoundError.
    out = _run_script(tmp_path, "nested.py", NESTED_SCRIPT)
    assert "outer cpus 2.0" in out and "inner env mine" in out, out
    assert "namespace=...): this process is conne" in out, out
    assert "stale call ActorDiedError" in out and "outer 6" in out, out
    assert "stale kill returned" in out, out
    assert "stale handle in an actor ActorDiedError" in out, out
    assert "stale unpickled ActorDiedError" in out, out


CLOSE_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {tests!r})
    import actorshm
    from actors import Counter
    from ray_actors import Streamer

    async def ends(aw):
        try:
            await aw
            return "finished"
        except actorshm.ActorDiedError:
            return "ActorDiedError"

    async def main():
        s = await Streamer.spawn()
        await Counter.options(num_cpus=2).spawn()  # every CPU of this Ray
        async def read(stream):
            async for _ in stream:
                pass
        reading = asyncio.ensure_future(ends(read(s.count(1000, 0.05))))
        spawning = asyncio.ensure_future(ends(Counter.options(num_cpus=2).spawn()))
        await asyncio.sleep(1.0)
        await actorshm.current_runtime().close()
        print("stream", await asyncio.wait_for(reading, 30))
        print("spawn", await asyncio.wait_for(spawning, 30))

    try:
        actorshm.run(main(), backend="ray", num_cpus=2, include_dashboard=False)
    finally:
        print("the driver goes on")
""")


def test_closing_while_a_stream_is_read_and_a_spawn_waits_ends_both(tmp_path):
    # Before: the spawn waited for ever, and the stream's read, resumed after Ray shut
    # down, ended the whole process with exit code 1 and no output; then the spawn's
    # clean-up started a second Ray (Ray's auto-init). And a runtime with no address
    # starts a Ray of its own, though RAY_ADDRESS names another (as where a `ray start`
    # cluster runs): it joined that one (here, none listens there).
    out = _run_script(tmp_path, "close.py", CLOSE_SCRIPT, {"RAY_ADDRESS": "127.0.0.1:9"})
    assert "stream ActorDiedError" in out and "spawn ActorDiedError" in out, out
    assert "the driver goes on" in out


WARN_SCRIPT = textwrap.dedent("""
    import asyncio, os, warnings
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import actorshm
    warnings.showwarning = lambda message, *args, **kwargs: print("warning:", message)

    async def main():
        async with actorshm.Runtime(backend="ray", num_cpus=1, include_dashboard=False):
            print("opened")
    asyncio.run(main())
""")


def test_a_runtime_without_an_address_says_it_does_not_join_ray_address(tmp_path):
    # A `ray job submit` entrypoint has RAY_ADDRESS set for it: a runtime without an
    # address starts a Ray of its own all the same, and now says how to join instead.
    out = _run_script(tmp_path, "warn.py", WARN_SCRIPT, {"RAY_ADDRESS": "127.0.0.1:9"})
    assert "warning: RAY_ADDRESS is set (127.0.0.1:9)" in out and "address='auto'" in out
    assert "opened" in out


WARN_RUN_SCRIPT = textwrap.dedent("""
    import asyncio, os, warnings
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import actorshm
    warnings.showwarning = lambda message, *args, **kwargs: print("warning:", message)

    @actorshm.actor
    class C:
        def ping(self):
            return "pong"

    async def idle():
        print("idle ran")

    async def main():
        c = await C.spawn()
        print("called", await c.ping())
    actorshm.run(idle(), backend="ray", num_cpus=1, include_dashboard=False)
    print("-- now one that spawns")
    actorshm.run(main(), backend="ray", num_cpus=1, include_dashboard=False)
""")


def test_actorshm_run_says_it_does_not_join_ray_address_once_used(tmp_path):
    # actorshm.run's runtime never said so (main may yet open a runtime of its own with
    # that address, which takes over): it now does when its own Ray is first used.
    out = _run_script(tmp_path, "warn_run.py", WARN_RUN_SCRIPT,
                      {"RAY_ADDRESS": "127.0.0.1:9"})
    before, _, after = out.partition("-- now one that spawns")
    assert "idle ran" in before and "warning: RAY_ADDRESS" not in before, out
    assert "warning: RAY_ADDRESS is set (127.0.0.1:9)" in after and "called pong" in after


def test_a_cluster_at_a_loopback_address_is_joined_from_127_0_0_1(monkeypatch):
    # Joining a `ray start --node-ip-address 127.0.0.1` cluster, Ray took the machine's
    # own address for the driver and retried for minutes (820 s seen), unless the user
    # set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; and deaths of restartable actors failed
    # pending calls a second late unless RAY_timeout_ms_task_wait_for_death_info=0.
    from actorshm import _ray
    for var in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_enable_metrics_collection",
                "RAY_timeout_ms_task_wait_for_death_info"):
        monkeypatch.delenv(var, raising=False)  # (restored after)
    _ray.ray_env("10.1.2.3:6379")  # a remote cluster: nothing about addresses
    assert os.environ["RAY_timeout_ms_task_wait_for_death_info"] == "0"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    for address in ("127.0.0.1:6399", "ray://localhost:10001", "[::1]:6379"):
        monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
        _ray.ray_env(address)
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0", address
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6399")
    _ray.ray_env("auto")  # ("auto": the address RAY_ADDRESS or `ray start` left)
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert "RAY_enable_metrics_collection" not in os.environ  # (a cluster's own setting)
    assert ray.is_initialized()  # (this module's Ray, started by ray.init here)
    _ray.ray_env(None)  # a Ray the user started: its metrics are as it was started
    assert "RAY_enable_metrics_collection" not in os.environ


async def test_a_cancelled_spawn_that_asked_for_cpus_leaves_no_unretrieved_error(
        art, backend):
    # Its wait for the actor (shielded, to warn after 10 s) ran on once the spawn was
    # cancelled, and failed when the actor was killed: "Task exception was never
    # retrieved".
    ray_only(backend, "the Ray spawn's wait for resources")
    loop = asyncio.get_running_loop()
    seen, old = [], loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx.get("message")))
    try:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(Counter.options(num_cpus=2).spawn(), 0.2)
        await asyncio.sleep(2)
        gc.collect()
        await asyncio.sleep(0.1)
    finally:
        loop.set_exception_handler(old)
    assert not [m for m in seen if "never retrieved" in str(m)], seen


PENDING_AT_CLOSE_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {tests!r})
    import actorshm
    from ray_actors import SlotLog

    async def main():
        s = await SlotLog.spawn()
        s.slow(30)  # never awaited
        waited = s.slow(30)
        await asyncio.sleep(0.5)
        await actorshm.current_runtime().close()
        try:
            await waited
        except actorshm.ActorDiedError as exc:
            print("awaited:", exc)

    actorshm.run(main(), backend="ray", num_cpus=2, include_dashboard=False,
                 log_to_driver=False)
    print("the driver goes on")
""")


def test_calls_pending_when_the_runtime_closes_fail_quietly(tmp_path):
    # Before: the call never awaited printed asyncio's "CallFuture exception was never
    # retrieved ... the actor died" at close (the local backend prints nothing)
    script = tmp_path / "pending.py"
    script.write_text(PENDING_AT_CLOSE_SCRIPT.format(tests=os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "never retrieved" not in out.stderr, out.stderr[-3000:]
    assert "awaited: SlotLog.slow: the actor's runtime closed" in out.stdout, out.stdout
    assert "the driver goes on" in out.stdout


STREAM_AFTER_CLOSE_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {tests!r})
    import ray
    import actorshm
    from ray_actors import Streamer

    async def main():
        rt = await actorshm.Runtime(backend="ray", num_cpus=2, include_dashboard=False,
                                    log_to_driver=False).start()
        s = await Streamer.spawn()
        it = s.count(100).__aiter__()
        print("first", await it.__anext__())
        await rt.close()  # shuts its Ray down; the stream is not being read meanwhile
        if sys.argv[1] == "read":
            try:
                await asyncio.wait_for(it.__anext__(), 30)
            except Exception as exc:
                print("next:", type(exc).__name__, exc)
        else:
            await asyncio.wait_for(it.aclose(), 30)
            print("ray up after aclose:", ray.is_initialized())

    asyncio.run(main())
    print("the driver goes on")
""")


@pytest.mark.parametrize("then, says", [
    # Before: the next item raised AttributeError: 'Worker' object has no attribute
    # 'core_worker' (the runtime had shut its Ray down)
    ("read", "next: ActorDiedError Streamer.count: the actor's runtime closed"),
    # Before: aclose() asked the actor whether the generator had ended, a Ray call
    # made after the runtime shut its Ray down: Ray's auto-init started a new Ray
    ("aclose", "ray up after aclose: False")])
def test_a_stream_used_after_its_runtime_closed(tmp_path, then, says):
    out = _run_script(tmp_path, "stream_after_close.py", STREAM_AFTER_CLOSE_SCRIPT,
                      args=[then])
    assert "first 0" in out, out
    assert says in out, out
    assert "the driver goes on" in out


async def test_a_spawn_that_ends_after_its_runtime_closed_leaves_no_actor(ray_session):
    rt = await actorshm.Runtime(backend="ray").start()  # on the module's Ray: it stays up
    await Counter.options(num_cpus=2).spawn()  # every CPU: the next spawn waits for it
    late = asyncio.ensure_future(Counter.options(num_cpus=2, name="late").spawn())
    await asyncio.sleep(1.0)
    await rt.close()  # frees the CPUs: the late spawn then starts its actor
    with pytest.raises(actorshm.ActorDiedError, match="runtime closed while it started"):
        await asyncio.wait_for(late, 60)
    for _ in range(100):
        try:
            ray.get_actor("late")
        except ValueError:
            break
        await asyncio.sleep(0.1)
    with pytest.raises(ValueError):
        ray.get_actor("late")


def test_two_node_cluster_runs_actors_on_both_nodes(tmp_path):
    assert "nodes 2" in _run_script(tmp_path, "cluster.py", CLUSTER_SCRIPT)


@pytest.fixture
def spawn_warnings(ray_session, monkeypatch, caplog):
    """The log of a waiting spawn's warning, given after 0.5 s instead of 10 s."""
    from actorshm import _ray_placement
    monkeypatch.setattr(_ray_placement, "WARN_AFTER", 0.5)
    caplog.set_level("WARNING", logger="actorshm")
    return caplog


async def _until_a_spawn_warns(log) -> str:
    """The log's text once ``Counter.spawn()`` said it waits (30 s at most)."""
    deadline = time.monotonic() + 30
    while "has waited" not in log.text and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert "Counter.spawn() has waited" in log.text
    return log.text


async def test_a_spawn_waiting_for_busy_cpus_says_so_and_starts_once_they_are_freed(
        spawn_warnings):
    async with actorshm.Runtime(backend="ray"):
        first = await Counter.options(num_cpus=2).spawn(0)  # every CPU of the module's Ray
        second = asyncio.ensure_future(Counter.options(num_cpus=2).spawn(7))
        text = await _until_a_spawn_warns(spawn_warnings)
        assert "needs 2 CPU" in text and "kill an actor" in text
        assert not second.done()
        await first.kill()
        c = await asyncio.wait_for(second, 60)
        assert await c.incr(1) == 8


async def test_a_spawn_whose_process_cannot_start_says_so(spawn_warnings):
    # (Ray tries again and again to start a process that fails at once, saying so only
    # in the raylet's log: the spawn waited in silence; locally it fails at once)
    async with actorshm.Runtime(backend="ray"):
        spawn = asyncio.ensure_future(
            Counter.options(env={"PYTHONHOME": "/nonexistent"}).spawn(0))
        text = await _until_a_spawn_warns(spawn_warnings)
        assert "no process runs it yet" in text and "PYTHONHOME" in text
        assert not spawn.done()
        spawn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await spawn
        assert await (await Counter.spawn(3)).incr(1) == 4  # others start as ever


INFEASIBLE_SCRIPT = textwrap.dedent("""
    import os, sys, time
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {tests!r})
    import actorshm
    from actors import Counter

    async def main():
        for opts in ({{"num_gpus": 64}}, {{"num_cpus": 3}}):
            t0 = time.monotonic()
            try:
                await Counter.options(**opts).spawn(0)
            except ValueError as exc:
                print("refused in", round(time.monotonic() - t0, 1), "s:", exc)
            else:
                print("spawned", opts)
        c = await Counter.options(num_cpus=2).spawn(1)  # as much as the node has: fine
        print("fits", await c.incr(1))

    actorshm.run(main(), backend="ray", num_cpus=2, log_to_driver=False)
""")


def test_a_request_no_node_of_a_local_ray_can_meet_is_refused_at_once(tmp_path):
    # Ray would keep such an actor pending forever: spawn says so instead of hanging.
    stdout = _run_script(tmp_path, "infeasible.py", INFEASIBLE_SCRIPT)
    refused = [line for line in stdout.splitlines() if line.startswith("refused")]
    assert len(refused) == 2, stdout
    assert "num_gpus=64" in refused[0] and "num_cpus=3" in refused[1]
    assert all("no node of this Ray cluster" in line and "has 2 CPU" in line
               and "forever" in line for line in refused)
    assert "fits 2" in stdout


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup: Python 3.11 on")
async def test_an_exception_group_keeps_the_types_of_its_exceptions(art):
    # A group pickles as a whole: one exception in it whose __init__ cannot take back its
    # args made the whole group a RemoteError, and ``except*`` found nothing
    f = await Faulty.spawn()
    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(f.raise_group(), 30)
    group = info.value
    assert "unhandled errors in a TaskGroup" in str(group) and group.__cause__ is not None
    two, = group.subgroup(TwoArgsError).exceptions
    assert (two.a, two.b) == (1, 2)
    inner = group.subgroup(KwOnlyError).exceptions[0]
    assert inner.message == "inner" and inner.exceptions[0].code == 4
    assert group.subgroup(KeyError) is not None


async def test_a_ray_actors_handle_passed_to_a_local_actor_is_refused_naming_why():
    # The local actor failed to rebuild it ("Ray has not been started yet"); the other
    # way round, a local handle in a Ray actor, its calls say whose it is
    async with actorshm.Runtime(backend="ray"):
        on_ray = await Counter.spawn()
        async with actorshm.Runtime(shutdown_grace=1.0):
            local = await Caller.spawn()
            with pytest.raises(TypeError, match="Ray backend cannot be passed to an actor "
                                                "of the local backend"):
                local.call_handle(on_ray, 1)
            assert await asyncio.wait_for(local.call_handle(await Counter.spawn(), 1), 30) == 1


async def test_kill_of_a_stopped_actor_ends_its_process_at_once(art, backend):
    # On Ray, kill() asked Ray to end the worker, which a process stopped by SIGSTOP (a
    # debugger, a frozen cgroup) cannot do, then waited 5 s for it and returned with the
    # process still there.
    import time
    from actorshm._descendants import process_start
    c = await Counter.spawn(0)
    assert await c.incr() == 1
    pid = c.pid
    started = process_start(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(c.kill(), 30)
        assert time.monotonic() - t0 < 4.0  # (Ray's own wait alone: 5 s)
        assert process_start(pid) != started  # gone (or only its zombie)
    finally:
        if process_start(pid) == started:
            os.kill(pid, signal.SIGCONT)


async def test_a_call_after_the_runtime_closed_says_so(backend):
    # On Ray it said "the actor was killed", as if kill() had been called.
    opts = {"shutdown_grace": 1.0} if backend == "local" else {}
    async with actorshm.Runtime(backend=backend, **opts):
        c = await Counter.spawn(0)
        assert await c.incr() == 1
    with pytest.raises(actorshm.ActorDiedError, match="runtime closed"):
        await c.incr()
    with pytest.raises(actorshm.ActorDiedError, match="runtime closed"):
        async for _ in c.logged_stream(2):
            pass


async def test_kill_of_a_stopped_restarted_or_found_actor_ends_it_at_once(art, backend):
    # Only an actor's first process, through the handle of its spawn, was known to be
    # this machine's: a restarted one, or one found with get_actor, stopped by SIGSTOP,
    # kept kill() waiting 5 s and was left running.
    import time
    from actors import Phoenix
    from actorshm._descendants import process_start
    ray_only(backend, "the local backend kills by its own record")
    p = await Phoenix.options(max_restarts=1, name="phoenix-k").spawn("x")
    first = p.pid
    os.kill(first, signal.SIGKILL)
    assert await until(lambda: p.pid != first, timeout=60)
    found = await actorshm.get_actor("phoenix-k")
    for h in (p, found):
        assert (await h.hit())[2] == p.pid
    await asyncio.sleep(0.5)  # (each asked where it runs, in the background)
    pid, started = p.pid, process_start(p.pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(found.kill(), 30)
        assert time.monotonic() - t0 < 4.0 and process_start(pid) != started
    finally:
        if process_start(pid) == started:
            os.kill(pid, signal.SIGCONT)


def test_kill_forces_only_the_process_the_actor_said_it_is():
    # kill() SIGKILLs a process that does not leave as Ray asks; it took the pid Ray
    # gave for the actor to be this machine's process of that number, which on another
    # node (or in another container's pid namespace) is a stranger's.
    import subprocess
    from actorshm._descendants import machine, process_start
    from actorshm._ray import CLIENT
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        pid, started = stranger.pid, process_start(stranger.pid)
        elsewhere = ("another-boot-id", 1)
        for answer, here in [((elsewhere, pid, started), False),  # another node's pid
                             ((machine(), pid, b"0"), False),  # an earlier process
                             (None, False),  # never answered
                             ((machine(), pid, started), True)]:
            if answer is not None:
                CLIENT._where["actor-key"] = answer
            assert CLIENT._runs_here("actor-key", pid, started) is here
            assert "actor-key" not in CLIENT._where
    finally:
        stranger.kill()
        stranger.wait()


def test_a_runtime_closed_from_another_threads_loop_ends_the_calls_pending_there(backend):
    """On Ray, the close ran on the caller's loop: the calls pending on the runtime's
    own loop failed as "the actor died unexpectedly", each printed as an exception
    never retrieved, and their tasks were cancelled from the wrong thread."""
    import threading
    loop = asyncio.new_event_loop()
    errors = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    opts = {"shutdown_grace": 1.0} if backend == "local" else {}

    async def open_one():
        rt = await actorshm.Runtime(backend=backend, **opts).start()
        c = await Counter.spawn()
        await c.incr()
        return rt, c.slow_record(1, 30), c.slow_record(2, 30)  # (one awaited, one never)
    try:
        rt, awaited, _unawaited = asyncio.run_coroutine_threadsafe(
            open_one(), loop).result(60)

        async def outcome():
            try:
                await awaited
            except actorshm.ActorDiedError as exc:
                return str(exc)
        result = asyncio.run_coroutine_threadsafe(outcome(), loop)
        time.sleep(0.3)
        t0 = time.monotonic()
        asyncio.run(asyncio.wait_for(rt.close(), 60))
        assert time.monotonic() - t0 < 20
        assert "runtime closed" in result.result(20)
        del _unawaited
        gc.collect()
        time.sleep(0.1)
        assert not errors, errors
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


CLOSED_STDIO_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {tests!r})
    import actorshm
    from actors import Counter
    out = open(sys.argv[1], "w")

    async def main():
        os.close(1)
        os.close(2)
        async with actorshm.Runtime(backend="ray", num_cpus=1, include_dashboard=False,
                                    log_to_driver=False):
            c = await Counter.spawn(1)
            print("a print goes nowhere", flush=True)
            out.write(f"incr {{await c.incr(1)}} ")
        print("and after the close", flush=True)
        out.write(" ".join(os.readlink(f"/proc/self/fd/{{fd}}") for fd in (1, 2)))

    asyncio.run(main())
""")


def test_a_ray_runtime_opened_after_the_driver_closed_its_stdout_keeps_prints_working(
        tmp_path):
    # Ray's own files (an epoll, an eventfd) took fds 1 and 2, and every print raised
    # OSError (EINVAL), before and after the runtime closed.
    _run_script(tmp_path, "closed_stdio.py", CLOSED_STDIO_SCRIPT,
                args=[str(tmp_path / "out")])
    assert (tmp_path / "out").read_text() == "incr 2 /dev/null /dev/null"
