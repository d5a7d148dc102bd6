"""What the tests use that Python 3.10 lacks (the library itself needs none of it)."""

import asyncio
import contextlib
import sys

# ``asyncio.TimeoutError`` is the builtin ``TimeoutError`` from Python 3.11 on.
TimeoutError = asyncio.TimeoutError  # noqa: A001

if sys.version_info >= (3, 11):
    timeout = asyncio.timeout
else:
    @contextlib.asynccontextmanager
    async def timeout(delay: float):
        """``asyncio.timeout``, enough for these tests: the task is cancelled after
        ``delay`` s, and that cancel leaves the block as ``TimeoutError``."""
        task = asyncio.current_task()
        fired = []

        def fire() -> None:
            fired.append(True)
            task.cancel()
        handle = asyncio.get_running_loop().call_later(delay, fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise TimeoutError from None
            raise
        finally:
            handle.cancel()


def noted(exc: BaseException, text: str) -> bool:
    """Whether one of ``exc``'s notes holds ``text`` (Python 3.10 has no notes: True)."""
    return sys.version_info < (3, 11) or any(text in n for n in exc.__notes__)
