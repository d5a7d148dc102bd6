"""The driver: its asyncio scheduler, and the lifecycle of actor processes.

Each actor is a fresh interpreter (``spawn``, never a bare ``fork``: forking a process
with threads deadlocks), connected to the driver by a socket pair it inherits. The
driver watches each child through a pidfd and its socket together, so a death is seen
at once and every pending call fails with ``ActorDiedError`` naming the exit code or
signal. Leaving the runtime asks every actor to stop, waits a grace period, then sends
SIGTERM and finally SIGKILL; children also die if the driver itself dies (each actor's
watchdog watches its pidfd) and exit on socket EOF. What an actor started ends with it
(``_descendants``).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import os
import signal
import threading
import warnings
import weakref
from typing import Any

from . import (_client, _descendants, _events, _introspect, _leases, _plugins,  # noqa: F401
               _serialization, _services, _shm)
from . import _multicast
from ._actor import ActorHandle, ActorOptions, public_methods
from ._backend import BackendChoice
from ._errors import ActorDiedError, class_not_loaded
from ._launch import (ActorRecord, ForkServerClient, GpuSlots, actor_env, check_number,
                      check_start_options, kill_all, out_of_fds, start_process)
from ._protocol import Connection
from ._streams import StreamingClient
from ._supervise import Supervisor
from ._util import (check_run_args, coalesced_call, fill_closed_stdio,
                    install_event_loop_policy, require_linux, socket_pair)

__all__ = ["Runtime", "run", "current_runtime", "get_actor"]

# Actor ids, unique in this process across runtimes: a handle that strays into another
# runtime (passed to one of its actors) then names no actor there, never another one.
_actor_ids = itertools.count(1)

_forked_warned = [False]  # a forked copy of the driver was told to end with os._exit()


class Runtime(Supervisor, _events.EventSource, _introspect.Inspectable, BackendChoice,
              StreamingClient):
    """Owns actor processes and shared memory. Use as ``async with Runtime() as rt``.

    Where one ``async with`` block cannot hold the whole program (a notebook: each cell is
    its own block), open it with ``rt = await Runtime().start()``, end it with ``close()``.

    Args:
      backend: ``"local"`` (default) or ``"ray"``: Ray actors (``address``, ``ray.init`` options).
      start_method: ``"spawn"`` (default: a fresh interpreter per actor) or
        ``"forkserver"`` (a warm, single-threaded server process forks each actor:
        much faster start-up, same isolation from the driver's threads).
      shm_budget: bytes of shared memory the driver and its actors may own together
        (default: half the RAM, or ``ACTORSHM_SHM_BUDGET``); 4 MiB (one arena) at least.
      shutdown_grace: seconds an actor gets to stop before SIGTERM, then SIGKILL.
      start_timeout: seconds an actor may take to start and run ``__init__``.
      gpus: the GPUs that ``num_gpus`` actors may get, as ``CUDA_VISIBLE_DEVICES``
        entries (ordinals or ``GPU-<uuid>``; default: the driver's
        ``CUDA_VISIBLE_DEVICES``, or every GPU CuPy sees).

    Raises:
      ValueError: an unknown ``start_method`` (a bare ``fork`` is not offered), or
        ``gpus`` naming a GPU twice.
    """

    def __init__(self, *, backend: str = "local", start_method: str = "spawn",
                 shm_budget: int | None = None, shutdown_grace: float = 2.0,
                 start_timeout: float = 60.0, gpus: list[int | str] | None = None) -> None:
        self.shm_budget = check_start_options(start_method, shm_budget)
        self.start_method = start_method
        self.shutdown_grace = check_number("shutdown_grace", shutdown_grace, 0, float,
                                            "seconds")
        self.start_timeout = check_number("start_timeout", start_timeout, 0, float,
                                          "seconds: no actor starts in no time", above=True)
        if gpus is not None and (isinstance(gpus, (str, bytes)) or not hasattr(gpus, "__iter__")):
            raise TypeError(f"gpus must be a list of GPU indices or UUIDs (e.g. [0, 1]), not "
                            f"{gpus!r}")
        if gpus is not None:
            gpus = list(gpus)
            bad = [g for g in gpus if isinstance(g, bool) or not (
                isinstance(g, int) and g >= 0 or isinstance(g, str) and g.strip())]
            if bad:  # (None or -1 became CUDA_VISIBLE_DEVICES="None", "-1": no GPU)
                raise ValueError(f"Runtime(gpus=...) takes GPU indices (ints >= 0) or "
                                 f"UUIDs (str), e.g. [0, 1]; not {bad}")
            gpus = [str(g) for g in gpus]
            dup = sorted({g for g in gpus if gpus.count(g) > 1})
            if dup:  # (two actors would each get the same GPU as "their own")
                raise ValueError(f"Runtime(gpus=...) names GPU(s) {dup} more than once; "
                                 "list each GPU once: an actor's num_gpus are its own")
        self._gpus = GpuSlots(gpus)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._actors: dict[int, ActorRecord] = {}
        self._names: dict[str, int] = {}
        self._killing: dict[int, asyncio.Task] = {}  # kills under way (``kill``)
        self._kill_begun: set[int] = set()  # actors whose kill() was called (``kill_begins``)
        self._starting = 0  # actors between their start and ``__init__``'s answer
        # spawns made for actors (``_services.cancel_spawn``): (conn, cid) -> task or id
        self.spawns_for_actors: collections.OrderedDict = collections.OrderedDict()
        self._open = False
        self._closing = False
        self._finalizer = None
        self.family: str | None = None  # (set by start(): see there)
        self.loop_guard = None  # (made by start(): ``_client.close_with_loop``)
        self.closed_with_loop = False  # (closed by it)
        self._ending: _descendants.Ending | None = None  # (made by start())
        self._owner = 0  # the driver's pid (set by start())
        self._forkserver: ForkServerClient | None = None
        self._release_hook = None  # (made by start(): dispatches releases on its loop)

    closing = property(lambda self: self._closing, doc="Whether it is closing or closed.")

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
        require_linux("the local backend")
        # A driver that closed its standard streams: the files this opens (the budget's
        # ledger, whose mmap keeps a dup of its fd; pidfds; subprocess's pipes) would
        # take their numbers, and its prints would go into them.
        fill_closed_stdio()
        _serialization.send_mp_main_by_value()
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if self.start_method == "forkserver":  # (its server starts on the first fork)
            self._forkserver = ForkServerClient(self.loop, self.start_timeout)
        with _client.runtimes_lock:
            _shm.set_budget(self.shm_budget, id(self))
            if _shm.pool().shared is None:  # the first runtime of this process
                _shm.shared_budget()
                _shm.watch_for_room(self.loop)
            self._release_hook = coalesced_call(self.loop, _leases.dispatch_releases)
            _leases.set_release_hook(self._release_hook)
            self._open = True
            _client.runtime_opened(self)
        self._ending = _descendants.Ending()
        self._owner = os.getpid()
        # The token of this process's actor ids, which its handles carry: kept, so that
        # one pickled in a fork of the driver (a DataLoader's worker) passes here.
        self.family = _client.family()
        self._finalizer = weakref.finalize(self, kill_all, self._actors, self._ending,
                                           self._owner)
        await _client.close_with_loop(self)
        return self

    __reduce__ = _client.refuse_runtime
    __enter__ = __exit__ = _client.refuse_sync_with

    async def __aenter__(self) -> "Runtime":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every actor (ask, grace period, SIGTERM, SIGKILL) and reap them.

        Leaving ``async with`` calls it; after ``start()``, call it yourself. Calling it
        again does nothing; while another task or thread closes it, it returns once that
        close has ended. Calling it in a copy of the driver made by ``os.fork()`` (a
        child leaving ``async with`` through ``sys.exit``) does nothing either: the
        actors are the driver's.
        """
        if not self._open or (self._closing and os.getpid() != self._owner):
            return
        limit = self.shutdown_grace + 5 + _descendants.GRACE
        if self._closing:
            if await _client.close_under_way(self, limit):
                return
        elif os.getpid() == self._owner and await _client.closed_on_own_loop(self, limit):
            return
        if os.getpid() != self._owner:
            self._open, self._closing = False, True
            self._finalizer.detach()
            _client.runtime_closed(self)  # (no longer current here)
            if _forked_warned[0]:
                return
            _forked_warned[0] = True  # (once: the runtimes nested in it all close)
            warnings.warn(
                "actorshm: a copy of the driver made with os.fork() is leaving its "
                "Runtime (the actors are the driver's, and stay): end such a child with "
                "os._exit() instead; an event loop (uvloop's above all) shutting down in "
                "a forked child can unregister the parent's sockets, and its calls then "
                "hang", RuntimeWarning, stacklevel=2)
            return
        self._closing = True
        try:
            if self.loop.is_closed():
                # Its loop ended with it open (an ``asyncio.run`` that returned): nothing
                # of it can run there any more, so its actors are killed, not asked.
                return
            recs = [r for r in self._actors.values() if r.alive or r.popen is not None]
            if self.closed_with_loop:  # (the message their calls fail with says why)
                for r in recs:  # (one leaving on its own: its exit code says why)
                    if r.alive and r.death is None and r.leaving is None:
                        r.death = f"{r.label} was stopped because its runtime closed " \
                                  f"{_client.WITH_LOOP}"

            async def stop() -> None:
                await asyncio.gather(*(r.stop(self.shutdown_grace) for r in recs),
                                     return_exceptions=True)
                await self._ending.wait()  # what they started: SIGTERM, SIGKILL after a grace
            task = asyncio.ensure_future(stop())
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                # Cancelled while the actors stop: asyncio.run's answer to a Ctrl-C (or
                # to the SIGINT a server such as uvicorn raises again after its own
                # shutdown), or a time-out. Cut short, the stop would lose what the
                # actors' atexit and finally blocks do: it ends first (within the
                # grace), then the cancel goes on. A second cancel kills them at once.
                try:
                    await asyncio.shield(task)
                except BaseException:
                    kill_all(self._actors, self._ending, self._owner)
                    raise
                raise
            except BaseException:
                kill_all(self._actors, self._ending, self._owner)
                raise
        finally:
            kill_all(self._actors, self._ending, self._owner)
            for r in list(self._actors.values()):
                self._reap(r)
            if self._forkserver is not None:
                self._forkserver.stop()
            _events.close(self)
            self._open = False
            with _client.runtimes_lock:  # (another thread may open one meanwhile)
                still_open = _client.runtime_closed(self)
                if _leases.release_hook() is self._release_hook:
                    # This loop may end now (a thread's ``asyncio.run``): releases are
                    # dispatched on the loop of a runtime still open, or, in an actor, on
                    # its worker's. With neither, this one's stays: its loop may run on
                    # (a notebook's), and a runtime opened later installs its own.
                    hook = next((rt._release_hook for rt in reversed(_client._runtimes)
                                 if getattr(rt, "_release_hook", None) is not None and
                                 not rt.loop.is_closed()), None) or \
                        getattr(_client.current_worker(), "release_hook", None)
                    if hook is not None:
                        _leases.set_release_hook(hook)
                if not still_open:
                    _leases.release_quarantine()  # whoever could hold those blocks is gone
                _shm.release_budget(id(self), trim=not still_open)  # idle memory too
            self._finalizer.detach()  # (set by start(), which close() needs)
            _client.end_loop_guard(self)

    # -- spawning ----------------------------------------------------------------
    async def spawn(self, cls: type, options: ActorOptions, args: tuple,
                    kwargs: dict) -> ActorHandle:
        """Start a process running ``cls(*args, **kwargs)`` (``Cls.spawn`` comes here).

        Args:
            cls: the actor class (the undecorated class of an ``@actor``).
            options: its ``ActorOptions``.
            args: for ``cls.__init__`` (sent like call arguments).
            kwargs: for ``cls.__init__``.

        Returns:
            An ``ActorHandle``, once ``__init__`` has returned in the actor.

        Raises:
            RuntimeError: the runtime is not open.
            ValueError: the name is taken by a live actor, or too few GPUs are free.
            TypeError: an argument cannot be pickled.
            ActorDiedError: the process died or ``__init__`` did not finish within
                ``start_timeout`` (the message holds the end of its stderr).
            Exception: whatever ``__init__`` raised, with the actor's traceback.
        """
        self._check_open()
        if threading.get_ident() != self._loop_thread:  # another thread's event loop
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self.spawn(cls, options, args, kwargs), self.loop))
        if options.name is not None:
            other = self._names.get(options.name)
            if other is not None and self._actors[other].has_future:
                raise ValueError(f"an actor named {options.name!r} already exists; "
                                 "choose another name or kill that actor first")
        rec = ActorRecord(next(_actor_ids), cls, options)
        rec.methods = public_methods(cls)
        rec.spawn_args = (args, kwargs)
        if options.num_gpus:
            rec.gpus = self._gpus.take(options.num_gpus, rec.cls_name)
        self._actors[rec.actor_id] = rec
        if options.name is not None:
            self._names[options.name] = rec.actor_id
        try:
            await self._start_process(rec)
        except BaseException as exc:
            if options.name is not None and self._names.get(options.name) == rec.actor_id:
                del self._names[options.name]
            self._gpus.release(rec)
            if rec.death is None:
                rec.death = f"{rec.label} was stopped: its spawn " + (
                    "was cancelled" if isinstance(exc, asyncio.CancelledError) else
                    f"failed ({type(exc).__name__})")
            await rec.stop(0.5)
            self._reap(rec)
            self._maybe_forget(rec)
            raise
        if not rec.alive and not self._closing:
            # Its process died after __init__ answered, before this spawn resumed: that
            # death was told as a failed spawn's (nothing restarts it, the record is
            # gone), so the spawn fails, rather than return a handle to a dead actor.
            raise ActorDiedError(rec.death or f"{rec.label} died as it started")
        rec.spawned = True
        if self._closing:  # it started as the runtime closed, which stops it: say so here
            raise ActorDiedError(rec.death or
                                 f"{rec.label} was stopped because its runtime closed")
        return self.track_handle(ActorHandle(self, rec.actor_id, rec.cls_name, rec.methods,
                                             options.name, rec.pid,
                                             options.max_pending_calls), rec)

    async def _start_process(self, rec: ActorRecord) -> None:
        fill_closed_stdio()  # (what a start opens: pidfds, subprocess's pipes, ...)
        try:
            parent, child = socket_pair()
        except OSError as exc:
            _raise_out_of_fds(exc)
        deadline = self.loop.time() + self.start_timeout  # (the fork's wait counts too)
        try:
            env = actor_env(rec)
            env["ACTORSHM_FAMILY"] = self.family  # (whose ids its handles carry)
            await start_process(self.loop, rec, child, env, self._forkserver, self._on_exit)
        except OSError as exc:
            parent.close()
            _raise_out_of_fds(exc)
        except BaseException:  # (cancelled while the fork server forks: no process here)
            parent.close()
            raise
        if rec.no_restart and rec.spawned:  # killed while its restart's process started
            parent.close()
            rec.death = rec.killed  # (its exit reports it: ``_restart_failed`` waits)
            rec.send_signal(signal.SIGKILL)
            raise ActorDiedError(rec.killed)
        if rec.conn is not None and rec.conn.sock is None and not rec.conn.closed:
            rec.conn.label = rec.label
            rec.conn.attach(parent)  # a restart: calls made meanwhile are buffered there
        else:
            rec.conn = Connection(self.loop, self, parent, label=rec.label)
            rec.conn.peer_id = rec.actor_id
        config = {"actor_id": rec.actor_id, "max_concurrency": rec.options.max_concurrency,
                  "shm_budget": self.shm_budget, "shutdown_grace": self.shutdown_grace,
                  "shm_ledger": rec.take_budget_slot()}
        args, kwargs = rec.take_spawn_args()
        try:
            fut = _introspect.call_init(rec, config, args, kwargs)  # (with its probe socket)
        except OSError as exc:  # (its process is stopped by ``spawn``)
            _raise_out_of_fds(exc)
        self._starting += 1
        try:
            pid = await asyncio.wait_for(fut, max(deadline - self.loop.time(), 0.001))
        except asyncio.TimeoutError:
            where = await _where_it_waits(rec)
            raise ActorDiedError(f"{rec.label} did not start within {self.start_timeout} s "
                                 f"{_crowd(self._starting - 1)}(Runtime(start_timeout=...) "
                                 f"sets the limit){where}") from None
        except ActorDiedError as exc:
            await asyncio.sleep(0.05)  # let stderr drain into the tail
            tail = "".join(rec.stderr_tail)
            raise ActorDiedError(f"{exc}\nlast lines of its stderr:\n{tail}" if tail
                                 else str(exc)) from None
        except Exception as exc:  # its __init__ raised (the error its reply carried)
            rec.init_error = exc = class_not_loaded(rec.cls, exc)
            raise exc
        finally:
            self._starting -= 1
        rec.pid = pid

    # -- calls -------------------------------------------------------------------
    def call(self, actor_id: int, method: str, args: tuple, kwargs: dict, what: str = "", **kw):
        """Call ``method`` on actor ``actor_id``; what handles' methods do.

        Args:
            actor_id: the actor, as its handle names it.
            method: the method's name.
            args: its positional arguments (numpy arrays travel in shared memory).
            kwargs: its keyword arguments.
            what: how errors name the call (``"Counter.incr"``); ``kw``: to ``Connection.call``.

        Returns:
            An asyncio future; from another thread, a ``concurrent.futures.Future``.

        Raises:
            TypeError: an argument cannot be pickled (raised here, nothing is sent).
        """
        if not self._open:  # (a handle kept past its runtime: maybe another loop's now)
            return _client.failed_call(ActorDiedError(self.death_of(actor_id)))
        if threading.get_ident() != self._loop_thread:
            _client.refuse_if_forked(self.loop)
            return _client.call_from_thread(self.loop, lambda: self.call(
                actor_id, method, args, kwargs, what, **kw))
        if self.loop.is_closed():  # (this thread's, ended: not the loop running now)
            self._check_open()
        rec = self._actors.get(actor_id)
        if rec is None or rec.conn is None:
            return _client.failed_call(ActorDiedError(self.death_of(actor_id)))
        if actor_id in self._kill_begun:  # (made after kill(): it would race the SIGKILL)
            return _client.failed_call(ActorDiedError(rec.killed))
        return rec.conn.call(method, args, kwargs, what, **kw)

    def call_group(self, actor_ids: list, method: str, args: tuple, kwargs: dict,
                   what: list):
        """Call ``method`` on every actor of ``actor_ids``, encoded once for all
        (``_multicast.call_many``); what ``ActorGroup`` calls do.

        Args:
            actor_ids: the actors, as their handles name them (distinct).
            method: the method's name.
            args: its positional arguments, the same for every actor.
            kwargs: its keyword arguments, the same for every actor.
            what: how errors name each actor's call (``"Worker.step"``), one per actor.

        Returns:
            One future per actor, in order; or None (nothing sent): make one ``call``
            per actor instead (from another thread, or a call that cannot be encoded
            once for all).
        """
        if threading.get_ident() != self._loop_thread:
            return None
        conns = []
        for actor_id in actor_ids:
            rec = self._actors.get(actor_id)
            if rec is None or rec.conn is None or actor_id in self._kill_begun:
                return None  # (each call then fails as a single call would)
            conns.append(rec.conn)
        return _multicast.call_many(conns, method, args, kwargs, what)

    def actor_pid(self, actor_id: int, pid: int) -> int:
        """The current pid of actor ``actor_id`` (it changes on a restart), or ``pid``
        if this runtime does not know the actor."""
        rec = self._actors.get(actor_id)
        gone = self.forgotten(actor_id) if rec is None else None
        return rec.pid if rec is not None else gone["pid"] if gone else pid

    def kill_begins(self, actor_id: int) -> None:
        """``handle.kill()`` was called: what this process asked actor ``actor_id`` and
        has not heard back fails now, as on Ray, not only if its process dies before
        answering (``kill`` gives a quick call time to answer while it settles), nor only
        if no answer is read before the kill's task first runs. (On the runtime's loop:
        ``handle.kill()`` on another thread's hands it over, ahead of the calls made
        after it, ``_client.on_loop``.)"""
        rec = self._actors.get(actor_id)
        if rec is not None and rec.alive and actor_id not in self._killing:
            # The calls made from now on fail at once too (until the kill is done, when
            # its end says so), also those made before the kill's task first runs.
            self._kill_begun.add(actor_id)
            for conn in rec.open_conns:
                conn.fail_pending(ActorDiedError(rec.killed))

    async def kill(self, actor_id: int) -> None:
        """Kill actor ``actor_id`` at once (SIGKILL, no restart); return once it is gone.
        Its calls fail with ``ActorDiedError``; an unknown or dead actor is no error.

        Args:
            actor_id: the actor, as its handle names it.
        """
        if self._open and threading.get_ident() != self._loop_thread:
            _client.refuse_if_forked(self.loop)
            # (another thread's event loop: the runtime's loop owns the record, and its
            # exit event, which a wait on this loop would bind here)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self.kill(actor_id), self.loop))
        rec = self._actors.get(actor_id)
        if rec is None:
            self._kill_begun.discard(actor_id)
            return
        rec.no_restart = True  # also ends a restart in progress
        if not rec.alive:
            self._kill_begun.discard(actor_id)  # (its calls fail as its end says)
            if rec.conn is not None and not rec.conn.closed:  # calls waiting for a restart
                rec.death = rec.killed
                rec.conn.close(ActorDiedError(rec.death))
                if not rec.starting:  # (a process starting reports its own end)
                    # Its last event said a restart follows; none will (``_restart``).
                    _events.emit(self, "died", rec, rec.death, will_restart=False)
            self._maybe_forget(rec)
            return
        rec.death = rec.killed
        # Begun, a kill goes through even if its caller stops waiting (a time-out, a
        # cancel): stopped half way, it would leave the actor running with its restarts
        # and its record's death already spent, so a later crash would neither restart
        # it nor be named. (Inside an actor the driver's kill runs on regardless.)
        task = self._killing.get(actor_id)
        if task is None:
            self.kill_begins(actor_id)
            task = self._killing[actor_id] = asyncio.ensure_future(self._kill_now(rec))
            task.add_done_callback(lambda _t: (self._killing.pop(actor_id, None),
                                               self._kill_begun.discard(actor_id)))
        await asyncio.shield(task)

    async def _kill_now(self, rec: ActorRecord) -> None:
        """``kill``'s work: settle what the actor owes, SIGKILL it, wait for its end."""
        if rec.conn is not None and not rec.conn.closed and rec.conn.sock is not None:
            # Blocks it passed on and just got back: let their withdrawals go out first,
            # so their owners need not keep them (bounded: a busy actor is killed anyway;
            # one whose process is ending, its calls held for a restart, is not asked).
            try:
                await asyncio.wait_for(rec.conn.call("__settle__", (0.05,), {}), 0.1)
            except Exception:
                pass
        rec.send_signal(signal.SIGKILL)  # (not if it exited during that wait)
        await rec.exited.wait()

    async def get_actor(self, name: str) -> ActorHandle:
        """A handle to the live actor spawned with ``options(name=name)``.

        Args:
            name: the actor's name.

        Raises:
            ValueError: no live actor has that name.
        """
        self._check_open()
        actor_id = self._names.get(name)
        rec = self._actors.get(actor_id) if actor_id is not None else None
        if rec is None or not rec.has_future:
            elsewhere = any(rt is not self and getattr(rt, "_names", {}).get(name) is not None
                            for rt in list(_client._runtimes))
            raise ValueError(f"no live actor named {name!r}" + (
                " in this runtime; one of that name lives in another runtime open here (an "
                "outer one): names are looked up in the runtime in use, the innermost, so "
                "ask that one, `await outer_rt.get_actor(name)`" if elsewhere else
                "; named actors are made with Cls.options(name=...).spawn()"))
        return self.track_handle(ActorHandle(self, rec.actor_id, rec.cls_name, rec.methods,
                                             name, rec.pid, rec.options.max_pending_calls),
                                 rec)

    def record(self, actor_id: int) -> ActorRecord | None:
        """The driver's record of actor ``actor_id`` (``_launch.ActorRecord``), or None."""
        return self._actors.get(actor_id)

    def actors(self) -> list[dict]:
        """A snapshot of the actors this runtime started, by id: the live ones, and the
        latest dead ones (a thousand of those whose handles are gone)."""
        rows = [{"id": r.actor_id, "class": r.cls_name, "pid": r.pid, "alive": r.alive,
                 "name": r.options.name, "death": r.death} for r in self._actors.values()]
        rows += [dict(g) for g in (self._gone or {}).values()]
        return sorted(rows, key=lambda r: r["id"])

    # -- services for actor processes --------------------------------------------
    def handle_call(self, conn: Connection, cid: int, call: list) -> None:
        """Answer a service call from an actor process (``Host``): connect it to a peer,
        spawn, kill or find an actor for it, or report the driver's stats."""
        _services.serve(self, conn, cid, call)

    def connection_eof(self, conn: Connection) -> None:
        """An actor closed its end (``Host``): it reads no reply to a spawn it asked for
        any more, though the connection stays open until its exit is known."""
        if self.spawns_for_actors:
            _services.forget_spawns(self, conn)
        super().connection_eof(conn)

    def connection_closed(self, conn: Connection) -> None:
        """An actor's connection closed (``Host``): no cancel of a spawn comes on it."""
        if self.spawns_for_actors:
            _services.forget_spawns(self, conn)
        super().connection_closed(conn)

    def cancel_call(self, conn: Connection, cid: int) -> None:
        """An actor cancelled service call ``cid``: a spawn it awaited leaves nothing
        running (``_services.cancel_spawn``); other services are quick, or (``kill``)
        go through once begun."""
        _services.cancel_spawn(self, conn, cid)

    def _check_open(self) -> None:
        _client.refuse_if_forked(self.loop)
        if self.closed_with_loop:
            raise RuntimeError(f"this actorshm Runtime closed {_client.WITH_LOOP}")
        if not self._open or self._closing:
            raise RuntimeError("this actorshm Runtime is not open (closed, or never "
                               "started): use it inside `async with actorshm.Runtime():`, or "
                               "after `rt = await actorshm.Runtime().start()`")
        if self.loop is not None and self.loop.is_closed():
            raise RuntimeError(
                "this actorshm Runtime was opened on an event loop that has since closed "
                "(an asyncio.run() that returned, a test's loop): its actors and calls "
                "live on that loop. Open the runtime inside the asyncio.run() that uses "
                "it (`async with actorshm.Runtime():` in main, or actorshm.run(main())), "
                "or close it before its loop ends (`await rt.close()`)")


async def _where_it_waits(rec: ActorRecord, limit: float = 1.0) -> str:
    """The stacks of the threads of ``rec``'s process, which is late to start (its
    import of the actor's module, or ``__init__``, hangs), as its faulthandler prints
    them to its stderr on ``STACK_SIGNAL``: gathered for up to ``limit`` seconds, for
    the error to quote; "" if none came (not started far enough to have the handler)."""
    got = rec.stderr_capture = []
    try:
        if not rec.send_signal(_introspect.STACK_SIGNAL):
            return ""
        loop = asyncio.get_running_loop()
        deadline, seen = loop.time() + limit, -1
        while loop.time() < deadline and (not got or len(got) != seen):
            seen = len(got)
            await asyncio.sleep(0.1)
    finally:
        rec.stderr_capture = None
    # Its main thread first (faulthandler prints it last, as the current one), and not
    # the thread of actorshm's own that answers the driver's probes.
    blocks: list = []
    for ln in got:
        if ln.startswith(("Thread ", "Current thread ")) or not blocks:
            blocks.append([])
        if ln.strip():
            blocks[-1].append(ln)
    blocks.sort(key=lambda b: not b[0].startswith("Current thread "))
    lines = [ln for b in blocks if not any("in _probe_loop" in ln for ln in b) for ln in b]
    if not lines:
        return ""
    return ". Where it was as the time ran out (innermost call first):\n" + \
        "".join(lines[:40])


def _crowd(others: int) -> str:
    """Why a start may have been slow: as many others starting at once, or ""."""
    try:
        cpus = len(os.sched_getaffinity(0))  # (those it may use: a container's cpuset)
    except (AttributeError, OSError):  # pragma: no cover
        cpus = os.cpu_count() or 1
    if others < 2 * cpus:
        return ""
    return (f"while {others} other actors were starting on {cpus} CPU(s), each slowing "
            "the others: spawn fewer at once (in batches), or raise the limit ")


def _raise_out_of_fds(exc: OSError):
    """Raise ``exc``, or what ``out_of_fds`` makes of it (the driver is out of fds)."""
    better = out_of_fds(exc)
    if better is exc:
        raise exc
    raise better from None


def current_runtime() -> Runtime:
    """The runtime that ``spawn`` uses here: the one opened last and not yet closed (on
    the event loop running in this thread, if one was opened on it).

    Raises:
        RuntimeError: no runtime is open (the message says how to open one), or this is
            an actor's process (actors use handles and ``get_actor``).
    """
    if _client.current_worker() is not None:
        raise RuntimeError("current_runtime() is for the driver; inside an actor, use "
                           "handles and actorshm.get_actor()")
    rt = _client.innermost_runtime()
    if rt is None:
        raise RuntimeError(
            "no actorshm runtime is open. Open one with `async with actorshm.Runtime():` "
            "around your code, or run it with `actorshm.run(main())`.")
    return rt


async def get_actor(name: str, **ray_options: Any) -> ActorHandle:
    """A handle to the live actor spawned with ``options(name=name)``.

    Works in the driver and inside actors.

    Args:
        name: the name given at spawn, as in ``Cls.options(name="ps").spawn()``.

    Raises:
        ValueError: no live actor has that name (whatever its type: API.md's rule).
    """
    if ray_options:
        from ._habits import OPTIONS, advice
        raise TypeError(f"get_actor() takes the name alone, not {sorted(ray_options)}"
                        f"{advice(OPTIONS, ray_options)}")
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
    try:
        rt = Runtime(**runtime_options)
    except BaseException:
        if inspect.iscoroutine(main):
            main.close()  # it will never run: no "never awaited" warning on top
        raise

    async def wrapper():
        # On Ray, one process holds one connection: a runtime ``main`` opens itself
        # with options of its own takes it over while this one has no actors.
        if rt.backend == "ray":
            rt.opened_by_run = True
        try:
            await rt.start()
        except BaseException:  # (Ray could not start, say): main will never run
            if inspect.iscoroutine(main):
                main.close()  # no "never awaited" warning on top of the error
            raise
        try:
            return await main
        finally:
            await rt.close()

    try:
        import uvloop
    except ImportError:
        return asyncio.run(wrapper())
    fill_closed_stdio()
    if hasattr(uvloop, "run"):
        return uvloop.run(wrapper())
    install_event_loop_policy()  # pragma: no cover - old uvloop
    return asyncio.run(wrapper())  # pragma: no cover
