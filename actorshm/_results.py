"""Results as arguments: a call's awaitable passed to another call (Ray's ObjectRef).

An unfinished call's future found while pickling a call's arguments (at any depth)
stops the pickling (``Unfinished``); the connection then holds that call, and every
later call on it (per-caller order holds), until the future is done, and sends them
again: a finished call's future pickles as its result. A call whose awaited result
failed fails with that error. Any other asyncio future is refused with a ``TypeError``
that says to await it first.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._errors import ActorDiedError, ActorError, Unsendable

__all__ = ["CallFuture", "JoinedFuture", "reduce_future", "Unfinished", "DependencyFailed",
           "not_made", "fail_not_made", "NOT_MADE", "futures_in", "with_results"]


_future_result = asyncio.Future.result


class CallFuture(asyncio.Future):
    """The awaitable of a call: an asyncio future that may be passed as an argument,
    and whose ``cancel()`` also cancels the call where it was sent."""

    conn: Any = None  # set once the call is sent: its connection and call id
    cid = 0

    @property
    def result(self):
        """``result()``: the call's result once it finished (``asyncio.Future.result``
        itself); before, an error that says to ``await`` it.

        A property that hands out asyncio's own method when the call is done: the task
        that awaits a call asks ``result()`` of it as it wakes, and a method of ours would
        put its frame in the traceback of every failed call (and, holding the future
        that holds the error, make each a reference cycle)."""
        if self.done():
            return _future_result.__get__(self)
        return self._unfinished

    def _unfinished(self, timeout: Any = None) -> Any:
        # (``timeout`` is accepted and ignored: on the event loop's thread nothing can
        # block for the answer, which that loop brings.)
        if self.done():  # (``g = fut.result`` taken before, called after)
            return _future_result(self)
        # Its caller gives up on it here: should it fail, that is not "an exception
        # never retrieved" printed later, with a traceback, by the event loop.
        self.add_done_callback(_retrieve)
        raise asyncio.InvalidStateError(
            "this call has not finished, and nothing on the event loop's thread can "
            "block for it (that loop brings its answer): `await` it in an `async def` "
            "method or function; or give the actor max_concurrency > 1, whose sync "
            "methods run in threads and get futures they can block on with .result()")

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        if self.conn is not None:
            self.conn.cancel(self.cid)
        return True


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class JoinedFuture(asyncio.Future):
    """A future that stands for the calls in ``parts`` (a group call's members, a pool's
    call): cancelling it cancels them then and there. (A done callback would cancel them
    a loop iteration later, after the canceller had gone on: its next call to a member
    with ``max_pending_calls=1`` was refused, the cancelled one still counted.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop, parts: list | None = None) -> None:
        super().__init__(loop=loop)
        self.parts: list = [] if parts is None else parts

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        for f in self.parts:
            f.cancel()
        return True


class Unfinished(Exception):
    """Pickling met the future of a call that has not finished yet."""

    def __init__(self, fut: asyncio.Future) -> None:
        super().__init__("it holds the awaitable of a call that has not finished; await "
                         "it first (make the method `async def` and return `await "
                         "handle.method(...)`)")
        self.fut = fut


class DependencyFailed(Exception):
    """Pickling met the future of a call that failed (or was cancelled)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


NOT_MADE = "_actorshm_not_made"  # set on the error of a call that was never made


def not_made(exc: BaseException) -> BaseException:
    """Mark ``exc`` as the error of a call that was never made, because a call's result
    given as an argument had failed (``DependencyFailed``): it is not the error of the
    actor called, whose death an ``ActorPool`` must not read in it."""
    try:
        setattr(exc, NOT_MADE, True)
    except Exception:  # (an exception type that takes no attributes)
        pass
    return exc


def fail_not_made(fut: asyncio.Future, exc: BaseException) -> None:
    """Fail call ``fut``, never made since a call's result it takes failed with ``exc``
    (a copy: ``not_made`` marks it). Where that was an actor's death, which its runtime
    reports, the call prints no "exception was never retrieved" if nobody awaits it, as
    the calls that waited on that actor itself."""
    fut.set_exception(not_made(exc))
    if isinstance(exc, ActorDiedError):
        fut.exception()


def _identity(x):
    return x


def reduce_future(fut: asyncio.Future):
    """How an encoder pickles an asyncio future: a finished call's as its result.

    Raises:
        Unfinished: the future is a call's that has not finished.
        DependencyFailed: it is a call's that failed or was cancelled.
        TypeError: it is not a call's future.
    """
    if not isinstance(fut, CallFuture):
        raise Unsendable("an asyncio Future cannot be passed to an actor: await it first "
                        "and pass its result (only the awaitable of an actor call may be "
                        "passed unfinished)")
    if not fut.done():
        raise Unfinished(fut)
    if fut.cancelled():  # (not a CancelledError: that would read as the cancellation
        # of whoever awaits this call, and a TaskGroup would drop it without a word)
        raise DependencyFailed(ActorError("a call given as an argument was cancelled, so "
                                          "this call was not made"))
    exc = fut.exception()
    if exc is not None:
        raise DependencyFailed(exc)
    return _identity, (fut.result(),)


_CONTAINERS = (list, tuple, dict)
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes})
_MAX_DEPTH = 8


def futures_in(values, depth: int = 0) -> list:
    """The call futures among ``values`` and in the lists, tuples and dicts they hold,
    down to eight levels (where a backend that cannot stop its pickling looks for them:
    the Ray backend; one anywhere else is refused by pickling, as any future).

    Raises:
        TypeError: one is an asyncio future other than a call's (await it first).
    """
    found = []
    for x in values:
        t = type(x)
        if t is CallFuture:
            found.append(x)
        elif isinstance(x, asyncio.Future):
            reduce_future(x)  # (raises the TypeError that says to await it)
        elif depth < _MAX_DEPTH and t in _CONTAINERS:
            items = x.values() if t is dict else x
            if not set(map(type, items)) <= _PLAIN:  # (a long list of numbers: one pass in C)
                found += futures_in(items, depth + 1)
    return found


def with_results(x, depth: int = 0):
    """``x`` with each finished call future that ``futures_in`` finds replaced by its
    result (containers rebuilt, the rest kept as it is).

    Raises:
        DependencyFailed: one of those calls failed or was cancelled.
    """
    t = type(x)
    if t is CallFuture:
        return reduce_future(x)[1][0]
    if depth >= _MAX_DEPTH or t not in _CONTAINERS:
        return x
    if t is dict:
        return {k: with_results(v, depth + 1) for k, v in x.items()}
    return t(with_results(v, depth + 1) for v in x)
