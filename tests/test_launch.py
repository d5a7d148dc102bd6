"""Starting actor processes: start methods, output, GPUs, environment, import path."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

import actorshm
from actorshm import ActorDiedError
from actors import Caller, Counter, Faulty, Probe
from waits import until


async def test_stdout_stderr_prefixed(rt_each, capfd):
    c = await Counter.spawn()
    assert await c.say("hello from actor")
    await asyncio.sleep(0.2)
    out, err = capfd.readouterr()
    assert f"(Counter pid={c.pid}) hello from actor" in out
    assert f"(Counter pid={c.pid}) err:hello from actor" in err


async def test_a_spawn_waiting_for_the_fork_server_fails_at_once_when_the_runtime_closes():
    rt = actorshm.Runtime(start_method="forkserver", start_timeout=30)
    await rt.__aenter__()
    spawn = asyncio.ensure_future(Counter.spawn())  # the fork server is still starting
    await asyncio.sleep(0)
    await rt.close()
    with pytest.raises(ActorDiedError, match="runtime closed"):
        await asyncio.wait_for(spawn, 10)  # (it waited its whole start timeout)


@pytest.mark.parametrize("delay", [0, 0.05])
async def test_a_spawn_under_way_when_the_runtime_closes_raises(delay):
    # (it returned a handle to an actor that was already stopped)
    rt = actorshm.Runtime()
    await rt.__aenter__()
    spawn = asyncio.ensure_future(Counter.spawn())
    await asyncio.sleep(delay)
    await rt.close()
    with pytest.raises(ActorDiedError, match="runtime closed"):
        await asyncio.wait_for(spawn, 10)


async def test_fork_requests_bigger_than_the_fork_servers_socket_are_written_whole():
    # (each request carries the actor's environment: spawns whose requests filled the
    # socket failed with BlockingIOError, and a stale reply slot misrouted later forks)
    big = "x" * 600_000
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=0.5):
        cs = await asyncio.gather(*(Counter.options(env={"BIG": big}).spawn(i)
                                    for i in range(3)))
        assert [await c.incr() for c in cs] == [1, 2, 3]
        assert len({c.pid for c in cs}) == 3


async def test_a_fork_request_that_cannot_be_written_fails_its_spawn_and_later_ones_work():
    # (a request lost to an OSError other than the server's death, ENOBUFS say, left
    # its spawn waiting for a report that never came: each later report went to the
    # spawn before it, and every spawn after timed out)
    import errno

    class Refusing:  # the fork server's socket, refusing one write
        def __init__(self, sock):
            self.sock, self.refuse = sock, True

        def __getattr__(self, name):
            return getattr(self.sock, name)

        def sendmsg(self, *args):
            if self.refuse:
                self.refuse = False
                raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
            return self.sock.sendmsg(*args)

    async with actorshm.Runtime(start_method="forkserver", start_timeout=5,
                                shutdown_grace=0.5) as rt:
        first = await Counter.spawn(0)
        fs = rt._forkserver
        fs._fs = (fs._fs[0], Refusing(fs._fs[1]))
        with pytest.raises(ActorDiedError, match="could not be written.*No buffer"):
            await asyncio.wait_for(Counter.spawn(0), 4)
        cs = [await asyncio.wait_for(Counter.spawn(i), 4) for i in (10, 20)]
        assert [await c.incr() for c in cs] == [11, 21]
        assert await first.incr() == 1  # (the server's actors live on)


async def test_the_exit_of_a_child_forked_for_a_spawn_given_up_is_not_kept(monkeypatch):
    # A spawn cancelled while the server forked: its child is killed, and the server's
    # report of its exit was kept for ever (one entry per such spawn; a later child
    # with that pid would have been given its exit code).
    from actorshm._launch import ForkServerClient
    killed = []
    real = ForkServerClient._kill_forked

    def counting(self, fut):
        if not fut.cancelled() and fut.exception() is None:
            killed.append(fut.result()[0])
        real(self, fut)
    monkeypatch.setattr(ForkServerClient, "_kill_forked", counting)
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=0.5) as rt:
        await Counter.spawn(0)  # (the server is up)
        fs = rt._forkserver
        for i in range(400):
            if len(killed) >= 3:
                break
            try:
                h = await asyncio.wait_for(Counter.spawn(0), 0.0005 * (1 + i % 8))
            except asyncio.TimeoutError:
                continue
            await h.kill()
        assert killed, "no spawn was given up after its fork"

        async def reports_in():  # (each killed child's exit reported and dropped)
            return not fs._abandoned
        assert await until(reports_in, 10), fs._abandoned
        assert not set(killed) & set(fs._fs_exit), fs._fs_exit
        # A server that dies never reports its children's exits: a later child (of the
        # next server) with such a pid would have had its own report dropped.
        fs._abandoned.add(killed[0])
        os.kill(fs._fs[0].pid, signal.SIGKILL)
        fs._fs[0].wait()
        assert await (await Counter.spawn(5)).incr() == 6  # (a new server)
        assert not fs._abandoned


async def test_a_fork_request_short_of_fds_leaks_none(monkeypatch):
    # (a request copies its 3 fds: out of fds at the second, the first copy leaked)
    import errno
    async with actorshm.Runtime(start_method="forkserver", shutdown_grace=0.5):
        await Counter.spawn(0)  # (the server is up)
        real_dup, made = os.dup, []

        def dup(fd):
            if made:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            made.append(real_dup(fd))
            return made[-1]

        before = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(os, "dup", dup)
        with pytest.raises(OSError, match="Too many open files"):
            await Counter.spawn(0)
        monkeypatch.setattr(os, "dup", real_dup)
        assert made and len(os.listdir("/proc/self/fd")) <= before
        assert (await Counter.spawn(1)).pid > 0


async def test_a_spawn_out_of_fds_says_whose_limit_and_what_to_do(rt_each):
    # (it raised a bare "[Errno 24] Too many open files", naming neither the driver's
    # limit nor the fix)
    import resource
    await Counter.spawn(0)  # (a fork server is up)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = len(os.listdir("/proc/self/fd"))
    # Every fd number below the limit taken but one (fd numbers, not the count of open
    # fds, decide: a gap below the limit would be a free slot): the socket pair fails.
    limit = max(map(int, os.listdir("/proc/self/fd"))) + 8
    fill = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        try:
            while True:
                fill.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        os.close(fill.pop())
        with pytest.raises(OSError, match=r"Too many open files\): this process \(the "
                                          r"driver\) is out of file descriptors .*ulimit -n, "
                                          rf"is {limit}.*raise the limit"):
            await Counter.spawn(0)
    finally:
        for fd in fill:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(os.listdir("/proc/self/fd")) <= before
    assert await (await Counter.spawn(1)).incr() == 2


async def test_a_fork_that_fails_fails_its_spawn_saying_why_and_the_server_lives_on():
    # (a fork refused for a process limit ended the fork server: every spawn waiting
    # on it failed with "the actorshm fork server died", naming no cause)
    from actorshm._launch import ForkServerClient
    loop = asyncio.get_running_loop()
    client = ForkServerClient(loop, 10)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    code = textwrap.dedent("""
        import errno, os
        def refuse():
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        os.fork = refuse
        import actorshm._forkserver as m
        m.main()
    """)
    root = os.path.dirname(os.path.dirname(actorshm.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    popen = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())],
                             pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    client._fs = (popen, ours)
    loop.add_reader(ours.fileno(), client._on_forkserver)
    try:
        for _ in range(2):
            child, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with pytest.raises(OSError, match="limit on processes"):
                await client.fork(child, {"ACTORSHM_SYS_PATH": root})
            child.close()
            peer.close()
        assert popen.poll() is None
    finally:
        client.stop()


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


async def test_a_program_the_driver_runs_inherits_no_actor_pidfd(rt_each):
    # A forked actor's pidfd comes from its fork server (SCM_RIGHTS), which gives it
    # without close-on-exec: an os.system() or close_fds=False child kept them all.
    await asyncio.gather(Counter.spawn(), Counter.spawn())
    fds = subprocess.run(["sh", "-c", "for f in /proc/$$/fd/*; do readlink $f; done"],
                         close_fds=False, capture_output=True, text=True).stdout
    assert "pidfd" not in fds, fds


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


def test_gpus_listing_a_gpu_twice_or_no_gpu_at_all_is_refused():
    # Two num_gpus=1 actors would each get GPU 0 "of their own".
    with pytest.raises(ValueError, match=r"names GPU\(s\) \['0'\] more than once"):
        actorshm.Runtime(gpus=[0, "0", 1])
    for bad in ([None], [-1], [""], [True], [1.5]):  # (they became CUDA_VISIBLE_DEVICES)
        with pytest.raises(ValueError, match=r"takes GPU indices \(ints >= 0\) or UUIDs"):
            actorshm.Runtime(gpus=bad)
    actorshm.Runtime(gpus=[0, "GPU-5a8c"])  # indices and UUIDs


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


async def test_actor_runs_the_drivers_own_actorshm(rt_each, tmp_path, monkeypatch):
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


FLAGS_SCRIPT = """
import sys, warnings
import actorshm

@actorshm.actor
class Flags:
    def read(self):
        try:
            warnings.warn("careful", UserWarning)
            warned = "printed"
        except UserWarning:
            warned = "raised"
        return sys.flags.optimize, sys.flags.dev_mode, warned

async def main():
    for method in ("spawn", "forkserver"):
        async with actorshm.Runtime(start_method=method):
            print(method, *await (await Flags.spawn()).read())

if __name__ == "__main__":
    actorshm.run(main())
"""


def test_actors_run_with_the_drivers_interpreter_flags(tmp_path):
    # As multiprocessing's children do: -O strips the asserts of an actor's own modules
    # too, and -W error raises in the actor as in the driver.
    (tmp_path / "drv.py").write_text(FLAGS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(actorshm.__file__)))
    p = subprocess.run([sys.executable, "-OO", "-X", "dev", "-W", "error::UserWarning",
                        str(tmp_path / "drv.py")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["spawn", "2", "True", "raised",
                                "forkserver", "2", "True", "raised"]


UNCLOSED_SCRIPT = """
import asyncio
import actorshm

@actorshm.actor
class Sum:
    def total(self, a):
        return float(a.sum())

async def main():
    rt = actorshm.Runtime(start_method="forkserver")
    await rt.__aenter__()  # (left open, as a notebook's runtime is)
    print(await (await Sum.spawn()).total(actorshm.zeros(3)))

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_driver_that_exits_with_its_runtime_open_ends_the_fork_server_quietly(tmp_path):
    (tmp_path / "drv.py").write_text(UNCLOSED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(actorshm.__file__)))
    p = subprocess.run([sys.executable, str(tmp_path / "drv.py")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "0.0\n", p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]


@pytest.mark.skipif((3, 13) <= sys.version_info[:3] < (3, 13, 3), reason=(
    "CPython 3.13.0-3.13.2: with the working directory deleted, reading a missing "
    "attribute of any module raises SystemError (python/cpython#130932): `import "
    "socket` fails before actorshm runs"))
def test_a_driver_whose_working_directory_was_deleted_starts_actors(tmp_path):
    # (os.getcwd() raised a bare FileNotFoundError from every spawn)
    (tmp_path / "drv.py").write_text(FLAGS_SCRIPT)
    gone = tmp_path / "gone"
    gone.mkdir()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(actorshm.__file__)))
    code = f"import os, runpy; os.rmdir({str(gone)!r}); runpy.run_path(" \
           f"{str(tmp_path / 'drv.py')!r}, run_name='__main__')"
    p = subprocess.run([sys.executable, "-c", code], cwd=gone, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[::4] == ["spawn", "forkserver"]


SHOUT_SCRIPT = """
import time
import actorshm

@actorshm.actor
class Shout:
    def shout(self):
        print("from the actor")
        time.sleep(0.5)

async def main():
    for method in ("spawn", "forkserver"):
        async with actorshm.Runtime(start_method=method):
            await (await Shout.spawn()).shout()
            print("then the driver")

if __name__ == "__main__":
    actorshm.run(main())
"""


def test_actor_output_comes_a_line_at_a_time_under_isolated_mode(tmp_path):
    # -I (and -E) make actors ignore PYTHONUNBUFFERED: their output came at their exit
    (tmp_path / "drv.py").write_text(SHOUT_SCRIPT)
    code = f"import runpy, sys; sys.path.insert(0, " \
           f"{os.path.dirname(os.path.dirname(actorshm.__file__))!r}); " \
           f"runpy.run_path({str(tmp_path / 'drv.py')!r}, run_name='__main__')"
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln.split(") ")[-1] for ln in p.stdout.splitlines()]
    assert lines == ["from the actor", "then the driver"] * 2, p.stdout


async def test_a_start_that_times_out_says_where_the_actor_was(tmp_path, start_method):
    # "did not start within 1.0 s" alone: nothing said whether its module's import or
    # its __init__ hung, nor where
    from actors import SlowStart
    marker = tmp_path / "slow"
    marker.write_text("x")
    async with actorshm.Runtime(start_method=start_method, start_timeout=1.0,
                                shutdown_grace=1.0):
        with pytest.raises(ActorDiedError, match=r"(?s)did not start within 1\.0 s .*sets "
                                                 r"the limit\)\. Where it was .*"
                                                 r"actors\.py\", line \d+ in __init__"):
            await asyncio.wait_for(SlowStart.spawn(str(marker), 30.0), 30)


async def test_start_timeout_counts_the_fork_and_init_together(tmp_path):
    # With the fork server, the fork's wait and __init__'s each had the whole
    # start_timeout: a spawn could take nearly twice the limit and succeed.
    import time
    from actors import SlowStart
    marker = tmp_path / "slow"
    async with actorshm.Runtime(start_method="forkserver", start_timeout=3.0,
                                shutdown_grace=1.0) as rt:
        await SlowStart.spawn(str(marker), 0.0)  # (the server is up; a quick start)
        server = rt._forkserver._fs[0].pid
        marker.write_text("x")  # the next __init__ takes 2 s
        os.kill(server, signal.SIGSTOP)  # and the fork 2 s before it
        asyncio.get_running_loop().call_later(2.0, os.kill, server, signal.SIGCONT)
        t0 = time.monotonic()
        with pytest.raises(ActorDiedError, match="did not start within 3.0 s"):
            await asyncio.wait_for(SlowStart.spawn(str(marker), 2.0), 30)
        assert time.monotonic() - t0 < 10
