"""Which object makes calls for this process: the driver's runtime or the actor's worker."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from typing import Any

_runtimes: list = []  # open runtimes in the driver, innermost last
DEAD_KEPT = 1000  # summaries of dead actors a runtime keeps for ``actors()`` (the latest)
# Held while a runtime opens or closes: threads may do both at once, and the first to
# open makes the process's shared budget, the last to close ends it.
runtimes_lock = threading.Lock()


# In a child forked (``os.fork``) from a driver with a runtime open, or from an actor:
# which process that was, and the event loops of the clients it inherited (refused).
_forked_from = ""
_inherited_loops: set = set()


def _after_fork_in_child() -> None:
    """A forked child gets a lock of its own: another thread of the parent may have held
    this one at the fork, and nothing in the child would release it. A child of a
    process that makes calls (a DataLoader's worker, a ``fork`` pool's) shares that
    process's sockets to its actors: calls through the clients it inherited are refused
    (``forked_error``), as their frames would mix with the parent's (a call's answer
    went to the parent's next call). Every call of such a client then takes the path of
    a call from another thread (its loop thread is no thread here), where the refusal
    is (``refuse_if_forked``). The child itself has no runtime open, and is no actor:
    it may open a runtime of its own."""
    global runtimes_lock, _forked_from
    runtimes_lock = threading.Lock()
    if _family[0] is not None:  # the ids its runtimes would hand out are its own; the
        _forked_from_families.append(_family[0])  # parent's handles still pass here
    _family[0] = None
    w = _worker[0]
    if w is None and not _runtimes:
        return
    _forked_from = (f"an actorshm actor's process (pid {os.getppid()})" if w is not None
                    else f"a driver with an actorshm runtime open (pid {os.getppid()})")
    if w is not None:
        w.loop_thread = None
        _inherited_loops.add(w.loop)
        _worker[0] = None
    for rt in _runtimes:
        rt._loop_thread = None
        _inherited_loops.add(rt.loop)
    _runtimes.clear()


def refuse_if_forked(loop) -> None:
    """Raise ``forked_error(loop)``, if any: a call made through an inherited client
    raises it, as a call that cannot be encoded raises its TypeError (not from its
    awaitable, which a coroutine in the child could not even await: its loop is the
    parent's)."""
    refused = forked_error(loop)
    if refused is not None:
        raise refused


def forked_error(loop) -> RuntimeError | None:
    """The error a call made in a forked child through a client it inherited (whose
    event loop is ``loop``) raises (``_after_fork_in_child``), or None: go on."""
    if loop not in _inherited_loops:
        return None
    return RuntimeError(
        f"actorshm: this process (pid {os.getpid()}) was forked from {_forked_from}, "
        "as a DataLoader's workers and a multiprocessing pool with the 'fork' start "
        "method are, and shares that process's connections to its actors, so it cannot "
        "call them (its messages would mix with that process's). Call actors in the "
        "process that holds the handles (before the workers run, or on what they "
        "return), or do the work in actors (an actorshm.ActorPool) instead")


os.register_at_fork(after_in_child=_after_fork_in_child)
_worker: list = [None]  # the worker, inside an actor process
_family: list = [None]  # (see ``family``)
_forked_from_families: list = []  # those of the processes this one is a fork of


def family() -> str:
    """The token of the actor ids the runtimes of this process hand out (they count from
    1 in every process): its pid and a random part, made once. A handle carries its
    id's, so that one unpickled in another driver's process (read from a file, sent over
    a queue) is refused rather than call whatever actor has its id there."""
    f = _family[0]
    if f is None:
        import secrets
        f = _family[0] = f"{os.getpid()}-{secrets.token_hex(8)}"
    return f


def known_family(f: str) -> bool:
    """Whether a handle of id token ``f`` addresses an actor of this process's runtimes
    or, in an actor, of its driver's (or, in a fork of such a process, of that
    process's: its calls then say that a fork cannot make them)."""
    return f == family() or f == getattr(_worker[0], "family", None) or \
        f in _forked_from_families


def set_worker(worker: Any) -> None:
    """This process is an actor's: ``worker`` makes its calls."""
    _worker[0] = worker


def current_worker() -> Any:
    """The worker of this actor process, or None in the driver."""
    return _worker[0]


async def closed_on_own_loop(runtime: Any, limit: float) -> bool:
    """Called from another thread's loop, close ``runtime`` on its own loop, which its
    actors' records, calls, events and connections belong to (run on the caller's, the
    close waited the whole grace for exits the runtime's loop reports, failed there,
    and left the calls pending there unanswered); whether it did. Where that loop
    closes first, or has not ended the close within ``limit`` seconds and either has
    not begun it (its thread waits for the caller's) or is not running (stopped for
    good, it would never end it), the caller closes it itself, as it would have. (A
    loop run in slices, not running now and then, ends it there.)"""
    loop = runtime.loop
    if loop.is_closed() or not loop.is_running() or asyncio.get_running_loop() is loop:
        return False
    done = asyncio.run_coroutine_threadsafe(runtime.close(), loop)
    deadline = time.monotonic() + limit
    while not done.done():
        await asyncio.sleep(0.05)
        if loop.is_closed() or (time.monotonic() > deadline and (
                not runtime._closing or not loop.is_running())):
            done.cancel()  # (not begun: it never will)
            return not runtime._open  # (ended as its loop closed: closed all the same)
    if done.cancelled():  # (the loop's end cancelled it: begun, it closed the runtime)
        return not runtime._open
    if done.exception() is not None:
        raise done.exception()
    return True


async def close_under_way(runtime: Any, limit: float) -> bool:
    """Wait for the close of ``runtime`` that another task or thread began, so that a
    second ``close()`` returns as the first does, the runtime closed (it returned at
    once, the actors still stopping, and a program that went on to end its loop cut
    their stop short). False where that close can no longer end: the runtime's loop
    closed in the middle of it, or has stopped for ``limit`` seconds: the caller ends
    it. (Polled: it waits for a state another thread's loop may change.)"""
    loop = runtime.loop
    deadline = time.monotonic() + limit
    while runtime._open:
        if loop.is_closed() or (time.monotonic() > deadline and not loop.is_running()):
            return False
        await asyncio.sleep(0.01)
    return True


# A runtime left open when its event loop shut down closes then (``Runtime.start``);
# what errors about it say, and whether the last one closed so.
WITH_LOOP = ("as the event loop it was opened on shut down (an asyncio.run() returned "
             "with it open): a runtime lives within one event loop; open it inside the "
             "asyncio.run() that uses it (`async with actorshm.Runtime():`)")
closed_with_loop = [False]


async def close_with_loop(runtime: Any) -> None:
    """Have ``runtime`` (just opened on the running loop) closed as that loop shuts
    down, if it is still open then: otherwise its actors lived on, out of reach (their
    calls fail once the loop is gone), until this process exited. An async generator
    that the loop finalizes on shutdown (``asyncio.run`` returning,
    ``loop.shutdown_asyncgens()``) closes it; ``end_loop_guard`` ends the generator when
    the runtime closes otherwise."""
    guard = _loop_guard(runtime)
    await guard.__anext__()  # (its first step is what registers it with the loop)
    runtime.loop_guard = guard


async def _loop_guard(runtime: Any):
    try:
        yield
    finally:
        runtime.loop_guard = None
        # (not in a fork of the driver, whose runtimes are the driver's: ``_runtimes``
        # is emptied there)
        if runtime._open and not runtime._closing and runtime in _runtimes:
            runtime.closed_with_loop = closed_with_loop[0] = True  # (its errors say so)
            await runtime.close()


def end_loop_guard(runtime: Any) -> None:
    """End ``runtime``'s ``close_with_loop`` generator, the runtime closed: here, at
    once, rather than by the loop's hook when it is collected (the loop may be closed
    by then)."""
    guard, runtime.loop_guard = runtime.loop_guard, None
    if guard is not None:
        step = guard.aclose()
        try:
            step.send(None)  # (its ``finally`` has nothing to wait for: it ends)
        except StopIteration:
            pass
        except RuntimeError:  # (the loop's shutdown closes it at this moment, on its
            pass  # thread: it finds the runtime closing, and does nothing either)


def runtime_opened(runtime: Any) -> None:
    """``runtime`` opened in this (driver) process: the innermost from now on."""
    _runtimes.append(runtime)
    closed_with_loop[0] = False


def runtime_closed(runtime: Any) -> bool:
    """``runtime`` closed; whether any runtime is still open."""
    if runtime in _runtimes:
        _runtimes.remove(runtime)
    return bool(_runtimes)


def innermost_runtime() -> Any:
    """The runtime opened last and not yet closed in this process, or None.

    One opened on the event loop running in this thread comes first: a runtime that
    another thread opened on a loop of its own (and closes when that thread is done)
    must not take this thread's spawns, whose actors would die with it.
    """
    if not _runtimes:
        return None
    loop = asyncio._get_running_loop()
    if loop is not None:
        for rt in reversed(_runtimes):
            if getattr(rt, "loop", None) is loop:
                return rt
    return _runtimes[-1]


def client() -> Any:
    w = _worker[0]
    if w is not None:
        return w
    if _runtimes:
        return innermost_runtime()
    raise RuntimeError(
        "no actorshm runtime is open. Open one with `async with actorshm.Runtime():` "
        "around your code, or run it with `actorshm.run(main())`." + (
            f" (The last one closed {WITH_LOOP}.)" if closed_with_loop[0] else ""))


def client_for_decode(actor_id: Any = None) -> Any:
    """The client a handle to actor ``actor_id`` decoded here calls through: the one
    whose connection it arrived on (else this process's), or in the driver the runtime
    that started the actor (``runtime_of``)."""
    from ._serialization import current_decode_conn
    conn = current_decode_conn()
    if conn is not None and (conn.host is _worker[0] or conn.host in _runtimes):
        host = conn.host  # the client whose connection the handle arrived on
    else:
        try:
            host = client()
        except RuntimeError:
            return _Unbound()
    return host if actor_id is None or host is _worker[0] else runtime_of(host, actor_id)


def runtime_of(runtime: Any, actor_id: Any) -> Any:
    """The runtime that started actor ``actor_id``: ``runtime``, or another runtime open
    in the driver on the same event loop that knows the actor (runtimes open at once:
    one opened inside another, a notebook's first cell run twice). Actor ids are unique
    in the process, so no other actor answers to one. ``runtime`` when none knows it,
    and for a Ray runtime's ids (their runtime is named in them)."""
    record = getattr(runtime, "record", None)
    if record is None or record(actor_id) is not None or runtime.forgotten(actor_id):
        return runtime
    for rt in list(_runtimes):
        if rt is not runtime and getattr(rt, "loop", None) is runtime.loop and \
                hasattr(rt, "record") and (  # (not a Ray runtime: none of its actors)
                    rt.record(actor_id) is not None or rt.forgotten(actor_id)):
            return rt
    return runtime


def refuse_runtime(rt) -> None:
    """A runtime's ``__reduce__``: it lives in the process that opened it."""
    from ._errors import Unsendable
    raise Unsendable(
        f"{type(rt).__name__} cannot be sent to another process (it owns this process's "
        "actors and memory): pass actor handles instead, which pickle")


def refuse_sync_with(rt, *exc_info) -> None:
    """A runtime's ``__enter__`` (and ``__exit__``): it opens and closes on an event
    loop, with ``async with``; say so rather than "does not support the context manager
    protocol"."""
    raise TypeError(
        f"{type(rt).__name__} is an async context manager: write `async with "
        "actorshm.Runtime(...) as rt:` inside an async function, and run that with "
        "actorshm.run(main()) (or asyncio.run)")


class Foreign:
    """The client of a local-backend actor's handle unpickled where its runtime cannot
    be reached: in a process of a Ray runtime (its driver or one of its actors), or of
    another driver's runtime (``family``). Only the runtime that spawned the actor can
    reach it, so every use says so."""

    shares_memory = False  # (a Ray runtime's process: group calls share nothing first)

    def __init__(self, what: str, owner: str | None = None) -> None:
        self.what = what
        self.owner = owner  # the token of the driver whose runtime spawned it, if not Ray

    def _error(self):
        from ._errors import ActorDiedError
        if self.owner is not None:
            return ActorDiedError(
                f"actor {self.what} belongs to a runtime of another process (pid "
                f"{self.owner.split('-')[0]}): its handle was pickled there and unpickled "
                "here, and a handle works only within the runtime that spawned its actor "
                "and that runtime's actors (pass handles to actors as arguments; in "
                "another program, spawn the actor there, or look it up by name with "
                "actorshm.get_actor inside the runtime that owns it)")
        return ActorDiedError(
            f"actor {self.what} belongs to a runtime of the local backend, and this "
            "process is a Ray runtime's: a handle works only within the runtime that "
            "spawned its actor (spawn the actor in this runtime, or use one backend)")

    def call(self, actor_id, method, args, kwargs, what="", meta=None, stream=False):
        return failed_call(self._error())

    def stream(self, actor_id, method, args, kwargs, what="", run_ahead=16):
        async def failing():
            raise self._error()
            yield  # (an async generator: the error comes from its ``async for``)
        return failing()

    async def kill(self, actor_id) -> None:
        raise self._error()

    def actor_pid(self, actor_id, pid):
        return pid


class _Unbound:
    """The client of a handle unpickled outside any runtime: every use says so."""

    def _fail(self, *a, **k):
        client()  # raises the RuntimeError that says how to open a runtime

    call = kill = _fail

    def actor_pid(self, actor_id, pid):
        return pid


def call_from_thread(loop, make_call):
    """Run ``make_call()`` (which returns an asyncio future) on ``loop``'s thread.

    Returns a ``concurrent.futures.Future`` that a thread can block on with
    ``.result()``: a sync method running in an actor's thread pool
    (``max_concurrency > 1``) can call other actors and wait for their answers.
    Cancelling it cancels the call, as cancelling the asyncio future does: cancelled
    before the loop got to it, the call is never made.
    """
    cf = ThreadCallFuture()

    def go() -> None:
        if cf.cancelled():
            return
        try:
            fut = make_call()
        except BaseException as exc:
            try:
                cf.set_exception(exc)
            except concurrent.futures.InvalidStateError:  # the thread cancelled it
                pass
            return

        def done(f) -> None:
            try:
                if f.cancelled():
                    cf.cancel()
                elif f.exception() is not None:
                    cf.set_exception(f.exception())
                else:
                    cf.set_result(f.result())
            except concurrent.futures.InvalidStateError:  # the thread cancelled it
                pass

        def cancelled(c) -> None:  # in the thread that cancelled ``cf``
            if c.cancelled() and not fut.done():
                try:
                    loop.call_soon_threadsafe(fut.cancel)
                except RuntimeError:  # the loop is closed: so is the call
                    pass

        fut.add_done_callback(done)
        cf.add_done_callback(cancelled)

    try:
        loop.call_soon_threadsafe(go)
    except RuntimeError:  # the loop has ended
        from ._errors import ActorDiedError
        cf.set_exception(ActorDiedError(
            "the call was made after the actor's runtime closed (its event loop has ended)"))
    return cf


def on_loop(loop, fn, *args) -> None:
    """``fn(*args)`` on ``loop``: now, on the thread that runs it; from another thread,
    handed to it, ahead of the calls that thread makes after (they go the same way);
    nothing once the loop has ended."""
    if asyncio._get_running_loop() is loop:
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # (its loop has ended: so has everything on it)
        pass


def failed_call(exc: BaseException):
    """What a call that cannot be made returns: an awaitable that raises ``exc``, on the
    event loop running in this thread (an asyncio future), or, with none running, a
    ``ThreadCallFuture`` to block on (a handle kept past its runtime, used from sync code
    or from the next ``asyncio.run``)."""
    try:
        fut = asyncio.get_running_loop().create_future()
    except RuntimeError:
        fut = ThreadCallFuture()
    fut.set_exception(exc)
    return fut


class ThreadCallFuture(concurrent.futures.Future):
    """What a call made from another thread returns: a ``concurrent.futures.Future`` to
    block on (``.result()``), which an event loop running in that thread can also
    ``await``."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()
