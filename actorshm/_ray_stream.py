"""A streaming call on the Ray backend: an async iterator over a Ray streaming generator."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from ._errors import ActorDiedError
from ._ray_order import ray_up
from ._streams import SecondConsumer, Stream

__all__ = ["RayStream"]


class RayStream(Stream):
    """What calling a generator method returns on Ray: ``async for item in stream``.

    The actor runs at most ``STREAM_BUFFER`` items ahead (Ray's generator back-pressure).
    Leaving the loop early (``break``, an exception, ``aclose()``, or dropping the
    iterator) cancels the generator in the actor, whose ``finally`` blocks then run
    (``_streams.StreamLoop``).
    """

    def __init__(self, gen: Any, what: str, translate: Callable, outcome: Callable,
                 cancel: Callable, wait: Callable, ended: Callable) -> None:
        # Ray's generator; or, for a call that waits for results it takes as arguments,
        # the task that starts it once they are in (``RayClient._stream_when_ready``).
        self._start = gen if isinstance(gen, asyncio.Task) else None
        self._gen = gen
        self._wait = wait  # ``RayClient.wait``: ends if the runtime closes meanwhile
        self.what = what
        self._translate = translate
        self._outcome = outcome
        self._cancel = cancel
        # ``ended(gen)``: an awaitable done once the actor closed it, or None (Ray is
        # down, the actor killed: nothing to wait for)
        self._ended = ended
        self._done = False
        self._busy = False  # an ``__anext__`` is waiting (one consumer at a time)

    async def __anext__(self) -> Any:
        self._polls += 1
        if self._done:
            if self._cut:
                raise self._cut_error()
            raise StopAsyncIteration
        if self._busy:
            raise SecondConsumer(self.what)
        if not ray_up():  # the runtime that started Ray closed (and shut it down) since
            # the last item: Ray's generator went with it, so its actor has ended
            self._finish()
            raise ActorDiedError(f"{self.what}: the actor's runtime closed")
        self._busy = True
        if self._start is not None:
            try:
                self._gen = await self._wait(self._start)
            except BaseException as exc:
                self._busy = False
                if isinstance(exc, asyncio.CancelledError):
                    self._cut = True
                    self._stop()
                else:  # a failed argument, a kill: it never started
                    self._finish()
                    # (nothing left to stop: the failed start and its stored error,
                    # whose traceback grows with the consumer's frames, are let go)
                    self._start = self._gen = None
                raise
            self._start = None
        try:
            ref = await self._wait(self._gen.__anext__())
            value = await self._wait(ref)
        except StopAsyncIteration:
            self._finish()
            raise
        except ActorDiedError:  # the runtime closed (``RayClient.abort_waits``)
            self._finish()
            raise
        except Exception as exc:
            err = self._translate(exc, self.what, "item")
            if not isinstance(err, ActorDiedError):  # (see ``RayClient._cancel``)
                self._cancel(self._gen)
            self._finish()
            try:
                raise err from err.__cause__  # (its remote traceback; not Ray's error)
            finally:
                del err  # (its traceback keeps this frame: no cycle through the local)
        except BaseException:  # cancelled: stop the generator in the actor
            self._cut = True
            self._stop()
            raise
        finally:
            self._busy = False
        item, err = self._outcome(value, self.what)
        if err is not None:
            self._finish()
            try:
                raise err
            finally:
                del err
        return item

    async def aclose(self) -> None:
        """Stop the generator in the actor; return once it has ended there (its
        ``finally`` blocks ran), so that the next call to the actor runs after them."""
        if not self._done:
            start, gen = self._start, self._gen
            self._stop()
            if start is not None:
                if not _started(start):  # given up before it started: nothing ran
                    return
                gen = start.result()
            # Ray's end of the stream, then the generator's end in the actor: Ray ends a
            # stream cancelled at a ``yield`` before its ``finally`` blocks have run.
            for end in (gen.completed, lambda: self._ended(gen)):
                try:
                    awaitable = end()  # (None: nothing to wait for, see ``_ended``)
                    if awaitable is not None:
                        await self._wait(awaitable)
                except Exception:  # it ended anyway: the actor died, or the runtime closed
                    pass

    def _stop(self) -> None:
        """Tell the actor to stop the generator (its ``finally`` blocks run there); or,
        before it started, give up its start (from any thread)."""
        start = self._start
        if start is not None and not start.done():
            # Marked first: its arguments may have come in this very turn, its wakeup
            # already queued ahead of the cancel; it then sees the mark and sends nothing.
            start.actorshm_given_up = True
            try:
                start.get_loop().call_soon_threadsafe(start.cancel)
            except RuntimeError:  # its loop is closed: the start ended with it
                pass
        elif start is None or _started(start):
            self._cancel(self._gen)
        self._finish()

    def _finish(self) -> None:
        self._done = True

    def __await__(self):
        raise TypeError(f"{self.what}() is a streaming method: iterate it with `async for "
                        f"item in handle.{self.what.rpartition('.')[2]}(...)`, or collect "
                        "its items with `[x async for x in ...]`")

    def _left(self) -> None:
        """A loop over it was left before the end (``StreamLoop``), or it was dropped."""
        if not self._done:
            self._stop()

    __del__ = _left


def _started(start: asyncio.Task) -> bool:
    """Whether a stream's start (``RayClient._stream_when_ready``) sent it to the actor."""
    return start.done() and not start.cancelled() and start.exception() is None
