"""A streaming call on the Ray backend: an async iterator over a Ray streaming generator."""

from __future__ import annotations

from typing import Any, Callable

from ._errors import ActorDiedError
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
                 cancel: Callable, wait: Callable) -> None:
        self._gen = gen
        self._wait = wait  # ``RayClient.wait``: ends if the runtime closes meanwhile
        self.what = what
        self._translate = translate
        self._outcome = outcome
        self._cancel = cancel
        self._done = False
        self._busy = False  # an ``__anext__`` is waiting (one consumer at a time)

    async def __anext__(self) -> Any:
        self._polls += 1
        if self._done:
            raise StopAsyncIteration
        if self._busy:
            raise SecondConsumer(self.what)
        self._busy = True
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
            raise err from None
        except BaseException:  # cancelled: stop the generator in the actor
            self._stop()
            raise
        finally:
            self._busy = False
        item, err = self._outcome(value, self.what)
        if err is not None:
            self._finish()
            raise err
        return item

    async def aclose(self) -> None:
        """Stop the generator in the actor; return once it has ended there (its
        ``finally`` blocks ran), so that the next call to the actor runs after them."""
        if not self._done:
            self._stop()
            try:
                await self._wait(self._gen.completed())
            except Exception:  # it ended anyway: the actor died, or the runtime closed
                pass

    def _stop(self) -> None:
        """Tell the actor to stop the generator (its ``finally`` blocks run there)."""
        self._cancel(self._gen)
        self._finish()

    def _finish(self) -> None:
        self._done = True

    def __await__(self):
        raise TypeError(f"{self.what}() is a streaming method: iterate it with "
                        "`async for item in handle.method(...)` instead of awaiting it")

    def _left(self) -> None:
        """A loop over it was left before the end (``StreamLoop``), or it was dropped."""
        if not self._done:
            self._stop()

    __del__ = _left
