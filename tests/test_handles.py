"""Handles: attributes are methods, including names the handle also uses."""

import asyncio

import pytest

import actorshm
from actors import Caller, Counter, Named


async def test_methods_named_name_and_actor_id_win_over_handle_properties(rt):
    n = await Named.options(name="svc").spawn("mine")
    assert await n.name() == "mine"
    assert await n.actor_id() == 42
    c = await Counter.options(name="ctr").spawn(0)
    assert c.name == "ctr" and isinstance(c.actor_id, int)


async def test_unknown_attribute_lists_the_methods(rt):
    c = await Counter.spawn(0)
    with pytest.raises(AttributeError, match="incr"):
        c.no_such_method
    assert "incr" in dir(c)
    assert isinstance(c, actorshm.ActorHandle)


async def test_an_actor_spawns_finds_and_kills_from_a_threads_own_event_loop(rt):
    # The driver's services were asked on the worker's connection from whichever loop
    # awaited: "attached to a different loop", and the spawn went through regardless,
    # leaving an actor nobody had a handle to
    from actors import ThreadLoopUser
    u = await ThreadLoopUser.spawn()
    n, spawned = await asyncio.wait_for(u.spawn_find_kill("thread-loop"), 60)
    assert n == 6
    rows = {r["id"]: r for r in rt.actors()}
    assert not rows[spawned]["alive"] and "kill" in rows[spawned]["death"]
    assert [r["class"] for r in rows.values() if r["alive"]] == ["ThreadLoopUser"]


async def test_ray_habits_say_what_to_write(rt):
    c = await Counter.spawn()
    with pytest.raises(AttributeError, match=r"called directly.*`await handle\.incr\(\.\.\.\)`"):
        c.incr.remote(1)  # (Ray's way)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        c.incr.nothing
    assert await c.incr() == 1


async def test_a_dropped_handle_is_freed_with_no_collector_run(rt):
    # A handle keeps the methods it made, and each method kept the handle: a reference
    # cycle, so a dropped handle (and its runtime's record of a dead actor, which stays
    # while a handle may use it) waited for the garbage collector.
    import gc
    import weakref
    c = await Counter.spawn(0)
    assert await c.incr(1) == 1
    incr = c.incr  # (a method kept past its handle still calls the actor)
    ref = weakref.ref(c)
    gc.disable()
    try:
        del c
        assert ref() is None
    finally:
        gc.enable()
    assert await incr(2) == 3


async def test_a_method_pickles_as_its_handle_does(rt):
    # (a method keeps no handle, but travels as one: to another actor, or copied)
    import copy
    import pickle
    c = await Counter.spawn(0)
    caller = await Caller.spawn()
    gen = pickle.loads(pickle.dumps(c.logged_stream.options(run_ahead=2)))
    assert gen._run_ahead == 2 and [x async for x in gen(3)] == [0, 1, 2]
    assert await copy.deepcopy(c.incr)(5) == 5
    assert await caller.call_method(c.incr, 2) == 7  # (called inside the other actor)


_OTHER_DRIVER = """
import itertools, pickle, sys
import actorshm
from actorshm import _runtime
from actors import Counter

async def main():
    _runtime._actor_ids = itertools.count(int(sys.argv[1]))  # (its next id: ours)
    c = await Counter.spawn(100)
    h = pickle.dumps((c, c.incr))
    assert await pickle.loads(h)[1](1) == 101  # (in its own process the handle works)
    sys.stdout.buffer.write(h)

actorshm.run(main())
"""


async def test_a_handle_from_another_drivers_process_is_refused_not_misrouted(rt):
    # Actor ids count from 1 in every process: a handle pickled in one program and
    # unpickled in another (a file, a queue) called whatever actor had its id there
    import os
    import pickle
    import subprocess
    import sys
    mine = await Counter.spawn(0)
    here = os.path.dirname(__file__)
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", _OTHER_DRIVER, str(mine._actor_id)],
        capture_output=True, cwd=here, timeout=60,
        env=dict(os.environ, PYTHONPATH=here))
    assert out.returncode == 0, out.stderr.decode()
    theirs, incr = pickle.loads(out.stdout)
    assert theirs._actor_id == mine._actor_id
    for call in (lambda: theirs.incr(5), lambda: incr(5)):
        with pytest.raises(actorshm.ActorDiedError, match=r"Counter \(id \d+\) belongs to "
                                                          r"a runtime of another process"):
            await call()
    assert await mine.incr(1) == 1  # ours was never called
    # within this program handles travel as before: through pickle, and to an actor
    caller = await Caller.spawn()
    assert await pickle.loads(pickle.dumps(mine)).incr(1) == 2
    assert await caller.call_method(mine.incr, 1) == 3


_FORKED_PICKLER = """
import os, pickle, sys
import actorshm
from actors import Counter

async def main():
    c = await Counter.spawn(10)
    r, w = os.pipe()
    if os.fork() == 0:  # a fork of the driver (a DataLoader's worker) sends it back
        os.write(w, pickle.dumps([c, c.incr]))
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    h, incr = pickle.loads(data)
    print(await h.incr(1), await incr(1))

actorshm.run(main())
"""


def test_a_handle_pickled_in_a_fork_of_the_driver_works_back_in_the_driver():
    # A fork's runtimes hand out ids of their own, so the fork took a token of its own,
    # and pickled the driver's handles with it: back in the driver they were refused
    import os
    import subprocess
    import sys
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", _FORKED_PICKLER], capture_output=True,
                         text=True, cwd=here, timeout=60, env=dict(os.environ, PYTHONPATH=here))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["11", "12"]
