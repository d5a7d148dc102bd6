"""Starting actor processes: the command, the fork-server client, output, GPU slots.

An actor process starts one of two ways (``Runtime(start_method=...)``): ``"spawn"`` runs
a fresh interpreter with ``worker_command()``; ``"forkserver"`` asks a warm fork server
(``_forkserver``, started on first use by ``ForkServerClient``) to fork one. Either way
the child gets one end of a socket pair and runs ``actorshm._actor_process``; its stdout and
stderr come back through pipes that ``OutputForwarder`` copies to the driver's, each
line prefixed with the actor. ``GpuSlots`` hands out the GPUs ``num_gpus`` actors get.
"""

from __future__ import annotations

import array
import asyncio
import collections
import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from . import _descendants, _forkserver, _leases, _shm
from ._output import OutputForwarder  # noqa: F401  (re-exported)
from ._errors import ActorDiedError
from ._serialization import PassFd
from ._util import THREAD_VARS, pipe, socket_pair

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bootstrap(module: str, first: str = "") -> str:
    """``python -c`` code that runs ``actorshm.<module>.main()`` from the driver's own
    copy of actorshm, even where another is installed or in the working directory, and
    then leaves ``sys.path`` as it was (the driver's order is applied later). ``first``:
    code to run before actorshm is imported."""
    # ``python -c`` puts '' (the working directory) first: drop it, so that a file there
    # cannot shadow the standard library before the driver's own path is in place.
    return (f"import sys; sys.path[:1] = [p for p in sys.path[:1] if p]\n{first}"
            f"sys.path.insert(0, {_PKG_PARENT!r}); "
            f"import actorshm.{module} as m; sys.path.remove({_PKG_PARENT!r}); m.main()")


# An actor forks its watchdog before importing actorshm (and numpy, whose BLAS may start
# threads): ``_descendants`` needs only the standard library, so it is loaded by path,
# as the module the package will find when it is imported. Where it is no plain file
# (a .pyc-only or zipped install), ``main()`` starts the watchdog after the imports.
_WATCHDOG_FIRST = (
    "import importlib.util as u\n"
    "try:\n"
    f" s = u.spec_from_file_location('actorshm._descendants', "
    f"{os.path.join(_PKG_PARENT, 'actorshm', '_descendants.py')!r})\n"
    " d = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(d)\n"
    "except OSError:\n"
    " sys.modules.pop('actorshm._descendants', None)\n"
    "else:\n"
    " d.start_watchdog()\n")
_WORKER_CMD = _bootstrap("_actor_process", first=_WATCHDOG_FIRST)


def python_command(code: str, fd: int) -> list[str]:
    """The argv that runs ``python -c code fd`` with the driver's interpreter flags (``-O``,
    ``-W``, ``-X dev``, ``-I``...), as ``multiprocessing`` starts its children: an actor's
    asserts, warnings filters and isolation are the driver's."""
    return [sys.executable, *_flags(), "-c", code, str(fd)]


_flags = getattr(subprocess, "_args_from_interpreter_flags", list)


def worker_command(fd: int) -> list[str]:
    """The argv that starts an actor process on inherited socket ``fd`` ("spawn")."""
    return python_command(_WORKER_CMD, fd)


def check_number(name: str, value: Any, least: float, kind: type, unit: str, *,
                 above: bool = False) -> Any:
    """A Runtime option that must be a number of at least ``least`` (more than it, with
    ``above``), as ``kind``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Runtime({name}=...) must be a number ({unit}), not {value!r}")
    if value != value or value == float("inf"):  # (nan, inf)
        raise ValueError(f"Runtime({name}=...) must be a finite number ({unit}), not "
                         f"{value!r}")
    if not (least < value if above else least <= value):
        raise ValueError(f"Runtime({name}=...) must be {'more than' if above else 'at least'} "
                         f"{least} ({unit}), not {value!r}")
    return kind(value)


def check_start_options(start_method: str, shm_budget: Any) -> int | None:
    """Check ``Runtime``'s ``start_method`` and ``shm_budget`` (on every backend); the
    budget as an int (or None)."""
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', not "
                         f"{start_method!r}" + (": a bare fork deadlocks with threads "
                                                "and cannot re-initialize CUDA"
                                                if start_method == "fork" else ""))
    if shm_budget is None:
        return None
    budget = check_number("shm_budget", shm_budget, _shm.MIN_BUDGET, int,
                          "bytes: room for one 4 MiB arena at least, e.g. 8 << 30")
    if budget > _shm.MAX_BUDGET:  # the shared ledger holds it in an int64
        raise ValueError(f"Runtime(shm_budget=...) must be at most {_shm.MAX_BUDGET} "
                         f"(bytes, 8 EiB), not {shm_budget!r}")
    return budget


class ActorRecord:
    """The driver's view of one actor process (and of its restarts).

    Args:
        actor_id: the runtime's id for the actor.
        cls: its class.
        options: its ``ActorOptions``.
    """

    def __init__(self, actor_id: int, cls: type, options) -> None:
        self.actor_id = actor_id
        self.cls = cls
        self.cls_name = cls.__qualname__
        self.options = options
        self.methods: dict = {}  # set by the runtime (``_actor.public_methods``)
        self.popen: subprocess.Popen | None = None
        self.conn = None  # its ``_protocol.Connection``
        # its ending process's connection (it said it is stopping, or the connection
        # ended), while ``conn`` holds the calls made since for its restart (``_supervise``)
        self.ended_conn = None
        self.pidfd, self.pid, self.alive = -1, 0, False
        self.no_pidfd = False  # pidfds are not to be had (see ``_poll_exit``)
        self.start_stamp: bytes | None = None  # a forked one's start, without pidfds
        self.exit_poll: asyncio.TimerHandle | None = None  # (``_poll_exit``)
        self.death: str | None = None
        self.exited = asyncio.Event()
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        self.stderr_capture: list | None = None  # its stderr lines gathered meanwhile
        self.pipes: list = []
        self.gpus: list[str] = []
        self.spawn_args: tuple = ()
        self.restarts = 0
        self.failed_starts = 0  # restarts in a row whose process died while starting
        self.starting = False  # a restart's process is starting (``_restart`` decides)
        self.spawned = False  # its spawn returned: only then may a death restart it
        self.death_told = False  # its process's death has been reported (``died``)
        self.init_error = None  # what its ``__init__`` raised in the start under way
        self._no_restart = False
        self.probe = None  # the driver's end of its probe socket (``_introspect``)
        self.oom_baseline = None  # its cgroup's OOM kill count when it started
        self.started: float | None = None  # time.monotonic() as its process started
        self.handles = 0  # the driver's handles on it that are alive (``track_handle``)
        self.budget_slot: tuple | None = None  # (SharedBudget, slot) its process charges

    @property
    def no_restart(self) -> bool:
        """Killed (or closing): it will not start again."""
        return self._no_restart

    @no_restart.setter
    def no_restart(self, value: bool) -> None:
        self._no_restart = value
        if value:
            self.spawn_args = ()  # (an argument may hold a large block live)

    def take_spawn_args(self) -> tuple:
        """``(args, kwargs)`` for this start; kept only while a later restart may need
        them, so that a dead actor's record holds no argument (nor its memory)."""
        args, limit = self.spawn_args, self.options.max_restarts
        if limit != -1 and self.restarts >= limit:
            self.spawn_args = ()
        return args

    @property
    def has_future(self) -> bool:
        """Alive, or restarting: its name and handle are still its own."""
        return self.alive or (self.conn is not None and not self.conn.closed
                              and not self.no_restart)

    @property
    def open_conns(self) -> list:
        """Its open connections: its ending process's (``ended_conn``), and the one that
        holds calls for its restart (else its process's)."""
        return [c for c in (self.ended_conn, self.conn) if c is not None and not c.closed]

    @property
    def leaving(self) -> float | None:
        """The seconds its process said its clean-up may take, as it began to stop
        (``LEAVING``: a method's ``sys.exit``, say); None if it has not."""
        conn = self.ended_conn if self.ended_conn is not None else self.conn
        return None if conn is None else conn.leaving

    @property
    def stopping(self) -> bool:
        """Its process said it is stopping (``leaving``)."""
        return self.leaving is not None

    @property
    def label(self) -> str:
        return f"actor {self.cls_name}(id={self.actor_id}, pid={self.pid})"

    @property
    def killed(self) -> str:
        """Its death, once ``kill()`` ended it."""
        return f"{self.label} was killed by actorshm kill()"

    async def stop(self, grace: float) -> None:
        """Ask the actor to stop; after ``grace`` seconds SIGTERM, then SIGKILL; return
        once it has exited."""
        if not self.alive:
            return
        leaving = self.leaving
        if leaving is not None:
            # It stops on its own (its exit code names its death), and has the time it
            # said its clean-up may take.
            grace = max(grace, leaving)
        elif self.death is None:
            self.death = f"{self.label} was stopped because its runtime closed"
        if self.conn is not None and not self.conn.closed:
            self.conn.call("__stop__", (), {}).add_done_callback(_ignore_result)
        for sig, wait in ((None, grace), (signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            if sig is not None:
                self.send_signal(sig)
            try:
                await asyncio.wait_for(self.exited.wait(), wait)
                return
            except asyncio.TimeoutError:
                continue

    def send_signal(self, sig: int) -> bool:
        """Send ``sig`` to its process while the driver has not seen it exit: through its
        pidfd, which names that process alone. Once the exit is seen (the pidfd closed),
        nothing is sent, even while ``alive`` waits for the exit code: the process may
        be reaped (a fork server reaps its children at once) and its number another's.

        Returns:
            Whether it was sent (False: its exit has been seen).
        """
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
                return True
            except ProcessLookupError:
                return False
        elif self.alive and self.no_pidfd and self.pid in _live_pids:  # (``_poll_exit``)
            if self.popen is not None:
                try:
                    self.popen.send_signal(sig)  # (not once it has been reaped)
                    return self.popen.returncode is None
                except ProcessLookupError:
                    return False
            return kill_if_same(self.pid, self.start_stamp, sig)
        return False

    def kill_now(self) -> None:
        """SIGKILL its process and everything in its group (watchdog included) at once,
        if the driver has not seen it exit and it has not been reaped: until then its
        number, and so its group's id, are its own. (Once it is reaped its watchdog,
        which holds the group's id while it lives, ends the group.)"""
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, 0)  # (a zombie still answers)
            except OSError:  # reaped by its fork server: not ours to name (or the fd
                return       # was closed meanwhile, its exit seen: a finalizer's race)
            _descendants.kill_now(self.pid)
        elif self.alive and self.no_pidfd and self.pid in _live_pids:
            same = ((self.popen is not None and self.popen.returncode is None)  # (unreaped)
                    or (self.start_stamp is not None
                        and _descendants.process_start(self.pid) == self.start_stamp))
            if same:
                _descendants.kill_now(self.pid)

    def unwatch_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop watching the process's pidfd (it exited, or is being reaped)."""
        if self.exit_poll is not None:
            self.exit_poll.cancel()
            self.exit_poll = None
        if self.pidfd >= 0:
            try:
                loop.remove_reader(self.pidfd)
            except Exception:  # the loop is closing
                pass
            os.close(self.pidfd)
            self.pidfd = -1

    def close_process(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop watching the (exited or killed) process, reap it, drain its output."""
        self.unwatch_exit(loop)
        if self.pid in _live_pids:  # (its exit was not reported through the pidfd)
            _live_pids.discard(self.pid)
            _leases.process_gone(self.pid)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.popen.kill()
                self.popen.wait()
        for fwd in self.pipes:
            fwd.drain()
            fwd.close()
        self.pipes = []
        self.close_probe()
        self.free_budget_slot()

    def take_budget_slot(self) -> tuple | None:
        """A slot in the runtime's shared budget for the process about to start, as
        ``(fd, slot)`` for its ``__init_actor__`` (None when all are taken: it keeps a
        budget of its own)."""
        self.free_budget_slot()
        shared = _shm.shared_budget()
        slot = shared.take_slot(f"{self.cls_name}(id={self.actor_id})")
        if slot is None:
            return None
        self.budget_slot = (shared, slot)
        return (PassFd(shared.fd), slot)

    def free_budget_slot(self) -> None:
        """Its process exited: its arenas are gone (save what peers still map), and so
        is its charge to the shared budget."""
        if self.budget_slot is not None:
            shared, slot = self.budget_slot
            self.budget_slot = None
            if shared.fd >= 0:  # (not closed with its last runtime)
                shared.free_slot(slot)

    def close_probe(self) -> None:
        """Close the driver's end of the probe socket (the process is gone)."""
        if self.probe is not None:
            self.probe.close()
            self.probe = None


def actor_env(rec: ActorRecord) -> dict:
    """The environment an actor process starts with: the driver's, the actor's options,
    the driver's import path, and its GPUs."""
    env = dict(os.environ)
    cwd = working_directory()
    env.update(rec.options.thread_env())
    env.update(rec.options.env or {})
    # The driver's import path, '' (its working directory, the actor's too) made
    # absolute: the actor imports what the driver would.
    env["ACTORSHM_SYS_PATH"] = json.dumps(
        [os.fspath(p) or cwd for p in sys.path
         if isinstance(p, (str, os.PathLike)) and isinstance(os.fspath(p), str)
         and (os.fspath(p) or cwd)])
    env["PYTHONUNBUFFERED"] = "1"
    # It dies with this process, its parent (a fork server names itself instead).
    env["ACTORSHM_DRIVER_PID"] = env["ACTORSHM_PARENT_PID"] = str(os.getpid())
    if rec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in rec.gpus)
    return env


def working_directory() -> str | None:
    """The driver's working directory, its actors' too; None where it was deleted or may
    not be entered (a driver run as another user from a home it cannot read: ``sudo -u
    svc python job.py`` from ``/root``): an actor then starts where it can, in it still
    when spawned (as the driver did), a fork in the server's."""
    try:
        cwd = os.getcwd()
    except (FileNotFoundError, PermissionError):
        return None
    mine = os.access in os.supports_effective_ids  # (the ids a chdir is checked with)
    return cwd if os.access(cwd, os.X_OK, effective_ids=mine) else None


def fork_failed(exc: OSError) -> OSError:
    """The error of a spawn whose process could not be made, saying why where it is a
    limit on processes (fork's EAGAIN) or on memory."""
    if exc.errno not in (errno.EAGAIN, errno.ENOMEM):
        return exc
    why = ("the limit on processes is reached (ulimit -u for this user, or a "
           "container's pids.max): end processes you no longer need, or raise the limit"
           if exc.errno == errno.EAGAIN else "the system is out of memory")
    return type(exc)(exc.errno, f"cannot start the actor's process: fork failed "
                                f"({exc.strerror}): {why}")


def out_of_fds(exc: OSError) -> OSError:
    """The error of a spawn that found the driver out of file descriptors (``EMFILE``,
    ``ENFILE``), saying so and what to do: a bare "Too many open files" names neither
    whose limit it is nor that each actor holds a few of the driver's fds."""
    if exc.errno not in (errno.EMFILE, errno.ENFILE):
        return exc
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    whose = (f"this process (the driver) is out of file descriptors (its limit, ulimit "
             f"-n, is {limit})" if exc.errno == errno.EMFILE else
             "the system is out of file descriptors (fs.file-max)")
    return type(exc)(exc.errno, f"cannot start the actor's process ({exc.strerror}): "
                                f"{whose}, and each "
                                "actor holds a few of the driver's (its socket, output "
                                "pipes and process handle): kill actors you no longer "
                                "need, close files, or raise the limit")


# What Python reads from the environment only as it starts (its command line's
# "Environment variables"; PYTHONPATH too, as the fork server's path is set by then).
_STARTUP_VARS = frozenset(
    "PYTHON" + v for v in (
        "HASHSEED IOENCODING WARNINGS DEVMODE UTF8 OPTIMIZE DONTWRITEBYTECODE FAULTHANDLER "
        "TRACEMALLOC MALLOC MALLOCSTATS VERBOSE DEBUG NOUSERSITE USERBASE SAFEPATH "
        "PYCACHEPREFIX PLATLIBDIR HOME PATH COERCECLOCALE INTMAXSTRDIGITS PERFSUPPORT "
        "NODEBUGRANGES WARNDEFAULTENCODING PROFILEIMPORTTIME INSPECT CASEOK "
        "_CPU_COUNT _GIL _FROZEN_MODULES _PERF_JIT_SUPPORT _JIT").split())


def _startup_vars_differ(env: dict) -> bool:
    """Whether an actor's ``env`` option sets a variable Python reads only as it starts
    (``PYTHONHASHSEED``, ``PYTHONIOENCODING``, ``PYTHONWARNINGS``...) to other than the
    driver's value, which the fork server started with: a forked child would show it in
    ``os.environ`` and not apply it. (Under ``-E`` or ``-I`` every actor ignores them.)"""
    if sys.flags.ignore_environment:
        return False
    return any(k in _STARTUP_VARS and os.environ.get(k) != v for k, v in env.items())


async def start_process(loop: asyncio.AbstractEventLoop, rec: ActorRecord,
                        child: socket.socket, env: dict,
                        forkserver: "ForkServerClient | None", on_exit) -> None:
    """Start ``rec``'s process and watch it: its exit (``on_exit(rec)``), its output.

    Args:
        loop: the runtime's event loop.
        rec: the actor; its pid, process and pipes are set here.
        child: the actor's end of its socket pair (closed here once passed on).
        env: its environment (``actor_env``).
        forkserver: where to fork it from, or None to start a fresh interpreter.
        on_exit: called on the loop once the process has exited.

    Raises:
        OSError: the process could not be started.
        ActorDiedError: the fork server died.
    """
    pidfd = -1
    rec.started = time.monotonic()
    if forkserver is not None and _startup_vars_differ(rec.options.env or {}):
        forkserver = None  # (a fork would only pretend to apply them: a fresh interpreter)
    if forkserver is not None:
        try:
            rec.pid, pidfd, rec.start_stamp, streams = await forkserver.fork(child, env)
        finally:
            child.close()
    else:
        try:
            # A session of its own from the fork on (``_descendants`` would make one only
            # once its bootstrap runs): a Ctrl-C on the driver's terminal while actors
            # start is the driver's alone, not a KeyboardInterrupt in each one's imports.
            rec.popen = subprocess.Popen(
                worker_command(child.fileno()),
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                cwd=working_directory(), start_new_session=True)
        except OSError as exc:
            raise fork_failed(exc) from None
        finally:
            child.close()
        rec.pid = rec.popen.pid
        streams = (rec.popen.stdout, rec.popen.stderr)
    rec.alive = True
    rec.death = None
    rec.exited = asyncio.Event()
    _live_pids.add(rec.pid)
    _leases.set_census(_live_pids.copy)
    _leases.process_started(rec.pid)
    try:
        # (A forked child's pidfd comes from its fork server, opened before it could
        # reap the child: here the number might be another's already.)
        rec.pidfd = pidfd if forkserver is not None else os.pidfd_open(rec.pid)
    except (AttributeError, OSError):  # a kernel before 5.3, or a seccomp filter's no
        rec.pidfd = -1
    rec.no_pidfd = rec.pidfd < 0
    if rec.no_pidfd:  # (on_exit runs on the loop, as a pidfd's reader would run it)
        rec.exit_poll = loop.call_later(EXIT_POLL, _poll_exit, loop, on_exit, rec,
                                        rec.pid, rec.start_stamp)
    else:
        loop.add_reader(rec.pidfd, _exited, on_exit, rec, rec.pid)
    rec.pipes = []
    for stream, out in zip(streams, ("stdout", "stderr")):
        os.set_blocking(stream.fileno(), False)
        fwd = OutputForwarder(rec, stream, out)
        rec.pipes.append(fwd)
        loop.add_reader(stream.fileno(), fwd.on_readable)


# The actor processes this (driver) process started that have not exited: whoever could
# hold a quarantined block of ours (``_leases.quarantine``).
_live_pids: set = set()


EXIT_POLL = 0.05  # seconds between looks at a process watched without a pidfd


def _poll_exit(loop: asyncio.AbstractEventLoop, on_exit, rec: ActorRecord, pid: int,
               start: bytes | None) -> None:
    """Watch process ``pid`` (started at ``start``) without a pidfd: where the kernel
    gives none (before 5.3, or a seccomp filter that refuses the call, as Docker's did
    before 20.10), look at it every ``EXIT_POLL`` seconds until it has exited (our child
    reaped, or a fork server's child gone, a zombie, or its number another's)."""
    if rec.pid != pid or pid not in _live_pids:
        return  # (its exit was handled: a restart's process has a watch of its own)
    if rec.popen is not None:
        gone = rec.popen.poll() is not None
    else:
        gone = start is None or _descendants.process_start(pid) != start
    if gone:
        rec.exit_poll = None
        _exited(on_exit, rec, pid)
    elif not loop.is_closed():
        rec.exit_poll = loop.call_later(EXIT_POLL, _poll_exit, loop, on_exit, rec, pid,
                                        start)


def kill_if_same(pid: int, start: bytes | None, sig: int) -> bool:
    """Send ``sig`` to process ``pid`` (a fork server's child, without pidfds) if its
    number still names the process that started at ``start``; whether it was sent."""
    if start is not None and _descendants.process_start(pid) == start:
        try:
            os.kill(pid, sig)
            return True
        except OSError:  # (gone meanwhile)
            pass
    return False


def _exited(on_exit, rec: ActorRecord, pid: int) -> None:
    _live_pids.discard(pid)
    try:
        on_exit(rec)
    finally:
        _leases.process_gone(pid)


def kill_all(actors: dict, ending: "_descendants.Ending", owner: int) -> None:
    """SIGKILL every actor process of ``actors`` (actor id -> ``ActorRecord``) whose exit
    has not been handled, with what it started, and what ``ending`` is still ending.
    Only in process ``owner``, the driver: a copy of it made by ``os.fork()`` inherits
    the runtime's finalizer, and must not end the driver's actors as it exits."""
    if os.getpid() != owner:
        return
    for rec in list(actors.values()):
        rec.kill_now()  # (those whose exit was not handled, and not reaped)
    ending.kill()



class ForkServerClient:
    """The driver's side of the fork server: started on first use, one per runtime.

    Args:
        loop: the runtime's event loop (the server's reports are read on it).
        start_timeout: seconds a fork may take before ``fork`` gives up.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, start_timeout: float) -> None:
        self.loop = loop
        self.start_timeout = start_timeout
        self._fs = None  # (Popen, socket) of the fork server, once started
        self._children: set[int] = set()  # its children whose exit it has yet to report
        self._fs_waiting: collections.deque = collections.deque()
        self._fs_out: collections.deque = collections.deque()  # [bytes, fds] unwritten
        self._fs_writing = False  # (a writer callback waits for room on the socket)
        self._fs_broken: OSError | None = None  # why a request could not be written
        self._fs_exit: dict[int, int] = {}
        self._abandoned: set[int] = set()  # children of spawns given up, still to exit
        self._fs_exit_events: dict[int, asyncio.Event] = {}

    async def fork(self, child: socket.socket, env: dict) -> tuple[int, int, bytes | None,
                                                                   tuple]:
        """Ask the fork server (started on first use) for a new actor process.

        Args:
            child: the actor's end of its socket pair (passed to the child).
            env: the actor's environment.

        Returns:
            The child's pid, its pidfd (-1 where pidfds are not to be had), its start
            time where they are not (``_descendants.process_start``, read by the
            server before it could reap the child), and its stdout and stderr pipes
            (read ends).

        Raises:
            ActorDiedError: the fork server died, or did not answer within
                ``start_timeout`` (the child it forks later is killed).
        """
        while self._fs is not None and self._fs[0].poll() is not None:
            # It died (killed?): its last reports first (exit codes, forks), then its
            # end (``_server_gone``); its actors live on, and a new one starts.
            self._on_forkserver()
        if self._fs is None:
            a, b = socket_pair()
            fs_env = dict(os.environ)
            fs_env["ACTORSHM_SYS_PATH"] = env["ACTORSHM_SYS_PATH"]
            # The server imports numpy, whose BLAS fixes its thread count then, for every
            # actor forked from it: one, as ``num_cpus`` defaults to (a child that asks
            # for more sets it again, ``_actor_process.forked_child_main``).
            fs_env.update(dict.fromkeys(THREAD_VARS, "1"))
            popen = subprocess.Popen(python_command(_bootstrap("_forkserver"), b.fileno()),
                                     pass_fds=(b.fileno(),), stdin=subprocess.DEVNULL,
                                     env=fs_env, start_new_session=True)  # (as an actor)
            b.close()
            self._fs = (popen, a)
            self.loop.add_reader(a.fileno(), self._on_forkserver)
        out_r, out_w = pipe()
        try:
            err_r, err_w = pipe()
        except OSError:  # (out of fds)
            os.close(out_r)
            os.close(out_w)
            raise
        fut = self.loop.create_future()
        try:
            self._send(_forkserver.encode_msg(("fork", env, working_directory(), None)),
                       [child.fileno(), out_w, err_w])
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self._fs_waiting.append(fut)  # (in the order of the requests, as the reports)
        try:
            pid, pidfd, start = await asyncio.wait_for(asyncio.shield(fut),
                                                       self.start_timeout)
        except BaseException as exc:  # cancelled, or timed out: nobody will take the child
            os.close(out_r)
            os.close(err_r)
            fut.add_done_callback(self._kill_forked)  # the server forks it all the same
            if isinstance(exc, asyncio.TimeoutError):
                raise ActorDiedError(
                    f"the fork server did not start the actor within {self.start_timeout} s "
                    "(Runtime(start_timeout=...) sets the limit)") from None
            raise
        return pid, pidfd, start, (open(out_r, "rb", buffering=0),
                                   open(err_r, "rb", buffering=0))

    def _kill_forked(self, fut: asyncio.Future) -> None:
        """A child forked for a spawn that was given up: it must not live on unseen.
        Nobody asks for its exit code: the server's report of it is dropped (kept, it
        would stay for ever, and be taken for the code of a later child with its pid)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        pid, pidfd, start = fut.result()
        exited = self._fs_exit.pop(pid, None) is not None  # (its report may be in)
        if not exited:
            self._abandoned.add(pid)
        try:
            if pidfd >= 0:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            elif not exited:  # (no pidfds: by its number, while that still names it)
                kill_if_same(pid, start, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    def _send(self, data: bytes, fds: list[int]) -> None:
        """Queue a request for the server, with copies of ``fds``, and write what the
        socket takes. The loop made the socket non-blocking: requests of many spawns at
        once (each carries the actor's environment) fill it, and the rest is written as
        the server reads, in order, whole (a cancelled spawn cannot cut one short)."""
        dups: list[int] = []
        try:
            for fd in fds:
                dups.append(os.dup(fd))
        except BaseException:  # (out of fds, say): those made so far go too
            for fd in dups:
                os.close(fd)
            raise
        self._fs_out.append([data, dups])
        if len(self._fs_out) == 1:
            self._flush()

    def _flush(self) -> None:
        sock = self._fs[1]
        while self._fs_out:
            data, fds = self._fs_out[0]
            anc = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                   if fds else [])
            try:
                sent = sock.sendmsg([data], anc)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                # The server is gone, or this request is lost (ENOBUFS, say): no report
                # will come for it, so later reports would go to the wrong spawns. End
                # the server: its EOF fails the spawns waiting on it, and the next fork
                # starts a new one.
                self._fs_broken = exc
                if self._fs[0].poll() is None:
                    self._fs[0].kill()
                sent = len(data)
            for fd in fds:  # (they went with the first byte)
                os.close(fd)
            self._fs_out[0] = [data[sent:], []]
            if sent >= len(data):
                self._fs_out.popleft()
        if self._fs_out and not self._fs_writing:
            self.loop.add_writer(sock.fileno(), self._flush)
            self._fs_writing = True
        elif not self._fs_out and self._fs_writing:
            self.loop.remove_writer(sock.fileno())
            self._fs_writing = False

    def _drop_queue(self, sock: socket.socket) -> None:
        """The server is gone or stopped: requests not yet written never will be."""
        if self._fs_writing:
            try:
                self.loop.remove_writer(sock.fileno())
            except Exception:
                pass
            self._fs_writing = False
        for _, fds in self._fs_out:
            for fd in fds:
                os.close(fd)
        self._fs_out.clear()

    def _server_gone(self) -> None:
        """The fork server died: fail the forks waiting for it; the next fork starts a
        new one. (Its actors live on: they watch the driver, not their parent.)"""
        popen, sock = self._fs
        self._fs = None
        self._abandoned.clear()  # (their reports never come; a later child may get a pid)
        self._children.clear()
        self.loop.remove_reader(sock.fileno())
        self._drop_queue(sock)
        sock.close()
        if popen.poll() is None:
            popen.kill()
        popen.wait()
        broken, self._fs_broken = self._fs_broken, None
        why = f" (a request could not be written to it: {broken})" if broken else ""
        for fut in self._fs_waiting:
            if not fut.done():
                fut.set_exception(ActorDiedError(f"the actorshm fork server died{why}"))
        self._fs_waiting.clear()
        for ev in self._fs_exit_events.values():  # their exit reports will not come
            ev.set()
        self._fs_exit_events.clear()

    def _on_forkserver(self) -> None:
        try:
            msg = _forkserver.recv_msg(self._fs[1])
        except OSError:
            msg = None
        if msg is None:
            self._server_gone()
            return
        (kind, pid, code), fds = msg  # ("forked": ``code`` is its start, or None)
        if kind == "fork_failed":
            fut = self._fs_waiting.popleft()
            if not fut.done():
                fut.set_exception(fork_failed(OSError(code, os.strerror(code))))
        elif kind == "forked":
            fut = self._fs_waiting.popleft()
            self._children.add(pid)
            pidfd = fds[0] if fds else -1  # (the child's, opened by the server)
            if pidfd >= 0:  # received without close-on-exec, unlike pidfd_open's own:
                os.set_inheritable(pidfd, False)  # a program this process runs gets none
            if not fut.done():
                fut.set_result((pid, pidfd, code))
            elif pidfd >= 0:  # pragma: no cover - (failed futures leave the queue)
                os.close(pidfd)
        elif pid in self._abandoned:  # (a child of a spawn given up: ``_kill_forked``)
            self._abandoned.discard(pid)
            self._children.discard(pid)
        else:
            self._children.discard(pid)
            self._fs_exit[pid] = code
            ev = self._fs_exit_events.pop(pid, None)
            if ev is not None:
                ev.set()

    def orphan(self, pid: int) -> bool:
        """Whether forked child ``pid``'s exit will never be reported: the server that
        forked it died (a new one may run now, which never knew it)."""
        return pid not in self._children and pid not in self._fs_exit

    async def exit_code(self, pid: int) -> int | None:
        """The exit code of forked child ``pid`` (which has exited), as the server
        reports it; None if no report comes within a second, or none will (``orphan``)."""
        if pid not in self._fs_exit and self._fs is not None and pid in self._children:
            ev = self._fs_exit_events.setdefault(pid, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        return self._fs_exit.pop(pid, None)

    def stop(self) -> None:
        if self._fs is not None:
            popen, sock = self._fs
            self._fs = None
            self._abandoned.clear()
            self._children.clear()
            try:
                self.loop.remove_reader(sock.fileno())
            except Exception:
                pass
            self._drop_queue(sock)
            sock.close()
            # Spawns waiting for the server fail now, not at their start timeout.
            for fut in self._fs_waiting:
                if not fut.done():
                    fut.set_exception(ActorDiedError(
                        "the runtime closed while the actor was starting"))
            self._fs_waiting.clear()
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                popen.kill()
                popen.wait()


class GpuSlots:
    """The GPUs a runtime may hand to ``num_gpus`` actors, and which are free.

    Args:
        gpus: ``CUDA_VISIBLE_DEVICES`` entries, or None for ``visible_gpus()``
            (read when the first GPU actor spawns).
    """

    def __init__(self, gpus: list[str] | None) -> None:
        self._gpus = gpus
        self._gpus_free: list[str] | None = None
        self._gpus_total = 0

    def take(self, n: int, who: str) -> list[str]:
        """Reserve ``n`` GPUs for actor ``who``.

        Raises:
            ValueError: not enough GPUs are free (the message says why and what to do).
        """
        if self._gpus_free is None:
            self._gpus_free = list(self._gpus) if self._gpus is not None else visible_gpus()
            self._gpus_total = len(self._gpus_free)
        if len(self._gpus_free) < n:
            if not self._gpus_total:
                where = ("Runtime(gpus=[])" if self._gpus is not None else
                         "CUDA_VISIBLE_DEVICES and CuPy")
                raise ValueError(
                    f"cannot spawn {who} with num_gpus={n}: no GPU is available to this "
                    f"runtime ({where} name none). Install the cuda extra "
                    "(pip install 'actorshm[cuda]') on a machine with a GPU, pass "
                    "Runtime(gpus=[...]), or spawn with num_gpus=0.")
            raise ValueError(
                f"cannot spawn {who} with num_gpus={n}: {len(self._gpus_free)} of "
                f"{self._gpus_total} GPU(s) are free. Kill a GPU actor first, lower "
                "num_gpus, or pass Runtime(gpus=[...]).")
        taken, self._gpus_free = self._gpus_free[:n], self._gpus_free[n:]
        return taken

    def release(self, rec: ActorRecord) -> None:
        """Give back the GPUs ``take`` reserved for ``rec`` (it died or was killed)."""
        if rec.gpus and self._gpus_free is not None:
            self._gpus_free.extend(rec.gpus)
        rec.gpus = []


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries.

    Entries are kept as written (ordinals, ``GPU-<uuid>`` or ``MIG-<uuid>``), so that an
    actor's ``CUDA_VISIBLE_DEVICES`` names the same GPU the driver sees. As in CUDA, the
    list ends at the first empty or negative entry.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        out = []
        for tok in env.split(","):
            tok = tok.strip()
            if not tok or tok.startswith("-"):
                break
            out.append(tok)
        return out
    try:
        from . import _cuda
        return [str(i) for i in range(_cuda.device_count())]
    except Exception:
        return []


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
