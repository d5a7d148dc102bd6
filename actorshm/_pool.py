"""``ActorPool``: load-balance calls over a set of actors, as Ray's ``ActorPool``.

Written against the public handle API only (calls, ``kill``), so it works the same on
every backend. Everything runs on the caller's event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator

from ._actor import ActorHandle, no_attribute
from ._errors import ActorDiedError, ActorError, RemoteTraceback
from ._results import NOT_MADE, JoinedFuture
from ._streams import StreamLoop
from ._util import first_line

__all__ = ["ActorPool"]


def check_handles(handles: Iterable[Any], what: str) -> list[ActorHandle]:
    """``handles`` as a list, or a clear error naming what is wrong with it."""
    if isinstance(handles, ActorHandle):
        raise TypeError(f"{what} takes a list of actor handles, not one handle; "
                        f"write {what}([handle])")
    try:
        out = list(handles)
    except TypeError:
        raise TypeError(f"{what} takes a list of actor handles, not "
                        f"{type(handles).__name__}") from None
    for i, h in enumerate(out):
        if not isinstance(h, ActorHandle):
            raise TypeError(f"{what}: item {i} is of type {type(h).__name__}, not an actor "
                            "handle (what `await Cls.spawn()` returns)")
    if not out:
        raise ValueError(f"{what} needs at least one actor handle; spawn some first, "
                         f"e.g. `await actorshm.ActorGroup.spawn(Cls, 4)`")
    if len(set(out)) != len(out):
        first: dict = {}
        for i, h in enumerate(out):
            if h in first:
                raise ValueError(f"{what}: the same actor is listed twice (items "
                                 f"{first[h]} and {i}: {h!r}); list each actor once")
            first[h] = i
    return out


def _check_fn(fn: Any, call: str) -> None:
    if not callable(fn):
        raise TypeError(f"ActorPool.{call}: fn must be callable, like "
                        f"`lambda actor, v: actor.method(v)`, not {type(fn).__name__}")


def _values(values: Any, method: str) -> Iterator[Any]:
    """An iterator over ``values`` (not read yet), or a TypeError naming the method."""
    try:
        return iter(values)
    except TypeError:
        raise TypeError(f"ActorPool.{method}(fn, values): values must be an iterable of "
                        f"values (a list, a range, a generator), one call each, not "
                        f"{type(values).__name__}; for one value use "
                        f"`await pool.submit(fn, value)`") from None


class ActorPool:
    """Runs work on a set of actors, one call per actor at a time, as Ray's ActorPool.

    ``fn(handle, value)`` must start one call on ``handle`` and return its awaitable
    (``lambda a, v: a.step(v)``), or be an ``async def`` that awaits calls on it.
    Work waits in a queue, first in first out, until an actor is free.

    A member whose actor is dead for good (killed, out of ``max_restarts``) leaves the
    pool once a call on it raises ``ActorDiedError`` (that call's awaitable raises the
    error; work still queued goes to the others). Once no member is left, queued and new
    work fails with ``ActorDiedError`` instead of waiting forever. A member whose actor
    restarts stays (its call at the death fails; later work waits for the new process),
    and so does one whose method raised another actor's ``ActorDiedError``.

    Args:
        handles: the actors (a non-empty list of distinct handles).

    Raises:
        TypeError: ``handles`` is not a list of actor handles.
        ValueError: it is empty or lists an actor twice.
    """

    def __init__(self, handles: Iterable[ActorHandle]) -> None:
        self._members: list[ActorHandle] = check_handles(handles, "ActorPool")
        self._idle: collections.deque = collections.deque(self._members)
        self._dispatching = False  # (an item that fails at once loops, not recurses)
        self._queue: collections.deque = collections.deque()  # (fn, value, future)
        self._busy: dict[ActorHandle, asyncio.Future] = {}
        self._last_death: str | None = None  # why the last member that died left
        # Members whose actor restarts but cannot take a call yet (``_rest``): neither
        # idle nor busy, checked again on a timer until it can, or is dead for good.
        self._resting: dict[ActorHandle, asyncio.TimerHandle] = {}

    def __getattr__(self, name: str):
        no_attribute(self, name, ("get_next", "get_next_unordered", "has_next"), lambda: (
            f"ActorPool.{name}: here `submit` returns the result's awaitable, so there is "
            "nothing to fetch: `await` it, or gather them (`asyncio.gather`, "
            "`asyncio.as_completed`); `pool.map`/`map_unordered` iterate results (see "
            "docs/pools.md)"))

    # -- members -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self):
        return iter(list(self._members))

    def __repr__(self) -> str:
        return (f"<ActorPool {len(self._members)} actors, {len(self._idle)} free, "
                f"{len(self._queue)} queued>")

    def push(self, handle: ActorHandle) -> None:
        """Add an actor to the pool; queued work starts on it at once.

        Args:
            handle: the actor to add.

        Raises:
            TypeError: ``handle`` is not an actor handle.
            ValueError: it is already a member.
        """
        if not isinstance(handle, ActorHandle):
            raise TypeError(f"ActorPool.push takes an actor handle, not "
                            f"{type(handle).__name__}")
        if handle in self._members:
            raise ValueError(f"{handle!r} is already in this pool")
        self._members.append(handle)
        if handle not in self._busy:  # (one removed while busy is free when its call ends)
            self._idle.append(handle)
        self._dispatch()

    def remove(self, handle: ActorHandle) -> None:
        """Take an actor out of the pool; a call it is running finishes normally.

        Work still queued when the last member leaves fails with ``ValueError``.

        Args:
            handle: a member.

        Raises:
            ValueError: ``handle`` is not a member.
        """
        if handle not in self._members:
            raise ValueError(f"{handle!r} is not in this pool")
        self._members.remove(handle)
        if handle in self._idle:
            self._idle.remove(handle)
        self._stop_resting(handle)
        self._last_death = None  # (the last to leave was removed, not dead)
        self._fail_queue_if_empty()

    def pop_idle(self) -> ActorHandle | None:
        """Take a free actor out of the pool and return it; ``None`` if none is free."""
        if not self._idle:
            return None
        h = self._idle.popleft()
        self._members.remove(h)
        self._last_death = None
        self._fail_queue_if_empty()
        return h

    def has_free(self) -> bool:
        """Whether an actor is free and nothing waits in the queue."""
        return bool(self._idle) and not self._queue

    # -- work ------------------------------------------------------------------------
    def submit(self, fn: Callable[[ActorHandle, Any], Awaitable], value: Any) -> asyncio.Future:
        """Run ``fn(handle, value)`` on the next free actor; return an awaitable of its result.

        The call starts at once when an actor is free (no ``await`` needed), else when
        one becomes free, in submission order. Cancelling the awaitable cancels the call
        (or drops it from the queue). Errors of ``fn`` and of the call are raised by
        ``await``.

        Args:
            fn: ``fn(actor, value)``, returning the awaitable of a call on ``actor``
                (``lambda a, v: a.method(v)``), or an ``async def`` awaiting calls on it.
            value: passed to ``fn``.

        Returns:
            An ``asyncio.Future`` of the result.

        Raises:
            TypeError: ``fn`` is not callable.
            RuntimeError: called from a thread that runs no event loop (the pool's
                queue lives on an event loop; a single handle call works from any thread).
            ValueError: the pool has no members (all removed).
            ActorDiedError: every member has died.
        """
        _check_fn(fn, "submit(fn, value)")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # The queue, the free members and their timers are the event loop's, unlocked
            # (as every asyncio object): handed over from a thread, work would race them.
            raise RuntimeError(
                "ActorPool.submit needs a running event loop: the pool's queue runs on "
                "the event loop it is used from, and this thread runs none. Call it from "
                "async code on that loop; from another thread, hand it over with "
                "`asyncio.run_coroutine_threadsafe(run(), loop).result()` where "
                "`async def run(): return await pool.submit(fn, value)` (a single call, "
                "`handle.method(v).result(timeout=...)`, works from any thread)") from None
        if not self._members:
            raise self._empty_error()
        fut = JoinedFuture(loop)  # (cancelled, it cancels the call it stands for at once)
        self._queue.append((fn, value, fut))
        self._dispatch()
        return fut

    def map(self, fn: Callable[[ActorHandle, Any], Awaitable],
            values: Iterable[Any]) -> AsyncIterator[Any]:
        """Apply ``fn`` to every value on the pool's actors; yield results in input order.

        ``values`` is read lazily (it may be a generator), keeping at most twice as many
        items in flight or finished-but-not-yet-yielded as the pool has actors. The first
        error is raised here; leaving the loop early cancels the work still in flight.

        Args:
            fn: as for ``submit``.
            values: an iterable of values, one call each.

        Returns:
            An async iterator of the results (``async for r in pool.map(...)``).

        Raises:
            TypeError: ``fn`` is not callable, or ``values`` is not iterable (raised
                by this call, not by the first ``async for`` step).
            ActorDiedError: a member died running an item (dead for good, it
                leaves the pool).
            Exception: the first error of ``fn`` or of a call, as ``await`` raises it.
        """
        # Checked here, not in the generator: its body runs only when iterated, and an
        # error there would name neither this call nor ``map``.
        _check_fn(fn, "map(fn, values)")
        res = _Results("map")
        res._agen = self._map(fn, _values(values, "map"), res)
        return res

    async def _map(self, fn: Callable[[ActorHandle, Any], Awaitable],
                   it: Iterator[Any], res: "_Results") -> AsyncIterator[Any]:
        pending: collections.deque = collections.deque()
        exhausted = False
        failed = None  # what ``values`` raised: after the results of the values before it
        try:
            while not res.stopping:  # (``aclose`` from another task or thread)
                while not exhausted and len(pending) < self._window():
                    try:
                        v = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    except Exception as exc:
                        exhausted, failed = True, exc
                        break
                    pending.append(self.submit(fn, v))
                if not pending:
                    if failed is not None:
                        raise failed
                    return
                if not pending[0].done():  # (``aclose`` from another task may stop it)
                    await asyncio.wait((pending[0], res.stop_signal()),
                                       return_when=asyncio.FIRST_COMPLETED)
                    if res.stopping:
                        return
                yield _outcome(pending.popleft())
        finally:
            _cancel_all(pending)

    def map_unordered(self, fn: Callable[[ActorHandle, Any], Awaitable],
                      values: Iterable[Any]) -> AsyncIterator[Any]:
        """Like ``map``, but yield each result as soon as it is ready (completion order).

        Args:
            fn: as for ``submit``.
            values: an iterable of values, one call each.

        Returns:
            An async iterator of the results (``async for r in pool.map_unordered(...)``).

        Raises:
            TypeError: ``fn`` is not callable, or ``values`` is not iterable (raised
                by this call, as for ``map``).
            ActorDiedError: a member died running an item (dead for good, it
                leaves the pool).
            Exception: the first error of ``fn`` or of a call, as ``await`` raises it.
        """
        _check_fn(fn, "map_unordered(fn, values)")
        res = _Results("map_unordered")
        res._agen = self._map_unordered(fn, _values(values, "map_unordered"), res)
        return res

    async def _map_unordered(self, fn: Callable[[ActorHandle, Any], Awaitable],
                             it: Iterator[Any], res: "_Results") -> AsyncIterator[Any]:
        pending: set = set()
        done: collections.deque = collections.deque()
        wake = asyncio.Event()

        def finished(f: asyncio.Future) -> None:
            pending.discard(f)
            done.append(f)
            wake.set()

        res.stop_signal().add_done_callback(lambda _f: wake.set())  # (``aclose``)
        exhausted = False
        failed = None  # what ``values`` raised: after the results of the values before it
        try:
            while not res.stopping:  # (``aclose`` from another task or thread)
                while not exhausted and len(pending) + len(done) < self._window():
                    try:
                        v = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    except Exception as exc:
                        exhausted, failed = True, exc
                        break
                    f = self.submit(fn, v)
                    pending.add(f)
                    f.add_done_callback(finished)
                if not done:
                    if not pending:
                        if failed is not None:
                            raise failed
                        return
                    wake.clear()
                    await wake.wait()
                    if res.stopping:  # (``aclose`` from another task)
                        return
                    continue
                yield _outcome(done.popleft())
        finally:
            _cancel_all(pending)
            for f in done:  # mark errors seen: they were superseded by the one raised
                if not f.cancelled():
                    f.exception()

    # -- internals ---------------------------------------------------------------------
    def _window(self) -> int:
        return max(2, 2 * len(self._members))

    def _empty_error(self) -> Exception:
        """What work fails with when no member is left: how the last one left."""
        if self._last_death is not None:
            return ActorDiedError("every actor of this ActorPool has died; last: "
                                  f"{self._last_death}")
        return ValueError("this ActorPool has no actors left (they were removed); "
                          "push() one before submitting work")

    def _fail_queue_if_empty(self) -> None:
        if self._members:
            return
        while self._queue:
            _, _, fut = self._queue.popleft()
            if not fut.done():
                fut.set_exception(self._empty_error())

    def _dispatch(self) -> None:
        if self._dispatching:  # an item failed at once: the loop below goes on
            return
        self._dispatching = True
        try:
            while self._queue and self._idle:
                fn, value, fut = self._queue.popleft()
                if fut.done():  # cancelled while queued
                    continue
                self._start(self._idle.popleft(), fn, value, fut)
        finally:
            self._dispatching = False

    def _start(self, h: ActorHandle, fn: Callable, value: Any, fut: asyncio.Future) -> None:
        try:
            aw = fn(h, value)
        except BaseException as exc:  # (a CancelledError too: the member stays free)
            try:
                if isinstance(exc, asyncio.CancelledError):
                    fut.cancel()  # (as an awaitable of ``fn``'s that was cancelled)
                elif isinstance(exc, StopIteration):  # (no future can hold one)
                    err = RuntimeError(f"ActorPool: fn(actor, value) raised {exc!r}")
                    err.__cause__ = exc
                    fut.set_exception(err)
                else:
                    fut.set_exception(exc)
            finally:
                self._release(h, None)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        if not inspect.isawaitable(aw):
            fut.set_exception(TypeError(
                "ActorPool: fn(actor, value) must return an awaitable, like "
                f"`lambda a, v: a.method(v)`; it returned {type(aw).__name__}"))
            self._release(h, None)
            return
        inner = asyncio.ensure_future(aw)
        self._busy[h] = inner
        inner.add_done_callback(lambda f: self._finished(h, fut, f))
        fut.parts.append(inner)

    def _finished(self, h: ActorHandle, fut: asyncio.Future, inner: asyncio.Future) -> None:
        self._busy.pop(h, None)
        exc = None if inner.cancelled() else inner.exception()
        if not fut.done():
            if inner.cancelled():
                fut.cancel()
            elif exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(inner.result())
        self._release(h, exc)

    def _release(self, h: ActorHandle, exc: BaseException | None) -> None:
        if h not in self._members:  # removed while busy
            self._dispatch()
            return
        if isinstance(exc, ActorDiedError):
            if not _lives(h, exc):
                self._drop_dead(h, str(exc).splitlines()[0] if str(exc) else repr(h))
                return
            if not _takes_calls(h):  # it restarts, but a call now would fail at once
                self._rest(h, RESTING_FIRST)
                return
        self._idle.append(h)
        self._dispatch()

    def _drop_dead(self, h: ActorHandle, why: str) -> None:
        """Member ``h``'s actor is dead for good: it leaves the pool."""
        self._members.remove(h)
        self._last_death = why  # (only the last is told: the pool may live long)
        self._fail_queue_if_empty()

    def _rest(self, h: ActorHandle, delay: float) -> None:
        """Keep member ``h`` out of work for ``delay`` seconds, then check it again: on the
        local backend a restarted process that dies while starting leaves its actor
        refusing calls at once until the next restart begins (some 50 ms plus a
        back-off), and work given to it then would fail, item after item."""
        self._resting[h] = asyncio.get_running_loop().call_later(
            delay, self._wake, h, min(delay * 2, RESTING_MAX))

    def _wake(self, h: ActorHandle, next_delay: float) -> None:
        if self._resting.pop(h, None) is None or h not in self._members:
            return
        if not _lives(h, None):
            death_of = getattr(h._client, "death_of", None)
            self._drop_dead(h, first_line(death_of(h._actor_id)) if death_of is not None
                            else f"{h!r} could not be restarted")
        elif not _takes_calls(h):
            self._rest(h, next_delay)
        else:
            self._idle.append(h)
            self._dispatch()

    def _stop_resting(self, h: ActorHandle) -> None:
        timer = self._resting.pop(h, None)
        if timer is not None:
            timer.cancel()


class _Results:
    """What ``map`` and ``map_unordered`` return: an async iterator of the results.

    Each ``async for`` over it iterates a ``StreamLoop``, as a stream does: a loop left
    early (``break``, an exception) closes the results at the event loop's next turn,
    which cancels the work in flight and queued, even while this object is kept in a
    variable (``m = pool.map(...)``; ``async for r in m: break``), where Python would
    keep an async generator open until it is dropped.

    A wait for a result that is cancelled or times out ends the generator too (the
    cancel is thrown into it, and it cancels the work): asking for more then raises
    ``RuntimeError`` saying so, as a stream cut that way does, rather than end as if
    every result had come.
    """

    __slots__ = ("_agen", "_what", "_polls", "_loop", "_cut", "_stop", "stopping")

    def __init__(self, method: str) -> None:
        self._agen: Any = None  # the generator, set by the pool
        self._stop: asyncio.Future | None = None  # set by ``aclose`` while it is iterated
        self.stopping = False
        self._what = f"ActorPool.{method}"
        self._polls = 0  # ``__anext__`` calls: iterated again before a loop's close?
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it is iterated on
        self._cut = False  # a wait for a result was cancelled: the generator ended

    def __aiter__(self) -> StreamLoop:
        return StreamLoop(self)

    def __iter__(self):
        raise TypeError(f"the results of {self._what}() come asynchronously: iterate them "
                        f"with `async for r in pool.{self._what[10:]}(...)` in an async "
                        "function")

    __next__ = __iter__

    def __await__(self):
        raise TypeError(f"{self._what}() gives its results one by one: iterate them with "
                        f"`async for r in pool.{self._what[10:]}(...)`, or collect them "
                        f"with `[r async for r in pool.{self._what[10:]}(...)]`")

    def __anext__(self) -> Awaitable[Any]:
        self._polls += 1
        self._loop = asyncio.get_running_loop()
        return self._next()

    async def _next(self) -> Any:
        if self._cut:
            raise RuntimeError(
                f"the results of {self._what}() were stopped when a wait for the next "
                "one was cancelled or timed out (task.cancel(), asyncio.wait_for, "
                "asyncio.timeout), and its work was cancelled: no more results come. To "
                "wait for a result with a time-out and go on, wait on a task, which a "
                "time-out leaves running: `t = asyncio.ensure_future(anext(it))`, then "
                "`await asyncio.wait({t}, timeout=...)`")
        try:
            return await self._agen.__anext__()
        except asyncio.CancelledError:
            self._cut = True  # (thrown into the generator, which ended on it)
            raise

    def aclose(self) -> Awaitable[None]:
        """Stop: cancel the work in flight and queued. While another task waits in it
        for a result, that wait ends, and its loop with it, as if the results were all
        in (the generator cannot be closed from outside while it runs)."""
        if not self._agen.ag_running:
            loop = self._loop
            if loop is not None and asyncio._get_running_loop() is not loop:
                self.stopping = True  # (should it step before its loop closes it)
                self._left()  # (another thread's: closed on the loop it is iterated on)
                return _nothing()
            return self._agen.aclose()
        self.stopping = True
        stop = self._stop
        if stop is not None:
            loop = stop.get_loop()
            if asyncio._get_running_loop() is loop:
                _settle(stop)
            else:  # (iterated on another thread's loop)
                try:
                    loop.call_soon_threadsafe(_settle, stop)
                except RuntimeError:  # that loop is closed: its work went with it
                    pass
        return _nothing()

    def stop_signal(self) -> asyncio.Future:
        """A future that ``aclose`` sets while another task waits for a result."""
        if self._stop is None:
            self._stop = asyncio.get_running_loop().create_future()
            if self.stopping:
                self._stop.set_result(None)
        return self._stop

    def _left(self) -> None:
        """A loop over it was left early (from any thread): close the generator on the
        loop it was iterated on, whose work it cancels."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if loop is None or here:  # (never iterated: nothing ran, nothing to cancel)
            self._close_now()
        else:
            try:
                loop.call_soon_threadsafe(self._close_now)
            except RuntimeError:  # that loop is closed: its work went with it
                pass

    def _close_now(self) -> None:
        """Close the generator at its ``yield`` (its ``finally``, which cancels the work,
        awaits nothing, so this completes at once)."""
        closing = self._agen.aclose()
        try:
            closing.send(None)
        except StopIteration:
            pass
        except RuntimeError:  # being iterated (``await anext(m)`` in another task)
            closing.close()
            self.stopping = True  # (it stops at its next step instead)
            if self._stop is not None:
                _settle(self._stop)


def _outcome(item: asyncio.Future) -> Any:
    """The result of a finished item of a map: a cancelled one (its ``fn`` or what that
    awaited was cancelled) raises ``ActorError``, not a ``CancelledError``, which the
    task iterating the map would take for its own cancellation."""
    if item.cancelled():
        raise ActorError("an item of this ActorPool map was cancelled (its fn(actor, "
                         "value), or what that awaited, was cancelled), so it has no "
                         "result")
    try:
        return item.result()
    except BaseException:
        del item  # (kept by the error's traceback, this frame would keep the item, which
        raise  # keeps the error: a reference cycle, the caller's frames in it)


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _nothing() -> None:
    pass


RESTING_FIRST = 0.02  # seconds before a restarting member is checked again (doubling)
RESTING_MAX = 0.5


def _lives(h: ActorHandle, exc: ActorDiedError | None) -> bool:
    """Whether member ``h`` stays in the pool after its call failed with ``exc``: the
    error was another actor's death that ``h``'s method raised (it came back from the
    actor, with its traceback), or ``h``'s actor lives or restarts (its client knows:
    the local runtime's record, or Ray's restart watch; a client that cannot tell, as
    inside an actor, counts it as dead)."""
    reachable = getattr(h._client, "reachable", None)
    known = reachable(h._actor_id) if reachable is not None else None
    if exc is not None and (isinstance(exc.__cause__, RemoteTraceback) or
                            getattr(exc, NOT_MADE, False) is True):
        # (an actor's own reply may say it is dead for good; a call never made, since
        # a result it took had failed, is no news of ``h``)
        return known is not False
    return bool(known)


def _takes_calls(h: ActorHandle) -> bool:
    """Whether a call on ``h`` made now runs or waits for its actor's restart, rather than
    failing at once (only the local runtime has such a moment: ``takes_calls``)."""
    takes = getattr(h._client, "takes_calls", None)
    return takes is None or bool(takes(h._actor_id))


def _cancel_all(futs) -> None:
    for f in list(futs):
        if not f.done():
            f.cancel()
        elif not f.cancelled():
            f.exception()  # retrieved: an error after the one raised is not "unhandled"
