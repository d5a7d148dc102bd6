"""Host memory hardening: budgets end with their runtime, idle memory goes back, fds."""

import asyncio
import gc
import os
import resource
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import actorshm
from actorshm import _shm


async def test_runtime_budget_ends_with_the_runtime(monkeypatch):
    from actorshm import _budget
    # (the default follows the memory available: fixed here, so that the two reads agree,
    # and measured afresh here and not kept: the next test to need it measures again)
    monkeypatch.setattr(_budget, "memory_available", lambda: None)
    monkeypatch.setattr(_budget, "_default", [None])
    pool = _shm.pool()
    default = _shm.default_budget()
    async with actorshm.Runtime(shm_budget=64 << 20):
        assert pool.budget == 64 << 20
    assert pool.budget == default
    a = actorshm.empty(100 << 20, np.uint8)  # over the closed runtime's budget
    del a


def _cgroup_tree(root, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("cgroups, files, limit", [
    # cgroup v2, a systemd unit under a slice with a limit (the lowest on the way up wins)
    ("0::/user.slice/app.service\n",
     {"user.slice/memory.max": "1073741824\n", "user.slice/app.service/memory.max": "max\n"},
     1 << 30),
    # v2 in a container (its own cgroup namespace: the path is "/")
    ("0::/\n", {"memory.max": "536870912\n"}, 512 << 20),
    # v1 beside v2 (the hybrid layout); v1 writes "no limit" as about 2**63
    ("4:memory:/docker/abc\n0::/\n",
     {"memory/memory.limit_in_bytes": "9223372036854771712\n",
      "memory/docker/abc/memory.limit_in_bytes": "268435456\n", "unified/memory.max": "max"},
     256 << 20),
    # v1 in a container without a cgroup namespace: its path names nothing here
    ("4:cpu,memory:/docker/abc\n", {"memory/memory.limit_in_bytes": "314572800"}, 300 << 20),
    ("0::/\n", {"memory.max": "max"}, None),  # no limit anywhere
    ("0::/\n", {}, None),  # no cgroup file system mounted
])
def test_a_cgroups_memory_limit_is_found(tmp_path, cgroups, files, limit):
    from actorshm import _budget
    (tmp_path / "cgroup").write_text(cgroups)
    _cgroup_tree(tmp_path / "fs", files)
    assert _budget.cgroup_memory_limit(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == limit


def test_the_default_budget_is_half_a_containers_memory_limit(monkeypatch):
    # Run with `docker run -m 500m`, half the host's RAM as the budget let actors' shared
    # arrays past the container's limit meet the OOM killer (SIGKILL) where the budget
    # promises a SharedMemoryError.
    from actorshm import _budget
    monkeypatch.delenv("ACTORSHM_SHM_BUDGET", raising=False)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(_budget, "memory_available", lambda: None)
    monkeypatch.setattr(_budget, "cgroup_memory_limit", lambda: 500 << 20)
    assert _budget.memory_default() == 250 << 20
    monkeypatch.setattr(_budget, "cgroup_memory_limit", lambda: 4 * ram)  # above RAM
    assert _budget.memory_default() == ram // 2
    monkeypatch.setattr(_budget, "cgroup_memory_limit", lambda: None)
    assert _budget.memory_default() == ram // 2
    monkeypatch.setattr(_budget, "cgroup_memory_limit", lambda: 1 << 20)  # a tiny one
    assert _budget.memory_default() == _budget.MIN_BUDGET


def test_the_default_budget_fits_the_memory_available_now(monkeypatch):
    # Half the RAM, where other programs already use most of it, let shared arrays past
    # what is left meet the OOM killer (SIGKILL, perhaps of another program) where the
    # budget promises a SharedMemoryError: the default takes at most three quarters of
    # the memory available when it is set.
    from actorshm import _budget
    monkeypatch.delenv("ACTORSHM_SHM_BUDGET", raising=False)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(_budget, "cgroup_memory_limit", lambda: None)
    monkeypatch.setattr(_budget, "memory_available", lambda: 400 << 20)
    assert _budget.memory_default() == 300 << 20
    monkeypatch.setattr(_budget, "memory_available", lambda: ram)  # an idle machine
    assert _budget.memory_default() == ram // 2
    monkeypatch.setattr(_budget, "memory_available", lambda: 0)  # none at all
    assert _budget.memory_default() == _budget.MIN_BUDGET
    monkeypatch.undo()
    room = _budget.memory_available()  # this machine's, read as the kernel gives it
    assert room is None or 0 < room <= ram


def test_the_default_budget_is_measured_once_per_process(monkeypatch):
    # Measured again when a runtime with a budget of its own closed, the memory this
    # process's own arrays held by then counted as other programs', and the default
    # shrank below what it already held: the next small array failed.
    import subprocess
    import sys
    from actorshm import _budget
    monkeypatch.delenv("ACTORSHM_SHM_BUDGET", raising=False)
    monkeypatch.setattr(_budget, "_default", [None])
    monkeypatch.setattr(_budget, "memory_available", lambda: 400 << 20)
    assert _budget.default_budget() == 300 << 20
    monkeypatch.setattr(_budget, "memory_available", lambda: 100 << 20)  # its own use
    assert _budget.default_budget() == 300 << 20
    monkeypatch.setenv("ACTORSHM_SHM_BUDGET", "64e6")  # the variable is read each time
    assert _budget.default_budget() == 64_000_000
    out = subprocess.run(  # a forked child measures for itself
        [sys.executable, "-c", "import os; from actorshm import _budget as b\n"
         "b._default[0] = 5\npid = os.fork()\n"
         "if pid == 0: os._exit(0 if b._default[0] is None else 1)\n"
         "print(os.waitpid(pid, 0)[1])"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", out


@pytest.mark.parametrize("meminfo, cgroups, files, room", [
    # no cgroup limit: the kernel's MemAvailable (kB)
    ("MemTotal: 8000000 kB\nMemFree: 1000 kB\nMemAvailable: 2048 kB\n", "0::/\n",
     {"memory.max": "max\n", "memory.current": "999999\n"}, 2 << 20),
    # cgroup v2 under its limit: the limit less its usage, inactive page cache not
    # counted as used (the kernel drops it before the OOM killer comes)
    ("MemAvailable: 8000000 kB\n", "0::/app.service\n",
     {"app.service/memory.max": "1073741824\n", "app.service/memory.current": "805306368\n",
      "app.service/memory.stat": "anon 1\ninactive_file 134217728\nfile 3\n"},
     (1 << 30) - (768 << 20) + (128 << 20)),
    # cgroup v1 (a container's, seen at the root), total_inactive_file
    ("MemAvailable: 8000000 kB\n", "4:memory:/docker/abc\n",
     {"memory/memory.limit_in_bytes": "536870912", "memory/memory.usage_in_bytes": "536870912",
      "memory/memory.stat": "inactive_file 5\ntotal_inactive_file 0\n"}, 0),
    # neither readable
    (None, "0::/\n", {}, None),
])
def test_the_memory_available_is_read(tmp_path, meminfo, cgroups, files, room):
    from actorshm import _budget
    (tmp_path / "cgroup").write_text(cgroups)
    if meminfo is not None:
        (tmp_path / "meminfo").write_text(meminfo)
    _cgroup_tree(tmp_path / "fs", files)
    assert _budget.memory_available(str(tmp_path / "meminfo"), str(tmp_path / "fs"),
                                    str(tmp_path / "cgroup")) == room


async def test_freed_small_blocks_make_room_for_a_large_one():
    pool = _shm.pool()
    old = pool.budget
    pool.budget = pool.reserved + (256 << 20)
    try:
        blocks = [actorshm.empty(1 << 20, np.uint8) for _ in range(190)]
        del blocks
        gc.collect()
        big = actorshm.empty(128 << 20, np.uint8)  # was: "192 MiB is already in use"
        big[:] = 1
        del big
    finally:
        pool.budget = old


async def test_runtime_close_gives_idle_memory_back():
    async with actorshm.Runtime():
        arrs = [actorshm.empty(8 << 20, np.uint8) for _ in range(4)]
        small = [actorshm.empty(4096, np.uint8) for _ in range(10)]
        del arrs, small
        gc.collect()
    st = actorshm.stats()
    assert st["blocks_live"] == 0
    assert st["arenas_owned"] == 0 and st["arena_bytes_owned"] == 0


def test_fd_exhaustion_is_a_clear_error_and_idle_arenas_let_fds_go():
    code = textwrap.dedent("""
        import gc, os, resource
        import numpy as np
        import actorshm
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        arrs = []
        try:
            for _ in range(200):
                arrs.append(actorshm.empty(4 << 20, np.uint8))
        except actorshm.SharedMemoryError as exc:
            assert "file descriptors" in str(exc), exc
            print("CLEAR", len(arrs))
        del arrs
        gc.collect()
        assert actorshm.stats()["blocks_live"] == 0
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(20)]
        print("OPENED", len(fds))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CLEAR" in out.stdout and "OPENED 20" in out.stdout


def test_an_address_space_limit_is_named_and_each_failed_block_says_so_alike():
    # Under `ulimit -v` a mapping failed with "Cannot allocate memory" alone; later blocks
    # of an arena that could not be mapped failed as a bare RuntimeError.
    code = textwrap.dedent("""
        import asyncio, resource
        import numpy as np
        import actorshm
        from actors import Arrays

        async def main():
            a = await Arrays.spawn()
            vm = int([l for l in open("/proc/self/status")
                      if l.startswith("VmSize")][0].split()[1]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
            try:
                actorshm.empty(300 << 20, np.uint8)
            except actorshm.SharedMemoryError as exc:
                print("LOCAL", exc)
            for i in range(2):  # blocks of one of the actor's arenas, which cannot map here
                try:
                    await a.make(10, 1.0)
                except TypeError as exc:
                    print("RESULT", i, exc)
            await a.kill()

        actorshm.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    for line in lines:
        assert "address space is limited to" in line and "ulimit -v" in line, line
    for line in lines[1:]:
        assert "SharedMemoryError" in line, line


def test_arenas_a_process_has_no_fd_left_for_fail_alone_naming_the_cause():
    # (the connection closed with "file descriptors were truncated", a protocol error
    # that did not say the process was out of fds, nor what to do; later, that the
    # actor died, though it was well: the connection was closed, and with it the actor)
    code = textwrap.dedent("""
        import asyncio, os, resource
        import actorshm
        from actors import Arrays
        async def main():
            async with actorshm.Runtime():
                p = await Arrays.spawn()
                n = len(os.listdir("/proc/self/fd"))
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                resource.setrlimit(resource.RLIMIT_NOFILE, (n + 8, hard))
                kept = []
                try:
                    for _ in range(30):  # (a block of 4 MiB is an arena, one fd, of its own)
                        kept.append(await p.make(4 << 20, 1, "uint8"))
                except TypeError as exc:  # that result alone
                    assert "out of file descriptors" in str(exc), exc
                    assert "ulimit -n" in str(exc), exc
                    assert "SharedMemoryError" in str(exc), exc
                    print("CLEAR", len(kept))
                assert await p.make_ordinary(3) is not None  # the actor and its link live
                # (its arenas stay mapped here while it may send them again: they keep
                # their fds) With the limit raised, the arena that could not be opened
                # is introduced afresh and maps.
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                again = [await p.make(4 << 20, 2, "uint8") for _ in range(4)]
                assert all(int(a[0]) == 2 for a in again)
                print("AGAIN", len(again))
        actorshm.run(main())
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "CLEAR" in out.stdout and "AGAIN 4" in out.stdout, out.stdout + out.stderr


async def test_dead_actor_records_let_go_of_spawn_arguments(rt):
    import weakref
    from actors import Counter, Phoenix
    a = np.ones(1000)
    ref = weakref.ref(a)
    c = await Counter.spawn(a)  # no restarts: the arguments are not kept at all
    del a
    gc.collect()
    assert ref() is None
    b = np.ones(1000)
    ref = weakref.ref(b)
    p = await Phoenix.options(max_restarts=-1).spawn(b)
    del b
    gc.collect()
    assert ref() is not None  # a restart needs them
    await p.kill()
    gc.collect()
    assert ref() is None  # dead for good
    await c.kill()


async def test_quarantined_blocks_go_home_once_no_process_can_hold_them(rt):
    import asyncio
    from actors import Arrays
    relay, d = await Arrays.spawn(), await Arrays.spawn()
    n = 1 << 16
    a = actorshm.empty(n)
    a[:] = 1.0
    await relay.keep(a)
    await relay.lend_kept(d)  # d holds our block through relay
    await relay.drop()
    del a
    gc.collect()
    live0 = actorshm.stats()["blocks_live"]
    await relay.kill()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while actorshm.stats()["blocks_quarantined"] != 1:
        assert loop.time() < deadline
        await asyncio.sleep(0.02)
    assert await d.sum_kept() == float(n)  # d still uses it: kept
    await d.kill()  # nobody left who could hold it
    while actorshm.stats()["blocks_quarantined"]:
        assert loop.time() < deadline, "quarantine never let go"
        await asyncio.sleep(0.02)
    gc.collect()
    assert actorshm.stats()["blocks_live"] == live0 - 1


async def test_records_of_actors_dead_for_good_go_with_their_handles(rt):
    import asyncio
    import signal
    from actors import Counter, Phoenix
    keep = await Counter.options(name="kept").spawn()
    await keep.kill()  # dead for good, but a handle is left: its record stays
    for i in range(3):
        c = await Counter.options(name="c").spawn(0)
        assert await c.incr() == 1
        await c.kill()
        p = await Phoenix.options(max_restarts=1).spawn("x")
        os.kill(p.pid, signal.SIGKILL)  # restarts once...
        for _ in range(200):
            await asyncio.sleep(0.02)
            if rt.record(p.actor_id).alive and rt.record(p.actor_id).restarts:
                break
        os.kill(p.pid, signal.SIGKILL)  # ...then dies for good
        await rt.record(p.actor_id).exited.wait()
        r = await Phoenix.options(max_restarts=-1).spawn("y")  # its handle goes: alive
        del c, p, r
        gc.collect()
        await asyncio.sleep(0.05)
    # Left: the live actors (their handles went, but they run) and "kept" (a handle).
    assert len(rt._actors) == 4 and all(r.alive for r in rt._actors.values()
                                        if r.actor_id != keep.actor_id)
    assert rt.record(keep.actor_id) is not None
    with pytest.raises(actorshm.ActorDiedError, match="killed by actorshm kill"):
        await keep.incr()
    rows = rt.actors()
    assert len(rows) == 1 + 3 * 3 and [r["id"] for r in rows] == sorted(r["id"] for r in rows)
    gone = [r for r in rows if r["class"] == "Counter" and r["name"] == "c"]
    assert len(gone) == 3 and all("killed by actorshm kill" in r["death"] for r in gone)
    assert sum(r["alive"] for r in rows) == 3  # the restartable ones live on
    with pytest.raises(ValueError, match="no live actor"):
        await actorshm.get_actor("c")
    await Counter.options(name="c").spawn()  # the name is free


@actorshm.actor
class Holder:
    def __init__(self):
        self.kept = []

    def take(self, n):
        self.kept.append(actorshm.empty(n, np.uint8))
        return len(self.kept)

    def drop(self):
        self.kept.clear()
        gc.collect()


async def test_one_budget_for_the_driver_and_its_actors_together():
    mib = 1 << 20
    async with actorshm.Runtime(shm_budget=64 * mib, shutdown_grace=1.0):
        a, b, c = [await Holder.spawn() for _ in range(3)]
        await a.take(24 * mib)
        await b.take(24 * mib)
        with pytest.raises(actorshm.SharedMemoryError) as info:
            await c.take(24 * mib)  # each process alone is far below 64 MiB
        msg = str(info.value)
        assert "the runtime's budget is 64.0 MiB for the driver and its actors" in msg
        assert "48.0 MiB is in use" in msg
        assert f"Holder(id={a.actor_id}) (pid {a.pid}) 24.0 MiB" in msg
        assert "shm_budget=" in msg and "ACTORSHM_SHM_BUDGET" in msg
        with pytest.raises(actorshm.SharedMemoryError, match="runtime's budget"):
            actorshm.empty(24 * mib, np.uint8)  # the driver shares it too
        await a.drop()  # its arena is idle in its pool: given back when c asks
        assert await c.take(24 * mib) == 1
        await b.kill()  # a dead actor's memory is no longer charged
        x = actorshm.empty(24 * mib, np.uint8)
        del x
    a = actorshm.empty(100 * mib, np.uint8)  # the runtime (and its budget) closed
    del a


async def test_short_of_the_budget_a_process_waits_only_until_the_others_answered(
        monkeypatch):
    # With the budget's memory all in use, every allocation over it waited the whole
    # wait for room that could not come, blocking the driver's event loop (40 clients
    # sending ordinary arrays: 14 s, and no time-out fired meanwhile)
    mib = 1 << 20
    monkeypatch.setattr(_shm, "ROOM_WAIT", 30.0)  # (only the answers can end it early)
    async with actorshm.Runtime(shm_budget=64 * mib, shutdown_grace=1.0):
        a, b = await asyncio.gather(Holder.spawn(), Holder.spawn())
        await a.take(48 * mib)  # in use, not idle: nothing to give back
        await b.take(8 * mib)
        for _ in range(3):
            t = time.monotonic()
            with pytest.raises(actorshm.SharedMemoryError, match="runtime's budget"):
                actorshm.empty(16 * mib, np.uint8)
            assert time.monotonic() - t < 15  # each actor answered (in ~0.1 s)
        await b.drop()  # idle in its pool: given back when asked, so the wait succeeds
        x = actorshm.empty(16 * mib, np.uint8)
        del x


def test_sizes_past_tib_read_in_their_unit():
    from actorshm._util import fmt_bytes
    assert fmt_bytes(1 << 62) == "4.0 EiB" and fmt_bytes(3 << 50) == "3.0 PiB"
    assert fmt_bytes(5 << 40) == "5.0 TiB" and fmt_bytes(100) == "100 B"


async def test_a_dead_actor_that_sent_shared_arrays_leaves_no_connection_behind(rt):
    # The lease of each block an actor sent kept the actor's connection (and its region's
    # object) in this process's map of blocks, dead, until 4,096 blocks had died: about
    # 6.5 KB of the driver's memory per such actor, spawned and killed in a loop.
    import weakref
    from call_actors import Worker
    from waits import until
    conns = []
    for _ in range(3):
        w = await Worker.spawn()
        got = [a async for a in w.arrays(2, 4096)]
        conns.append(weakref.ref(rt._actors[w.actor_id].conn))
        del got
        await w.kill()
        del w
    gc.collect()
    assert await until(lambda: gc.collect() is not None and all(c() is None for c in conns))
