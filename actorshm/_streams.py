"""Streaming calls, and the chain of calls each call was made from.

A method that is a generator (sync or async) streams: the caller gets a ``CallStream``,
an async iterator fed by ``ITEM`` frames; the call's ordinary reply (``None``, or the
generator's error) ends it. The actor runs at most ``run_ahead`` items ahead of the
consumer: the caller gives credit (``CREDIT`` frames) as it takes items, and the actor
waits at the generator's ``yield`` while it has none (``Outflow``). Leaving the loop early
cancels the call (``CANCEL``): the generator is closed in the actor, so its ``finally``
blocks run.

Each call made inside an actor also carries the chain of actor calls it was made from
(``chain``), so that an actor that runs one call at a time can refuse, at once and with
the chain named, a call that would wait on itself (A -> B -> A), instead of hanging.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
from typing import Any

from ._errors import ReentrantCallError

__all__ = ["CallStream", "StreamingClient", "Outflow", "run_stream", "chain",
           "reentrant_error", "DEFAULT_RUN_AHEAD"]

DEFAULT_RUN_AHEAD = 16
NO_META: dict = {}  # the meta of a call that carries none (read only)

# The call this task or thread runs, as (the chain it carried, actor id, "Cls.method",
# seq); a chain is ((actor id, "Cls.method", seq), ...), outermost first. Empty in the
# driver. (A call made here carries the chain plus this call: ``Worker.call``.)
chain: contextvars.ContextVar[tuple] = contextvars.ContextVar("actorshm_chain", default=())


def reentrant_error(calls: tuple, running: tuple, cls_name: str, what: str):
    """The error for a call that would wait on itself, or None when it would not.

    Args:
        calls: the chain the call carries (``chain``'s value where it was made):
            ``(actor id, "Cls.method", seq)`` per call, outermost first.
        running: ``(actor id, seq)`` of the call the receiving actor is running (it runs
            one call at a time).
        cls_name: the receiving actor's class name.
        what: the call (``"Cls.method"``).
    """
    keys = [(c[0], c[2]) for c in calls]
    if running not in keys:
        return None
    loop = calls[keys.index(running):]
    names = " -> ".join(f"{w} (actor {a})" for a, w, _seq in loop)
    return ReentrantCallError(
        f"re-entrant call would deadlock: {names} -> {what} (actor {running[0]}). Actor "
        f"{cls_name} runs one call at a time (max_concurrency=1) and its running call is "
        f"waiting for this one. Give {cls_name} max_concurrency > 1 with async methods, "
        "or do not call back into an actor from a call it is waiting for.")


class Inbox:
    """Where a connection puts a streaming call's items (the ``CallStream`` reads them).

    Kept apart from the ``CallStream`` so that the connection does not keep the user's
    iterator alive: dropping it cancels the call.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.fut: asyncio.Future | None = None  # the call's reply: the end of the stream
        self.conn: Any = None  # set by the connection that sends the call
        self.cid = 0
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None

    def push(self, item: Any) -> None:
        self.items.append(item)
        self.wake()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.fut.cancel()  # (tells the actor to stop)
        self.wake()

    def wake(self, _fut: Any = None) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class CallStream:
    """The async iterator a streaming method's call returns.

    ``async for item in handle.batches(10): ...``. Items arrive as the generator yields
    them; an error the generator raised is raised after the items before it; the
    actor's death raises ``ActorDiedError``. Leaving the loop early (``break``, an
    exception, ``aclose()``, or dropping the iterator) stops the generator in the actor.

    Args:
        what: how errors name the call (``"Cls.method"``).
        run_ahead: the most items the actor may produce beyond those taken.
    """

    def __init__(self, what: str, run_ahead: int = DEFAULT_RUN_AHEAD) -> None:
        self.what = what
        self.run_ahead = run_ahead
        self.inbox = Inbox(what)
        self.fut: asyncio.Future | None = None
        self._owed = 0  # items taken and not yet credited back

    def start(self, fut: Any) -> "CallStream":
        """Follow the call's reply ``fut``.

        Raises:
            TypeError: the call was made from a thread other than the event loop's.
        """
        if not isinstance(fut, asyncio.Future):
            fut.cancel()
            raise TypeError(f"{self.what}() streams: call it from the event loop's thread "
                            "(in an async method), not from a worker thread")
        self.fut = self.inbox.fut = fut
        fut.add_done_callback(self.inbox.wake)
        return self

    def __aiter__(self) -> "CallStream":
        return self

    def __await__(self):
        self.fut.cancel()
        raise TypeError(f"{self.what}() is a streaming method: iterate it with `async for "
                        f"item in handle.{self.what.rpartition('.')[2]}(...)`, or collect "
                        "its items with `[x async for x in ...]`")

    async def __anext__(self) -> Any:
        box = self.inbox
        while True:
            if box.items:
                self._owed += 1
                if self._owed >= max(1, self.run_ahead // 2) and box.conn is not None:
                    box.conn.send_credit(box.cid, self._owed)
                    self._owed = 0
                return box.items.popleft()
            if box.error is not None:
                raise box.error
            fut = self.fut
            if fut.done():
                if fut.cancelled():
                    raise StopAsyncIteration
                exc = fut.exception()
                if exc is not None:
                    raise exc
                raise StopAsyncIteration
            box.waiter = fut.get_loop().create_future()
            await box.waiter

    async def aclose(self) -> None:
        """Stop the stream: the generator in the actor is closed (its ``finally`` runs)."""
        self.inbox.items.clear()
        if self.fut is not None and not self.fut.done():
            self.fut.cancel()

    def __del__(self) -> None:
        fut = self.fut
        if fut is not None and not fut.done():
            try:
                fut.get_loop().call_soon_threadsafe(fut.cancel)
            except RuntimeError:  # the loop is closed: so is the connection
                pass

    def __repr__(self) -> str:
        return f"<stream of {self.what}()>"


class StreamingClient:
    """What a client (runtime or worker) gains for streaming methods: ``stream``."""

    def stream(self, actor_id: int, method: str, args: tuple, kwargs: dict,
               what: str = "", run_ahead: int = DEFAULT_RUN_AHEAD) -> CallStream:
        """Call generator method ``method`` on actor ``actor_id``; an async iterator of
        its items (``CallStream``).

        Raises:
            TypeError: an argument cannot be pickled (nothing is sent).
        """
        st = CallStream(what or method, run_ahead)
        return st.start(self.call(actor_id, method, args, kwargs, what,
                                  meta={"run_ahead": run_ahead}, stream=st.inbox))


class Outflow:
    """The actor's side of one stream: how many more items it may send now."""

    def __init__(self, run_ahead: int) -> None:
        self.credit = max(1, run_ahead)
        self._waiter: asyncio.Future | None = None

    def add(self, n: int) -> None:
        self.credit += n
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> None:
        while self.credit <= 0:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self.credit -= 1


_DONE = object()


async def run_stream(conn: Any, cid: int, gen: Any, out: Outflow, what: str,
                     executor: Any = None) -> None:
    """Send the items of generator ``gen`` as streaming call ``cid``'s, then its end.

    A sync generator runs on the event loop's thread, or in ``executor`` when given.
    Cancelled (the caller left the loop), it closes the generator: its ``finally`` runs.
    """
    loop = asyncio.get_running_loop()
    is_async = inspect.isasyncgen(gen)
    step = None
    try:
        while True:
            if is_async:
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    break
            elif executor is not None:
                step = loop.run_in_executor(executor, next, gen, _DONE)
                item = await asyncio.shield(step)
                step = None
                if item is _DONE:
                    break
            else:
                item = next(gen, _DONE)
                if item is _DONE:
                    break
            await out.take()
            conn.send_item(cid, item, what)
            del item
            if not is_async and executor is None:
                conn.flush_now()  # out before the generator holds the event loop again
    except asyncio.CancelledError:
        await _close(gen, is_async, step)
        return
    except BaseException as exc:
        await _close(gen, is_async, step)
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            raise
        conn.reply_error(cid, exc)
        return
    conn.reply(cid, None, what)


async def _close(gen: Any, is_async: bool, step: Any) -> None:
    try:
        if is_async:
            await gen.aclose()
        else:
            if step is not None:  # let the executor's next() finish first
                await asyncio.wait([step])
            gen.close()
    except BaseException:  # its finally failed: nobody is left to tell
        pass
