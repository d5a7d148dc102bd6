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
from ._remote_errors import copy_exc
from ._util import exit_code, leave_if_forked

__all__ = ["Stream", "CallStream", "StreamLoop", "SecondConsumer", "StreamingClient",
           "Outflow", "StreamSlot", "run_stream", "chain", "reentrant_error",
           "DEFAULT_RUN_AHEAD", "CANCELLED_BY_CALLER", "STREAM_DONE", "next_caught"]

DEFAULT_RUN_AHEAD = 16
# Set on the task of a call (or stream) its caller cancelled: no reply is owed to it. A
# CancelledError in a task without it is the method's own error, answered as any other.
CANCELLED_BY_CALLER = "actorshm_cancelled_by_caller"
NO_META: dict = {}  # the meta of a call that carries none (read only)

# The call this task or thread runs, as (the chain it carried, actor id, "Cls.method",
# seq); a chain is ((actor id, "Cls.method", seq), ...), outermost first. Empty in the
# driver. (A call made here carries the chain plus this call: ``Worker.call``.)
chain: contextvars.ContextVar[tuple] = contextvars.ContextVar("actorshm_chain", default=())


def reentrant_error(calls: tuple, worker: Any, what: str):
    """The error for a call that would wait forever for a slot of ``worker``'s actor, or
    None when it would not.

    It would when every slot is held by a call that waits, through a chain of calls, for
    this call or for a call queued behind them: then no slot frees until one of those
    calls runs, and none of them runs until a slot frees. (A call in a chain is taken to
    wait for the calls it made: it may await them at any time.) With
    ``max_concurrency=1``: the call the actor runs is in this call's chain (A -> B -> A).

    Args:
        calls: the chain the call carries (``chain``'s value where it was made):
            ``(actor id, "Cls.method", seq)`` per call, outermost first.
        worker: the receiving actor's worker: its ``actor_id``, ``max_concurrency``,
            ``holding`` (the calls in its slots -> their seqs) and ``queue``.
        what: the call (``"Cls.method"``).
    """
    me = worker.actor_id
    held = set(worker.holding.values())
    mine = [c for c in calls if c[0] == me and c[2] in held]
    if not mine or len(held) < worker.max_concurrency:
        return None  # not waited for by a call here, or a slot frees without it
    waiting = {c[2] for c in mine}
    for entry in worker.queue:  # the calls already queued, and whom they keep waiting
        if len(waiting) == len(held):
            break
        call = entry[2]
        if entry[0] is not None and len(call) == 4:
            waiting.update(c[2] for c in call[3].get("chain", ()) if c[0] == me)
    if not held <= waiting:
        return None  # a call in a slot waits for nothing queued here: it will end
    loop = calls[calls.index(mine[0]):]
    names = " -> ".join(f"{w} (actor {a})" for a, w, _seq in loop)
    name, n = worker.cls_name, worker.max_concurrency
    why = (f"Actor {name} runs one call at a time (max_concurrency=1) and this call comes "
           "from its running call's chain, which is taken to wait for it (a call sent "
           f"and never awaited too). Give {name} max_concurrency > 1 with async methods, "
           "or return the data to the running call instead of calling back into its "
           "actor.") if n == 1 \
        else (f"All {n} slots of actor {name} (max_concurrency={n}) are held by calls "
              "waiting, through chains of calls, for this call or for calls queued behind "
              f"them. Raise {name}'s max_concurrency, or do not call back into an actor "
              "from calls it is waiting for.")
    return ReentrantCallError(
        f"re-entrant call would deadlock: {names} -> {what} (actor {me}). {why}")


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
        self.stopped = False  # left or closed (``stop``)

    def push(self, item: Any) -> None:
        if not self.stopped:  # (items sent before the actor heard of the stop: dropped)
            self.items.append(item)
            self.wake()

    def stop(self) -> None:
        """The caller left the stream: what it holds and what still arrives is dropped."""
        self.stopped = True
        self.items.clear()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.fut.cancel()  # (tells the actor to stop)
        self.wake()

    def wake(self, _fut: Any = None) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class SecondConsumer(RuntimeError):
    """A task asked a stream for an item while another task waits for one (``__anext__``)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"the stream of {what}() is already awaited by another task: a stream has one "
            "consumer at a time (as an async generator does); call the method again for a "
            "second stream")


class Stream:
    """What every backend's stream shares: one ``StreamLoop`` per ``async for``, and clear
    errors for a plain ``for`` and for sending it. A subclass sets ``what`` ("Cls.method")
    and ``_polls``, and provides ``__anext__``, ``aclose()`` and ``_left()``."""

    what = ""
    _polls = 0  # ``__anext__`` calls (``StreamLoop``)
    _cut = False  # stopped by a cancel (or a time-out) of a wait for an item

    def _cut_error(self) -> RuntimeError:
        """What a stream stopped by a cancelled wait raises when asked for more: its
        later items are lost, which must not look like the stream's end."""
        return RuntimeError(
            f"the stream of {self.what}() was stopped when a wait for its next item was "
            "cancelled or timed out (task.cancel(), asyncio.wait_for, asyncio.timeout), "
            "and the generator was closed in the actor: it has no more items. To wait "
            "for an item with a time-out and go on iterating, wait on a task, which a "
            "time-out leaves running: `t = asyncio.ensure_future(anext(it))`, then "
            "`await asyncio.wait({t}, timeout=...)`")

    def __aiter__(self) -> "StreamLoop":
        return StreamLoop(self)

    def __iter__(self):
        raise TypeError(f"the stream of {self.what}() is asynchronous: iterate it with "
                        "`async for` in an `async def` function")

    __next__ = __iter__  # (``next(stream)``: Ray's generators are iterated so)

    def __reduce__(self):
        raise TypeError(f"the stream of {self.what}() cannot be sent to another process: "
                        "iterate it here and send its items, or send the actor's handle "
                        "and call the method there")


class StreamLoop:
    """One ``async for`` over a stream (what a stream's ``__aiter__`` returns).

    A loop left before the stream's end (``break``, an exception) drops this object, and
    that stops the stream: the generator in the actor is closed, even while the stream
    itself is still held (``s = handle.batches(10); async for x in s: break``). A
    cancel (or a timeout) while it waits for an item stops it too, without waiting for
    this object to be dropped (a traceback kept, or the cancelled task, holds it). Python's
    own generators would stay open there until ``s`` is dropped; a stream's generator
    holds an actor's resources and its caller's credit, so leaving the loop ends it.
    The stop waits for the event loop's next turn, and is called off if the stream is
    iterated again before then (``first = await anext(aiter(s))``, then ``async for x
    in s``: one iteration handed on, not left).

    The stream (a ``Stream``) provides ``__anext__``, ``aclose()``, ``_polls`` (how often
    its ``__anext__`` was called) and ``_left()`` (stop, from any thread).
    """

    __slots__ = ("stream", "ended")

    def __init__(self, stream) -> None:
        self.stream = stream
        self.ended = False

    def __aiter__(self) -> "StreamLoop":
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:  # (after its error, or a cancel, stopping is a no-op)
            self.ended = True
            raise
        except SecondConsumer:  # the stream is another loop's: leaving this one is not
            self.ended = True  # leaving it
            raise
        except asyncio.CancelledError:  # (a timeout too) while waiting for an item: the
            # loop is left, even while the error or the task keeps this object alive
            _leave_later(self.stream, cut=True)
            raise

    async def aclose(self) -> None:
        """Stop the stream (as ``stream.aclose()``)."""
        self.ended = True
        await self.stream.aclose()

    def __del__(self) -> None:
        if not self.ended:
            _leave_later(self.stream)


def _leave_later(stream, cut: bool = False) -> None:
    """Stop ``stream`` at the event loop's next turn unless it is iterated meanwhile;
    ``cut``: a wait for an item was cancelled (asking for more then raises)."""
    polls = stream._polls

    def leave() -> None:
        if stream._polls == polls:
            if cut:
                stream._cut = True
            stream._left()
    try:
        asyncio.get_running_loop().call_soon(leave)
    except RuntimeError:  # dropped outside the loop's thread (a garbage collection)
        stream._left()


class CallStream(Stream):
    """The async iterator a streaming method's call returns.

    ``async for item in handle.batches(10): ...``. Items arrive as the generator yields
    them; an error the generator raised is raised after the items before it; the
    actor's death raises ``ActorDiedError``. Leaving the loop early (``break``, an
    exception, ``aclose()``, or dropping the iterator) stops the generator in the actor
    (``StreamLoop``).

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
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # (its runtime has closed, say): that comes first
            fut.cancel()
            # (A driver thread may run a loop of its own: "the event loop's thread" alone
            # does not say which one.)
            raise TypeError(
                f"{self.what}() streams, and a stream is iterated on the thread that runs "
                "its runtime's event loop (in an actor: in an async method), not from "
                "another thread or another thread's loop; from such a thread, hand the "
                "loop a coroutine that iterates it: "
                "`asyncio.run_coroutine_threadsafe(consume(), loop).result()`")
        self.fut = self.inbox.fut = fut
        fut.add_done_callback(self.inbox.wake)
        return self

    def __await__(self):
        self.fut.cancel()
        raise TypeError(f"{self.what}() is a streaming method: iterate it with `async for "
                        f"item in handle.{self.what.rpartition('.')[2]}(...)`, or collect "
                        "its items with `[x async for x in ...]`")

    async def __anext__(self) -> Any:
        self._polls += 1
        box = self.inbox
        if box.waiter is not None:  # another task waits in here (set until it resumes:
            raise SecondConsumer(self.what)  # an item that woke it is its to take)
        while True:
            if box.stopped:
                if self._cut:
                    raise self._cut_error()
                raise StopAsyncIteration
            if box.items:
                try:
                    item = box.items.popleft()
                except IndexError:  # dropped meanwhile by a ``_left`` in another thread
                    continue  # (a garbage collection there): the stream is stopped
                self._owed += 1
                if self._owed >= max(1, self.run_ahead // 2) and box.conn is not None:
                    box.conn.send_credit(box.cid, self._owed)
                    self._owed = 0
                return item
            # An error kept here is raised as a copy: raised itself, it would take the
            # consumer's frames in its traceback, and keep their locals (the last item,
            # a whole batch) alive for as long as the stream is kept (its connection's
            # record of it, after the producer died).
            if box.error is not None:
                raise copy_exc(box.error)
            fut = self.fut
            if fut.done():
                if fut.cancelled():
                    raise StopAsyncIteration
                exc = fut.exception()
                if exc is not None:
                    raise copy_exc(exc)
                raise StopAsyncIteration
            waiter = box.waiter = fut.get_loop().create_future()
            try:
                await waiter
            finally:
                if box.waiter is waiter:
                    box.waiter = None

    async def aclose(self) -> None:
        """Stop the stream: the generator in the actor is closed (its ``finally`` runs)."""
        self.inbox.stop()
        if self.fut is not None:
            _end_call(self.fut)

    def _left(self) -> None:
        """A loop over it was left before the end, or it was dropped: stop the call
        (from any thread; the cancel goes out at the event loop's next turn)."""
        self.inbox.stop()  # (the items it buffers, their blocks, go now, even if the
        # call has ended already: its last items may have arrived before its end)
        fut = self.fut
        if fut is None:
            return
        if fut.done():
            _end_call(fut)
            return
        try:
            fut.get_loop().call_soon_threadsafe(_end_call, fut)
        except RuntimeError:  # the loop is closed: so is the connection
            pass

    __del__ = _left

    def __repr__(self) -> str:
        return f"<stream of {self.what}()>"


def _end_call(fut: asyncio.Future) -> None:
    """Stop the call of a stream that was left; or, if it ended already, let its error
    go (the generator raised after the items taken: nobody is left to hear it, and
    asyncio would print it as an exception never retrieved)."""
    if not fut.done():
        fut.cancel()
    elif not fut.cancelled():
        fut.exception()


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
        self.slot: StreamSlot | None = None  # its hold on an actor slot

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


class StreamSlot:
    """A streaming call's hold on one of its actor's ``max_concurrency`` slots.

    The generator holds the slot while it makes an item; it lets go while it waits at a
    ``yield`` (for the consumer's credit, or behind calls that wait for the slot), so
    other calls run between its items; it queues for a slot again, behind them, before
    it makes the next item. Stopped by its caller, it takes a slot ahead of the calls
    waiting (``reclaim``) to run its ``finally`` blocks in.

    Args:
        worker: the actor's worker (``running``, ``max_concurrency``, ``queue``,
            ``holding``, ``running_calls``, ``_finished``).
        key: the call's ``(conn, cid)``.
        seq: the call's number in the actor (its place in chains of calls).
    """

    __slots__ = ("worker", "key", "seq", "held", "entry", "waiter")

    def __init__(self, worker: Any, key: tuple, seq: int) -> None:
        self.worker, self.key, self.seq = worker, key, seq
        self.held = True  # it starts in the slot the call was started in
        self.entry: tuple | None = None  # its place in the worker's queue, while queued
        self.waiter: asyncio.Future | None = None

    def wanted(self) -> bool:
        """Whether calls wait for a slot."""
        return bool(self.worker.queue)

    def release(self) -> None:
        """Let go of the slot: the next call waiting for one starts."""
        if self.held:
            self.held = False
            self.worker.holding.pop(self.key, None)
            self.worker._finished(None)

    async def acquire(self) -> None:
        """Take a slot again, behind the calls already waiting for one."""
        w = self.worker
        if not self.held and self.entry is None:
            if w.running < w.max_concurrency and not w.queue:
                self._take()
                return
            self.entry = (None, self, None)
            w.queue.append(self.entry)
        while not self.held:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def reclaim(self) -> None:
        """The call is being stopped: take a slot at once if one is free, else be the
        first to get one, so that its ``finally`` runs before the calls queued."""
        w = self.worker
        if self.held:
            return
        if self.entry is not None:
            w.queue.remove(self.entry)
            self.entry = None
        if w.running < w.max_concurrency:
            self._take()
        else:
            self.entry = (None, self, None)
            w.queue.appendleft(self.entry)

    def grant(self) -> None:
        """The worker gives this stream the slot it queued for."""
        self.entry = None
        self._take()

    def _take(self) -> None:
        self.worker.running += 1
        self.held = True
        self.worker.holding[self.key] = self.seq
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def done(self) -> None:
        """The stream's call ended: its slot, if it holds one, goes to the next call."""
        w = self.worker
        if self.entry is not None:
            w.queue.remove(self.entry)
            self.entry = None
        if self.held:
            self.held = False
            w._finished(self.key)
        else:
            w.running_calls.pop(self.key, None)


STREAM_DONE = object()  # what ``next_caught`` gives for a sync generator that ended


async def run_stream(conn: Any, cid: int, gen: Any, out: Outflow, what: str,
                     executor: Any = None, slot: StreamSlot | None = None) -> None:
    """Send the items of generator ``gen`` as streaming call ``cid``'s, then its end.

    A sync generator runs on the event loop's thread, or in ``executor`` when given.
    With ``slot``, the generator lets go of its actor slot while it waits at a ``yield``
    (for credit, or because calls wait for the slot) and takes one again to go on.
    Cancelled (the caller left the loop), it closes the generator: its ``finally`` runs.
    """
    loop = asyncio.get_running_loop()
    is_async = inspect.isasyncgen(gen)
    step = None
    try:
        out.credit -= 1  # the first item's (credit starts at ``run_ahead``, at least 1)
        while True:
            if is_async:
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    break
            elif executor is not None:
                step = loop.run_in_executor(executor, next_caught, gen)
                item, raised = await asyncio.shield(step)
                step = None
                if raised is not None:
                    raise raised  # (here: see ``next_caught``)
                if item is STREAM_DONE:
                    break
            else:
                item = next(gen, STREAM_DONE)
                if item is STREAM_DONE:
                    break
            leave_if_forked()  # (a child the generator forked: not a second stream)
            conn.send_item(cid, item, what)
            del item
            # Credit for the next item before it is made: the generator waits at its
            # ``yield`` while it is ``run_ahead`` items ahead, so it never runs further.
            if out.credit <= 0 or (slot is not None and slot.wanted()):
                conn.flush_now()  # (the item sent goes out first)
                if slot is not None:
                    slot.release()  # parked at its yield: other calls run meanwhile
                    await out.take()
                    await slot.acquire()
                else:
                    await out.take()
            else:
                out.credit -= 1
                if not is_async and executor is None:
                    conn.flush_now()  # out before the generator holds the loop again
    except asyncio.CancelledError as exc:
        if not getattr(asyncio.current_task(), CANCELLED_BY_CALLER, False):
            # The generator's own error (it raised it, or awaited a task cancelled in
            # the actor): ended like any other, after the items before it.
            await _close(gen, is_async, step)
            conn.reply_error(cid, exc)
            return
        if slot is not None:
            try:
                await slot.acquire()  # (``reclaim`` put it first in line)
            except asyncio.CancelledError:  # stopped again: close it as it is
                pass
        await _close(gen, is_async, step)
        return
    except BaseException as exc:
        leave_if_forked(exit_code(exc) if isinstance(exc, SystemExit) else 0)
        await _close(gen, is_async, step)
        if isinstance(exc, SystemExit):
            raise  # the process exits, as from any method
        conn.reply_error(cid, exc)  # (KeyboardInterrupt too, as from any method)
        return
    leave_if_forked()
    conn.reply(cid, None, what)


def next_caught(gen: Any) -> tuple:
    """``(next(gen, STREAM_DONE), None)``, or ``(None, exc)`` for what it raised: for an
    executor thread. Awaited through the thread's future, a ``GeneratorExit`` the
    generator raised would be thrown into the awaiting coroutines, which closes them
    (``coroutine ignored GeneratorExit``) instead of failing the stream, and its consumer
    would wait for ever."""
    try:
        return next(gen, STREAM_DONE), None
    except BaseException as exc:
        return None, exc


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
