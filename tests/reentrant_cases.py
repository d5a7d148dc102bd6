"""Re-entrant call chains (A -> B -> A), run by the local tests (test_control.py) and
by the Ray backend's (test_ray.py) alike: one body of each case for both backends."""

import asyncio
import time

import pytest

import actorshm
from call_actors import Relay


async def chain_is_refused_at_once(limit: float) -> None:
    """A, running one call at a time, waits for B, which calls A back: refused at once,
    naming the chain; both actors stay usable."""
    a, b = await asyncio.gather(Relay.spawn(), Relay.spawn())
    await a.set_self(a)
    t0 = time.monotonic()
    with pytest.raises(actorshm.ReentrantCallError, match=r"Relay.ping_via .*Relay.call_back"):
        await asyncio.wait_for(a.ping_via(b), 6 * limit)
    assert time.monotonic() - t0 < limit
    assert await a.ping() == "pong"
    assert await b.call_back(a) == "pong"


async def a_chain_through_a_stream_is_refused_at_once(limit: float) -> None:
    """A, running one call at a time, reads B's stream, whose generator calls A back."""
    a, b = await asyncio.gather(Relay.spawn(), Relay.spawn())
    await a.set_self(a)
    t0 = time.monotonic()
    with pytest.raises(actorshm.ReentrantCallError,
                       match=r"Relay.ping_via_stream .*Relay.pings_back"):
        await asyncio.wait_for(a.ping_via_stream(b), 6 * limit)
    assert time.monotonic() - t0 < limit
    assert await a.ping() == "pong"
    assert [x async for x in b.pings_back(a, 2)] == ["pong", "pong"]


async def every_slot_waiting_refuses_the_call_back(limit: float) -> None:
    """A runs two calls at once, both waiting for B, whose calls back to A would wait for
    a slot of A: the second to arrive finds every slot held by a call waiting on it."""
    a = await Relay.options(max_concurrency=2).spawn()
    b = await Relay.options(max_concurrency=2).spawn()
    await a.set_self(a)
    out = await asyncio.wait_for(asyncio.gather(
        a.ping_via(b, 0.3), a.ping_via(b, 0.3), return_exceptions=True), 6 * limit)
    errors = [e for e in out if isinstance(e, actorshm.ReentrantCallError)]
    assert len(errors) == 1 and out.count("pong") == 1, out
    assert "max_concurrency=2" in str(errors[0])
    assert await a.ping() == "pong"


async def a_call_back_into_a_slot_that_frees_waits(limit: float) -> None:
    """One slot of A waits for B's call back, the other runs a call that ends by itself:
    no deadlock, so no error; the call back runs once that slot frees."""
    a = await Relay.options(max_concurrency=2).spawn()
    b = await Relay.spawn()
    await a.set_self(a)
    held = a.hold(0.8)
    await asyncio.sleep(0.2)
    assert await asyncio.wait_for(a.ping_via(b, 0.2), 6 * limit) == "pong"
    assert await held == "held"
