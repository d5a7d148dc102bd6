"""Actor options: num_cpus sets the actor's thread counts; max_pending_calls bounds calls."""

import asyncio
import os
import pickle
import threading

import pytest

import actorshm
from actors import Counter, EnvReader

THREADS = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"]


async def test_num_cpus_default_is_one_thread(rt):
    e = await EnvReader.spawn()
    assert await e.get(THREADS) == {n: "1" for n in THREADS}


async def test_num_cpus_sets_thread_counts_and_env_wins(rt):
    e = await EnvReader.options(num_cpus=3, env={"MKL_NUM_THREADS": "7"}).spawn()
    assert await e.get(THREADS) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "7",
                                    "OPENBLAS_NUM_THREADS": "3"}


async def test_num_cpus_sets_the_blas_thread_count_with_either_start_method(rt_each):
    # With forkserver numpy (and its BLAS) is loaded before the fork: the count must
    # still be the actor's, not the machine's.
    pytest.importorskip("threadpoolctl")
    one = await EnvReader.spawn()
    assert await one.blas_threads() in ([1], [])  # ([]: a numpy with no BLAS listed)
    two = await EnvReader.options(num_cpus=2).spawn()
    assert await two.blas_threads() in ([2], [])


async def test_python_startup_variables_in_env_apply_with_either_start_method(rt_each):
    # A forked actor shows them in os.environ, but Python read them as it started.
    import subprocess
    import sys
    env = {"PYTHONIOENCODING": "latin-1", "PYTHONHASHSEED": "7"}
    seeded = subprocess.run([sys.executable, "-c", "print(hash('actorshm'))"],
                            env={**os.environ, **env}, capture_output=True, text=True)
    e = await EnvReader.options(env=env).spawn()
    assert await e.startup() == ("iso8859-1", int(seeded.stdout))


@pytest.mark.parametrize("bad", [
    {"num_cpus": 0}, {"num_cpus": float("inf")}, {"num_cpus": 1e30},
    {"max_pending_calls": 0}, {"max_pending_calls": 1.5}, {"env": {"A": 1}},
    {"env": {"A=B": "1"}}, {"env": {"A": "x\0y"}}, {"env": {"": "1"}}, {"name": ""},
    {"max_concurrency": True}, {"num_gpus": True}, {"max_restarts": True}])
def test_bad_options_are_refused_where_given_naming_the_option(bad):
    with pytest.raises((TypeError, ValueError), match=list(bad)[0]):
        Counter.options(**bad)


@pytest.mark.parametrize("bad", [
    {"max_pending_calls": "3"}, {"max_restarts": True}, {"max_concurrency": 2.0},
    {"num_gpus": "1"}, {"num_cpus": "2"}])
def test_an_option_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match=rf"{list(bad)[0]} must be .*not {list(bad.values())[0]!r}"):
        Counter.options(**bad)


def test_an_async_init_is_refused_where_the_class_is_decorated():
    with pytest.raises(TypeError, match=r"async def __init__.*h\.setup\(\)"):
        actorshm.actor(type("AsyncInit", (), {"__init__": _async_init}))


async def _async_init(self):
    pass


async def test_a_private_name_on_a_handle_says_why_at_once(rt):
    c = await Counter.spawn()
    with pytest.raises(AttributeError, match=r"'_secret'.*private.*rename"):
        c._secret
    with pytest.raises(AttributeError):
        c.__array_interface__  # (libraries probe for these: a bare AttributeError)


@pytest.mark.parametrize("bad", [
    {"shm_budget": "1GB"}, {"shm_budget": 0}, {"shm_budget": -1}, {"shm_budget": 1 << 20},
    {"shm_budget": 1 << 70}, {"shm_budget": 1e30},
    {"start_timeout": "x"}, {"start_timeout": 0}, {"start_timeout": -0.5},
    {"start_timeout": float("nan")}, {"shutdown_grace": "x"}, {"shutdown_grace": -1},
    {"gpus": 3}, {"gpus": "01"}])
def test_bad_runtime_options_are_refused_naming_the_option(bad):
    with pytest.raises((TypeError, ValueError), match=list(bad)[0]):
        actorshm.Runtime(**bad)


@pytest.mark.parametrize("ray_option", [{"address": "auto"}, {"num_cpus": 2}])
def test_a_ray_option_without_backend_ray_says_to_pass_it(ray_option):
    with pytest.raises(TypeError, match=rf"\['{list(ray_option)[0]}'\].*backend='ray'"):
        actorshm.Runtime(**ray_option)


def test_decorating_again_sets_new_default_options():
    cls = actorshm.actor(type("Twice", (), {"f": lambda self: 1}))
    assert actorshm.actor(num_cpus=2)(cls) is cls
    assert cls.__actorshm_options__.num_cpus == 2
    with pytest.raises(TypeError, match="built in: subclass it"):
        actorshm.actor(int)


def test_a_decorated_subclass_starts_from_its_bases_options():
    base = actorshm.actor(max_concurrency=3, num_cpus=2)(type("Base", (), {}))
    child = actorshm.actor(env={"ROLE": "child"})(type("Child", (base,), {}))
    plain = type("Plain", (base,), {})
    assert (child.__actorshm_options__.max_concurrency, child.__actorshm_options__.num_cpus,
            child.__actorshm_options__.env) == (3, 2, {"ROLE": "child"})
    assert base.__actorshm_options__.env is None  # (the base keeps its own)
    assert actorshm._actor._options_of(plain) is base.__actorshm_options__


async def test_max_pending_calls_refuses_without_sending(rt):
    c = await Counter.options(name="limited", max_pending_calls=2).spawn(0)
    same = await actorshm.get_actor("limited")
    first = c.slow_record(1, 0.3)
    second = same.slow_record(2, 0.0)  # a second handle to the actor shares the count
    for h in (c, same):
        with pytest.raises(actorshm.PendingCallsLimitError, match="max_pending_calls=2"):
            h.record(3)
    await asyncio.gather(first, second)
    assert await c.get_log() == [1, 2]  # the refused calls were never sent
    await asyncio.gather(c.record(4), same.record(5))  # answered calls free their places
    assert await c.get_log() == [1, 2, 4, 5]


async def test_max_pending_calls_none_means_no_limit(rt):
    c = await Counter.options(max_pending_calls=None).spawn(0)
    calls = [c.incr(1) for _ in range(50)]  # none refused
    assert sorted(await asyncio.gather(*calls)) == list(range(1, 51))


async def test_a_call_refused_for_its_arguments_frees_its_place(rt):
    c = await Counter.options(max_pending_calls=1).spawn(0)
    with pytest.raises(TypeError):
        c.echo(threading.Lock())
    assert await c.incr(1) == 1


async def test_a_cancelled_call_frees_its_place_at_once(rt):
    c = await Counter.options(max_pending_calls=1).spawn(0)
    slow = c.slow_record(1, 0.3)
    slow.cancel()
    assert await c.record(2) == 2  # no event-loop turn needed in between
    task = asyncio.ensure_future(c.slow_record(3, 0.3))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(task, 0.05)
    assert await c.record(4) == 4


async def test_runtimes_open_at_once_count_their_actors_apart():
    # Each actor of two runtimes has its own count of pending calls.
    async with actorshm.Runtime(shutdown_grace=1.0):
        a = await Counter.options(max_pending_calls=1).spawn(0)
        async with actorshm.Runtime(shutdown_grace=1.0):
            b = await Counter.options(max_pending_calls=1).spawn(0)
            busy = a.slow_record(1, 0.2)
            assert await b.record(2) == 2
            await busy


async def test_a_handle_passed_into_an_actor_of_another_runtime_reaches_its_actor():
    # (a notebook whose first cell ran twice: two runtimes, old handles in variables) An
    # actor of one runtime reaches an actor of another one open on the same loop through
    # a handle it was given, as the driver does and as on Ray: its driver finds the
    # runtime that started it (the call failed with ActorDiedError, the actor alive).
    from actors import Caller
    async with actorshm.Runtime(shutdown_grace=1.0):
        first = [await Counter.spawn(10 * i) for i in range(2)]
        outer_caller = await Caller.spawn()
        async with actorshm.Runtime(shutdown_grace=1.0):
            here = [await Counter.spawn(100 + i) for i in range(2)]
            caller = await Caller.spawn(first[1])
            assert await caller.call_other(1) == 11
            assert await caller.pid_of(first[1]) == first[1].pid
            assert await here[1].incr(0) == 101  # ids apart: nothing went to this one
            assert await first[1].incr(0) == 11  # the call above reached it
            # the other way: an actor of the outer runtime calls one of the inner
            assert await outer_caller.call_handle(here[0], 5) == 105
            # a kill from an actor of the inner runtime ends the outer one's actor
            await caller.call_method(first[0].kill)
            with pytest.raises(actorshm.ActorDiedError):
                await first[0].incr(0)
            with pytest.raises(actorshm.ActorDiedError, match="killed"):
                await caller.call_handle(first[0], 1)
            # a handle that comes back to the driver through the other runtime's actor,
            # or unpickled in this one's scope, calls the actor that runtime started
            back = await outer_caller.echo_handle(here[1])
            assert await back.incr(1) == 102
            assert await pickle.loads(pickle.dumps(first[1])).incr(0) == 11
        # the inner runtime closed: its actors are gone for the outer one's actors too
        with pytest.raises(actorshm.ActorDiedError):
            await outer_caller.call_handle(here[1], 1)
        assert await outer_caller.call_handle(first[1], 1) == 12


async def test_an_actor_of_a_runtime_open_beside_a_ray_runtime_finds_its_peers(rt):
    # A Ray runtime open on the same loop (no actors here: its ids name it) is skipped
    # when the driver looks for the runtime of a local actor id; it has no records, and
    # looking raised AttributeError for every id this runtime did not know.
    from actorshm import _client

    class OtherBackend:  # (what the lookup sees of a Ray runtime)
        loop = asyncio.get_running_loop()

    _client._runtimes.insert(0, OtherBackend())
    try:
        from actors import Caller
        caller, c = await Caller.spawn(), await Counter.spawn(3)
        assert _client.runtime_of(rt, 10 ** 9) is rt
        assert await caller.call_handle(c, 1) == 4
        async with actorshm.Runtime(shutdown_grace=1.0):
            gone = await Counter.spawn(0)
        with pytest.raises(actorshm.ActorDiedError):
            await caller.call_handle(gone, 1)
        await caller.call_method(gone.kill)  # (an actor that is gone: nothing to do)
    finally:
        del _client._runtimes[0]


def test_a_budget_below_one_arena_in_the_environment_is_refused():
    import os
    import subprocess
    import sys
    env = dict(os.environ, ACTORSHM_SHM_BUDGET="1000")
    out = subprocess.run([sys.executable, "-c", "import actorshm; actorshm.zeros(3)"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "ACTORSHM_SHM_BUDGET='1000'" in out.stderr and "at least" in out.stderr


async def test_a_budget_too_large_for_the_ledger_is_refused_and_leaves_no_trace():
    # 2**70 bytes passed the "at least" check, then failed in start() while the budget
    # was half set: every later Runtime of the process failed the same way.
    with pytest.raises(ValueError, match="shm_budget=.*at most"):
        async with actorshm.Runtime(shm_budget=1 << 70):
            pass
    async with actorshm.Runtime():
        c = await Counter.spawn(1)
        assert await c.incr(1) == 2


@pytest.mark.parametrize("value", ["1e30", "inf"])
def test_a_budget_too_large_in_the_environment_is_refused(value):
    import os
    import subprocess
    import sys
    env = dict(os.environ, ACTORSHM_SHM_BUDGET=value)
    out = subprocess.run([sys.executable, "-c", "import actorshm; actorshm.zeros(3)"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"ACTORSHM_SHM_BUDGET={value!r}" in out.stderr and "at most" in out.stderr


async def test_run_ahead_on_a_method_that_does_not_stream_is_refused(rt):
    c = await Counter.spawn(0)
    with pytest.raises(TypeError, match=r"Counter\.incr\.options\(run_ahead=\.\.\.\): "
                                        r"run_ahead applies to streaming methods "
                                        r"\(generators\) only"):
        c.incr.options(run_ahead=2)
    assert [x async for x in c.logged_stream.options(run_ahead=2)(3)] == [0, 1, 2]
    assert await c.incr(1) == 1  # nothing was sent by the refused call


def test_calling_options_instead_of_spawn_says_to_spawn():
    with pytest.raises(TypeError, match=r"Counter\.options\(\.\.\.\) returns a spawner, "
                                        r"not the class.*`await Counter\.options\(\.\.\.\)"
                                        r"\.spawn\(\*args\)`"):
        Counter.options(name="x")()


async def test_a_forgotten_call_spawn_or_async_says_what_to_write(rt):
    # asyncio's words were "object ActorMethod can't be used in 'await' expression",
    # the same for a spawner, and "'Runtime' object does not support the context
    # manager protocol"
    c = await Counter.spawn()
    with pytest.raises(TypeError, match=r"Counter\.incr is a method, not a call: call it, "
                                        r"`await handle\.incr\(\.\.\.\)`"):
        await c.incr
    with pytest.raises(TypeError, match=r"Counter\.options\(\.\.\.\) is not awaitable: "
                                        r"start the actor with `await Counter\.options"):
        await Counter.options(name="x")
    with pytest.raises(TypeError, match=r"Runtime is an async context manager: write "
                                        r"`async with actorshm\.Runtime\(\.\.\.\) as rt:`"):
        with actorshm.Runtime():
            pass
    assert await c.incr() == 1
    assert actorshm.current_runtime() is rt


@pytest.mark.parametrize("option", ["start_timeout", "shutdown_grace"])
def test_an_infinite_time_is_refused_as_not_finite(option):
    # "must be more than 0 ..., not inf": inf is more than 0
    with pytest.raises(ValueError, match=rf"Runtime\({option}=\.\.\.\) must be a finite "
                                         r"number .*, not inf"):
        actorshm.Runtime(**{option: float("inf")})


def test_share_of_something_not_an_array_names_it():
    # "object arrays cannot live in shared memory", of None
    for bad, name in ((None, "NoneType"), ([1, None], "list")):
        with pytest.raises(TypeError, match=rf"actorshm\.share takes an array .*, not {name}"):
            actorshm.share(bad)


async def test_a_handle_listed_twice_names_both_items(rt):
    c, d = await Counter.spawn(), await Counter.spawn()
    for make in (actorshm.ActorPool, actorshm.ActorGroup):
        with pytest.raises(ValueError, match=r"the same actor is listed twice \(items 0 and "
                                             r"2: <ActorHandle Counter"):
            make([c, d, c])


def test_bad_env_names_the_entry_and_a_bad_target_names_what_it_got():
    with pytest.raises(TypeError, match=r"env must be .*: 'OMP_NUM_THREADS': 4 is not; write "
                                        r"it as 'OMP_NUM_THREADS': '4'"):
        Counter.options(env={"OMP_NUM_THREADS": 4})
    with pytest.raises(TypeError, match=r"env must be .*: b'A': b'1' is not; write it as "
                                        r"'A': '1'"):
        Counter.options(env={b"A": b"1"})  # (it said "write it as "b'A'": "b'1'"")
    with pytest.raises(TypeError, match=r"env must be a dict .*, not list"):
        Counter.options(env=["A=1"])
    with pytest.raises(TypeError, match=r"@actor decorates classes, not function "
                                        r"<function .*above a `class` statement"):
        actorshm.actor(lambda: 1)


async def test_rays_spellings_say_how_actorshm_spells_them(rt):
    # Each was Python's own error, naming no replacement: "module 'actorshm' has no
    # attribute 'get'", "unknown actor option(s) ['runtime_env']", "options() got an
    # unexpected keyword argument 'num_returns'", "'CallStream' object is not an iterator"
    for name, says in (("get", r"`await handle\.method\(\.\.\.\)`"),
                       ("wait", r"asyncio\.wait\(calls"), ("put", r"actorshm\.share"),
                       ("kill", r"`await handle\.kill\(\)`"), ("init", r"Runtime\(\)"),
                       ("remote", r"`@actorshm\.actor`")):
        with pytest.raises(AttributeError, match=rf"no attribute '{name}': .*{says}"):
            getattr(actorshm, name)
    assert not hasattr(actorshm, "annotations")  # (``from __future__``'s)
    with pytest.raises(AttributeError, match=r"no attribute 'nothing'$"):
        actorshm.nothing
    with pytest.raises(TypeError, match=r"unknown actor option\(s\) \['runtime_env'\].*"
                                        r"runtime_env: environment variables go in `env="):
        Counter.options(runtime_env={"env_vars": {"A": "1"}})
    with pytest.raises(TypeError, match=r"max_task_retries: a call runs at most once"):
        Counter.options(max_task_retries=3)
    with pytest.raises(ValueError, match=r"not 0: to reserve no CPU .*leave it out"):
        Counter.options(num_cpus=0)
    c = await Counter.spawn()
    with pytest.raises(TypeError, match=r"Counter\.incr\.options\(\) takes run_ahead=.*"
                                        r"\['num_returns'\] \(num_returns: .*return a tuple"):
        c.incr.options(num_returns=2)
    with pytest.raises(TypeError, match=r"kill\(\) takes no options, not \['no_restart'\]"):
        c.kill(no_restart=False)
    with pytest.raises(TypeError, match=r"get_actor\(\) takes the name alone, not "
                                        r"\['namespace'\] \(namespace: names are per"):
        await actorshm.get_actor("x", namespace="y")
    pool = actorshm.ActorPool([c])
    with pytest.raises(TypeError, match=r"ActorPool\.map\(\) gives its results one by one"):
        await pool.map(lambda a, v: a.incr(v), [1])
    with pytest.raises(TypeError, match=r"come asynchronously"):
        next(pool.map(lambda a, v: a.incr(v), [1]))
    with pytest.raises(TypeError, match=r"is asynchronous: iterate it with `async for`"):
        next(c.logged_stream(2))
    assert [x async for x in pool.map(lambda a, v: a.incr(v), [1, 2])] == [1, 3]
