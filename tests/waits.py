"""Waiting in tests for what another process does in its own time."""

import asyncio
import inspect


async def until(cond, timeout: float = 5.0) -> bool:
    """Whether ``cond()`` (a function, or an async one) became true within ``timeout``
    seconds, asked every 10 ms."""
    for _ in range(int(timeout / 0.01)):
        if await _ask(cond):
            return True
        await asyncio.sleep(0.01)
    return bool(await _ask(cond))


async def _ask(cond):
    got = cond()
    return await got if inspect.isawaitable(got) else got
