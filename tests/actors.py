"""Actor classes the tests spawn. Kept free of pytest so actor processes import it fast."""

import asyncio
import atexit
import errno
import functools
import os
import signal
import sys
import threading
import time

import numpy as np

import actorshm
from actorshm import actor



try:
    _ExceptionGroup = ExceptionGroup
except NameError:  # Python 3.10: the backport, which the package depends on there
    from exceptiongroup import ExceptionGroup as _ExceptionGroup

@actor
class Counter:
    def __init__(self, start=0):
        self.n = start
        self.log = []

    def start_program(self, *argv):
        import subprocess
        self.program = subprocess.Popen(argv)
        return self.program.pid

    def wait_program(self, timeout):
        return self.program.wait(timeout)

    def incr(self, k=1):
        self.n += k
        return self.n

    def first(self, a):
        return float(a[0])

    def raise_with_a_pipe_end(self):
        import multiprocessing
        self.pipe = multiprocessing.Pipe()
        raise ValueError("boom", self.pipe[0])

    def pipe_works(self):
        self.pipe[0].send(1)
        return self.pipe[1].recv()

    def record(self, i):
        self.log.append(i)
        return i

    def get_log(self):
        return list(self.log)

    def logged_stream(self, n):
        self.log.append("stream")
        yield from range(n)

    def slow_record(self, i, delay):
        time.sleep(delay)
        self.log.append(i)
        return i

    def stall(self, seconds):
        """Return at once, then hold the event loop for ``seconds``, outside any call:
        the calls made meanwhile are then read together."""
        asyncio.get_running_loop().call_soon(time.sleep, seconds)

    async def async_record(self, i, delay):
        await asyncio.sleep(delay)
        self.log.append(i)
        return i

    def pid_(self):
        return os.getpid()

    def echo(self, x):
        return x

    def say(self, text):
        print(text)
        print("err:" + text, file=sys.stderr)
        return True


class CustomError(Exception):
    pass


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")
        self.lock = threading.Lock()  # (cannot be pickled: the error comes as RemoteError)


class KwOnlyError(Exception):
    """Pickle rebuilds an exception with ``cls(*args)``: each of these refuses that."""

    def __init__(self, *, code):
        super().__init__(f"code={code}")
        self.code = code


class NoArgsError(Exception):
    def __init__(self):
        super().__init__("a fixed message")


class TwoArgsError(ValueError):
    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")
        self.a, self.b = a, b


class FormatsError(Exception):
    """``cls(*args)`` works, and formats the message again: ``code=code=4``."""

    def __init__(self, code):
        super().__init__(f"code={code}")
        self.code = code


class PathError(FileNotFoundError):
    """An ``OSError`` whose ``errno``, ``strerror`` and ``filename`` are not in ``args``'s
    order an ``__init__`` of its own takes back."""

    def __init__(self, *, path):
        super().__init__(errno.ENOENT, "no such thing", path)


class SlotsError(Exception):
    __slots__ = ("code",)

    def __init__(self, *, code):
        super().__init__(f"code={code}")
        self.code = code


class NewKwError(Exception):
    def __new__(cls, *, code):
        return super().__new__(cls)

    def __init__(self, *, code):
        super().__init__(f"code={code}")
        self.code = code


class RefusesReduceError(Exception):
    def __reduce__(self):
        raise TypeError("not pickled by its __reduce__")


class BigKwError(ValueError):
    def __init__(self, *, data):
        super().__init__("payload", data)


@actor
class Starter:
    """Starts processes, as a method that runs a DataLoader or a tool would."""

    def tree(self, ignore_sigterm=False):
        """A child that starts a grandchild: their pids. ``ignore_sigterm``: the child
        ignores SIGTERM (it must be SIGKILLed)."""
        import subprocess
        code = ("import signal, subprocess, time\n"
                + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_sigterm else "")
                + "p = subprocess.Popen(['sleep', '60'])\n"
                  "print(p.pid, flush=True)\n"
                  "time.sleep(60)\n")
        self.child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        return self.child.pid, int(self.child.stdout.readline())

    def detached(self):
        """A program that leaves the actor's process group on purpose."""
        import subprocess
        return subprocess.Popen(["sleep", "60"], start_new_session=True).pid

    def exit(self, code):
        os._exit(code)

    def child_with_a_slow_sigterm(self, path):
        """A child whose SIGTERM handler takes 0.3 s, then writes ``path``: its pid."""
        import subprocess
        code = ("import signal, sys, time\n"
                "def term(*_):\n"
                "    time.sleep(0.3)\n"
                f"    open({path!r}, 'w').write('ran')\n"
                "    sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, term)\n"
                "print('ready', flush=True)\n"
                "while True:\n"
                "    time.sleep(1)\n")
        self.slow_child = subprocess.Popen([sys.executable, "-c", code],
                                           stdout=subprocess.PIPE, text=True)
        self.slow_child.stdout.readline()
        return self.slow_child.pid

    def pool(self, n):
        """A multiprocessing pool (which replaces workers that die): their pids."""
        import multiprocessing as mp
        self.mp_pool = mp.get_context("fork").Pool(n)
        return [p.pid for p in self.mp_pool._pool]

    def late_forker(self):
        """A shell that starts a program when it gets SIGTERM: its pid."""
        import subprocess
        self.shell = subprocess.Popen(
            ["sh", "-c", "trap 'sleep 61 &' TERM; sleep 60 & wait; wait"])
        time.sleep(0.2)  # (its trap set)
        return self.shell.pid

    def has_children(self):
        """Whether this process has a child (what ``os.wait()`` would wait for)."""
        try:
            os.waitpid(-1, os.WNOHANG)
            return True
        except ChildProcessError:
            return False

    def hold_gil(self, seconds):
        """Sleep in a C call that keeps the GIL."""
        import ctypes
        ctypes.PyDLL(None).sleep(int(seconds))

    def open_terminal(self):
        """What opening the controlling terminal and setting it up gives here."""
        import termios
        try:
            fd = os.open("/dev/tty", os.O_RDWR)
        except OSError as exc:
            return type(exc).__name__
        try:
            termios.tcsetattr(fd, termios.TCSANOW, termios.tcgetattr(fd))
            return "ok"
        finally:
            os.close(fd)

    def shm_child(self, ignore_sigterm):
        """A multiprocessing child that makes a shared-memory segment: its name."""
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.mp_child = ctx.Process(target=make_segment, args=(q, ignore_sigterm))
        self.mp_child.start()
        return q.get(timeout=60)


def make_segment(q, ignore_sigterm):  # (a multiprocessing child of ``Starter``)
    from multiprocessing import shared_memory
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seg = shared_memory.SharedMemory(create=True, size=4096)
    q.put(seg.name)
    time.sleep(60)


@actor
class Faulty:
    async def stream(self, n):
        for i in range(n):
            yield i

    def nested(self, depth):
        deep = inner = []
        for _ in range(depth):
            inner.append([])
            inner = inner[0]
        return deep

    def __init__(self, fail=False):
        if fail == "exit":
            sys.exit(3)
        if fail:
            raise KeyError("init failed on purpose")

    def interrupt(self):
        raise KeyboardInterrupt("pressed in the actor")

    def interrupt_stream(self):
        yield 1
        raise KeyboardInterrupt("pressed in the stream")

    def raise_base_error(self, kind):
        raise {"genexit": GeneratorExit("raised by the method"),
               "group": BaseExceptionGroup("a group", [KeyboardInterrupt("in a group")])}[kind]

    def exit_in_stream(self, code):
        yield 1
        sys.exit(code)

    def base_error_stream(self, kind):
        yield 1
        raise {"genexit": GeneratorExit("raised by the generator"),
               "group": BaseExceptionGroup("a group", [KeyboardInterrupt("in a group")])}[kind]

    def call_in_a_forked_child(self, other):
        """What a child forked from this actor hears when it calls ``other`` (as a
        DataLoader worker whose dataset holds a handle would)."""
        return call_in_a_forked_child(lambda: other.incr(100))

    async def incr_on(self, other):
        return await other.incr()

    def relay_in_a_forked_childs_runtime(self, x):
        """Keep ``x``; fork a child that opens a runtime of its own and passes ``x`` to
        an actor of it (the child is no actor: it must tell this actor's upstream
        nothing): what that actor read."""
        self.kept = x
        return own_runtime_in_a_forked_child(lambda c: c.first(x))

    def fork_and_return(self):
        return os.fork()  # the child returns too, into actorshm's code

    def fork_and_exit(self):
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the child leaves with SystemExit, through actorshm's code
        return pid

    def fork_in_stream(self):
        yield os.fork()  # the child yields too

    def breaking(self, kind):
        return BreaksOnArrival(kind)  # its unpickling in the driver raises

    def breaking_items(self, kind):
        yield 1
        yield BreaksOnArrival(kind)

    def close_stdout(self):
        sys.stdout.close()
        return True

    def value_error(self):
        raise ValueError("bad value")

    def custom(self):
        raise CustomError("custom")

    def unpicklable(self):
        raise Unpicklable(1, 2)

    def not_rebuilt_by_init(self, which):
        raise {"kw": lambda: KwOnlyError(code=4), "none": NoArgsError,
               "two": lambda: TwoArgsError(1, 2)}[which]()

    def raise_plain_group(self):
        """An ExceptionGroup raised as it is (the backport's, on Python 3.10)."""
        raise _ExceptionGroup("grp", [TwoArgsError(1, 2), KeyError(5)])

    async def raise_group(self):
        """What a TaskGroup raises when its tasks fail: an ExceptionGroup, nested here."""
        async def fail(exc):
            raise exc
        async with asyncio.TaskGroup() as tg:
            tg.create_task(fail(TwoArgsError(1, 2)))
            tg.create_task(fail(ExceptionGroup("inner", [KwOnlyError(code=4), KeyError(5)])))

    def rebuilt_by_state(self, which):
        raise {"formats": lambda: FormatsError(4), "path": lambda: PathError(path="/x"),
               "slots": lambda: SlotsError(code=4), "new": lambda: NewKwError(code=4),
               "reduce": lambda: RefusesReduceError("refused")}[which]()

    def crash(self):
        os.kill(os.getpid(), signal.SIGSEGV)

    def exit(self, code):
        sys.exit(code)

    def hang(self):
        time.sleep(60)

    def exit_later(self, delay):
        time.sleep(delay)
        os._exit(3)

    def call(self, fn, *args):
        return fn(*args)

    def ok(self):
        return "ok"

    def bad_result(self):
        return threading.Lock()

    def made_by_mistake(self, kind):
        """A result the method meant to stream or await (the caller gets a TypeError)."""
        async def agen():
            yield 1
        return {"generator": lambda: (i for i in range(3)), "async generator": agen,
                "coroutine": lambda: asyncio.sleep(0, "slept")}[kind]()


@actor(max_concurrency=4)
class Concurrent:
    def __init__(self):
        self.active = 0
        self.peak = 0

    async def work(self, delay):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(delay)
        self.active -= 1
        return self.peak

    def blocking(self, delay):
        time.sleep(delay)
        return threading.get_ident()

    async def ping(self):
        return "pong"

    def peak_(self):
        return self.peak


@actor
class Caller:
    """Calls other actors through handles it was given."""

    def __init__(self, other=None):
        self.other = other

    async def call_other(self, k):
        return await self.other.incr(k)

    async def call_handle(self, handle, k):
        return await handle.incr(k)

    async def call_method(self, method, *args):
        return await method(*args)

    async def link_behind_a_held_spawn(self, counter, marker, path):
        """Spawn a ``Marker`` given an unfinished call as its argument (the spawn is
        held on the connection to the driver until that call's result is in), and
        meanwhile make the first call to ``marker`` (a new link), opening a file as it
        goes (it would take the number of a socket end closed too early)."""
        result = counter.async_record(1, 3.0)
        spawn = asyncio.ensure_future(Marker.spawn(result))
        await asyncio.sleep(0.05)
        call = marker.mark(path)
        with open(os.devnull) as _file:
            pid = await asyncio.wait_for(call, 20)
            waited = result.done()  # (whether the call waited for the held one)
            await asyncio.wait_for(spawn, 20)
        return pid, waited

    async def link_after_a_failed_ask(self, marker, path):
        """Call ``marker`` while asking the driver for the link fails (out of memory as
        the ask is encoded), then call it again: what the second call returns."""
        from actorshm import _serialization
        encode = _serialization.encode

        def failing(obj, conn):
            if type(obj) is tuple and obj and obj[0] == "__connect__":
                raise MemoryError("no memory for the ask")
            return encode(obj, conn)
        _serialization.encode = failing
        try:
            try:
                marker.mark(path)
            except MemoryError:
                pass
        finally:
            _serialization.encode = encode
        return await asyncio.wait_for(marker.mark(path), 20)

    def call_then_block(self, method, path, seconds):
        """Call ``method(path)`` (a ``Marker.mark``) without waiting for it, then block
        this actor's event loop for up to ``seconds``: whether the call ran meanwhile."""
        method(path)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if os.path.exists(path):
                return True
            time.sleep(0.01)
        return False

    def pid_of(self, handle):
        return handle.pid

    def echo_handle(self, handle):
        return handle

    def ping(self):
        return os.getpid()

    def links_to(self, actor_id):
        """How many links this actor holds to actor ``actor_id`` (open or ending)."""
        from actorshm import _client
        w = _client.current_worker()
        return sum(c.peer_id == actor_id and not c.closed
                   for c in (*w.peers.values(), *w.peers_leaving))

    async def call_times(self, method, n, gap):
        """``method()`` ``n`` times, ``gap`` seconds apart, on actor ``method``'s
        actor: (the links to it open after the last, how many calls failed)."""
        calls = []
        for _ in range(n):
            calls.append(method())
            await asyncio.sleep(gap)
        links = self.links_to(method._actor_id)
        done = await asyncio.gather(*calls, return_exceptions=True)
        return links, sum(isinstance(r, actorshm.ActorDiedError) for r in done)

    async def hit_other_times(self, k):
        """``other.hit()`` ``k`` times, one after another: each pid, or "died"."""
        out = []
        for _ in range(k):
            try:
                out.append((await asyncio.wait_for(self.other.hit(), 10))[2])
            except actorshm.ActorDiedError:
                out.append("died")
        return out

    async def crash_other_then_hit(self, k):
        """Crash ``other`` (its death seen here first: our link to it breaks), then
        ``hit_other_times(k)``."""
        try:
            await self.other.crash()
        except actorshm.ActorDiedError:
            pass
        return await self.hit_other_times(k)

    async def hit_other(self):
        """``other.hit()``'s pid, and what ``other.pid`` says afterwards."""
        return (await self.other.hit())[2], self.other.pid

    def block_on(self, handle, k=1):  # a Ray habit, in a sync method
        return handle.incr(k).result(timeout=2)

    def return_unfinished(self, handle):
        return handle.incr(1)

    async def by_name(self, name, k):
        h = await actorshm.get_actor(name)
        return await h.incr(k)

    async def spawn_child(self, start):
        c = await Counter.spawn(start)
        return c, await c.incr(1)

    async def spawn_cancelled(self, wait, block):
        """Spawn a Counter and cancel the spawn after ``wait`` s; with ``block`` the event
        loop is held meanwhile, so a reply that came is still unread at the cancel."""
        t = asyncio.ensure_future(Counter.spawn(0))
        await asyncio.sleep(0)  # (the spawn is asked for)
        if block:
            time.sleep(wait)
        else:
            await asyncio.sleep(wait)
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            return "cancelled"
        return "spawned"

    async def spawn_slow(self, marker, n):
        """Spawn ``n`` SlowStart actors whose ``__init__`` takes 10 s (``marker`` exists)."""
        return await asyncio.gather(*(SlowStart.spawn(marker, 10.0) for _ in range(n)))

    def make_handle_list(self):
        return [self.other]

    def return_unawaited(self, k):
        return self.other.slow_record(k, 0.5)  # (forgot to await it)


class CancelsPickling:
    def __reduce__(self):
        raise asyncio.CancelledError("a __reduce__ raised CancelledError")


class CancelsPicklingError(Exception):
    def __reduce__(self):
        raise asyncio.CancelledError("a __reduce__ raised CancelledError")


class InterruptsPicklingError(Exception):
    def __reduce__(self):
        raise KeyboardInterrupt("a __reduce__ raised KeyboardInterrupt")


class InterruptsPickling:
    def __reduce__(self):
        raise KeyboardInterrupt("a __reduce__ raised KeyboardInterrupt")


class Box:
    """An object that pickles as its ``__dict__``."""

    def __init__(self, x):
        self.x = x


@actor
class Arrays:
    def __init__(self):
        self.kept = None

    def breaking_with_array(self, n, kind="error"):
        """A result that cannot be rebuilt in the driver, an array of ours in its state."""
        return BreaksOnArrival(kind, payload=actorshm.zeros(n))

    def fill(self, a, value):
        a[...] = value
        return None

    def between(self, x):
        """The memory between the elements of 1-D ``x`` (its stride twice its items)."""
        full = np.lib.stride_tricks.as_strided(x, (2 * len(x) - 1,), (x.strides[0] // 2,))
        return full[1::2].tolist()

    def echo(self, x):
        return x

    def parts(self, *xs):
        return list(xs)

    def add_one(self, a):
        a += 1
        return a

    def make(self, shape, value, dtype="float64"):
        a = actorshm.empty(shape, dtype)
        a[...] = value
        return a

    def make_ordinary(self, n):
        return np.full(n, 7.0)

    def keep(self, a):
        self.kept = a
        return True

    def sum_kept(self):
        return float(self.kept.sum())

    def drop(self):
        self.kept = None
        return True

    def write_slice(self, a, start, stop, value):
        a[start:stop] = value
        return True

    def sum(self, a):
        return float(np.asarray(a).sum())

    def info(self, a):
        return (a.shape, str(a.dtype), a.strides, a.flags.c_contiguous,
                a.flags.f_contiguous, actorshm.is_shared(a), a.flags.writeable)

    def stats(self):
        return actorshm.stats()

    async def wait_blocks_home(self, timeout):
        """Whether every block of ours came back within ``timeout`` s (while we wait)."""
        end = time.monotonic() + timeout
        while actorshm.stats()["blocks_live"]:
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.01)
        return True

    def fd_count(self):
        return len(os.listdir("/proc/self/fd"))

    def regions(self):
        from actorshm import _leases
        return len(_leases._regions)

    def get_kept(self):
        return self.kept

    def pause_gc(self):
        """Leave collecting cycles to later: what an idle actor does."""
        import gc
        gc.disable()

    def unsendable_with(self, a):
        return [a, threading.Lock()]

    def unsendable_deep(self):
        return {"ok": 1, "rows": [2, Box(threading.Lock())]}

    def unsendable_items(self):
        yield 1
        yield {"ok": 1, "rows": [2, Box(threading.Lock())]}

    def cancels_pickling(self, what):
        """A result, or an error, whose pickling raises CancelledError (KeyboardInterrupt:
        ``what`` "interrupt")."""
        if what == "error":
            raise CancelsPicklingError("raised")
        if what == "interrupt":
            raise InterruptsPicklingError("raised")
        if what == "interrupting result":
            return {"rows": [1, InterruptsPickling()]}
        return CancelsPickling()

    async def cancels_pickling_async(self):
        return CancelsPickling()

    def cancels_pickling_items(self):
        yield 1
        yield CancelsPickling()

    async def make_and_lend(self, others, n, value):
        """A new array, lent to each of ``others`` (actor to actor) and returned."""
        a = actorshm.empty(n)
        a[...] = value
        for other in others:
            await other.keep(a)
        return a

    async def sum_kept_at(self, other):
        return await other.sum(self.kept)

    async def lend_kept(self, other):
        return await other.keep(self.kept)

    async def bounce(self, a, other):
        """Pass ``a`` to ``other``, which hands it straight back."""
        b = await other.echo(a)
        return float(b.sum())

    def quarantined(self):
        return actorshm.stats()["blocks_quarantined"]

    def exit(self, code):
        sys.exit(code)

    def labelled(self, value):
        a = actorshm.empty(3)
        a[:] = value
        return ("label", value, a)  # shaped like a call: (str, scalar, array)

    async def lend_kept_behind_a_full_socket_then_die(self, other, nbytes):
        """Fill our socket to the driver, pass the driver's block on, then die."""
        from actorshm import _client, _serialization
        driver = _client._worker[0].driver
        _serialization.SPILL_MIN = 1 << 40  # (big messages through the socket)
        driver.call("echo_to_nobody", (b"x" * nbytes,), {})  # the driver is not reading
        await asyncio.sleep(0.05)
        assert driver._writing, "the socket to the driver did not fill up"
        await other.keep(self.kept)
        self.kept = None
        os._exit(1)


@actor
class Probe:
    """Reports what its process sees."""

    def env(self, name):
        return os.environ.get(name)


@actor(max_restarts=1)
class Phoenix:
    def __init__(self, tag):
        self.tag = tag
        self.calls = 0

    def hit(self):
        self.calls += 1
        return (self.tag, self.calls, os.getpid())

    def hits(self, k):
        for _ in range(k):
            yield self.hit()

    def nap(self, seconds):
        time.sleep(seconds)

    def crash(self):
        os._exit(9)


@actor(max_restarts=1)
class SlowStart:
    """Its __init__ takes ``delay`` seconds while ``marker`` exists (a slow restart)."""

    def __init__(self, marker, delay=2.0):
        if os.path.exists(marker):
            time.sleep(delay)
        self.log = []

    def rec(self, x):
        self.log.append(x)
        return x

    def getlog(self):
        return self.log


@actor(max_restarts=3)
class FlakyStart:
    """Its __init__ crashes the process once while ``marker`` exists (then removes it)."""

    def __init__(self, marker, once=True, raises=False):
        if os.path.exists(marker):
            if raises:
                raise KeyError("this start fails on purpose")
            if once:
                os.remove(marker)
            os._exit(3)
        self.pid = os.getpid()

    def crash(self):
        os._exit(9)

    def ping(self):
        return os.getpid()


@actor(max_concurrency=2)
class ThreadedCaller:
    """Sync methods run in threads here; they may block on calls to other actors."""

    def call_and_wait(self, handle, k):
        return handle.incr(k).result(timeout=10)

    def group_and_wait(self, group, value):
        return group.work(value).result(timeout=10)


from dataclasses import dataclass  # noqa: E402


@dataclass
class Batch:
    """A dataclass holding arrays, as users pass them."""
    x: np.ndarray
    y: np.ndarray
    step: int


class Holder:
    """A plain object holding an array."""

    def __init__(self, arr):
        self.arr = arr


def _lookup(mapping, key):
    return mapping[key]


class BreaksOnArrival:
    """Pickles fine here; unpickling it in another process raises RuntimeError (or,
    given ``kind``, a CancelledError, GeneratorExit, KeyboardInterrupt or SystemExit)."""

    def __init__(self, kind="error", payload=None):
        self.pid = os.getpid()
        self.kind = kind
        self.payload = payload  # (what its state holds as it fails to arrive)

    def __setstate__(self, state):
        if state["pid"] != os.getpid() and state.get("kind") == "chained":
            try:  # (a helper's frame, holding the state, in the error's context)
                _lookup(state, "missing")
            except KeyError:
                raise RuntimeError("cannot be rebuilt in another process")
        if state["pid"] != os.getpid():
            raise {"error": RuntimeError("cannot be rebuilt in another process"),
                   "cancel": asyncio.CancelledError("raised while unpickling"),
                   "genexit": GeneratorExit(), "kbi": KeyboardInterrupt("unpickling"),
                   "exit": SystemExit(7)}[state.get("kind", "error")]
        self.__dict__.update(state)


@actor(max_concurrency=2)
class Dying:
    async def hang(self):
        await asyncio.sleep(60)

    async def slow_finally(self, seconds):
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(seconds)

    def exit_now(self):
        sys.exit(0)

    def ping(self):
        return os.getpid()

    async def call_in_finally(self, method, seconds):
        """Wait; as it is cancelled (its actor stops), call ``method()``, then take
        ``seconds`` more."""
        try:
            await asyncio.sleep(60)
        finally:
            await method()
            await asyncio.sleep(seconds)

    async def reply_then_exit(self, value, code):
        asyncio.get_running_loop().call_later(0.01, os._exit, code)
        return value

    async def big_reply_then_exit(self, code):
        from actorshm import _serialization
        _serialization.SPILL_MIN = 1 << 40  # through the socket: a reply read in many reads
        asyncio.get_running_loop().call_later(0.01, os._exit, code)
        return b"x" * (4 << 20)


@actor
class EnvReader:
    def get(self, names):
        import os
        return {n: os.environ.get(n) for n in names}

    def startup(self):
        """What Python set up from its environment as it started."""
        return sys.stdout.encoding, hash("actorshm")

    def blas_threads(self):
        """The thread counts of the BLAS libraries numpy loaded here (threadpoolctl)."""
        import numpy  # noqa: F401  (loaded, so that its BLAS is listed)
        import threadpoolctl
        return sorted({i["num_threads"] for i in threadpoolctl.threadpool_info()
                       if i["user_api"] == "blas"})


@actor
class LookupFails:
    """Looking up its method ``boom`` raises (a ``__getattribute__`` of its own)."""

    def __getattribute__(self, name):
        if name == "boom":
            raise LookupError(f"no {name} today")
        return object.__getattribute__(self, name)

    def boom(self):
        return "boom"

    def ok(self, x):
        return x


@actor
class Staggered:
    """Members of one group spawn take turns (files ``path.0``, ``path.1``, ...): those
    from turn ``slow_from`` on sleep ``delay`` seconds in ``__init__``."""

    def __init__(self, path, slow_from, delay):
        turn = 0
        while True:
            try:
                os.close(os.open(f"{path}.{turn}", os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                turn += 1
        if turn >= slow_from:
            time.sleep(delay)


@actor(max_concurrency=8)
class PoolWorker:
    """For pools and groups: counts how many of its calls run at once."""

    def __init__(self, tag=0, init_delay=0.0):
        self.started = time.time()
        time.sleep(init_delay)
        self.init_done = time.time()
        self.tag = tag
        self.active = 0
        self.peak = 0
        self.calls = 0

    async def work(self, value, delay=0.0):
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.calls += 1
        try:
            await asyncio.sleep(delay)
            return (self.tag, value)
        finally:
            self.active -= 1

    def counts(self):
        return {"peak": self.peak, "calls": self.calls, "active": self.active}

    def init_times(self):
        return (self.started, self.init_done)

    async def fail_if(self, value, bad, delay=0.0):
        await asyncio.sleep(delay)
        if value == bad:
            raise ValueError(f"bad value {value}")
        return value

    def fail_if_tag(self, tag):
        if tag == self.tag:
            raise ValueError(f"tag {tag} fails")
        return self.tag

    def die_if(self, value, bad):
        if value == bad:
            os._exit(7)
        return value

    def write_at(self, a, i, value):
        a[i] = value
        return actorshm.is_shared(a)

    def sum(self, a):
        return float(a.sum())

    def aliases(self, v):
        """Whether what was one object twice in ``[x, x, [l, l], cycle]`` still is."""
        return v[0] is v[1], v[2][0] is v[2][1], v[3][1] is v[3]

    def stats(self):
        return actorshm.stats()

    async def broadcast(self, group, value):
        """Use a group and a pool of other actors from inside this actor."""
        pool = actorshm.ActorPool(list(group))
        mapped = [r async for r in pool.map(lambda a, v: a.work(v), range(3))]
        return await group.work(value), mapped


@actor
class PoolOwner:
    """Keeps an ActorPool of other actors across calls."""

    def __init__(self, members):
        self.pool = actorshm.ActorPool(members)

    async def run(self, values):
        """The values mapped on the pool, or the error that ended the map; the pool's size."""
        try:
            out = sorted([r async for r in self.pool.map_unordered(
                lambda a, v: a.work(v), values)])
        except actorshm.ActorDiedError as exc:
            out = f"ActorDiedError: {exc}"
        return out, len(self.pool)

    async def run_on_failed_result(self, dead, n):
        """``n`` items whose value is the failed call of a dead actor: their errors' types
        and the pool's size after them."""
        f = dead.counts()
        try:
            await f
        except actorshm.ActorDiedError:
            pass
        errors = []
        for _ in range(n):
            try:
                await self.pool.submit(lambda a, v: a.work(v), f)
            except Exception as exc:
                errors.append(type(exc).__name__)
        return errors, len(self.pool)


@actor
class InitFailsOnce:
    """The first of several to create ``path`` fails in ``__init__``; the others start."""

    def __init__(self, path):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        raise KeyError("the first one fails on purpose")

    def ping(self):
        return os.getpid()


@actor
class Named:
    def __init__(self, label):
        self.label = label

    def name(self):
        return self.label

    def actor_id(self):
        return 42


@actor
class Shell:
    """Starts programs the way user code does."""

    def driver_socket_inherited(self):
        import subprocess
        import sys
        fd = int(sys.argv[1])  # the actor's socket to the driver
        out = subprocess.run(["sh", "-c", "ls /proc/$$/fd"], close_fds=False,
                             capture_output=True, text=True).stdout.split()
        return fd, str(fd) in out

    def write(self, text):
        import sys
        sys.stdout.write(text)
        sys.stdout.flush()
        return len(text)


@actor
class BigInitError:
    """``__init__`` raises an error whose message is ``n`` bytes long."""

    def __init__(self, n):
        raise ValueError("x" * n)

    def ok(self):
        return "ok"


@actor
class Oversized:
    """Replies that cannot be sent as they are (the frame limit lowered in the actor)."""

    def lower_frame_limit(self, n):
        from actorshm import _encoding, _framing, _remote_errors
        _framing.MAX_FRAME = n
        _encoding.MAX_MESSAGE = _remote_errors.MAX_MESSAGE = n
        return True

    def lower_framing_limit_only(self, n):
        from actorshm import _framing
        _framing.MAX_FRAME = n  # the serializer's own check passes: the frame writer fails
        return True

    def raise_big(self, n):
        raise ValueError("payload", np.ones(n, np.uint8))

    def raise_big_kw(self, n):
        raise BigKwError(data=np.ones(n, np.uint8))  # its __init__ takes no message

    async def araise_big(self, n):
        raise ValueError("payload", np.ones(n, np.uint8))

    def call(self, fn, *args):
        return fn(*args)

    def ok(self):
        return "ok"


@actor(max_concurrency=2)
class Quirks:
    """Methods that end in ways a future cannot simply carry."""

    def __init__(self):
        self.job = None

    def stop_iteration(self):
        return next(iter([]))  # a StopIteration out of a sync method

    async def own_cancel(self):
        raise asyncio.CancelledError("raised by the method itself")

    async def wait_job(self):
        self.job = asyncio.ensure_future(asyncio.sleep(60))
        return await self.job  # CancelledError once stop_job cancels the job

    async def stop_job(self):
        self.job.cancel()
        return True

    async def stream_own_cancel(self):
        yield 1
        raise asyncio.CancelledError("raised in the stream")

    def ping(self):
        return "pong"


@actor
class WithoutTorch:
    """An actor whose process cannot import torch (as where torch is not installed)."""

    def __init__(self):
        sys.modules["torch"] = None  # ``import torch`` raises ImportError from now on

    def kind(self, x):
        return type(x).__name__

    def ping(self):
        return "alive"


@actor(max_concurrency=2)
class CalledBack:
    """Calls an actor that calls it back, from a sync method, over the same connection."""

    async def run(self, other, me, arr):
        return await other.call_then_wait(me, arr)

    async def mark(self, arr):
        arr[0] = 1.0


@actor
class CallsBack:
    def call_then_wait(self, other, arr):
        other.mark(arr)  # not awaited: it goes now, though this method holds the loop
        deadline = time.monotonic() + 5
        while arr[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return float(arr[0])


class SubCounter(Counter):
    """A subclass of an actor class, not decorated itself: it spawns as Counter does."""

    def kind(self):
        return type(self).__name__


@actor
class TaskFactorySetter:
    """Sets a task factory on its own loop that fails, as ``asyncio.eager_task_factory``
    does under uvloop on Python 3.13."""

    async def break_tasks(self):
        def factory(loop, coro, **kw):
            raise TypeError("this factory makes no tasks")
        asyncio.get_running_loop().set_task_factory(factory)

    async def aping(self, x):
        return x

    def ping(self, x):
        return x

    def agen(self):
        yield 1


@actor(max_concurrency=2)
class ThreadLoopUser:
    """Uses the runtime from a thread's own event loop (``asyncio.run`` in a sync
    method, which runs in a thread of its own when max_concurrency > 1)."""

    def spawn_find_kill(self, name):
        async def go():
            h = await Counter.options(name=name).spawn(5)
            same = await actorshm.get_actor(name)
            n = await same.incr()
            await h.kill()
            return n, h.actor_id
        return asyncio.run(go())

    def kill_and_wait(self, target):
        """``target.kill()`` (a handle or a group) in this thread, with no event loop
        running in it: what it returned, and its result."""
        done = target.kill()
        return type(done).__name__, done.result(timeout=10)


@actor
class Tidy:
    """Leaves traces of its ending, as a program's own clean-up would: what its file
    holds, its ``__del__``, an ``atexit`` function and an async method's ``finally``."""

    def __init__(self, path):
        import logging.handlers
        self.path = path
        self.f = open(path, "w")  # buffered: only closing it writes the lines out
        atexit.register(_mark_collecting, path + ".atexit")
        # A logger that writes only when flushed (logging's own exit function does it)
        log = logging.getLogger(f"tidy.{os.getpid()}")
        log.addHandler(logging.handlers.MemoryHandler(
            100, target=logging.FileHandler(path + ".log", delay=True)))
        log.warning("started")
        # An exit function that runs an event loop of its own, as async clients close
        atexit.register(lambda: asyncio.run(_amark(path + ".async_atexit")))

    def start_background(self):
        async def background():
            try:
                await asyncio.sleep(60)
            finally:
                _mark(self.path + ".background")
        self.background = asyncio.get_running_loop().create_task(background())

    def exit_from_a_task(self, code):
        async def later():
            sys.exit(code)
        self.exiting = asyncio.get_running_loop().create_task(later())

    def slow_exit(self, seconds):
        atexit.register(time.sleep, seconds)  # (registered last: runs first)

    def hang_at_exit(self, close_stderr=False):
        atexit.register(time.sleep, 60)
        if close_stderr:
            sys.stderr.close()
        sys.exit(0)

    def log(self, line):
        self.f.write(line + "\n")

    async def wait(self):
        try:
            await asyncio.sleep(60)
        finally:
            _mark(self.path + ".finally")

    def exit(self, code=0):
        sys.exit(code)

    def ping(self):
        return os.getpid()

    def close_driver_socket(self):
        import socket
        from actorshm import _client
        _client.current_worker().driver.sock.shutdown(socket.SHUT_RDWR)  # (a mistake)

    def make_cycle(self):
        self.me = self  # (now only a garbage collection frees it)
        # Its file stays out of the garbage: a collection finalizes the objects of a
        # cycle in no set order, and the file's lower layers could go before __del__
        # flushes it (as in any program), losing the lines this test looks for.
        _KEPT.append(self.f)

    def numbers(self):
        try:
            yield from range(100)
        finally:
            _mark(self.path + ".stream")

    def slow_del(self, seconds):
        self.del_seconds = seconds

    def __del__(self):
        time.sleep(getattr(self, "del_seconds", 0))  # (holding the event loop)
        self.f.close()
        # (an instance in a reference cycle is collected after atexit, as at a
        # program's end; one that is not, when it is dropped, before)
        _mark(self.path + ".del", "after atexit" if os.path.exists(self.path + ".atexit")
              else "before atexit")


def in_a_forked_child(work):
    """Fork; the child runs ``work()`` and exits: the text of what it returned (of its
    error, if it raised: a RuntimeError's message, else its repr)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            said = str(work())
        except RuntimeError as exc:
            said = str(exc)
        except BaseException as exc:
            said = repr(exc)
        os.write(w, said.encode()[:4000])
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()


def call_in_a_forked_child(call):
    """Fork; in the child, ``call()`` and wait for its answer: what it said (its error's
    text; "answered" if it was answered)."""
    def answered():
        call().result(timeout=5)
        return "answered"

    return in_a_forked_child(answered)


def own_runtime_in_a_forked_child(call=lambda c: c.incr()):
    """Fork; the child opens a runtime of its own and makes ``call(c)`` on a Counter
    (41) of it: what it got."""
    async def main():
        c = await Counter.spawn(41)
        return await call(c)

    return in_a_forked_child(lambda: actorshm.run(main()))


_KEPT = []  # (what ``Tidy.make_cycle`` keeps out of its cycle)


def _mark_collecting(path):
    """An exit function's trace: whether garbage collection runs while it does."""
    import gc
    _mark(path, f"gc {'on' if gc.isenabled() else 'off'}")


@actor
class Marker:
    def __init__(self, value=None):
        self.value = value

    def mark(self, path):
        _mark(path)
        return os.getpid()


def _mark(path, text="ran"):
    with open(path, "w") as f:
        f.write(text)


async def _amark(path):
    await asyncio.sleep(0)
    _mark(path)


def _logged(fn):
    """A decorator as timing and logging ones are written: a plain function wrapper."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def _in_a_thread(fn):
    """An async decorator of a sync function (the async wrapper is the method)."""
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)
    return wrapper


def _as_a_stream(fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        for x in fn(*args, **kwargs):
            yield x
    return wrapper


@actor
class Decorated:
    """Methods made by decorators and descriptors, and class members that are not
    methods."""

    class Config:
        pass

    dtype = float

    def _scale(self, x, k):
        return x * k

    double = functools.partialmethod(_scale, k=2)

    @functools.singledispatchmethod
    def describe(self, x):
        return "something"

    @describe.register
    def _(self, x: int):
        return "an int"

    @_logged
    async def fetch(self, x):
        await asyncio.sleep(0)
        return x + 1

    @_logged
    def count(self, n):
        yield from range(n)

    @property
    def state(self):
        return 1

    @_in_a_thread
    def blocking(self, x):
        return x * 2

    @_as_a_stream
    def items(self):
        return [1, 2, 3]



@actor(max_concurrency=4)
class AtThreadLimit:
    """An actor at its process's limit of threads (``ulimit -u``, a container's pids
    limit): starting one raises as CPython's does there, from ``__init__`` on when
    ``at_start``, else once ``limit()`` ran."""

    def __init__(self, at_start=True):
        if at_start:
            self.limit()

    def limit(self):
        def refuse(thread):
            raise RuntimeError("can't start new thread")
        threading.Thread.start = refuse

    def sync(self, x):
        time.sleep(0.05)
        return x

    async def ping(self):
        return "pong"


@actor
class StdioCloser:
    """Closes its standard streams, as daemon-style code does, then prints."""

    def close_stdio(self):
        for fd in (0, 1, 2):
            os.close(fd)

    def make(self, n):
        return actorshm.zeros(n, dtype=np.uint8)

    def first(self, a):
        return int(a[0])

    def say(self, text):
        for write in (lambda: print(text, flush=True), lambda: os.write(2, text.encode())):
            try:
                write()
            except OSError:  # (EBADF: the stream is closed, as it should be)
                pass

    async def ask(self, other, a):
        return await other.first(a)


def _slow_square(x):
    return x * x


# Its name finds the function it wraps, not itself: pickle refused it by name.
fast_square = functools.lru_cache(maxsize=16)(_slow_square)
