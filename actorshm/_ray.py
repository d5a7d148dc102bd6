"""The Ray backend: the same ``@actor`` classes and handles, run as Ray actors.

``Runtime(backend="ray")`` makes a ``RayRuntime`` (``_ray_runtime``); it and this
module's ``RayClient`` sit beside the local runtime behind the handle layer
(``_actor.py``): a handle asks its client to ``call``, ``kill``, ``spawn`` and
``get_actor``. Each actorshm actor is one generic Ray actor (``_ray_host.Host``) that
builds the user's instance. Handles carry their Ray actor handle in their actor id
(``RayActorId``), so they pickle through Ray and keep calling through Ray in whatever
process they land. The order of each caller's calls is kept by ``_ray_order``. Ray is
imported only in these modules, on first use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import signal
import sys
import time
from typing import Any

from . import _client, _registry
from ._actor import STREAM, ActorHandle, ActorOptions, public_methods
from ._descendants import is_stopped, machine, process_start
from ._client import ThreadCallFuture
from ._results import (CallFuture, DependencyFailed, fail_not_made, futures_in, not_made,
                       with_results)
from ._errors import PICKLING_FAILURES, ActorDiedError, class_not_loaded
from ._ray_errors import (arguments_unsent, check_args, outcome, pickling_failed, translate,
                          unavailable_error)
from ._ray_host import Host, register_reducers, simple
from ._ray_order import CallOrder, end_actor, fail_on_its_loop, ray_up
from ._ray_placement import await_ready, check_feasible, requested
from ._remote_errors import copy_exc, decode_exception
from ._streams import chain

__all__ = ["RayClient", "RayActorId", "CLIENT", "get_client", "ray_env", "import_ray"]

STREAM_BUFFER = 16  # items a streaming method may run ahead of its consumer
RESTART_WAIT = 60.0  # seconds get_actor waits for a named actor Ray is restarting


def ray_env(address: str | None = None) -> None:
    """Settings for this process's Ray (read when Ray is imported and when it connects;
    a value the user set wins). Always: fail the calls pending on an actor's dead
    process at once (a setting of the caller's). Ray otherwise waits up to a second for
    the cause of the death, which for an actor it restarts (``max_restarts``) never
    comes, so each pending call would fail a second late; the calls made after it wait
    for the new process (``RayClient.watch_restart``).

    A Ray started from this process (no ``address``): bound to 127.0.0.1 (on Linux
    too), and no Ray metrics (nothing reads them without the dashboard, which such a
    Ray does not start): calls then carry their identity in their Ray task names, Ray's
    cheapest way (``names_in_tasks``). A cluster at a loopback address (``ray start
    --node-ip-address 127.0.0.1``): this process takes part as 127.0.0.1 too (else Ray
    takes the machine's own address for it, and the connection retried for minutes).
    """
    os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", "0")
    if address is None or _loopback(address):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = sys.modules.get("ray")
    if address is None and not (ray is not None and ray.is_initialized()):
        # (not for a Ray the user started: its metrics are as it was started with)
        os.environ.setdefault("RAY_enable_metrics_collection", "0")


def _loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``, ``ray://host:port``; ``"auto"``: the one
    ``RAY_ADDRESS`` or the latest ``ray start`` on this machine names) is this
    machine's loopback interface."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _current_cluster()
        if address in ("", "auto"):
            return False
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]").lower()
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _current_cluster() -> str:
    """The address of the cluster ``ray start`` last started on this machine, or ""."""
    tmp = os.environ.get("RAY_TMPDIR") or "/tmp/ray"
    try:
        with open(os.path.join(tmp, "ray_current_cluster")) as f:
            return f.read().strip()
    except OSError:
        return ""


def names_in_tasks() -> bool:
    """Whether calls may carry their identity in their Ray task names (a name per
    call): only where Ray's metrics are off in the whole Ray. Ray records its task
    metrics under each task's name, so with metrics on, a name per call grew the
    memory of the caller and of the actor by some 2.5 KB per call, for good. Off means:
    off in this process, and this process started that Ray (``ray_env`` then), so that
    its processes have them off too; in an actor, off in its process (whose setting is
    its Ray's). A driver that joined a cluster cannot know the cluster's setting."""
    if os.environ.get("RAY_enable_metrics_collection", "").strip().lower() not in \
            ("0", "false"):
        return False
    return _client.current_worker() is not None or _ray_started_here()


def _ray_started_here() -> bool:
    """Whether this process's ``ray.init`` started the Ray it is connected to."""
    try:
        from ray._private import worker
        node = worker._global_node
        return bool(node is not None and node.head)
    except Exception:  # pragma: no cover - another Ray
        return False


# The first Ray whose async actors take ``_generator_backpressure_num_objects``, which
# bounds how far a stream runs ahead (earlier ones refuse it; the Ray suite passes on
# 2.57.0 and fails on 2.56.1).
MIN_RAY = (2, 57)


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the Ray backend needs Ray: pip install 'actorshm[ray]' "
                          f"(or pip install 'ray>={MIN_RAY[0]}.{MIN_RAY[1]}')") from exc
    check_ray_version(ray.__version__)
    return ray


def check_ray_version(version: str) -> None:
    """Raise an ``ImportError`` that says what to install where Ray ``version`` is older
    than the backend needs."""
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:  # (a development build: taken as recent)
        return
    if have < MIN_RAY:
        want = f"{MIN_RAY[0]}.{MIN_RAY[1]}"
        raise ImportError(
            f"the Ray backend needs Ray {want} or later, and this is Ray {version} (an "
            f"older Ray refuses to bound how far a stream runs ahead on an async actor): "
            f"pip install -U 'ray>={want}'")


KILLED_KEPT = 10_000  # dead actors' keys a process keeps (``RayClient._dead``)


class RayActorId:
    """The actor id of a handle on the Ray backend: the Ray actor handle and its facts."""

    def __init__(self, handle: Any, key: str, streams: frozenset,
                 named: bool = False, restarts: int = 0, session: str | None = None) -> None:
        now = ray_connection()
        if handle is not None and session is not None and now is not None and \
                session != now[0]:
            handle = None  # unpickled in another Ray session: as ``_stale``
        self.handle = handle  # (None: a handle of a Ray session that ended, ``_stale``)
        self.session = session if session is not None else now and now[0]
        self._worker = now and now[1]  # this process's connection to Ray it came through
        self.key = key
        if handle is None:
            CLIENT.killed(key, "is gone: its runtime closed (and shut its Ray down)")
        self.streams = streams
        self.named = named  # calls carry their identity in Ray's task name
        self.restarts = restarts  # its max_restarts: whether a new process may come
        self.pid = 0  # its first process's pid (``RayClient._pids`` has later ones)
        self._methods: tuple | None = None  # (call0, call1) of the Ray actor handle

    def detached(self) -> "RayActorId":
        """A copy without Ray's actor handle (what a summary of a dead actor keeps: the
        handle holds ~64 KB of Ray's objects); equal to this one."""
        d = object.__new__(RayActorId)
        d.__dict__.update(self.__dict__)
        d.handle, d._methods = None, None
        return d

    def call_methods(self) -> tuple:
        """The host's ``call0`` and ``call1`` (Ray makes a new object per attribute read)."""
        if self._methods is None:
            self._methods = (self.handle.call0, self.handle.call1)
        return self._methods

    def __reduce__(self):
        now = ray_connection()
        if self.handle is None or now is not None and (
                self.session and self.session != now[0]
                or self._worker and self._worker != now[1]):
            # A handle of a runtime that closed, whose connection to Ray (or whose Ray)
            # is gone: Ray cannot pickle its actor handle through another connection
            # (the driver died on a check in Ray's C++ code), so it goes as a handle whose
            # calls fail, as locally.
            return (_stale, (self.key, self.streams, self.session))
        return (RayActorId, (self.handle, self.key, self.streams, self.named,
                             self.restarts, self.session))

    def actorshm_client(self) -> "RayClient":
        return CLIENT

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RayActorId) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return self.key[:12]


def ray_connection() -> tuple | None:
    """This process's connection to Ray: ``(the Ray session, its worker id)``, or None.
    The session is the cluster's (every driver and actor of one Ray shares it); the
    worker id changes each time this process connects anew."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        ctx = ray.get_runtime_context()
        session = ctx.get_session_name() if hasattr(ctx, "get_session_name") else \
            ctx.gcs_address
        return session, ctx.get_worker_id()
    except Exception:
        return None


def _stale(key: str, streams: frozenset, session: str | None) -> RayActorId:
    """A handle of a Ray runtime that closed, received: its calls fail (ActorDiedError)."""
    return RayActorId(None, key, streams, session=session)


async def _name_released(ray: Any, name: str, handle: Any, limit: float = 5.0) -> None:
    """Wait (at most ``limit`` s) until Ray has let go of the name of the actor ``handle``
    it was asked to kill: ``ray.kill`` returns before Ray's control service has done so,
    and a spawn under that name right after a cancelled one would find it taken."""
    for _ in range(int(limit / 0.01)):
        try:
            if ray.get_actor(name)._actor_id != handle._actor_id:
                return
        except Exception:  # (ValueError: no actor has that name any more)
            return
        await asyncio.sleep(0.01)


class RayClient(CallOrder):
    """Makes calls through Ray, in the driver and inside Ray-hosted actors."""

    shares_memory = False  # arguments travel through Ray's object store, copied

    def __init__(self) -> None:
        super().__init__()  # (``CallOrder``'s state)
        # Keys of actors killed or dead for good (the latest ``KILLED_KEPT``, in order):
        # their calls fail at once. (An older one's call goes to Ray, which fails it too.)
        self._dead: dict[str, str] = {}  # those actors' keys: why calls to them fail
        self._remote_host = None
        self._names_ok: tuple | None = None  # (Ray connection, answer): ``_names_work``
        self._spawn_listeners: list = []
        # The cluster cannot grow (a local Ray a runtime started): a resource request no
        # node can meet is an error at spawn, not a wait forever (``_ray_placement``).
        self.fixed_cluster = False
        self._waits: set = set()  # ``wait``: awaits on Ray that a closing runtime ends
        # calls waiting for results they take as arguments: task -> its actor's key
        self._waits_for_args: dict = {}
        self._calls: dict = {}  # pending calls' futures -> (actor key, what): ``close_calls``
        # spawned actors' answers to ``probe("where")``: ``kill``
        self._where: dict = {}
        self._asking: set = set()  # ``learn_where``'s tasks

    async def wait(self, awaitable: Any) -> Any:
        """Await ``awaitable`` (a Ray reference or a coroutine awaiting Ray), unless the
        runtime closes meanwhile (``abort_waits``): an await on Ray that resumes after
        Ray has shut down ends the whole process."""
        task = asyncio.ensure_future(awaitable)
        self._waits.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            why = getattr(task, "actorshm_abort", None)
            if why is not None:
                raise why from None
            raise
        finally:
            self._waits.discard(task)

    def abort_waits(self, why: BaseException) -> None:
        """End every ``wait`` in progress with ``why`` (the runtime is closing)."""
        for task in list(self._waits):
            task.actorshm_abort = why
            task.cancel()

    def close_calls(self, keys: set | None, why: str) -> None:
        """Fail the calls still pending on the actors ``keys`` (None: on every actor)
        with ``ActorDiedError`` (``why``), each on its own event loop (another thread's
        too), as retrieved: a runtime that closes ends them without asyncio's "exception
        was never retrieved" for each (an ``await`` still raises), as a connection that
        ends does on the local backend."""
        for fut, (key, what) in list(self._calls.items()):
            if (keys is None or key in keys) and not fut.done():
                fail_on_its_loop(fut, ActorDiedError(f"{what}: {why}"))

    # -- calls -------------------------------------------------------------------
    def call(self, actor_id: RayActorId, method: str, args: tuple, kwargs: dict,
             what: str = ""):
        what = what or method
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if method in actor_id.streams:
            return self.stream(actor_id, method, args, kwargs, what)
        if loop is None:  # a sync method in a thread: block on the concurrent future
            return self._call_from_thread(actor_id, method, args, kwargs, what)
        fut = CallFuture(loop=loop)  # (it may be passed to another call unfinished)
        gone = self._unreachable(actor_id)
        if gone is not None:
            fut.set_exception(ActorDiedError(f"{what}: {gone}"))
            return fut
        self._calls[fut] = (actor_id.key, what)
        fut.add_done_callback(lambda f: self._calls.pop(f, None))
        deps = futures_in((*args, *kwargs.values())) if args or kwargs else ()
        if deps:  # results as arguments
            if all(d.done() for d in deps):  # finished: their results in their places
                try:
                    args, kwargs = _with_results(args, kwargs)
                except DependencyFailed as dep:
                    fail_not_made(fut, copy_exc(dep.exc))
                    return fut
            else:  # sent once they are in, under the number it takes now
                check_args(args, kwargs, what)
                number = self._number(actor_id)
                task = loop.create_task(self._send_when_ready(
                    deps, fut, actor_id, method, args, kwargs, what, number, loop))
                self._waits_for_args[task] = actor_id.key
                task.add_done_callback(lambda t: self._waits_for_args.pop(t, None))
                fut.add_done_callback(lambda f: f.cancelled() and task.cancel())
                return fut
        if actor_id.key in self._restarting:  # Ray restarts its process: the call waits
            check_args(args, kwargs, what)  # for the new one
            number = self._number(actor_id)
            if self._hold(actor_id.key, (fut, method, args, kwargs, what, number,
                                         chain.get())):
                return fut
            try:  # (the new process came meanwhile: it goes now, under that number)
                ref, seq = self._submit(actor_id, None, method, args, kwargs, what, number)
            except BaseException:
                self._drop(actor_id, number[0])
                raise
        else:
            ref, seq = self._submit(actor_id, None, method, args, kwargs, what)
        self._settle_with(actor_id, fut, ref, seq, what, loop)
        return fut

    async def _send_when_ready(self, deps, fut, actor_id, method, args, kwargs, what,
                               number, loop) -> None:
        """Send a call whose arguments hold unfinished calls' futures (``deps``) once
        they are done, with their results in their places, under the number it took
        when it was made (so the caller's later calls to that actor run after it); a
        failed dependency fails the call, which then skips its turn."""
        try:
            pending = [d for d in deps if not d.done()]
            if pending:  # (one may have finished since the call: cancelled at once)
                await asyncio.wait(pending)
            if fut.done() or actor_id.key in self._dead or not ray_up():
                if not fut.done():
                    why = self._dead.get(actor_id.key) or "is gone (Ray was shut down)"
                    fut.set_exception(ActorDiedError(f"{what}: the actor {why}"))
                raise _Dropped
            try:
                args, kwargs = _with_results(args, kwargs)
            except DependencyFailed as dep:
                fail_not_made(fut, copy_exc(dep.exc))
                raise _Dropped from None
            if self._hold(actor_id.key, (fut, method, args, kwargs, what, number,
                                         chain.get())):
                return  # (the actor restarts: the call waits for it too)
            ref, seq = self._submit(actor_id, None, method, args, kwargs, what, number)
        except BaseException as exc:  # (cancelled: the call, its actor's kill, a close)
            if not isinstance(exc, _Dropped) and not fut.done():
                dead = self._dead.get(actor_id.key)
                why = f"the actor {dead}" if dead is not None else "the runtime closed"
                fut.set_exception(exc if isinstance(exc, Exception) else
                                  ActorDiedError(f"{what}: {why}"))
            self._drop(actor_id, number[0])
            return
        self._settle_with(actor_id, fut, ref, seq, what, loop)

    def _unreachable(self, actor_id: RayActorId) -> str | None:
        """Why a call to ``actor_id`` fails at once, without Ray (None: it is sent).
        Killed; or a handle of a runtime that closed (its Ray handle gone, or Ray shut
        down: a call on Ray then would start a new local Ray, Ray's auto-init)."""
        dead = self._dead.get(actor_id.key)
        if dead is not None:
            return f"the actor {dead}"
        if actor_id.handle is None or not ray_up():
            return "the actor is gone: its runtime closed (and shut its Ray down)"
        return None

    def killed(self, key: str, why: str = "was killed") -> None:
        """Actor ``key`` was killed, or died for good (``why`` says which): calls made from
        now on fail ("the actor " + ``why``), and so do those still waiting for their
        arguments (now, not once the arguments are in)."""
        self._dead[key] = why
        if len(self._dead) > KILLED_KEPT:
            del self._dead[next(iter(self._dead))]
        for task in [t for t, k in list(self._waits_for_args.items()) if k == key]:
            try:
                task.get_loop().call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop is closed: the task ended with it
                pass

    def _settle_with(self, actor_id, fut, ref, seq, what, loop) -> None:
        """Give ``fut`` (on ``loop``) the outcome of call ``seq`` (``ref``), and send the
        actor a cancel when ``fut`` is cancelled."""
        def settle(cf: concurrent.futures.Future) -> None:
            if fut.done():
                return
            exc = cf.exception()
            if exc is not None:
                err = translate(exc, what)
                if isinstance(err, ActorDiedError):  # (restarting: Ray says "unavailable")
                    self.watch_restart(actor_id, loop, actor_id.restarts != 0 and
                                       isinstance(exc, unavailable_error()))
                else:  # it may never have reached the actor's code: skip its turn there
                    self._cancel(actor_id, seq)
                if isinstance(err, BaseException) and not fut.cancelled():
                    fut.set_exception(err)
                    if isinstance(err, ActorDiedError):
                        # The actor died with the call pending: nobody awaiting it, it
                        # prints no "exception was never retrieved", as locally (where
                        # the calls waiting on a connection that ends fail quietly).
                        fut.exception()
                return
            result, err = outcome(cf.result(), what)
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(result)

        def done(c: concurrent.futures.Future) -> None:
            self._finished(actor_id, seq, c, loop)
            try:
                loop.call_soon_threadsafe(settle, c)
            except RuntimeError:  # its loop closed (a thread's, ended): nobody waits
                self._calls.pop(fut, None)

        cf = ref.future()
        cf.add_done_callback(done)
        fut.add_done_callback(lambda f: f.cancelled() and self._cancel(actor_id, seq))

    def _submit(self, actor_id, remote_method, method, args, kwargs, what, number=None,
                link=None):
        """Send one call (or stream, ``remote_method``) through Ray: ``(ref, seq)``.

        Each call carries its number ``seq`` and ``base``, the number of this caller's
        oldest call to that actor that Ray has not finished: a host that starts (or
        restarts, ``max_restarts``) takes its turns from ``base``, so the calls it gets
        run in the order they were made, whichever Ray delivers first. Every call's end
        must reach ``_finished`` (its caller arranges that). ``number``: the call's
        ``(seq, base)``, taken earlier (``_number``) by a call that waited; ``link``:
        the chain (``_streams.chain``) where such a call was made (default: here).
        """
        if number is None:  # (a call that waited was checked when it was made)
            check_args(args, kwargs, what)
        std = sys.stdout, sys.stderr  # (``arguments_unsent``)
        try:
            with self._lock:
                if number is None:
                    seq, base, opened = self._next(actor_id.key)
                else:
                    seq, base = number
                if link is None:  # (in an actor: the call this one is made in)
                    link = chain.get()
                if remote_method is None and actor_id.named and not link:  # see Host.call0
                    call0, call1 = actor_id.call_methods()
                    name = f"{method}:{self._caller}:{seq}:{base}"
                    if args or kwargs:
                        payload = (args, kwargs)
                        if simple(args) and simple(kwargs):
                            payload = pickle.dumps(payload, protocol=5)
                        ref = call1.options(name=name).remote(payload)
                    else:
                        ref = call0.options(name=name).remote()
                else:
                    req = (method, args, kwargs, self._caller, seq, base)
                    if link:  # the chain, as ``Worker.call``
                        req += ((*link[0], link[1:]),)
                    if simple(args) and simple(kwargs):
                        req = pickle.dumps(req, protocol=5)
                    ref = (remote_method or actor_id.handle.call).remote(req)
                if number is None:
                    opened[seq] = None
                    self._seqs[actor_id.key] = seq + 1
            return ref, seq
        except PICKLING_FAILURES as exc:  # (sync code: a CancelledError is a __reduce__'s)
            if isinstance(exc, TypeError) or pickling_failed(exc):  # (an argument's
                raise arguments_unsent(exc, what, args, kwargs, std) from exc  # reduce)
            raise

    def _call_from_thread(self, actor_id, method, args, kwargs, what):
        out = ThreadCallFuture()  # (awaitable from a loop of that thread's own, as locally)
        gone = self._unreachable(actor_id)
        if gone is not None:
            out.set_exception(ActorDiedError(f"{what}: {gone}"))
            return out
        ref, seq = self._submit(actor_id, None, method, args, kwargs, what)
        self._calls[out] = (actor_id.key, what)  # (failed by a kill, a close: close_calls)
        out.add_done_callback(lambda f: self._calls.pop(f, None))

        def settle(cf) -> None:
            if out.done():  # cancelled by the caller, or failed by a kill or a close
                return
            exc = cf.exception()
            try:
                if exc is not None:
                    err = translate(exc, what)
                    if not isinstance(err, ActorDiedError):  # (as in ``call``)
                        self._cancel(actor_id, seq)
                    out.set_exception(err)
                    return
                result, err = outcome(cf.result(), what)
                out.set_exception(err) if err is not None else out.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass

        ref.future().add_done_callback(lambda c: (self._finished(actor_id, seq, c),
                                                  settle(c)))
        out.add_done_callback(lambda f: f.cancelled() and self._cancel(actor_id, seq))
        return out

    def stream(self, actor_id: RayActorId, method: str, args: tuple, kwargs: dict,
               what: str = "", run_ahead: int = STREAM_BUFFER):
        """Call generator method ``method``: an async iterator of its items
        (``RayStream``), the actor running at most ``run_ahead`` items ahead (Ray's
        generator back-pressure). Not counted in ``max_pending_calls``, as locally.
        On a killed actor, an iterator whose first item raises ``ActorDiedError``."""
        what = what or method
        gone = self._unreachable(actor_id)
        if gone is not None:
            return _failed_stream(ActorDiedError(f"{what}: {gone}"))
        remote = actor_id.handle.stream.options(
            num_returns="streaming", _generator_backpressure_num_objects=run_ahead)
        from ._ray_stream import RayStream
        deps = futures_in((*args, *kwargs.values())) if args or kwargs else ()
        if deps:  # results as arguments, as in ``call``
            if all(d.done() for d in deps):
                try:
                    args, kwargs = _with_results(args, kwargs)
                except DependencyFailed as dep:
                    return _failed_stream(not_made(copy_exc(dep.exc)))
            else:  # started once they are in, under the number it takes now
                check_args(args, kwargs, what)
                number = self._number(actor_id)
                start = asyncio.get_running_loop().create_task(self._stream_when_ready(
                    deps, actor_id, remote, method, args, kwargs, what, number))
                self._waits_for_args[start] = actor_id.key
                start.add_done_callback(lambda t: self._waits_for_args.pop(t, None))
                return RayStream(start, what, translate, outcome,
                                 lambda _gen: self._cancel(actor_id, number[0]), self.wait,
                                 lambda _gen: self._stream_ended(actor_id, number[0]))
        gen, seq = self._submit(actor_id, remote, method, args, kwargs, what)
        gen.completed().future().add_done_callback(
            lambda c: self._finished(actor_id, seq, c))
        return RayStream(gen, what, translate, outcome,
                         lambda _gen: self._cancel(actor_id, seq), self.wait,
                         lambda _gen: self._stream_ended(actor_id, seq))

    def _stream_ended(self, actor_id: RayActorId, seq: int):
        """An awaitable done once stream ``seq`` closed its generator in the actor; None
        when there is nothing to ask: Ray is down (a call now would start a new local
        Ray, Ray's auto-init) or the actor was killed (its generator went with it)."""
        if not ray_up() or actor_id.key in self._dead:
            return None
        return actor_id.handle.stream_ended.remote(self._caller, seq)

    async def _stream_when_ready(self, deps, actor_id, remote, method, args, kwargs, what,
                                 number):
        """Start a streaming call whose arguments hold unfinished calls' futures once
        they are in (as ``_send_when_ready``): its Ray generator. A failed dependency,
        a kill, or a cancel (the stream left before its start) gives up its turn."""
        try:
            try:
                pending = [d for d in deps if not d.done()]
                if pending:  # (as in ``_send_when_ready``)
                    await asyncio.wait(pending)
            except asyncio.CancelledError:
                why = self._dead.get(actor_id.key)  # (``killed``)
                if why is not None:
                    raise ActorDiedError(f"{what}: the actor {why}") from None
                raise
            if getattr(asyncio.current_task(), "actorshm_given_up", False):
                # (``RayStream._stop``: left as its arguments came in, its cancel queued)
                raise asyncio.CancelledError
            if actor_id.key in self._dead or not ray_up():
                why = self._dead.get(actor_id.key) or "is gone (Ray was shut down)"
                raise ActorDiedError(f"{what}: the actor {why}")
            failed = None
            try:
                args, kwargs = _with_results(args, kwargs)
            except DependencyFailed as dep:
                failed = not_made(copy_exc(dep.exc))
            if failed is not None:  # (raised as it is: its cause, the remote traceback, kept)
                raise failed
            gen, seq = self._submit(actor_id, remote, method, args, kwargs, what, number)
        except BaseException:
            self._drop(actor_id, number[0])
            raise
        gen.completed().future().add_done_callback(
            lambda c: self._finished(actor_id, seq, c))
        if getattr(asyncio.current_task(), "actorshm_given_up", False):
            # Left from another thread (a garbage collection's ``_left``) as it was
            # being sent: its queued cancel of this task comes too late; stop it there.
            self._cancel(actor_id, seq)
        return gen

    def busy(self) -> bool:
        """Whether anything waits on Ray here (a spawn, a call, a call's arguments)."""
        return bool(self._waits or self._waits_for_args or any(self._open.values()))

    def reachable(self, actor_id: RayActorId) -> bool | None:
        """As ``Runtime.reachable``: False once killed or seen dead for good; True while
        Ray restarts it (calls wait for it), or while no call of this process has seen
        it die; None while a death's restart is still being watched."""
        key = actor_id.key
        if key in self._dead or not ray_up():
            return False
        if key in self._restarting:
            return True
        if key in self._died:
            return None if key in self._watching else False
        return True

    def actor_pid(self, actor_id: RayActorId, pid: int) -> int:
        return self._pids.get(actor_id.key, pid)

    async def kill(self, actor_id: RayActorId) -> None:
        ray = import_ray()
        # (one dead for good keeps why it died)
        self.killed(actor_id.key, self._dead.get(actor_id.key, "was killed"))
        if not ray_up() or actor_id.handle is None:  # the runtime shut Ray down (a
            # handle of a runtime that closed, ``_stale``), and every actor with it
            self._release(actor_id, None)
            return
        pid = self._pids.get(actor_id.key, actor_id.pid)
        started = process_start(pid)  # (None: not a process of this machine)
        here = self._runs_here(actor_id.key, pid, started)
        try:
            ray.kill(actor_id.handle, no_restart=True)
        except Exception as exc:  # a handle of an earlier Ray session: gone with it
            self._release(actor_id, None)  # (either way: calls held for a restart fail)
            if "HandleNotFound" not in type(exc).__name__:
                raise
            return
        self._release(actor_id, None)  # calls waiting for a restart fail now
        # and those under way, as killed (Ray's word: "died unexpectedly"), retrieved as
        # locally (a call nobody awaits printed "exception was never retrieved")
        self.close_calls({actor_id.key}, "the actor was killed by kill()")
        self._open.pop(actor_id.key, None)
        try:  # wait until Ray reports the death, so pending calls have failed
            await asyncio.wait_for(actor_id.handle.ready.remote(), 10)
        except Exception:
            pass
        # and, when it ran on this machine, until its process is gone, as locally; a
        # process that cannot leave as Ray asks is SIGKILLed, as the local backend's
        # kill() does: at once when it is stopped (SIGSTOP, a debugger), else after 1 s
        # (only where it is known to be that process: another node's pid may be the
        # number of one of this machine's)
        now = time.monotonic()
        deadline, force_at = now + 5, (now + 1 if here else None)
        while started is not None and process_start(pid) == started and \
                time.monotonic() < deadline:
            if force_at is not None and (time.monotonic() >= force_at or is_stopped(pid)):
                force_at = None
                try:
                    os.kill(pid, signal.SIGKILL)  # (the same process: its start time)
                except OSError:
                    pass
            await asyncio.sleep(0.005)
        self.forget(actor_id.key)

    def forget(self, key: str) -> None:
        super().forget(key)
        self._where.pop(key, None)

    def learn_where(self, actor_id: RayActorId) -> None:
        """Ask ``actor_id``'s process where it runs, in the background (``kill``): one
        found with ``get_actor``, or restarted (the answer of its spawn was its first
        process's)."""
        async def ask() -> None:
            try:  # (through ``wait``: a closing runtime ends it before Ray shuts down)
                answer = await asyncio.wait_for(self.wait(actor_id.handle.probe.options(
                    concurrency_group="control").remote("where")), 5)
            except BaseException:  # (then kill() does not force it)
                return
            self._remember_where(actor_id.key, answer)
        try:
            task = asyncio.get_running_loop().create_task(ask())
        except Exception:  # pragma: no cover (no loop, or Ray's handle is gone)
            return
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    def _remember_where(self, key: str, answer) -> None:
        """Keep actor ``key``'s answer to ``probe("where")`` for ``kill`` (the oldest go
        past ``KILLED_KEPT``: those never killed nor forgotten)."""
        self._where[key] = answer
        if len(self._where) > KILLED_KEPT:
            del self._where[next(iter(self._where))]

    def forget_all_where(self) -> None:
        """Ray shuts down: the answers to ``probe("where")`` go (pids of its actors)."""
        self._where.clear()

    def _runs_here(self, key: str, pid: int, started: bytes | None) -> bool:
        """Whether actor ``key``'s process is this machine's process ``pid`` that started
        at ``started``: its own answer to ``probe("where")``, at spawn or from
        ``learn_where``, says so (an answer from an earlier process of a restarted actor
        does not match)."""
        answer = self._where.pop(key, None)
        if answer is None or started is None:
            return False
        where, wpid, wstarted = answer
        return where is not None and where == machine() and (wpid, wstarted) == (pid, started)

    # -- spawning ----------------------------------------------------------------
    async def spawn(self, cls: type, options: ActorOptions, args: tuple,
                    kwargs: dict) -> ActorHandle:
        ray = import_ray()
        with self._lock:
            if self._remote_host is None:
                # Cancel messages run in their own group: their own thread and loop.
                self._remote_host = ray.remote(concurrency_groups={"control": 1})(Host)
                register_reducers(ray)
        methods = public_methods(cls)
        streams = frozenset(n for n, kind in methods.items() if kind == STREAM)
        # The host enforces max_concurrency and call order itself (Ray runs async actor
        # tasks out of order), so Ray may hand it every call at once.
        opts: dict[str, Any] = {"max_concurrency": 1000 + options.max_concurrency,
                                "max_restarts": options.max_restarts,
                                "max_task_retries": 0}
        if options.name is not None:
            opts["name"] = options.name
        if options.num_gpus:
            opts["num_gpus"] = options.num_gpus
        env = {}
        if options.num_cpus != 1:  # Ray's default reserves no CPU while an actor runs
            opts["num_cpus"] = options.num_cpus
            env.update(options.thread_env())
        env.update(options.env or {})
        if env:
            opts["runtime_env"] = {"env_vars": env}
        what = f"{cls.__qualname__}.spawn"
        req = requested(options.num_cpus, options.num_gpus)
        check_feasible(ray, cls.__qualname__, req, self.fixed_cluster)
        check_args(args, kwargs, what)  # (as a call's: what Ray would let through silently)
        std = sys.stdout, sys.stderr  # (``arguments_unsent``)
        try:
            meta = (cls.__qualname__, methods, streams, options.max_pending_calls,
                    options.max_restarts)
            handle = self._remote_host.options(**opts).remote(
                cls, args, kwargs, options.max_concurrency, get_client, meta)
        except PICKLING_FAILURES as exc:  # (sync code: a CancelledError is a __reduce__'s)
            if isinstance(exc, TypeError) or pickling_failed(exc):  # (an argument's
                raise arguments_unsent(exc, what, args, kwargs, std) from exc  # reduce)
            if isinstance(exc, ValueError) and options.name is not None and \
                    "already" in str(exc):
                raise ValueError(f"an actor named {options.name!r} already exists; "
                                 "names are unique while the actor lives") from exc
            raise
        async def started() -> tuple:
            ready = handle.ready.remote()
            # where it runs, asked now, while it answers (``kill``)
            where = handle.probe.options(concurrency_group="control").remote("where")
            named = await self._names_work(handle)
            outcome = await await_ready(ready, ray, f"{what}()", req, handle._actor_id.hex())
            try:
                where = await asyncio.wait_for(where, 5)
            except Exception:  # (then kill() never forces it)
                where = None
            return named, outcome, where
        try:
            named, (ok, payload), where = await self.wait(started())
        except ActorDiedError:  # the runtime closed meanwhile (``abort_waits``)
            end_actor(handle)
            raise
        except asyncio.CancelledError:
            # The spawn was cancelled (a time-out): the actor goes now, and its name with
            # it, as locally. Left to Ray, it went only once its handle was collected: it
            # kept its name until then, and ran on while anything held the handle (the
            # cancel's traceback, say).
            end_actor(handle)
            if options.name is not None:
                await _name_released(ray, options.name, handle)
            raise
        except Exception as exc:
            try:
                exc = await self._death_cause(handle, exc)
            finally:  # (dead; or restarted meanwhile, under its name: it goes too)
                end_actor(handle)
            raise class_not_loaded(cls, translate(exc, what, None)) from exc
        if not ok:
            end_actor(handle)
            raise decode_exception(payload, f"{cls.__qualname__}.__init__")
        aid = RayActorId(handle, handle._actor_id.hex(), streams, named,
                         options.max_restarts)
        aid.pid = payload
        if where is not None:
            self._remember_where(aid.key, where)
        h = ActorHandle(self, aid, cls.__qualname__, methods, options.name, payload,
                        options.max_pending_calls)
        for fn in self._spawn_listeners:
            fn(h, options)
        return h

    async def _death_cause(self, handle: Any, exc: BaseException) -> BaseException:
        """Ray fails the calls on a dead actor at once, as "unavailable", before it knows
        why (``ray_env``): at spawn, ask again (for up to 3 s) until Ray says why, e.g.
        that an argument of ``__init__`` could not be unpickled there."""
        for _ in range(30):
            if not isinstance(exc, unavailable_error()) or not ray_up():
                break
            await asyncio.sleep(0.1)
            try:
                await handle.ready.remote()
                break  # it answers now (restarted): the first error stands
            except Exception as again:
                exc = again
        return exc

    def on_spawn(self, fn) -> None:
        """Call ``fn(handle, options)`` for each actor this process spawns (a host
        passes its children on to the runtime that watches it: lifecycle events)."""
        self._spawn_listeners.append(fn)

    async def get_actor(self, name: str) -> ActorHandle:
        ray = import_ray()
        try:
            if not isinstance(name, str) or not name:
                raise ValueError
            handle = ray.get_actor(name)
        except ValueError:
            raise ValueError(f"no live actor named {name!r}; named actors are made with "
                             "Cls.options(name=...).spawn()") from None
        key = handle._actor_id.hex()
        if key in self._dead:
            raise ValueError(f"no live actor named {name!r} (it {self._dead[key]})")
        due = time.monotonic() + RESTART_WAIT
        while True:
            try:
                # (in the control group: a sync method running there holds its loop)
                described = await handle.describe.options(
                    concurrency_group="control").remote()
                if described is None:  # not started yet: ``ready`` waits for __init__
                    described = await handle.ready.remote(), await handle.meta.remote()
                (ok, pid), (cls_name, methods, streams, max_pending, restarts) = described
                if not ok:
                    raise ActorDiedError("it failed in __init__")
                named = await self._names_work(handle)
                break
            except unavailable_error() as exc:
                # Ray is restarting it: the name stays its own until it is dead for good
                if time.monotonic() > due:
                    raise ValueError(f"no live actor named {name!r} (still restarting "
                                     f"after {RESTART_WAIT:g} s: {exc})") from None
                await asyncio.sleep(0.05)
            except Exception as exc:
                raise ValueError(f"no live actor named {name!r} ({exc})") from None
        aid = RayActorId(handle, key, streams, named, restarts)
        aid.pid = pid
        self.learn_where(aid)
        return ActorHandle(self, aid, cls_name, methods, name, pid, max_pending)

    async def _names_work(self, handle: Any) -> bool:
        """Whether calls carry their identity in their Ray task names instead of in an
        argument: where ``names_in_tasks`` and an actor task reads its own name (asked
        once per connection to Ray: a process may join another Ray later)."""
        now = ray_connection()
        if self._names_ok is None or self._names_ok[0] != now:
            ok = names_in_tasks()
            if ok:
                probe = "actorshm:probe:0"
                ok = await handle.task_name.options(
                    name=probe, concurrency_group="control").remote() == probe
            self._names_ok = (now, ok)
        return self._names_ok[1]


async def _failed_stream(exc: BaseException):
    """A stream whose first item raises ``exc`` (a streaming call on a dead actor)."""
    raise exc
    yield  # (an async generator)


def _with_results(args: tuple, kwargs: dict) -> tuple:
    """``with_results`` of each argument (at the depth ``futures_in`` looked at them)."""
    return (tuple(with_results(a) for a in args),
            {k: with_results(v) for k, v in kwargs.items()})


class _Dropped(Exception):
    """A call that waited for its arguments is not sent (``_send_when_ready``)."""


CLIENT = RayClient()


def get_client() -> RayClient:
    """This process's Ray client (a Ray-hosted actor installs it as its client)."""
    return CLIENT


def _refuse_in_local_message(enc, actor_id: RayActorId):
    """How actorshm's own encoder (the local backend's messages; Ray pickles its own)
    meets a Ray actor's handle: refused before sending, as an argument that cannot be
    serialized (the local actor failed to rebuild it: "Ray has not been started")."""
    raise TypeError("a handle of an actor of the Ray backend cannot be passed to an "
                    "actor of the local backend: an actor is called only from its own "
                    "runtime's backend (make the call in the driver, or spawn the actor "
                    "in the runtime whose actors call it)")


_registry.register_reducer(RayActorId, _refuse_in_local_message)
