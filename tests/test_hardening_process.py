"""Process hardening: fork-server death, names during restarts, inherited fds, output."""

import asyncio
import io
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest

import actorshm
from actorshm import ActorDiedError, _descendants
from actorshm._launch import OutputForwarder


async def _poll(pred, timeout=20.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def test_actors_survive_their_fork_server_and_a_new_one_starts():
    from actors import Counter, Phoenix
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=1.0) as rt:
        c = await Counter.spawn()
        p = await Phoenix.spawn("x")
        assert await c.incr() == 1
        server = rt._forkserver._fs[0]
        server.kill()
        server.wait()
        await asyncio.sleep(0.2)  # (an actor killed with its server would be gone by now)
        assert await c.incr() == 2  # the actor lives on
        d = await Counter.spawn(10)  # a new fork server starts
        assert await d.incr() == 11
        assert rt._forkserver._fs[0] is not server
        pid = p.pid
        os.kill(pid, signal.SIGKILL)  # restartable: restarts through the new server
        await _poll(lambda: p.pid != pid)
        tag, calls, _ = await p.hit()
        assert (tag, calls) == ("x", 1)
        # The old server's child dies: nobody will report its exit code. A pending call
        # failed after 0.3 s saying its connection closed, and the death was reported a
        # second late (the exit code was waited for from the new server).
        pending = c.slow_record(1, 30)
        await asyncio.sleep(0.1)
        t0 = asyncio.get_running_loop().time()
        os.kill(c.pid, signal.SIGKILL)
        with pytest.raises(actorshm.ActorDiedError, match="exit status is unknown"):
            await asyncio.wait_for(pending, 10)
        assert asyncio.get_running_loop().time() - t0 < 0.9


async def test_a_spawn_given_up_while_the_fork_server_forks_leaks_nothing():
    from actors import Counter
    fds = len(os.listdir("/proc/self/fd"))
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=1.0) as rt:
        c = await Counter.spawn()
        for _ in range(5):  # cancelled while it waits for the fork server's answer
            task = asyncio.ensure_future(Counter.spawn())
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        rt._forkserver.start_timeout = 0  # and timed out there
        with pytest.raises(actorshm.ActorDiedError, match=r"start_timeout"):
            await Counter.spawn()
        await asyncio.sleep(0.5)
        assert [a["id"] for a in rt.actors() if a["alive"]] == [c._actor_id]
        assert await c.incr() == 1
    assert len(os.listdir("/proc/self/fd")) == fds  # (and no process: the fixture)


def test_forked_actors_die_with_their_driver(tmp_path):
    import subprocess
    import textwrap
    import time
    code = textwrap.dedent("""
        import asyncio, os, sys, time
        sys.path.insert(0, %r)
        import actorshm
        from actors import Probe
        async def main():
            async with actorshm.Runtime(start_method="forkserver"):
                a = await Probe.spawn()
                print(a.pid, flush=True)
                time.sleep(60)
        actorshm.run(main())
    """ % os.path.dirname(__file__))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):
                break
        time.sleep(0.02)
    else:
        assert not os.path.exists(f"/proc/{pid}"), "the actor outlived its driver"


async def test_name_belongs_to_a_restarting_actor(rt):
    from actors import Phoenix
    p = await Phoenix.options(name="svc", max_restarts=-1).spawn("orig")
    await p.hit()
    with pytest.raises(ActorDiedError):
        await p.crash()
    # During the restart the name is still the actor's.
    h = await rt.get_actor("svc")
    assert h.actor_id == p.actor_id
    with pytest.raises(ValueError, match="already exists"):
        await Phoenix.options(name="svc").spawn("thief")
    tag, _, _ = await h.hit()
    assert tag == "orig"
    await p.kill()
    with pytest.raises(ValueError, match="no live actor"):
        await rt.get_actor("svc")
    q = await Phoenix.options(name="svc").spawn("next")  # dead for good: free again
    assert (await q.hit())[0] == "next"


async def test_programs_an_actor_starts_do_not_inherit_its_driver_socket(rt_each):
    from actors import Shell
    s = await Shell.spawn()
    fd, inherited = await s.driver_socket_inherited()
    assert not inherited, f"fd {fd} leaked into a child program"


def _forwarder(cap=None):
    rec = types.SimpleNamespace(cls_name="A", pid=1, stderr_tail=[], conn=None)
    r, w = os.pipe()
    os.close(w)
    fwd = OutputForwarder(rec, open(r, "rb", buffering=0), "stdout")
    return fwd


def test_output_without_newlines_is_capped_and_carriage_returns_forwarded(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    fwd = _forwarder()
    fwd._emit(b"10%\r20%\r")
    assert out.getvalue() == "(A pid=1) 10%\n(A pid=1) 20%\n"
    # a bar that writes "\r" then its state: each state at once, no empty lines
    for i, chunk in enumerate((b"\r30%", b"\r40%", b"\r", b"\n", b"done\r\n")):
        fwd._emit(chunk)
        assert out.getvalue().endswith(("(A pid=1) 30%\n", "(A pid=1) 40%\n", "40%\n",
                                        "40%\n", "(A pid=1) done\n")[i])
    assert out.getvalue().count("(A pid=1)") == 5
    out.seek(0)
    out.truncate()
    for _ in range(100):
        fwd._emit(b"x" * 65536)  # 6.4 MiB and no line end
        assert len(fwd.partial) <= OutputForwarder.max_line
    assert out.getvalue().count("(A pid=1) x") >= 90
    # a long line is cut between characters, never inside one (U+FFFD in their place)
    fwd._emit(b"\n")
    out.seek(0)
    out.truncate()
    fwd._emit(b"a" + "\u00e9".encode() * 100_000)  # (no line end yet: in pieces)
    fwd._emit(b"\n")
    assert "\ufffd" not in out.getvalue() and out.getvalue().count("\u00e9") == 100_000
    fwd.close()


def test_output_the_drivers_stdout_cannot_encode_is_escaped_not_lost(monkeypatch):
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", write_through=True)
    monkeypatch.setattr(sys, "stdout", out)
    fwd = _forwarder()
    fwd._emit("one\ntwo \u00e9 \u2713\nthree\n".encode())
    assert raw.getvalue() == (b"(A pid=1) one\n(A pid=1) two \\xe9 \\u2713\n"
                              b"(A pid=1) three\n")
    fwd.close()


async def test_progress_output_reaches_the_driver(rt, capfd):
    from actors import Shell
    s = await Shell.spawn()
    await s.write("step 1\rstep 2\r")
    seen = []

    def arrived():
        seen.append(capfd.readouterr().out)
        return "step 2" in "".join(seen)
    await _poll(arrived)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_kills_and_restarts_leave_the_drivers_fds_flat(rt):
    """Each actor's sockets (its connection and its probe), pipes and pidfd close when
    it dies: killed, crashed for good, or restarted."""
    from actors import Counter, Phoenix
    p = await Phoenix.options(max_restarts=-1).spawn("x")
    c = await Counter.spawn()  # the first of each kind warms up what stays
    await c.kill()
    await asyncio.sleep(0.1)
    before = _fds()
    for _ in range(4):
        old = p.pid
        os.kill(old, signal.SIGKILL)  # it restarts
        await _poll(lambda: p.pid != old and rt.record(p.actor_id).alive)
        await p.hit()
        c = await Counter.spawn()
        await c.incr()
        await c.kill()  # dead for good
        c = await Counter.spawn()
        os.kill(c.pid, signal.SIGKILL)  # dies, no restart
        await _poll(lambda: not rt.record(c.actor_id).alive)
    await rt.stats()  # the probes answer
    await _poll(lambda: _fds() <= before, timeout=5)


def _signals_sent(monkeypatch) -> list:
    """Record every ``os.kill`` and ``os.killpg`` of this process from now on: (pid, sig)."""
    sent = []
    for name in ("kill", "killpg"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda pid, sig, real=real: (
            sent.append((pid, sig)), real(pid, sig))[1])
    return sent


async def test_a_forked_actor_seen_dead_is_not_signalled_by_its_number(monkeypatch):
    # Its fork server reaps it at once; the driver then waits for the exit code the
    # server reports (late here: a server busy forking). Meanwhile its number is free
    # for another process: neither kill(), nor the broken connection, nor a close may
    # signal it.
    from actors import Counter
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=0.5) as rt:
        c = await Counter.spawn()
        fs = rt._forkserver
        report = fs.exit_code

        async def late_report(pid):
            await asyncio.sleep(0.6)
            return await report(pid)
        fs.exit_code = late_report
        pid, rec = c.pid, rt.record(c.actor_id)
        os.kill(pid, signal.SIGKILL)
        sent = _signals_sent(monkeypatch)
        await _poll(lambda: rec.pidfd < 0)  # its exit seen; the report still to come
        assert rec.alive
        await asyncio.sleep(0.4)  # (the broken connection's wait for the exit is over)
        await rt.kill(c.actor_id)
        assert not rec.alive
    assert [s for s in sent if s[0] == pid and s[1] != 0] == []  # (0: a probe, sent nothing)


async def test_a_forked_actor_is_watched_through_a_pidfd_its_fork_server_opened(monkeypatch):
    # a pidfd the driver opened from the number the server reported could name another
    # process: the child may have died and been reaped by the server before it opened
    from actors import Counter
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=0.5) as rt:
        await Counter.spawn()  # (the server started)
        opened = []
        real = os.pidfd_open
        monkeypatch.setattr(os, "pidfd_open", lambda pid, *a: (
            opened.append(pid), real(pid, *a))[1])
        c = await Counter.spawn()
        assert rt.record(c.actor_id).pidfd >= 0 and c.pid not in opened
        os.kill(c.pid, signal.SIGKILL)  # and its death is seen through it
        await _poll(lambda: not rt.record(c.actor_id).alive)


async def test_the_group_of_a_dead_actors_reused_number_is_left_alone():
    # once its fork server has reaped it, a dead actor's number (its group's id) may be
    # given to a new process, which may lead a group of its own: not the actor's
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             start_new_session=True)  # (the process a reused number names)
    ending = _descendants.Ending()
    try:
        ending.end(other.pid)
        assert ending.groups == {}
        ending.kill()
        await asyncio.sleep(0.1)
        assert other.poll() is None
    finally:
        ending.kill()
        other.kill()
        other.wait()


def test_closing_the_fds_an_actor_left_ignores_one_closed_already():
    # (a stale fd number, closed by code that held it, made the runtime's close raise
    # EBADF before it said it was done: the close hung)
    r, w = os.pipe()
    os.close(r)
    _descendants._close([r, w])
    with pytest.raises(OSError):
        os.fstat(w)  # (the others are closed all the same)


async def test_sync_calls_at_the_thread_limit_fail_or_wait_never_hang(rt):
    # max_concurrency > 1 runs sync methods in threads. At the limit of threads, every
    # call went unanswered (a plain pool raised, yet kept the call queued, its slot
    # taken): the caller hung.
    from actors import AtThreadLimit
    a = await AtThreadLimit.spawn()
    for _ in range(2):  # no thread runs: each call fails at once, naming the limit
        with pytest.raises(RuntimeError, match=r"could not start a thread.*ulimit -u"):
            await asyncio.wait_for(a.sync(1), 10)
    assert await asyncio.wait_for(a.ping(), 10) == "pong"  # the actor carries on
    # One thread running before the limit was met: the calls take turns on it.
    b = await AtThreadLimit.spawn(at_start=False)
    await b.limit()  # (ran in the first thread)
    assert await asyncio.wait_for(asyncio.gather(*(b.sync(i) for i in range(4))), 10) == \
        [0, 1, 2, 3]


async def test_an_actor_at_the_thread_limit_stops_without_a_traceback(capfd):
    # Its stop starts a timer thread (the clean-up's time limit): that failing printed a
    # traceback ending in "can't start new thread" from every such actor.
    from actors import AtThreadLimit
    async with actorshm.Runtime():
        a = await AtThreadLimit.spawn()
        assert await a.ping() == "pong"
    err = capfd.readouterr().err
    assert "can't start new thread" not in err and "Traceback" not in err, err


async def test_a_forked_actor_that_cannot_start_says_why(monkeypatch):
    # It exited with code 1 and nothing on its stderr (its error was swallowed)
    from actorshm import _launch
    from actors import Counter
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=0.5):
        await Counter.spawn()  # (the fork server started where the driver is)
        monkeypatch.setattr(_launch, "working_directory", lambda: "/nonexistent/actorshm")
        with pytest.raises(ActorDiedError) as err:
            await Counter.spawn()
    assert "the forked actor process could not start: FileNotFoundError" in str(err.value)
    assert "/nonexistent/actorshm" in str(err.value)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_actors_start_where_the_driver_may_not_enter_its_directory(
        start_method, monkeypatch, tmp_path):
    # A driver run as another user from a home it cannot read (``sudo -u svc python
    # job.py`` from /root) works there; its forked actors exited with code 1 (the fork
    # failed its chdir), spawned ones raised PermissionError from the spawn
    from actorshm import _launch
    from actors import Counter
    here = os.getcwd()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False
                        if os.fspath(path) == str(tmp_path) else real_access(path, mode, **kw))
    os.chdir(tmp_path)
    try:
        assert _launch.working_directory() is None
        async with actorshm.Runtime(start_method=start_method, shutdown_grace=0.5):
            c = await Counter.spawn(1)
            assert await c.incr() == 2
    finally:
        os.chdir(here)


def test_a_group_scan_reads_the_stat_files_of_its_members_only(monkeypatch):
    # An actor's exit scans the machine's processes for its group, on the driver's loop:
    # reading every process's stat file took 60 ms on a machine running 3,000 of them
    seen = []
    real = _descendants._stat
    monkeypatch.setattr(_descendants, "_stat", lambda pid: seen.append(pid) or real(pid))
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert _descendants._members(p.pid) == [p.pid]
    finally:
        p.kill()
        p.wait()
    assert seen == [p.pid]


async def test_without_proc_an_actors_death_is_still_reported(rt, monkeypatch):
    # (a sandbox or chroot with no /proc: the scan for what the actor started raised
    # in the driver's exit handling, and the death was never reported)
    from actors import Counter
    c = await Counter.spawn()
    real = os.listdir

    def no_proc(path="."):
        if os.fspath(path) == "/proc":
            raise FileNotFoundError(2, "No such file or directory", "/proc")
        return real(path)
    monkeypatch.setattr(os, "listdir", no_proc)
    assert _descendants._members(os.getpgid(0)) == []
    os.kill(c.pid, signal.SIGKILL)
    with pytest.raises(ActorDiedError, match="SIGKILL"):
        await asyncio.wait_for(c.incr(), 5)


async def test_without_pidfds_a_group_whose_number_went_to_another_is_left_alone(
        monkeypatch):
    # An ended actor's group is watched by its number without pidfds: once it emptied
    # and a new session leader took the number, the watch SIGKILLed that stranger's group
    monkeypatch.setattr(_descendants, "_pidfds", False)
    ending = _descendants.Ending()
    ending._loop = asyncio.get_running_loop()
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        ending._look(stranger.pid, ending._loop.time())  # (its deadline has passed)
        ending.kill()
        await asyncio.sleep(0.1)
        assert stranger.poll() is None and not ending.groups
    finally:
        stranger.kill()
        stranger.wait()


def test_without_proc_the_watchdog_still_gives_the_grace(tmp_path):
    # (without /proc the members of its group cannot be named: it sent SIGKILL right
    # after SIGTERM, and a program's clean-up, a resource tracker's too, never ran)
    done = tmp_path / "cleaned-up"
    code = f"""
import os, signal, subprocess, sys, time
os.setsid()
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def bye(*_):
    time.sleep(0.3)
    open({str(done)!r}, "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(60)
'''], stdout=subprocess.PIPE)
child.stdout.readline()
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)  # (as the watchdog does)
from actorshm import _descendants
def no_proc(real):
    def call(path="."):
        if os.fspath(path) == "/proc":
            raise FileNotFoundError(2, "No such file or directory", "/proc")
        return real(path)
    return call
os.listdir = no_proc(os.listdir)
isdir = os.path.isdir
os.path.isdir = lambda p: False if p == "/proc" else isdir(p)
_descendants._end(os.getpgid(0))
"""
    p = subprocess.run([sys.executable, "-c", code], timeout=30,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == -signal.SIGKILL  # (it ends with its group, itself last)
    assert done.exists()


async def test_an_actor_that_closed_its_standard_streams_prints_into_nothing_of_ours(
        rt_each):
    # Daemon-style code closes fds 0, 1 and 2. The arenas and sockets the actor opened
    # or received next took those numbers, and its prints went into them: a print wrote
    # itself into an array the driver held, and a write to fd 2 into a connection to
    # another actor ("bad frame header", the connection dropped).
    from actors import StdioCloser
    a, b = await asyncio.gather(StdioCloser.spawn(), StdioCloser.spawn())
    await a.close_stdio()
    x = actorshm.zeros(64, dtype=np.uint8)
    assert await a.first(x) == 0  # (x's arena arrives: it took fd 0)
    y = await a.make(64)  # (an arena of its own: fd 1)
    assert await a.ask(b, x) == 0  # (a connection to b: fd 2)
    await a.say("HELLO FROM A PRINT " * 4)
    assert not x.any() and not y.any()
    y[0] = 7
    assert await a.ask(b, y) == 7  # the connection to b still reads frames


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.parametrize("runner", ["actorshm.run", "asyncio.run"])
def test_a_driver_that_closed_its_standard_streams_prints_into_nothing_of_ours(
        tmp_path, start_method, runner):
    # The same in the driver: its budget ledger (whose mmap keeps a dup of its fd: a
    # print wrote itself into the ledger every process shares), arenas, pidfds, actor
    # sockets and output pipes took the numbers 0, 1 and 2; with uvloop (actorshm.run)
    # libuv's own files took them, and it aborted the process closing one. /dev/null
    # is put on them before a uvloop loop starts, as a runtime opens and as an actor
    # starts.
    import textwrap
    code = textwrap.dedent("""
        import asyncio, os, sys
        sys.path.insert(0, %r)
        import numpy as np
        import actorshm
        from actors import StdioCloser
        out = open(sys.argv[1], "w")
        def close_stdio(fds=(0, 1, 2)):
            for fd in fds:
                os.close(fd)
        if %r == "actorshm.run":
            close_stdio()  # (before its uvloop loop starts)
        async def main():
            if %r == "asyncio.run":
                close_stdio((1, 2))  # (after the loop made its own files)
            async with actorshm.Runtime(start_method=%r):
                a = await StdioCloser.spawn()
                b = await StdioCloser.spawn()
                x = actorshm.zeros(64, dtype=np.uint8)
                y = await a.make(64)
                for write in (lambda: print("HELLO " * 10, flush=True),
                              lambda: os.write(2, b"HELLO " * 10)):
                    try:
                        write()
                    except OSError:
                        pass
                y[0] = 5
                from actorshm import _shm
                ledger = _shm.shared_budget()
                out.write(repr((bool(x.any()), bool(y[1:].any()), await b.ask(a, y),
                                ledger.budget == _shm.pool().budget)))
        %s(main())
    """ % (os.path.dirname(__file__), runner, runner, start_method, runner))
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")],
                          timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0
    assert (tmp_path / "out").read_text() == "(False, False, 5, True)"
