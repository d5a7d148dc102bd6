"""Lifecycle events: the owner hears of deaths and restarts without calling the actor."""

import asyncio
import gc
import os
import signal

import pytest

import actorshm
from actors import Counter, FlakyStart, Phoenix


async def next_event(stream, timeout=10):
    return await asyncio.wait_for(stream.__anext__(), timeout)


async def test_death_by_signal_is_reported_without_a_call(rt):
    seen = []
    unsubscribe = rt.on_actor_event(seen.append)
    stream = rt.events()
    c = await Counter.options(name="watched").spawn(0)
    pid = c.pid
    os.kill(pid, signal.SIGKILL)  # nobody calls it
    ev = await next_event(stream)
    assert ev.kind == "died" and ev.actor_id == c.actor_id and ev.handle == c
    assert ev.cls_name == "Counter" and ev.name == "watched" and ev.pid == pid
    assert "SIGKILL" in ev.reason and not ev.will_restart and not ev.killed
    await asyncio.sleep(0)  # callbacks run on the loop, after the stream got it
    assert seen == [ev]
    unsubscribe()
    d = await Counter.spawn(0)
    await d.kill()  # kill() is reported too, with its reason
    ev = await next_event(stream)
    assert ev.kind == "died" and ev.actor_id == d.actor_id and "kill()" in ev.reason
    assert ev.killed  # (a program that replaces the actors that die can tell its own)
    assert seen == [seen[0]]  # unsubscribed
    await stream.aclose()


async def test_restart_is_reported_and_the_handle_works_again(rt):
    stream = rt.events()
    got = asyncio.Queue()

    async def on_event(ev):  # an async callback runs as a task
        await got.put(ev)
    rt.on_actor_event(on_event)
    p = await Phoenix.spawn("t")
    pid1 = p.pid
    os.kill(pid1, signal.SIGKILL)
    died = await next_event(stream)
    assert (died.kind, died.pid, died.will_restart, died.restarts) == ("died", pid1, True, 0)
    restarted = await next_event(stream)
    assert restarted.kind == "restarted" and restarted.restarts == 1
    assert restarted.pid != pid1 and restarted.pid == p.pid
    assert "SIGKILL" in restarted.reason
    assert (await restarted.handle.hit())[0] == "t"
    assert [(await asyncio.wait_for(got.get(), 5)).kind for _ in range(2)] == \
        ["died", "restarted"]


async def test_kill_while_a_restart_backs_off_is_reported(rt, tmp_path):
    # The last event said a restart follows: kill() must say none will, as for a live one.
    marker = tmp_path / "crash"
    stream = rt.events()
    f = await FlakyStart.options(max_restarts=-1).spawn(str(marker), False)
    marker.touch()  # from now on every new process dies in __init__
    with pytest.raises(actorshm.ActorDiedError):
        await f.crash()
    assert (await next_event(stream)).will_restart  # the crash
    ev = await next_event(stream)  # the restart's process died while starting
    assert ev.kind == "died" and ev.will_restart  # (the next try waits 0.1 s)
    await f.kill()
    ev = await next_event(stream, timeout=3)
    assert (ev.kind, ev.will_restart) == ("died", False) and "kill()" in ev.reason
    assert ev.killed
    await stream.aclose()


async def test_a_failing_callback_is_logged_and_later_events_still_come(rt, caplog):
    def bad(ev):
        raise RuntimeError("callback bug")
    rt.on_actor_event(bad)
    stream = rt.events()
    for _ in range(2):
        c = await Counter.spawn(0)
        await c.kill()
        assert (await next_event(stream)).kind == "died"
    await asyncio.sleep(0.05)
    assert caplog.text.count("an actor event callback raised") == 2
    with pytest.raises(TypeError, match="callable"):
        rt.on_actor_event("nope")


async def test_events_end_when_the_runtime_closes_and_closing_is_not_reported():
    async with actorshm.Runtime(shutdown_grace=1.0) as rt:
        stream = rt.events()
        await Counter.spawn(0)
    assert [ev async for ev in stream] == []  # ended, with no "died" for the shutdown
    assert [ev async for ev in rt.events()] == []  # made after the close: ended at once


async def test_a_stream_left_with_break_stops_receiving_events(rt):
    # The "wait for the next death" loop, many times: each stream it leaves must go, not
    # keep every later event (they piled up, one more subscriber per round).
    async def next_death():
        async for ev in rt.events():
            if ev.kind == "died":
                return ev
    for _ in range(5):
        waiter = asyncio.ensure_future(next_death())
        await asyncio.sleep(0)
        c = await Counter.spawn(0)
        await c.kill()
        assert (await asyncio.wait_for(waiter, 10)).kind == "died"
    del waiter
    gc.collect()
    assert len(rt._event_state()[1]) == 0
    kept = rt.events()  # one still referred to keeps receiving
    c = await Counter.spawn(0)
    await c.kill()
    assert (await next_event(kept)).kind == "died"


async def test_events_iterated_on_another_threads_loop_come_at_once_and_end():
    # The stream woke its waiter with an asyncio.Event set from the runtime's thread,
    # which does not wake another loop: a death, and the runtime's close, reached a
    # thread iterating on its own loop only when something else woke that loop.
    import threading
    import time
    log, ready = [], threading.Event()

    def consume(rt):
        async def run():
            stream = rt.events()
            ready.set()
            t0 = time.monotonic()
            async for ev in stream:
                log.append((ev.kind, time.monotonic() - t0))
            log.append(("ended", time.monotonic() - t0))
        asyncio.run(asyncio.wait_for(run(), 60))  # (bounded: a hang fails, not hangs)

    rt = actorshm.Runtime(shutdown_grace=1.0)
    await rt.start()
    thread = None
    try:
        c = await Counter.spawn(0)
        thread = threading.Thread(target=consume, args=(rt,), daemon=True)
        thread.start()
        assert await asyncio.to_thread(ready.wait, 30)
        os.kill(c.pid, signal.SIGKILL)
        for _ in range(200):
            if log:
                break
            await asyncio.sleep(0.05)
        assert [k for k, _ in log] == ["died"]  # within 10 s, not at the 60 s bound
    finally:
        await rt.close()
    await asyncio.to_thread(thread.join, 30)
    assert [k for k, _ in log] == ["died", "ended"] and log[1][1] < 30
