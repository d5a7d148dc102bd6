"""The Ray actor that hosts one ``@actor`` instance on the Ray backend.

Every actorshm actor on Ray is this one generic async Ray actor: it builds the user's
instance in its ``__init__`` and runs each call with ``call`` (a sync method inline, or in
a thread pool when ``max_concurrency > 1``; an async method on Ray's event loop) and
each streaming call with ``stream``. Results travel as ``(True, value)``; an exception
raised by the user's code travels as ``(False, encoded)`` (see ``encode_exception``), so
the caller re-raises the same type instead of Ray's ``RayTaskError``.

Array arguments arrive read-only (Ray's object store gives read-only zero-copy views of
large arrays; small ones are made read-only here too), so code that writes into an
argument expecting the caller to see it fails loudly instead of silently.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import copyreg
import inspect
import os
import pickle
import threading
import time
import types
from typing import Any

import numpy as np

from . import _client, _introspect, _serialization, _shm
from ._descendants import machine, process_start
from ._errors import ActorDiedError, init_exit_error
from ._ray_errors import check_result
from ._ray_loop import TaskWatch
from ._ray_watched import Watched
from ._remote_errors import call_caught
from ._remote_errors import encode_exception as _encode_exception
from ._remote_errors import encode_failure
from ._streams import CANCELLED_BY_CALLER, STREAM_DONE, chain, next_caught, reentrant_error

# How long after a result was handed to Ray a sync method's first run waits (for Ray's
# thread to send it: that run may end the process), and an exit waits.
_FIRST_RUN_GRACE = 0.05

__all__ = ["Host", "freeze_arrays", "simple", "pack"]

_MAX_DEPTH = 4
_SCALARS = (type(None), bool, int, float, complex)
_SMALL = 64 << 10


def simple(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` is small builtin data (scalars, short str/bytes, and lists, tuples
    and dicts of them): then actorshm pickles it itself into one ``bytes``, which Ray
    passes far more cheaply than a Python object it must serialize."""
    t = type(obj)
    if t in _SCALARS:
        return True
    if t is str or t is bytes:
        return len(obj) <= _SMALL
    if depth >= _MAX_DEPTH:
        return False
    if t is tuple or t is list:
        return len(obj) <= 64 and all(simple(x, depth + 1) for x in obj)
    if t is dict:
        return len(obj) <= 64 and all(
            type(k) is str and simple(v, depth + 1) for k, v in obj.items())
    return False


def encode_exception(exc: BaseException) -> bytes:
    """An error reply's exception, pickled as Ray pickled the actor's class (Ray's copy of
    cloudpickle): a class from the caller's ``__main__`` is the caller's own there."""
    from ray import cloudpickle  # (this module runs in Ray's workers only)
    try:
        return _encode_exception(exc, cloudpickle.dumps)
    except BaseException as why:  # its own pickling raised KeyboardInterrupt, SystemExit:
        # its text, not that (left to Ray, the call failed as cancelled, with Ray's
        # internal names, and the actor answered no call again)
        return encode_failure(exc, why)


def pack(pair: tuple) -> Any:
    """A reply ``(ok, value)``: one pickled ``bytes`` when it is simple, else as it is."""
    return pickle.dumps(pair, protocol=5) if simple(pair[1]) else pair


def freeze_arrays(obj: Any, depth: int = 0) -> None:
    """Make numpy arrays in ``obj`` (lists, tuples, dicts and the attributes of plain
    objects such as dataclasses, a few levels deep) read-only. Ray's pickling gives
    contiguous arrays as read-only views wherever they are, but the arrays numpy pickles
    by value (a strided view, datetime, a subclass such as ``np.recarray``) arrive
    writable: only this makes a write to one of them fail rather than be lost."""
    if depth > _MAX_DEPTH or type(obj) in _SCALARS:
        return
    if isinstance(obj, np.ndarray):  # (not by its attributes: the class np.ndarray, a
        # numpy scalar type or a dict that makes up attributes has them too)
        try:
            obj.setflags(write=False)
        except ValueError:
            pass
        return
    if isinstance(obj, (list, tuple)):
        for x in obj:
            freeze_arrays(x, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            freeze_arrays(x, depth + 1)
    elif _plain(type(obj)):  # pickling carries it as its __dict__, which is a copy
        state = getattr(obj, "__dict__", None)
        if type(state) is dict:
            for x in state.values():
                freeze_arrays(x, depth + 1)


_DEFAULT_GETSTATE = getattr(object, "__getstate__", None)  # (Python 3.11 on)


def _plain(t: type) -> bool:
    """Whether instances of ``t`` are pickled as their ``__dict__`` and rebuilt from a
    copy of it: not an object with its own pickling (``__reduce__``, ``__getstate__``,
    ``__setstate__``, a ``copyreg`` entry), whose rebuilt attributes may be the
    receiver's own (a table of its module), nor a function or class (pickled by name:
    the receiver's own object, attributes and all; a module, also pickled by name, whose
    ``__dict__`` is the receiver's imported module's)."""
    return (t.__reduce_ex__ is object.__reduce_ex__ and t.__reduce__ is object.__reduce__
            and getattr(t, "__getstate__", None) is _DEFAULT_GETSTATE
            and getattr(t, "__setstate__", None) is None
            and t not in copyreg.dispatch_table
            and not issubclass(t, (type, types.FunctionType, types.ModuleType,
                                   types.MethodType, types.BuiltinFunctionType)))


class _Turns:
    """Start order of one caller's calls: Ray runs async actor tasks out of order.

    ``next`` is the call that may start now; ``skip`` holds calls after it that will
    never start here (cancelled). After a restart, ``resync`` says that of the calls
    before ``upto`` only ``still`` (sorted) may come: the turns of the others pass in
    one step each, however many there are.
    """

    __slots__ = ("next", "skip", "waiters", "upto", "still")

    def __init__(self, first: int) -> None:
        self.next = first
        self.skip: set = set()
        self.waiters: dict = {}
        self.upto = 0
        self.still: list = []

    def advance(self) -> None:
        self.next += 1
        self._pass()

    def consume(self, seq: int) -> None:
        """``seq`` will never start (cancelled): let the calls after it go."""
        if seq == self.next:
            self.advance()
        elif seq > self.next:
            self.skip.add(seq)

    def resync(self, upto: int, still: list) -> None:
        """Of the calls before ``upto``, only ``still`` (and those waiting) may come."""
        if upto > self.upto:
            self.upto, self.still = upto, sorted({*still, *self.waiters})
            self._pass()

    def _pass(self) -> None:
        """Move ``next`` past the calls that will not come, and wake the one it reaches."""
        while True:
            if self.next in self.skip:
                self.skip.discard(self.next)
                self.next += 1
            elif self.next < self.upto:
                i = bisect.bisect_left(self.still, self.next)
                if i < len(self.still) and self.still[i] == self.next:
                    break
                self.next = self.still[i] if i < len(self.still) else self.upto
            else:
                break
        w = self.waiters.pop(self.next, None)
        if w is not None and not w.done():
            w.set_result(None)


def register_reducers(ray: Any) -> None:
    """Teach Ray's pickling what actorshm's own does beyond cloudpickle, in this process
    (Ray's table of serializers is its pickler's, one for the process): a cached method
    (``functools.lru_cache``) of a class sent by value goes by value, as locally."""
    ray.util.register_serializer(_serialization.LruCache,
                                 serializer=_serialization.lru_cache_state,
                                 deserializer=_serialization.from_lru_cache_state)


class Host(Watched):
    """Wraps the user's class inside a Ray actor process (made remote by ``_ray``).

    Ray runs async actor tasks in arrival order at best, so each call carries its
    caller's id and a sequence number: calls from one caller start in the order they
    were made, and at most ``max_concurrency`` run at once (an ``asyncio.Semaphore``).
    """

    def __init__(self, cls: type, args: tuple, kwargs: dict, max_concurrency: int,
                 get_client: Any, meta: tuple) -> None:
        client = get_client()
        _client.set_worker(client)  # calls made in here go through Ray
        self._watched(client)
        self._meta = meta
        self._cls_name = cls.__qualname__
        self._executor = None
        if max_concurrency > 1:
            from concurrent.futures import ThreadPoolExecutor
            self._executor = ThreadPoolExecutor(max_concurrency,
                                                thread_name_prefix=f"actorshm-{cls.__qualname__}")
        from ._actor import THREAD_VARS, public_methods
        # Ray sets OMP_NUM_THREADS for its actors (num_cpus, or 1), which OpenBLAS and MKL
        # also read; the other thread-count variables say the same, as locally.
        for var in THREAD_VARS:
            os.environ.setdefault(var, os.environ.get("OMP_NUM_THREADS", "1"))
        self._methods = public_methods(cls)
        self._init_error = None
        self._instance = None
        self._max_concurrency = max_concurrency
        self._sem = None
        self._callers: dict[str, _Turns] = {}
        self._cancelled: set = set()  # (caller, seq) cancelled before they arrived
        self._requested: set = set()  # (caller, seq) whose cancel message arrived
        self._resyncs: dict = {}  # caller -> (upto, calls that may come), before its turns
        self._cancel_lock = threading.Lock()
        self._loop = None  # the actor's event loop, where every call runs
        self._watch = None  # Ray's tasks on it (``_ray_loop``), once it is known
        self._tasks: dict = {}  # (caller, seq) -> the task running that call
        # (caller, seq) -> (method, the coroutine or async generator running it): Ray
        # runs each call in a task whose outer coroutines are compiled (Cython), with no
        # frames to follow, so ``rt.dump_stacks()`` walks a pending call from this one.
        self._running: dict = {}
        # (caller, seq) -> a future done once that stream closed its generator here
        # (``stream_ended``): Ray reports a stream cancelled at a ``yield`` as ended
        # before the generator's ``finally`` blocks have run.
        self._stream_ends: dict = {}
        self._calls = 0  # calls received (``rt.stats()``)
        self._ran: set = set()  # the sync methods that ran here at least once
        self._handed = 0.0  # time.monotonic() when a call last handed its result to Ray
        # Chains of calls (``_streams.chain``), to refuse a call that would wait forever
        # for a slot (A -> B -> A), as locally: this host's id in chains, the number of
        # its last call, its calls in slots -> their numbers, and the chains of the calls
        # waiting for a slot (their ``reentrant_error`` view: ``holding``, ``queue``).
        self.actor_id = os.urandom(4).hex()
        self.cls_name = cls.__qualname__
        self.max_concurrency = max_concurrency
        self._run_seq = 0
        self.holding: dict = {}
        self._slot_waits: dict = {}  # key -> (key, None, (..., {"chain": links}))
        try:
            import ray
            self._ctx = ray.get_runtime_context()
            register_reducers(ray)  # (for what it sends: results, items, its own calls)
        except Exception:  # pragma: no cover - outside Ray
            self._ctx = None
        # The user's __init__ runs on the actor's event loop, as on the local backend
        # (it may start tasks there): on the first call, ``ready`` at spawn.
        self._pending_init = (cls, args, kwargs)

    def _build(self) -> None:
        cls, args, kwargs = self._pending_init
        self._pending_init = None
        try:
            freeze_arrays(args)
            freeze_arrays(kwargs)
            self._instance = cls(*args, **kwargs)
            if self._watch is not None:  # (its __init__ may have set a task factory)
                self._watch.keep()
        except BaseException as exc:  # raised by spawn in the caller
            exc = init_exit_error(self._cls_name, exc)
            self._init_error = encode_exception(exc)
            self._dead_reply = pack((False, encode_exception(ActorDiedError(
                f"actor {self._cls_name} failed in __init__: {exc!r}"))))

    async def ready(self) -> tuple:
        """``(True, pid)`` once ``__init__`` returned, ``(False, encoded error)`` if it raised."""
        self._on_loop()
        if self._pending_init is not None:
            self._build()
        if self._init_error is not None:
            return False, self._init_error
        return True, os.getpid()

    def _on_loop(self) -> None:
        """Note the actor's event loop (where every call runs), and watch the tasks made
        on it from its first call (``ready``, at spawn) on (``_ray_loop``)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._watch = TaskWatch(self._loop)

    async def meta(self) -> tuple:
        """``(class name, public methods, streaming methods, max_pending_calls,
        max_restarts)``."""
        return self._meta

    async def describe(self) -> tuple | None:
        """What ``get_actor`` needs, answered in the ``control`` concurrency group (so an
        actor busy in a long sync method answers at once): ``(ready, meta)`` with
        ``ready`` as ``ready`` gives it, or None while ``__init__`` has yet to run
        (that waits for ``ready``, on the actor's own loop)."""
        if self._instance is None and self._init_error is None:
            return None  # (not built yet, or its __init__ is running)
        ready = (False, self._init_error) if self._init_error is not None else \
            (True, os.getpid())
        return ready, self._meta

    async def probe(self, what: str) -> Any:
        """Answer the driver's ``rt.stats()`` (``"stats"``), ``rt.memory()``
        (``"memory"``) and ``rt.dump_stacks()`` (``"stacks"``) for this process, and
        where it runs (``"where"``: machine, pid and start time, ``RayClient.kill``).

        Runs in the ``control`` concurrency group (its own thread and event loop), so
        an actor busy in a sync method answers too.
        """
        if what == "stats":
            out = _shm.stats()
            out["calls_received"] = self._calls
            return out
        if what == "memory":
            return _introspect.held_blocks(())
        if what == "where":  # (``RayClient.kill``: is its process the driver's machine's?)
            return machine(), os.getpid(), process_start(os.getpid())
        return _introspect.format_stacks(
            self._loop, skip=("watch_death", "next_children"),
            calls=[(f"{self._cls_name}.{m}", coro) for m, coro in
                   list(self._running.values())])

    def _method(self, method: str):
        if method not in self._methods:
            raise AttributeError(f"actor {self._cls_name} has no public method {method!r}")
        return getattr(self._instance, method)

    async def cancel(self, caller: str, seqs: list) -> None:
        """Cancel calls ``seqs`` of ``caller``: queued, one never runs; running, an
        async method gets ``CancelledError`` at its ``await`` (a sync one finishes).

        Runs in its own concurrency group (its own thread and loop), so a cancellation
        is recorded even while a sync method blocks the actor's loop: the calls queued
        behind it then see it before they start.
        """
        with self._cancel_lock:
            self._requested.update((caller, seq) for seq in seqs)
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._apply_cancel, caller, seqs)

    async def resync(self, caller: str, upto: int, still: list) -> None:
        """After a restart: of ``caller``'s calls before ``upto``, only ``still`` may
        come here; the others ended in the old process, and their turns pass."""
        with self._cancel_lock:
            if upto > self._resyncs.get(caller, (0,))[0]:  # (a late retry of an older one)
                self._resyncs[caller] = (upto, still)
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._apply_resync, caller)

    def _apply_resync(self, caller: str) -> None:
        st = self._callers.get(caller)
        if st is None:  # applied when its first call comes (``_turns``)
            return
        with self._cancel_lock:
            upto, still = self._resyncs.pop(caller, (0, ()))
        st.resync(upto, still)

    def _apply_cancel(self, caller: str, seqs: list) -> None:
        for seq in seqs:
            task = self._tasks.get((caller, seq))
            if task is not None:
                setattr(task, CANCELLED_BY_CALLER, True)  # (no reply owed: nobody waits)
                task.cancel()
            else:
                st = self._callers.get(caller)
                if st is None or seq >= st.next:  # not arrived yet: it will not run
                    self._cancelled.add((caller, seq))
                    if st is not None:
                        st.consume(seq)
            with self._cancel_lock:
                self._requested.discard((caller, seq))

    def _skip_cancelled(self, caller: str, seq: int, base: int) -> None:
        """Call ``seq`` of ``caller``, cancelled before it came, came: it never runs, and
        its turn passes. A cancel that came before any call of its caller could not pass
        that turn then (``_apply_cancel``: no turns yet); the caller's turns are made
        now, which passes it (``_turns``). Left to the caller's next call, they started
        at that call's ``base``, this very call, whose mark was gone: the next call
        waited for this one's turn forever (a stream given up at once, then another)."""
        self._turns(caller, base)
        self._cancelled.discard((caller, seq))

    def _turns(self, caller: str, base: int) -> _Turns:
        """The turns of ``caller``; its first call here makes them, starting at ``base``
        (the caller's oldest call Ray had not finished when it sent that call: 0 in a
        new actor, or where the caller is after a restart). The calls before ``base``
        ended elsewhere, and those cancelled already are skipped."""
        st = self._callers.get(caller)
        if st is None:
            st = self._callers[caller] = _Turns(base)
            with self._cancel_lock:  # cancel messages that came before any call did
                early = [key for key in self._requested if key[0] == caller]
            self._cancelled.update(key for key in early if key[1] >= base)
            for c, seq in sorted(self._cancelled):
                if c == caller and seq >= base:
                    st.consume(seq)
            self._apply_resync(caller)
        return st

    async def _take_turn(self, caller: str, seq: int, base: int) -> None:
        turns = await self._wait_turn(caller, seq, base)
        if turns is not None:
            turns.advance()

    async def _wait_turn(self, caller: str, seq: int, base: int) -> _Turns | None:
        """Wait until call ``seq`` may start: the caller's turns, for the call to pass
        on (``advance``) once it has started, or None when its turn has passed and it
        runs now without one (a call that Ray reported lost although it arrived, whose
        turn its cancel or a ``resync`` passed: defensive)."""
        st = self._turns(caller, base)
        if seq < st.next:
            return None
        if seq != st.next:
            fut = asyncio.get_running_loop().create_future()
            st.waiters[seq] = fut
            try:
                await fut
            except BaseException:
                st.waiters.pop(seq, None)
                st.consume(seq)
                raise
        return st

    async def task_name(self) -> str | None:
        """This task's Ray task name: whether ``call0``/``call1`` can read theirs (None
        where Ray cannot tell a task its name: before 2.40)."""
        get = getattr(self._ctx, "get_task_name", None)
        return get() if get is not None else None

    async def call0(self) -> Any:
        """Run a call without arguments named ``method:caller:seq:base`` (its Ray task name,
        read before the first ``await``): a Ray task with no argument at all is Ray's
        cheapest, about a quarter faster than one carrying a small ``bytes``."""
        method, caller, seq, base = self._ctx.get_task_name().split(":")
        return await self._call(method, (), {}, caller, int(seq), int(base))

    async def call1(self, payload: Any) -> Any:
        """Run a call named ``method:caller:seq:base`` with ``payload = (args, kwargs)``
        (pickled into one ``bytes`` by the caller when they are simple)."""
        method, caller, seq, base = self._ctx.get_task_name().split(":")
        args, kwargs = pickle.loads(payload) if type(payload) is bytes else payload
        del payload
        return await self._call(method, args, kwargs, caller, int(seq), int(base))

    async def call(self, req: tuple) -> tuple:
        """Run ``req = (method, args, kwargs, caller, seq, base[, links])``: ``(ok,
        result or error)``; ``links``: the chain of calls a call made inside an actor
        carries (``_streams.chain``).

        One argument, not six: Ray serializes each argument of a task on its own.
        (Used where Ray's task names cannot carry the call's identity, or the chain.)
        """
        if type(req) is bytes:
            req = pickle.loads(req)
        method, args, kwargs, caller, seq, base, *links = req
        del req
        return await self._call(method, args, kwargs, caller, seq, base,
                                links[0] if links else ())

    @property
    def queue(self) -> list:
        """The calls waiting for a slot, as ``reentrant_error`` reads a queue."""
        return list(self._slot_waits.values())

    async def _call(self, method: str, args: tuple, kwargs: dict, caller: str,
                    seq: int, base: int, links: tuple = ()) -> Any:
        self._calls += 1
        key = (caller, seq)
        if key in self._cancelled:
            self._skip_cancelled(caller, seq, base)
            return None, None
        self._on_loop()
        if self._pending_init is not None:
            self._build()
        if self._init_error is not None:
            return self._dead_reply
        self._tasks[key] = asyncio.current_task()
        owed = None  # the caller's turns, while this call has yet to pass its turn on
        try:
            st = self._callers.get(caller)
            if st is not None and seq == st.next:  # its turn already (the usual case)
                owed = st
            else:
                owed = await self._wait_turn(caller, seq, base)
            # A sync method run on Ray's loop holds it: it passes its turn on only once
            # it holds its slot and the calls that finished before it have handed their
            # results to Ray (one loop step), so that neither a later call (a stream
            # takes no slot) starts first nor a long or fatal call holds those back.
            inline = self._executor is None and self._methods.get(method) is False
            if owed is not None and not inline:
                owed.advance()
                owed = None
            if self._sem is None:
                self._sem = asyncio.Semaphore(self._max_concurrency)
            if links and self._sem.locked():
                err = reentrant_error(links, self, f"{self._cls_name}.{method}")
                if err is not None:  # it would wait for a slot forever
                    return pack((False, encode_exception(err)))
                self._slot_waits[key] = (key, None, (method, None, None, {"chain": links}))
            try:
                await self._sem.acquire()
            finally:
                self._slot_waits.pop(key, None)
            try:
                if owed is not None:
                    # Ray sends the results handed to it from a thread of its own: before
                    # a method's first run (the one that may end the process: an exit,
                    # a crash), give that thread time to send them.
                    wait = 0.0 if method in self._ran else \
                        self._handed + _FIRST_RUN_GRACE - time.monotonic()
                    await asyncio.sleep(max(0.0, wait))
                    self._ran.add(method)
                if inline:  # (it holds the loop, and so Ray's thread: ``_ray_loop``)
                    await self._watch.settled()  # (its turn not passed on yet)
                if owed is not None:
                    owed.advance()
                    owed = None
                if self._requested and key in self._requested:  # cancelled while queued
                    with self._cancel_lock:
                        self._requested.discard(key)
                    return None, None
                self._run_seq += 1
                self.holding[key] = run_seq = self._run_seq
                token = chain.set((links, self.actor_id, f"{self._cls_name}.{method}", run_seq))
                run = self._run(method, args, kwargs)
                if self._methods.get(method):  # async (a sync one shows in its thread)
                    self._running[key] = (method, run)
                try:
                    return pack(await run)
                finally:
                    chain.reset(token)
                    del self.holding[key]
                    self._running.pop(key, None)
            finally:
                self._sem.release()
        except asyncio.CancelledError:
            return None, None  # the caller has stopped waiting
        finally:
            if owed is not None:  # (cancelled before it started)
                owed.advance()
            del self._tasks[key]
            self._handed = time.monotonic()

    async def _run(self, method: str, args: tuple, kwargs: dict) -> tuple:
        try:
            fn = self._method(method)
            if args:
                freeze_arrays(args)
            if kwargs:
                freeze_arrays(kwargs)
            if self._methods[method] or self._executor is None:
                result = fn(*args, **kwargs)
                # Awaited for an async method only, as locally: what a sync method
                # returns is its result (a coroutine or an unfinished call it forgot to
                # await is a TypeError, not awaited here behind its back).
                if self._methods[method] and inspect.isawaitable(result):
                    result = await result
            else:
                result, raised = await self._in_thread(
                    call_caught, fn, args, kwargs, f"{self._cls_name}.{method}")
                if raised is not None:
                    raise raised  # (here, not thrown in: see ``call_caught``)
            check_result(result, f"{self._cls_name}.{method}")
        except SystemExit:
            await asyncio.sleep(_FIRST_RUN_GRACE)  # (the results already handed to Ray)
            os._exit(0)
        except asyncio.CancelledError as exc:
            if getattr(asyncio.current_task(), CANCELLED_BY_CALLER, False):
                raise  # the caller cancelled it (``_call``)
            return False, encode_exception(exc)  # the method's own: its caller waits
        except BaseException as exc:  # KeyboardInterrupt too: the caller's error to see
            return False, encode_exception(exc)
        return True, result

    async def _in_thread(self, caught: Any, *args: Any) -> tuple:
        """Run ``caught(*args)`` (``call_caught`` of a sync method, ``next_caught`` of a
        sync generator: ``(value, raised)``) in the actor's thread pool.

        A cancel cannot stop a thread: the method (or the generator's step) runs on, and
        its call keeps its slot (the caller releases it once this returns) until it has
        returned, as locally; only then is the cancel raised and the result dropped.
        Released at the cancel, the slot let one call more than ``max_concurrency`` run
        beside it (and a generator be closed while it still ran).
        """
        ctx = contextvars.copy_context()  # (the chain, for calls it makes)
        done = asyncio.get_running_loop().run_in_executor(
            self._executor, ctx.run, caught, *args)
        cancelled = None
        while True:
            try:
                out = await asyncio.shield(done)
                break
            except asyncio.CancelledError as exc:
                if done.cancelled():  # (the pool itself shut down)
                    raise
                cancelled = exc  # the method runs on: wait for it, then raise this
        if cancelled is not None:
            raise cancelled
        return out

    async def _take_slot(self, key: tuple, links: tuple, what: str, run_seq: int) -> None:
        """Take one of the actor's ``max_concurrency`` slots for call ``key`` (a stream,
        for one item), as ``_call`` does; a chain that would wait for it forever raises
        ``ReentrantCallError``."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._max_concurrency)
        if self._sem.locked() and links:
            err = reentrant_error(links, self, what)
            if err is not None:
                raise err
            self._slot_waits[key] = (key, None, (what, None, None, {"chain": links}))
        try:
            await self._sem.acquire()
        finally:
            self._slot_waits.pop(key, None)
        self.holding[key] = run_seq

    def _give_slot(self, key: tuple) -> None:
        del self.holding[key]
        self._sem.release()

    async def stream_ended(self, caller: str, seq: int) -> None:
        """Return once stream ``seq`` of ``caller`` has closed its generator here (its
        ``finally`` blocks ran): what ``await it.aclose()`` waits for. Ray's own end of
        a stream cancelled at a ``yield`` comes before that."""
        ended = self._stream_ends.get((caller, seq))
        if ended is not None:
            await asyncio.shield(ended)

    async def stream(self, req: tuple):
        """Run a generator or async-generator method, yielding ``(ok, item)`` pairs."""
        if type(req) is bytes:
            req = pickle.loads(req)
        method, args, kwargs, caller, seq, base, *links = req
        del req
        self._calls += 1
        key = (caller, seq)
        if key in self._cancelled:
            self._skip_cancelled(caller, seq, base)
            return
        self._on_loop()
        if self._pending_init is not None:
            self._build()
        if self._init_error is not None:
            yield self._dead_reply
            return
        task = self._tasks[key] = asyncio.current_task()
        try:
            await self._take_turn(caller, seq, base)
        except BaseException:
            del self._tasks[key]
            raise
        what = f"{self._cls_name}.{method}"
        self._run_seq += 1
        # Calls the generator makes carry the chain, this stream last: set around each
        # step of it, never across a yield (Ray may resume this generator elsewhere).
        link = (links[0] if links else (), self.actor_id, what, self._run_seq)
        try:
            fn = self._method(method)
            freeze_arrays(args)
            freeze_arrays(kwargs)
            gen = fn(*args, **kwargs)
        except Exception as exc:
            self._tasks.pop(key, None)
            yield pack((False, encode_exception(exc)))
            return
        ended = self._stream_ends[key] = self._loop.create_future()
        started = False  # (a generator that never ran closes without running any code)
        own = False  # whether what is raised is the generator's (not thrown in here)
        try:
            step = gen.__anext__ if inspect.isasyncgen(gen) else None
            if step is not None:  # (``rt.dump_stacks()`` walks it: ``probe``)
                self._running[key] = (method, gen)
            while True:
                # Each item is made in one of the actor's slots, as locally: not while
                # max_concurrency calls run, and no call starts meanwhile beyond them.
                await self._take_slot(key, links[0] if links else (), what, link[3])
                if step is None and self._executor is None:  # (as in ``_call``)
                    try:
                        await self._watch.settled()
                    except BaseException:  # (cancelled: left while queued)
                        self._give_slot(key)
                        raise
                if not started and self._requested and key in self._requested:
                    # Left while it was queued (the cancel came while a sync method held
                    # the loop, and its turn and slot came first): it never starts, as
                    # a queued call never runs (``_call``).
                    self._give_slot(key)
                    with self._cancel_lock:
                        self._requested.discard(key)
                    return
                token = chain.set(link)
                started = own = True
                try:
                    if step is not None:
                        item = await step()
                    elif self._executor is not None:
                        # In a thread, as a sync method runs (and as locally): the
                        # actor's loop runs its other calls beside this step.
                        item, raised = await self._in_thread(next_caught, gen)
                        if raised is not None:
                            raise raised  # (here, not thrown in: see ``next_caught``)
                        if item is STREAM_DONE:
                            break
                    else:
                        item = next(gen)
                except (StopIteration, StopAsyncIteration):
                    break
                finally:
                    chain.reset(token)
                    self._give_slot(key)
                own = False
                check_result(item, what, item=True)
                yield pack((True, item))
        except Exception as exc:
            yield pack((False, encode_exception(exc)))
        except (asyncio.CancelledError, KeyboardInterrupt) as exc:
            if getattr(task, CANCELLED_BY_CALLER, False):
                raise
            yield pack((False, encode_exception(exc)))  # the generator's own error
        except SystemExit:
            # The process exits, as from a method (``_run``): left to Ray, the stream
            # failed as if the actor died, while the process stayed and later calls on
            # it were never answered.
            await asyncio.sleep(_FIRST_RUN_GRACE)  # (the items already handed to Ray)
            os._exit(0)
        except BaseException as exc:
            if not own:
                raise  # (a GeneratorExit thrown in at the yield: Ray closes the stream)
            # The generator raised it (GeneratorExit, a BaseExceptionGroup): RemoteError
            # naming it, as from a method and locally, not Ray's own error type.
            yield pack((False, encode_exception(exc)))
        finally:
            self._tasks.pop(key, None)
            self._running.pop(key, None)
            slot = False
            # Its finally blocks run in a slot too. One that never started has none to
            # run: it must not wait for a slot (its first item may have been refused as
            # re-entrant, the slot held by a call that waits for this stream's end).
            if started:
                try:
                    await self._take_slot(key, (), what, link[3])
                    slot = True
                except BaseException:  # (cancelled again: closed as it is)
                    pass
            try:
                close = getattr(gen, "aclose", None)
                if close is not None:
                    await close()
                else:
                    gen.close()
            except Exception:
                # Its finally failed (it yielded again: "generator ignored GeneratorExit"):
                # nobody is left to tell, as locally (raised here, asyncio printed it
                # from the actor: "Task exception was never retrieved").
                pass
            finally:
                if slot:
                    self._give_slot(key)
                self._stream_ends.pop(key, None)
                ended.set_result(None)
