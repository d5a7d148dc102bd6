"""The driver: its asyncio scheduler, and the lifecycle of actor processes.

Each actor is a fresh interpreter (``spawn``, never a bare ``fork``: forking a process
with threads deadlocks), connected to the driver by a socket pair it inherits. The
driver watches each child through a pidfd and its socket together, so a death is seen
at once and every pending call fails with ``ActorDiedError`` naming the exit code or
signal. Leaving the runtime asks every actor to stop, waits a grace period, then sends
SIGTERM and finally SIGKILL; children also get SIGKILL from the kernel if the driver
itself dies (``PR_SET_PDEATHSIG``) and exit on socket EOF.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from typing import Any

from . import _client, _shm
from ._actor import ActorHandle, ActorOptions, public_methods
from ._errors import ActorDiedError
from ._protocol import Connection
from ._util import check_run_args, describe_exit, install_event_loop_policy

__all__ = ["Runtime", "run", "current_runtime", "get_actor"]

logger = logging.getLogger("actorshm")
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bootstrap(module: str) -> str:
    """``python -c`` code that runs ``actorshm.<module>.main()`` from the driver's own
    copy of actorshm, even where another is installed or in the working directory, and
    then leaves ``sys.path`` as it was (the driver's order is applied later)."""
    # ``python -c`` puts '' (the working directory) first: drop it, so that a file there
    # cannot shadow the standard library before the driver's own path is in place.
    return (f"import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
            f"sys.path.insert(0, {_PKG_PARENT!r}); "
            f"import actorshm.{module} as m; sys.path.remove({_PKG_PARENT!r}); m.main()")


_WORKER_CMD = _bootstrap("_worker")


class _Record:
    """The driver's view of one actor process."""

    def __init__(self, actor_id: int, cls: type, options: ActorOptions) -> None:
        self.actor_id = actor_id
        self.cls = cls
        self.cls_name = cls.__qualname__
        self.options = options
        self.methods = public_methods(cls)
        self.popen: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.pidfd = -1
        self.pid = 0
        self.alive = False
        self.death: str | None = None
        self.exited = asyncio.Event()
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        self.pipes: list = []
        self.gpus: list[str] = []
        self.spawn_args: tuple = ()
        self.restarts = 0
        self.failed_starts = 0  # restarts in a row whose process died while starting
        self.no_restart = False

    @property
    def label(self) -> str:
        return f"actor {self.cls_name}(id={self.actor_id}, pid={self.pid})"


class Runtime:
    """Owns actor processes and shared memory. Use as ``async with Runtime() as rt``.

    Where one ``async with`` block cannot hold the whole program (a notebook: each cell
    is its own block), open it with ``rt = await Runtime().start()`` and end it with
    ``await rt.close()``.

    Args:
      backend: ``"local"`` (default: actors are processes on this machine, arrays
        travel through shared memory) or ``"ray"`` (actors are Ray actors, arrays travel
        through Ray's object store). ``Runtime(backend="ray", address=None,
        **ray_init_options)`` starts a local Ray when ``address`` is None, else connects
        to that cluster; see the "Scale-out on Ray" page.
      start_method: ``"spawn"`` (default: a fresh interpreter per actor) or
        ``"forkserver"`` (a warm, single-threaded server process forks each actor:
        much faster start-up, same isolation from the driver's threads).
      shm_budget: bytes of shared memory each process may own (default: half the RAM,
        or ``ACTORSHM_SHM_BUDGET``).
      shutdown_grace: seconds an actor gets to stop before SIGTERM, then SIGKILL.
      start_timeout: seconds an actor may take to start and run ``__init__``.
      gpus: the GPUs that ``num_gpus`` actors may get, as ``CUDA_VISIBLE_DEVICES``
        entries (ordinals or ``GPU-<uuid>``; default: the driver's
        ``CUDA_VISIBLE_DEVICES``, or every GPU CuPy sees).
    """

    def __new__(cls, *args: Any, backend: str = "local", **options: Any):
        if backend == "ray":
            from ._ray import RayRuntime
            return RayRuntime(*args, **options)
        if backend != "local":
            raise ValueError(f"backend must be 'local' or 'ray', not {backend!r}")
        return super().__new__(cls)

    def __init__(self, *, backend: str = "local", start_method: str = "spawn",
                 shm_budget: int | None = None, shutdown_grace: float = 2.0,
                 start_timeout: float = 60.0,
                 gpus: list[int | str] | None = None) -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', not "
                             f"{start_method!r}: a bare fork deadlocks with threads and "
                             "cannot re-initialize CUDA")
        self.start_method = start_method
        self.shm_budget = shm_budget
        self.shutdown_grace = shutdown_grace
        self.start_timeout = start_timeout
        self._gpus = None if gpus is None else [str(g) for g in gpus]
        self._gpus_free: list[str] | None = None
        self._gpus_total = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._actors: dict[int, _Record] = {}
        self._names: dict[str, int] = {}
        self._next_id = 1
        self._open = False
        self._closing = False
        self._finalizer = None
        self._fs = None  # (Popen, socket) of the fork server, once started
        self._fs_waiting: collections.deque = collections.deque()
        self._fs_exit: dict[int, int] = {}
        self._fs_exit_events: dict[int, asyncio.Event] = {}

    # -- context manager ---------------------------------------------------------
    async def start(self) -> "Runtime":
        """Open the runtime on the running event loop and return it.

        ``async with Runtime() as rt`` does this on entry and ``close()`` on exit. Call
        it directly to keep a runtime open across notebook cells: ``rt = await
        actorshm.Runtime().start()`` in one cell, ``await rt.close()`` in a later one.
        Until then it is ``current_runtime()`` and spawns every actor.

        Returns:
            The runtime itself.

        Raises:
            RuntimeError: it is already open, or was closed (make a new ``Runtime``).
        """
        if self._open:
            raise RuntimeError("this Runtime is already open")
        if self._closing:
            raise RuntimeError("this Runtime was closed; open a new one: "
                               "`rt = await actorshm.Runtime().start()`")
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        _shm.set_budget(self.shm_budget)
        _shm.pool()
        _shm._flush_hook[0] = _make_flush_hook(self.loop)
        self._open = True
        _client._runtimes.append(self)
        self._finalizer = weakref.finalize(self, _kill_all, self._actors)
        return self

    async def __aenter__(self) -> "Runtime":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every actor (ask, grace period, SIGTERM, SIGKILL) and reap them.

        Leaving ``async with`` calls it; after ``start()``, call it yourself. Calling it
        again does nothing.
        """
        if not self._open or self._closing:
            return
        self._closing = True
        try:
            recs = [r for r in self._actors.values() if r.alive or r.popen is not None]
            task = asyncio.ensure_future(
                asyncio.gather(*(self._stop(r) for r in recs), return_exceptions=True))
            try:
                await asyncio.shield(task)
            except BaseException:
                _kill_all(self._actors)
                raise
        finally:
            _kill_all(self._actors)
            for r in self._actors.values():
                self._reap(r)
            self._stop_forkserver()
            self._open = False
            if self in _client._runtimes:
                _client._runtimes.remove(self)
            if not _client._runtimes:
                _shm.release_quarantine()  # whoever could hold those blocks is gone
            if self._finalizer is not None:
                self._finalizer.detach()

    # -- spawning ----------------------------------------------------------------
    async def spawn(self, cls: type, options: ActorOptions, args: tuple,
                    kwargs: dict) -> ActorHandle:
        self._check_open()
        if options.name is not None:
            other = self._names.get(options.name)
            if other is not None and self._actors[other].alive:
                raise ValueError(f"an actor named {options.name!r} already exists; "
                                 "choose another name or kill that actor first")
        rec = _Record(self._next_id, cls, options)
        self._next_id += 1
        rec.spawn_args = (args, kwargs)
        if options.num_gpus:
            rec.gpus = self._take_gpus(options.num_gpus, rec.cls_name)
        self._actors[rec.actor_id] = rec
        if options.name is not None:
            self._names[options.name] = rec.actor_id
        try:
            await self._start_process(rec)
        except BaseException:
            if options.name is not None and self._names.get(options.name) == rec.actor_id:
                del self._names[options.name]
            self._release_gpus(rec)
            await self._stop(rec, grace=0.5)
            self._reap(rec)
            raise
        return ActorHandle(self, rec.actor_id, rec.cls_name, rec.methods, options.name,
                           rec.pid, options.max_pending_calls)

    async def _start_process(self, rec: _Record) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env.update(rec.options.thread_env())
        env.update(rec.options.env or {})
        # The driver's import path, '' (its working directory, the actor's too) made
        # absolute: the actor imports what the driver would.
        env["ACTORSHM_SYS_PATH"] = json.dumps(
            [os.fspath(p) or os.getcwd() for p in sys.path
             if isinstance(p, (str, os.PathLike)) and isinstance(os.fspath(p), str)])
        env["PYTHONUNBUFFERED"] = "1"
        if rec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in rec.gpus)
        if self.start_method == "forkserver":
            try:
                rec.pid, streams = await self._fork(child, env)
            finally:
                child.close()
        else:
            try:
                rec.popen = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_CMD, str(child.fileno())],
                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                    cwd=os.getcwd())
            finally:
                child.close()
            rec.pid = rec.popen.pid
            streams = (rec.popen.stdout, rec.popen.stderr)
        rec.alive = True
        rec.death = None
        rec.exited = asyncio.Event()
        try:
            rec.pidfd = os.pidfd_open(rec.pid)
            self.loop.add_reader(rec.pidfd, self._on_exit, rec)
        except (AttributeError, OSError):  # pragma: no cover - kernels before 5.3
            rec.pidfd = -1
        rec.pipes = []
        for stream, out in zip(streams, ("stdout", "stderr")):
            os.set_blocking(stream.fileno(), False)
            fwd = _OutputForwarder(rec, stream, out)
            rec.pipes.append(fwd)
            self.loop.add_reader(stream.fileno(), fwd.on_readable)
        if rec.conn is not None and rec.conn.sock is None and not rec.conn.closed:
            rec.conn.label = rec.label
            rec.conn.attach(parent)  # a restart: calls made meanwhile are buffered there
        else:
            rec.conn = Connection(self.loop, self, parent, label=rec.label)
            rec.conn.peer_id = rec.actor_id
        config = {"actor_id": rec.actor_id, "max_concurrency": rec.options.max_concurrency,
                  "shm_budget": self.shm_budget, "shutdown_grace": self.shutdown_grace}
        args, kwargs = rec.spawn_args
        fut = rec.conn.call("__init_actor__", (rec.cls, args, kwargs, config), {},
                            f"{rec.cls_name}.__init__")
        try:
            pid = await asyncio.wait_for(fut, self.start_timeout)
        except asyncio.TimeoutError:
            raise ActorDiedError(f"{rec.label} did not start within {self.start_timeout} s "
                                 "(Runtime(start_timeout=...) sets the limit)") from None
        except ActorDiedError as exc:
            await asyncio.sleep(0.05)  # let stderr drain into the tail
            tail = "".join(rec.stderr_tail)
            raise ActorDiedError(f"{exc}\nlast lines of its stderr:\n{tail}" if tail
                                 else str(exc)) from None
        rec.pid = pid

    async def _fork(self, child: socket.socket, env: dict) -> tuple[int, tuple]:
        """Ask the fork server (started on first use) for a new actor process."""
        from . import _forkserver
        if self._fs is None:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fs_env = dict(os.environ)
            fs_env["ACTORSHM_SYS_PATH"] = env["ACTORSHM_SYS_PATH"]
            popen = subprocess.Popen([sys.executable, "-c", _bootstrap("_forkserver"),
                                      str(b.fileno())],
                                     pass_fds=(b.fileno(),), stdin=subprocess.DEVNULL,
                                     env=fs_env)
            b.close()
            self._fs = (popen, a)
            self.loop.add_reader(a.fileno(), self._on_forkserver)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fut = self.loop.create_future()
        self._fs_waiting.append(fut)
        try:
            _forkserver.send_msg(self._fs[1], ("fork", env, os.getcwd(), None),
                                 [child.fileno(), out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        pid = await asyncio.wait_for(fut, self.start_timeout)
        return pid, (open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0))

    def _on_forkserver(self) -> None:
        from . import _forkserver
        msg = _forkserver.recv_msg(self._fs[1])
        if msg is None:
            self.loop.remove_reader(self._fs[1].fileno())
            for fut in self._fs_waiting:
                if not fut.done():
                    fut.set_exception(ActorDiedError("the actorshm fork server died"))
            self._fs_waiting.clear()
            return
        (kind, pid, code), _ = msg
        if kind == "forked":
            fut = self._fs_waiting.popleft()
            if not fut.done():
                fut.set_result(pid)
        else:
            self._fs_exit[pid] = code
            ev = self._fs_exit_events.pop(pid, None)
            if ev is not None:
                ev.set()

    def _stop_forkserver(self) -> None:
        if self._fs is not None:
            popen, sock = self._fs
            self._fs = None
            try:
                self.loop.remove_reader(sock.fileno())
            except Exception:
                pass
            sock.close()
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                popen.kill()
                popen.wait()

    def _take_gpus(self, n: int, who: str) -> list[str]:
        if self._gpus_free is None:
            self._gpus_free = list(self._gpus) if self._gpus is not None else _visible_gpus()
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

    def _release_gpus(self, rec: _Record) -> None:
        if rec.gpus and self._gpus_free is not None:
            self._gpus_free.extend(rec.gpus)
            rec.gpus = []

    # -- calls -------------------------------------------------------------------
    def call(self, actor_id: int, method: str, args: tuple, kwargs: dict, what: str = ""):
        if threading.get_ident() != self._loop_thread:
            return _client.call_from_thread(
                self.loop, lambda: self.call(actor_id, method, args, kwargs, what))
        rec = self._actors.get(actor_id)
        if rec is None or rec.conn is None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(ActorDiedError(f"no actor with id {actor_id} in this runtime"))
            return fut
        return rec.conn.call(method, args, kwargs, what)

    def actor_pid(self, actor_id: int, pid: int) -> int:
        rec = self._actors.get(actor_id)
        return rec.pid if rec is not None else pid

    async def kill(self, actor_id: int) -> None:
        rec = self._actors.get(actor_id)
        if rec is None:
            return
        rec.no_restart = True  # also ends a restart in progress
        if not rec.alive:
            if rec.conn is not None and not rec.conn.closed:  # calls waiting for a restart
                rec.death = f"{rec.label} was killed by actorshm kill()"
                rec.conn.close(ActorDiedError(rec.death))
            return
        rec.death = f"{rec.label} was killed by actorshm kill()"
        if rec.conn is not None and not rec.conn.closed:
            # Blocks it passed on and just got back: let their withdrawals go out first,
            # so their owners need not keep them (bounded: a busy actor is killed anyway).
            try:
                await asyncio.wait_for(rec.conn.call("__settle__", (0.05,), {}), 0.1)
            except Exception:
                pass
        try:
            os.kill(rec.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await rec.exited.wait()

    async def get_actor(self, name: str) -> ActorHandle:
        actor_id = self._names.get(name)
        rec = self._actors.get(actor_id) if actor_id is not None else None
        if rec is None or not rec.alive:
            raise ValueError(f"no live actor named {name!r}; named actors are made with "
                             "Cls.options(name=...).spawn()")
        return ActorHandle(self, rec.actor_id, rec.cls_name, rec.methods, name, rec.pid,
                           rec.options.max_pending_calls)

    def actors(self) -> list[dict]:
        """A snapshot of the actors this runtime started."""
        return [{"id": r.actor_id, "class": r.cls_name, "pid": r.pid, "alive": r.alive,
                 "name": r.options.name, "death": r.death} for r in self._actors.values()]

    # -- services for actor processes --------------------------------------------
    def handle_call(self, conn: Connection, cid: int, call: list) -> None:
        method, args, _ = call
        call.clear()
        try:
            if method == "__connect__":
                (target,) = args
                rec = self._actors.get(target)
                if rec is None or not rec.alive or rec.conn is None or rec.conn.closed:
                    why = rec.death if rec is not None and rec.death else \
                        f"actor {target} is not running"
                    raise ActorDiedError(why)
                a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                from ._serialization import PassFd
                fa, fb = a.detach(), b.detach()
                rec.conn.call("__accept_peer__", (PassFd(fb), conn.peer_id), {}) \
                    .add_done_callback(_ignore)
                rec.conn.close_after_send([fb])
                conn.reply(cid, (PassFd(fa), rec.label))
                conn.close_after_send([fa])
            elif method == "__get_actor__":
                task = self.loop.create_task(self.get_actor(*args))
                task.add_done_callback(lambda t: _reply_task(conn, cid, t))
            elif method == "__kill__":
                task = self.loop.create_task(self.kill(*args))
                task.add_done_callback(lambda t: _reply_task(conn, cid, t))
            elif method == "__spawn__":
                cls, options, a, k = args
                task = self.loop.create_task(self.spawn(cls, options, a, k))
                task.add_done_callback(lambda t: _reply_task(conn, cid, t))
            elif method == "__stats__":
                conn.reply(cid, _shm.stats())
            else:
                raise AttributeError(f"the driver has no service {method!r}")
        except BaseException as exc:
            conn.reply_error(cid, exc)

    def connection_eof(self, conn: Connection) -> None:
        rec = self._actors.get(conn.peer_id)
        if rec is not None and rec.conn is conn and rec.alive:
            # The process is exiting; give its pidfd a moment to tell us how.
            self.loop.create_task(self._await_exit_then_close(rec))
        elif rec is not None and rec.conn is conn and rec.death:
            conn.close(ActorDiedError(rec.death))  # (read to its end after the death)
        else:
            conn.close()

    async def _await_exit_then_close(self, rec: _Record) -> None:
        try:
            await asyncio.wait_for(rec.exited.wait(), 0.3)
        except asyncio.TimeoutError:
            if rec.conn is not None:
                rec.conn.close(ActorDiedError(f"{rec.label} closed its connection"))
            try:
                os.kill(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def connection_closed(self, conn: Connection) -> None:
        rec = self._actors.get(conn.peer_id)
        if rec is not None and rec.conn is conn and rec.alive and not self._closing:
            # The connection broke (protocol error): the actor is unusable.
            try:
                os.kill(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- death and shutdown ------------------------------------------------------
    def _on_exit(self, rec: _Record) -> None:
        self.loop.remove_reader(rec.pidfd)
        os.close(rec.pidfd)
        rec.pidfd = -1
        if rec.popen is not None:
            self._exited(rec, rec.popen.wait())
        else:
            self.loop.create_task(self._forked_exit(rec))

    async def _forked_exit(self, rec: _Record) -> None:
        if rec.pid not in self._fs_exit:
            ev = self._fs_exit_events.setdefault(rec.pid, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        self._exited(rec, self._fs_exit.pop(rec.pid, None))

    def _exited(self, rec: _Record, code: int | None) -> None:
        rec.alive = False
        why = rec.death or f"{rec.label} died: {describe_exit(code)}"
        if self._closing and rec.death is None:
            why = f"{rec.label} was stopped because its runtime closed"
        rec.death = why
        self._release_gpus(rec)
        for fwd in rec.pipes:
            fwd.drain()
        if rec.conn is not None:
            rec.conn.drain()  # what it wrote before it died: replies, releases, notices
            rec.conn.close(ActorDiedError(why))
        rec.exited.set()
        limit = rec.options.max_restarts
        if not self._closing and not rec.no_restart and (limit == -1 or rec.restarts < limit):
            # Calls made from now on wait in a fresh connection for the new process;
            # the ones that were pending have failed (at-most-once, as in Ray).
            rec.restarts += 1
            rec.conn = Connection(self.loop, self, label=rec.label)
            rec.conn.peer_id = rec.actor_id
            self.loop.create_task(self._restart(rec, why))

    async def _restart(self, rec: _Record, why: str) -> None:
        conn = rec.conn  # this attempt's; a death during start-up makes the next one's
        if rec.failed_starts:  # back off while new processes keep dying as they start
            await asyncio.sleep(min(5.0, 0.05 * 2 ** rec.failed_starts))
        if self._closing or rec.no_restart:  # closed or killed meanwhile
            if rec.conn is conn and conn is not None:
                conn.close(ActorDiedError(rec.death or f"{rec.label} was stopped"))
            return
        try:
            if rec.options.num_gpus:
                rec.gpus = self._take_gpus(rec.options.num_gpus, rec.cls_name)
            rec.death = None
            await self._start_process(rec)
            rec.failed_starts = 0
            if rec.no_restart:  # killed while it was starting
                rec.death = f"{rec.label} was killed by actorshm kill()"
                os.kill(rec.pid, signal.SIGKILL)
                return
            logger.warning("actorshm: restarted %s (restart %d of %s) after: %s", rec.label,
                           rec.restarts, rec.options.max_restarts, _first_line(why))
        except BaseException as exc:
            if rec.conn is not conn:
                # The new process died while starting; the next restart is on its way.
                rec.failed_starts += 1
                logger.warning("actorshm: restart %d of %s of %s failed while starting: %s",
                               rec.restarts - 1, rec.options.max_restarts, rec.label,
                               _first_line(str(exc)))
                return
            rec.death = (f"{rec.label} could not be restarted: {_first_line(str(exc))} "
                         f"(after: {_first_line(why)})")
            if rec.conn is not None:
                rec.conn.close(ActorDiedError(rec.death))
            if rec.alive:
                await self._stop(rec, grace=0.5)

    async def _stop(self, rec: _Record, grace: float | None = None) -> None:
        if not rec.alive:
            return
        grace = self.shutdown_grace if grace is None else grace
        if rec.death is None:
            rec.death = f"{rec.label} was stopped because its runtime closed"
        if rec.conn is not None and not rec.conn.closed:
            rec.conn.call("__stop__", (), {}).add_done_callback(_ignore)
        for sig, wait in ((None, grace), (signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            if sig is not None:
                try:
                    os.kill(rec.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                await asyncio.wait_for(rec.exited.wait(), wait)
                return
            except asyncio.TimeoutError:
                continue

    def _reap(self, rec: _Record) -> None:
        if rec.pidfd >= 0:
            try:
                self.loop.remove_reader(rec.pidfd)
            except Exception:
                pass
            os.close(rec.pidfd)
            rec.pidfd = -1
        if rec.popen is not None:
            try:
                rec.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                rec.popen.kill()
                rec.popen.wait()
        for fwd in rec.pipes:
            fwd.drain()
            fwd.close()
        rec.pipes = []
        rec.alive = False
        if rec.conn is not None and not rec.conn.closed:
            rec.conn.close(ActorDiedError(rec.death or f"{rec.label} was stopped"))

    def _check_open(self) -> None:
        if not self._open or self._closing:
            raise RuntimeError("this actorshm Runtime is not open; spawn actors inside "
                               "`async with actorshm.Runtime():`")


def _ignore(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _reply_task(conn: Connection, cid: int, task: asyncio.Task) -> None:
    if task.cancelled():
        conn.reply_error(cid, asyncio.CancelledError())
    elif task.exception() is not None:
        conn.reply_error(cid, task.exception())
    else:
        conn.reply(cid, task.result())


def _first_line(text: str, limit: int = 300) -> str:
    """A death's cause, short: restart messages must not nest earlier ones whole."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _kill_all(actors: dict) -> None:
    for rec in list(actors.values()):
        if rec.popen is not None:
            if rec.popen.poll() is None:
                try:
                    rec.popen.kill()
                except OSError:
                    pass
        elif rec.alive and rec.pid:
            try:
                os.kill(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _visible_gpus() -> list[str]:
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


class _OutputForwarder:
    """Copies an actor's stdout/stderr to the driver's, each line prefixed as Ray does."""

    def __init__(self, rec: _Record, stream, which: str) -> None:
        self.rec = rec
        self.stream = stream
        self.fd = stream.fileno()
        self.which = which
        self.partial = b""
        self.closed = False

    def on_readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        self._emit(data)

    def _emit(self, data: bytes) -> None:
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        if not lines:
            return
        prefix = f"({self.rec.cls_name} pid={self.rec.pid}) "
        text = "".join(prefix + ln.decode(errors="replace") + "\n" for ln in lines)
        if self.which == "stderr":
            self.rec.stderr_tail.extend(ln.decode(errors="replace") + "\n" for ln in lines)
        out = sys.stderr if self.which == "stderr" else sys.stdout
        try:
            out.write(text)
            out.flush()
        except Exception:  # pragma: no cover
            pass

    def drain(self) -> None:
        while not self.closed:
            try:
                data = os.read(self.fd, 65536)
            except (BlockingIOError, OSError):
                return
            if not data:
                self.close()
                return
            self._emit(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.partial:
            self._emit(b"\n")
        try:
            if self.rec.conn is not None:
                self.rec.conn.loop.remove_reader(self.fd)
        except Exception:  # the loop is closing
            pass
        self.stream.close()


def _make_flush_hook(loop: asyncio.AbstractEventLoop):
    from ._worker import _make_flush_hook as make
    return make(loop)


def current_runtime() -> Runtime:
    """The runtime that ``spawn`` uses here: the one opened last and not yet closed.

    Raises:
        RuntimeError: no runtime is open (the message says how to open one), or this is
            an actor's process (actors use handles and ``get_actor``).
    """
    if _client._worker[0] is not None:
        raise RuntimeError("current_runtime() is for the driver; inside an actor, use "
                           "handles and actorshm.get_actor()")
    if not _client._runtimes:
        raise RuntimeError(
            "no actorshm runtime is open. Open one with `async with actorshm.Runtime():` "
            "around your code, or run it with `actorshm.run(main())`.")
    return _client._runtimes[-1]


async def get_actor(name: str) -> ActorHandle:
    """A handle to the live actor spawned with ``options(name=name)``.

    Works in the driver and inside actors.

    Args:
        name: the name given at spawn, as in ``Cls.options(name="ps").spawn()``.

    Raises:
        ValueError: no live actor has that name.
    """
    return await _client.client().get_actor(name)


def run(main, **runtime_options: Any):
    """Run coroutine ``main`` on uvloop (where installed) inside a Runtime; return its result.

    If ``main`` opens its own Runtime, that one is used inside it; the outer one that
    ``run`` opened has no actors and costs nothing. Where an event loop already runs (a
    notebook, async code), await ``main`` instead, in ``async with actorshm.Runtime():``
    or after ``rt = await actorshm.Runtime().start()``.

    Args:
        main: a coroutine: ``run(main())``, not ``run(main)``.
        **runtime_options: keyword arguments for ``Runtime``.

    Returns:
        What ``main`` returned.

    Raises:
        TypeError: ``main`` is not a coroutine (a coroutine function names the fix).
        RuntimeError: called from a running event loop; the message says what to do.
    """
    check_run_args(main)

    async def wrapper():
        async with Runtime(**runtime_options):
            return await main

    try:
        import uvloop
    except ImportError:
        return asyncio.run(wrapper())
    if hasattr(uvloop, "run"):
        return uvloop.run(wrapper())
    install_event_loop_policy()  # pragma: no cover - old uvloop
    return asyncio.run(wrapper())  # pragma: no cover
