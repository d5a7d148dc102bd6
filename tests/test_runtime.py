"""The actor runtime: spawning, calls, ordering, concurrency, errors, death, lifecycle."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import actorshm
from actorshm import ActorDiedError, RemoteError
from actors import (BreaksOnArrival, Caller, Concurrent, Counter, CustomError, Dying,
                    Faulty, Probe)


async def test_spawn_call_and_local_use(rt):
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
    with pytest.raises(TypeError, match="do not stream results yet: return a list"):
        await f.stream(3)
    assert await f.ok() == "ok"


@pytest.mark.parametrize("how,expect", [
    ("crash", "SIGSEGV"),
    ("exit", "code 3"),
    ("kill", "kill"),
])
async def test_death_fails_pending_and_later_calls(rt, how, expect):
    f = await Faulty.spawn()
    other = await Counter.spawn()
    if how == "kill":
        pending = [f.hang()] + [f.ok() for _ in range(5)]
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await f.kill()
    else:
        t0 = time.monotonic()
        doomed = f.crash() if how == "crash" else f.exit(3)
        pending = [doomed] + [f.ok() for _ in range(5)]  # queued behind the death
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert time.monotonic() - t0 < 1.0
    for r in results:
        assert isinstance(r, ActorDiedError), r
        assert expect in str(r), str(r)
    with pytest.raises(ActorDiedError):
        await f.ok()
    assert await other.incr() == 1  # a death never disturbs the other actors


async def test_pending_calls_name_the_exit_code_when_the_death_is_seen_first(rt):
    # The process's exit is handled before the socket's end (a big reply was still
    # being read): pending calls must still say how it died.
    for _ in range(3):
        d = await Dying.spawn()
        pending = asyncio.ensure_future(d.hang())
        await asyncio.sleep(0.02)
        last = asyncio.ensure_future(d.big_reply_then_exit(9))
        await asyncio.sleep(0.005)
        time.sleep(0.3)  # the exit and the data are both waiting when we look
        with pytest.raises(ActorDiedError, match="code 9"):
            await pending
        try:
            await last
        except ActorDiedError:
            pass


async def test_a_reply_written_just_before_death_is_delivered(rt):
    # The process exit is handled before the socket is read (as when the pidfd's event
    # comes first): what the actor wrote before it died is still read and delivered.
    d = await Dying.spawn()
    rec = rt._actors[d.actor_id]
    reply = asyncio.ensure_future(d.reply_then_exit("last words", 3))
    deadline = time.monotonic() + 5  # our loop reads nothing meanwhile
    while time.monotonic() < deadline and not os.waitid(
            os.P_PID, rec.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
        time.sleep(0.01)
    rt._on_exit(rec)  # the exit first, the socket after
    assert await reply == "last words"
    with pytest.raises(ActorDiedError, match="code 3"):
        await d.hang()


async def test_handles_pass_and_call_directly(rt):
    c = await Counter.spawn(10)
    caller = await Caller.spawn(c)
    assert await caller.call_other(1) == 11
    assert await caller.call_handle(c, 2) == 13
    back = await caller.make_handle_list()
    assert back == [c] and await back[0].incr(1) == 14


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


async def test_current_runtime():
    with pytest.raises(RuntimeError, match="actorshm.Runtime"):
        actorshm.current_runtime()
    async with actorshm.Runtime() as rt:
        assert actorshm.current_runtime() is rt
    with pytest.raises(RuntimeError, match="actorshm.run"):
        await Counter.spawn()


async def test_bad_start_method():
    with pytest.raises(ValueError, match="fork"):
        actorshm.Runtime(start_method="fork")


async def test_stdout_stderr_prefixed(rt, capfd):
    c = await Counter.spawn()
    assert await c.say("hello from actor")
    await asyncio.sleep(0.2)
    out, err = capfd.readouterr()
    assert f"(Counter pid={c.pid}) hello from actor" in out
    assert f"(Counter pid={c.pid}) err:hello from actor" in err


async def test_runtime_exit_leaves_nothing_behind():
    fds_before = set(os.listdir("/proc/self/fd"))
    async with actorshm.Runtime(shutdown_grace=0.5):
        actors = [await Counter.spawn(i) for i in range(3)]
        pids = [a.pid for a in actors]
        caller = await Caller.spawn(actors[0])
        await caller.call_other(1)
        busy = await Faulty.spawn()
        busy.hang()  # must be stopped by SIGTERM after the grace period
        pids.append(busy.pid)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    await asyncio.sleep(0.05)
    leaked = set(os.listdir("/proc/self/fd")) - fds_before
    # fds of arenas this process owns may stay (the pool outlives a runtime); nothing else
    leaked = {fd for fd in leaked if "memfd" not in _readlink(fd)}
    assert not leaked, [(_readlink(fd)) for fd in leaked]


def _readlink(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


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
            await rec.conn.call("__accept_peer__", (PassFd(b.fileno()), 999), {})
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


DRIVER_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys, time
    import actorshm
    from actorshm import actor

    @actor
    class Local:
        def __init__(self, k):
            self.k = k
        def mul(self, x):
            return x * self.k
        def getpid(self):
            return os.getpid()

    async def main():
        a = await Local.spawn(3)
        print("RESULT", await a.mul(14), flush=True)
        print("PID", await a.getpid(), flush=True)
        if len(sys.argv) > 1:
            time.sleep(60)

    actorshm.run(main())
""")


def _run_script(tmp_path, *args, **kw):
    script = tmp_path / "driver_script.py"
    script.write_text(DRIVER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(actorshm.__file__)))
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, **kw)


def test_actor_class_defined_in_main(tmp_path):
    p = _run_script(tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "RESULT 42" in out


def test_driver_sigkill_ends_actors(tmp_path):
    p = _run_script(tmp_path, "hang")
    pid = None
    for line in p.stdout:
        if line.startswith("PID"):
            pid = int(line.split()[1])
            break
    assert pid
    p.kill()
    p.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("actor outlived its killed driver")
    p.stdout.close()
    p.stderr.close()


def test_run_returns_result():
    async def main():
        c = await Counter.spawn(1)
        return await c.incr(1)
    assert actorshm.run(main()) == 2


async def test_forkserver_start_method(capfd):
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=0.5):
        cs = await asyncio.gather(*(Counter.spawn(i) for i in range(4)))
        assert [await c.incr() for c in cs] == [1, 2, 3, 4]
        assert len({c.pid for c in cs}) == 4
        assert await cs[0].say("forked hello")
        f = await Faulty.spawn()
        with pytest.raises(ActorDiedError, match="SIGSEGV"):
            await f.crash()
        g = await Faulty.spawn()
        with pytest.raises(ActorDiedError, match="code 5"):
            await g.exit(5)
        with pytest.raises(KeyError):
            await Faulty.spawn(fail=True)
        caller = await Caller.spawn(cs[1])
        assert await caller.call_other(10) == 12
        pids = [c.pid for c in cs]
    await asyncio.sleep(0.1)
    out, _ = capfd.readouterr()
    assert f"(Counter pid={pids[0]}) forked hello" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_max_restarts(rt):
    from actors import Phoenix
    p = await Phoenix.spawn("t")
    tag, calls, pid1 = await p.hit()
    assert (tag, calls) == ("t", 1)
    with pytest.raises(ActorDiedError, match="code 9"):
        await p.crash()  # the pending call fails: at-most-once delivery
    tag, calls, pid2 = await p.hit()  # made during the restart: waits for the new process
    assert (tag, calls) == ("t", 1) and pid2 != pid1 and p.pid == pid2
    with pytest.raises(ActorDiedError):
        await p.crash()
    with pytest.raises(ActorDiedError, match="code 9"):
        await p.hit()  # restarts used up: dead for good
    q = await Phoenix.spawn("q")
    await q.kill()  # kill() never restarts
    with pytest.raises(ActorDiedError, match="kill"):
        await q.hit()


async def test_restart_that_dies_while_starting_is_retried(rt, tmp_path):
    from actors import FlakyStart
    marker = tmp_path / "crash-next-start"
    a = await FlakyStart.spawn(str(marker))
    pid1 = await a.ping()
    marker.write_text("x")  # the first restart's __init__ crashes; the second works
    with pytest.raises(ActorDiedError):
        await a.crash()
    for _ in range(100):
        try:
            pid = await a.ping()
            break
        except ActorDiedError:
            await asyncio.sleep(0.05)
    assert pid != pid1 and not marker.exists()
    assert rt.actors()[-1]["alive"]


async def test_restarts_that_keep_failing_back_off_and_say_so(rt, tmp_path, caplog):
    from actors import FlakyStart
    marker = tmp_path / "always-crash"
    a = await FlakyStart.options(max_restarts=-1).spawn(str(marker), False)
    marker.write_text("x")  # every restart now dies in __init__
    with pytest.raises(ActorDiedError):
        await a.crash()
    await asyncio.sleep(1.0)
    rec = rt._actors[a.actor_id]
    assert 2 <= rec.restarts <= 8  # backing off, not spinning
    assert "failed while starting" in caplog.text
    await a.kill()  # ends the retries
    n = rec.restarts
    await asyncio.sleep(1.5)
    assert rec.restarts == n and not rec.alive
    with pytest.raises(ActorDiedError, match="kill"):
        await a.ping()


async def test_sync_method_in_thread_can_wait_on_calls(rt):
    from actors import ThreadedCaller
    c = await Counter.spawn(1)
    t = await ThreadedCaller.spawn()
    assert await t.call_and_wait(c, 2) == 3
    # the driver, from a thread of its own
    result = await asyncio.to_thread(lambda: c.incr(1).result(timeout=10))
    assert result == 4


async def test_num_gpus_gives_each_actor_its_own_gpu():
    # The runtime's GPU bookkeeping needs no GPU: it hands out CUDA_VISIBLE_DEVICES entries.
    async with actorshm.Runtime(gpus=[0, "GPU-5d2c"], shutdown_grace=1.0):
        a = await Probe.options(num_gpus=1).spawn()
        b = await Probe.options(num_gpus=1).spawn()
        assert await a.env("CUDA_VISIBLE_DEVICES") == "0"
        assert await b.env("CUDA_VISIBLE_DEVICES") == "GPU-5d2c"
        with pytest.raises(ValueError, match="0 of 2 GPU"):
            await Probe.options(num_gpus=1).spawn()
        await a.kill()
        c = await Probe.options(num_gpus=1).spawn()  # a's GPU is free again
        assert await c.env("CUDA_VISIBLE_DEVICES") == "0"


async def test_num_gpus_without_gpus_is_a_clear_error():
    async with actorshm.Runtime(gpus=[], shutdown_grace=1.0):
        with pytest.raises(ValueError, match="no GPU is available.*num_gpus=0"):
            await Probe.options(num_gpus=1).spawn()
        p = await Probe.spawn()  # the failed spawn left nothing half-made
        assert await p.env("PATH") == os.environ["PATH"]


@pytest.mark.parametrize("env, expect", [
    ("0,GPU-1a2b, 2", ["0", "GPU-1a2b", "2"]),
    ("1,-1,2", ["1"]),  # CUDA ignores everything from the first invalid entry
    ("", []),
])
def test_visible_gpus_follow_cuda_visible_devices(monkeypatch, env, expect):
    from actorshm._launch import visible_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert visible_gpus() == expect


async def test_actor_runs_the_drivers_own_actorshm(rt, tmp_path, monkeypatch):
    # Another actorshm earlier on the actor's path (an old install, a folder of that name
    # in the working directory) must not be used: driver and actors would speak
    # different protocols.
    other = tmp_path / "actorshm"
    other.mkdir()
    (other / "__init__.py").write_text("raise ImportError('not the driver\\'s actorshm')\n")
    monkeypatch.chdir(tmp_path)  # actors start in the driver's working directory
    c = await Counter.options(env={"PYTHONPATH": str(tmp_path)}).spawn(0)
    assert await c.incr() == 1


SHADOW_SCRIPT = textwrap.dedent("""
    import actorshm
    from actorshm import actor

    @actor
    class Maker:
        def make(self):
            return float(actorshm.zeros(10).sum() + 1)  # needs the real secrets module

    async def main():
        for method in ("spawn", "forkserver"):
            async with actorshm.Runtime(start_method=method):
                print(method, await (await Maker.spawn()).make(), flush=True)

    actorshm.run(main())
""")


def test_working_directory_files_do_not_shadow_the_standard_library(tmp_path):
    # The driver runs a script from elsewhere, so its working directory is not on its
    # path; a secrets.py there must not be what its actors import either.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "scripts" / "drv.py").write_text(SHADOW_SCRIPT)
    (tmp_path / "work" / "secrets.py").write_text("broken = True\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(actorshm.__file__)))
    p = subprocess.run([sys.executable, str(tmp_path / "scripts" / "drv.py")], env=env,
                       cwd=tmp_path / "work", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["spawn", "1.0", "forkserver", "1.0"]
