"""Lifecycle events: the owner of actors learns of deaths and restarts without calling them.

``Runtime`` mixes in ``EventSource``: ``rt.on_actor_event(callback)`` and
``async for ev in rt.events()``. The runtime calls ``emit`` where it learns that an actor
process died or that a restart brought one back; everything else lives here.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ActorEvent", "EventSource", "emit", "close"]

logger = logging.getLogger("actorshm")


@dataclass(frozen=True)
class ActorEvent:
    """Something that happened to an actor, seen by the runtime that owns it.

    Attributes:
        kind: ``"died"`` (its process is gone: a crash, a signal, ``kill()``, an exit)
            or ``"restarted"`` (a new process runs it after a death, ``max_restarts``).
        handle: a handle to the actor (after ``"restarted"``, calls on it work again).
        actor_id: the actor's id in its runtime (``handle.actor_id``).
        cls_name: the actor's class name.
        name: its ``name`` option, or ``None``.
        pid: the process that died, or the new process after a restart.
        reason: why it died, in words (the exit code or signal, ``kill()``, ...: e.g.
            ``"actor Counter(id=1, pid=8974) died: it was killed by SIGKILL (-9)"``), or
            for ``"restarted"``, the death the restart followed.
        will_restart: for ``"died"``: whether a restart is on its way.
        restarts: how many times it has been restarted so far.
        time: ``time.time()`` when the runtime learned of it.
        killed: for ``"died"``: whether ``kill()`` ended it (this program's, on any of
            its handles), not a crash, a signal from elsewhere or an exit.
    """

    kind: str
    handle: Any = field(repr=False)
    actor_id: int
    cls_name: str
    name: str | None
    pid: int
    reason: str
    will_restart: bool = False
    restarts: int = 0
    time: float = 0.0
    killed: bool = False


# Guards the runtimes' sets of ``events()`` streams: one may be made (and closed) on
# another thread's loop while the runtime's thread goes through its set.
_STREAMS_LOCK = threading.RLock()


class _EventStream:
    """What ``rt.events()`` returns: an async iterator over the events from then on.

    It may be iterated on another thread's event loop than the runtime's: an event wakes
    the waiting loop thread-safely (a plain ``asyncio.Event`` set from the runtime's
    thread would not wake it)."""

    def __init__(self, source: "EventSource") -> None:
        self._source = source
        self._queue: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None  # the wait of ``__anext__``, if any
        self._closed = False
        with _STREAMS_LOCK:  # (made on another thread's loop, maybe)
            source._event_state()[1].add(self)

    def _put(self, ev: ActorEvent | None) -> None:
        if ev is None:
            self._closed = True
        else:
            self._queue.append(ev)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is None:
            return
        loop = waiter.get_loop()
        if asyncio._get_running_loop() is loop:
            _set(waiter)
        else:  # iterated on another thread's loop
            try:
                loop.call_soon_threadsafe(_set, waiter)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass

    def __aiter__(self) -> "_EventStream":
        return self

    async def __anext__(self) -> ActorEvent:
        while True:
            if self._queue:
                return self._queue.popleft()
            if self._closed:
                raise StopAsyncIteration
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            if self._queue or self._closed:  # (came before the waiter was seen)
                self._waiter = None
                continue
            try:
                await waiter
            finally:
                self._waiter = None

    async def aclose(self) -> None:
        """Stop receiving events (leaving ``async for`` with ``break`` is enough too)."""
        self._closed = True
        self._queue.clear()
        with _STREAMS_LOCK:
            self._source._event_state()[1].discard(self)
        self._wake()


def _set(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EventSource:
    """Mixed into ``Runtime``: subscribe to its actors' lifecycle events."""

    def _event_state(self) -> tuple[list, weakref.WeakSet]:
        st = self.__dict__.get("_actorshm_events")
        if st is None:
            with _STREAMS_LOCK:  # (a stream made on another thread makes it too)
                st = self.__dict__.get("_actorshm_events")
                if st is None:
                    # (callbacks, streams): a stream is held weakly, so one left with
                    # ``break`` (nothing refers to it any more) stops receiving events
                    st = self.__dict__["_actorshm_events"] = ([], weakref.WeakSet())
        return st

    def on_actor_event(self, callback: Callable[[ActorEvent], Any]) -> Callable[[], None]:
        """Call ``callback(event)`` on the event loop for every later death or restart.

        The callback may be a plain function or an ``async def`` (run as a task). An
        exception it raises is logged and does not stop later events. Deaths caused by
        closing the runtime are not reported.

        Args:
            callback: called with each ``ActorEvent``.

        Returns:
            A function that unsubscribes the callback.

        Raises:
            TypeError: ``callback`` is not callable.
        """
        if not callable(callback):
            raise TypeError(f"on_actor_event takes a callable, not {type(callback).__name__}")
        callbacks = self._event_state()[0]
        entry = [callback]  # a fresh object: the same function may be subscribed twice
        callbacks.append(entry)

        def unsubscribe() -> None:
            if entry in callbacks:
                callbacks.remove(entry)
        return unsubscribe

    def events(self) -> _EventStream:
        """An async iterator of the ``ActorEvent``s from now on; it ends when the
        runtime closes. ``async for ev in rt.events(): ...``; events wait in it
        (unbounded) until read, so leave the loop (or ``aclose()`` it) when done."""
        stream = _EventStream(self)
        if getattr(self, "_closing", False):  # closed (or closing): nothing more will come
            stream._put(None)
        return stream


def emit(runtime: Any, kind: str, rec: Any, reason: str, will_restart: bool = False) -> None:
    """Tell ``runtime``'s subscribers that actor ``rec`` died or restarted."""
    if getattr(runtime, "_closing", False):
        return
    callbacks, streams = runtime._event_state()
    if not callbacks and not streams:
        return
    from ._actor import ActorHandle
    handle = ActorHandle(runtime, rec.actor_id, rec.cls_name, rec.methods, rec.options.name,
                         rec.pid, rec.options.max_pending_calls)
    # (a kill's reason: on Ray "kill()", locally the record's ``killed`` words)
    killed = kind == "died" and (reason == "kill()" or reason == getattr(rec, "killed", None))
    ev = ActorEvent(kind, handle, rec.actor_id, rec.cls_name, rec.options.name, rec.pid,
                    reason, will_restart, rec.restarts, time.time(), killed)
    with _STREAMS_LOCK:
        streams = list(streams)
    for s in streams:
        s._put(ev)
    for (cb,) in list(callbacks):
        runtime.loop.call_soon(_run_callback, runtime.loop, cb, ev)


def close(runtime: Any) -> None:
    """The runtime closed: every ``events()`` iterator ends."""
    st = runtime.__dict__.get("_actorshm_events")
    if st is not None:
        with _STREAMS_LOCK:
            streams = list(st[1])
            st[1].clear()
        for s in streams:
            s._put(None)
        st[0].clear()


def _run_callback(loop: asyncio.AbstractEventLoop, cb: Callable, ev: ActorEvent) -> None:
    try:
        out = cb(ev)
        if inspect.isawaitable(out):
            task = asyncio.ensure_future(out)
            task.add_done_callback(_log_task_error)
    except Exception:
        logger.exception("actorshm: an actor event callback raised (event: %s)", ev)


def _log_task_error(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("actorshm: an actor event callback raised", exc_info=task.exception())
