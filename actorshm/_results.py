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
import weakref

__all__ = ["mark_call", "reduce_future", "Unfinished", "DependencyFailed"]

_call_futures: "weakref.WeakSet[asyncio.Future]" = weakref.WeakSet()


def mark_call(fut: asyncio.Future) -> None:
    """Remember ``fut`` as a call's future: it may be passed as an argument."""
    _call_futures.add(fut)


class Unfinished(Exception):
    """Pickling met the future of a call that has not finished yet."""

    def __init__(self, fut: asyncio.Future) -> None:
        super().__init__("a call's result is not ready yet")
        self.fut = fut


class DependencyFailed(Exception):
    """Pickling met the future of a call that failed (or was cancelled)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


def _identity(x):
    return x


def reduce_future(fut: asyncio.Future):
    """How an encoder pickles an asyncio future: a finished call's as its result.

    Raises:
        Unfinished: the future is a call's that has not finished.
        DependencyFailed: it is a call's that failed or was cancelled.
        TypeError: it is not a call's future.
    """
    if fut not in _call_futures:
        raise TypeError("an asyncio Future cannot be passed to an actor: await it first "
                        "and pass its result (only the awaitable of an actor call may be "
                        "passed unfinished)")
    if not fut.done():
        raise Unfinished(fut)
    if fut.cancelled():
        raise DependencyFailed(asyncio.CancelledError("a call given as an argument was "
                                                      "cancelled"))
    exc = fut.exception()
    if exc is not None:
        raise DependencyFailed(exc)
    return _identity, (fut.result(),)
