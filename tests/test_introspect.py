"""Seeing inside a running runtime: Runtime.stats(), memory(), dump_stacks(), and an
actor killed by the OOM killer saying so."""

import asyncio
import gc
import io
import os
import signal
import threading
import time

import numpy as np
import pytest

import actorshm
from actorshm import _oom, actor


@actor
class Probed:
    def __init__(self):
        self.kept = None
        self.gate = threading.Event()

    def keep(self, a):
        self.kept = a
        return float(a.sum())

    def drop(self):
        self.kept = None
        import gc
        gc.collect()

    def make(self, n):
        return actorshm.zeros(n)

    def wait_forever_in_sync(self):
        self.gate.wait(60)  # a sync method stuck: the actor's event loop is blocked

    async def wait_forever_in_async(self):
        await asyncio.sleep(60)

    def spin_in_c(self):
        import re
        re.match(r"(a+)+$", "a" * 40 + "b")  # backtracks for ages, holding the GIL

    def ping(self):
        return os.getpid()


async def test_stats_gives_each_actor_and_the_sum(rt):
    a, b = await Probed.spawn(), await Probed.spawn()
    for _ in range(3):
        await a.ping()
    await b.keep(np.ones(4096))  # an ordinary array over INLINE_MAX: copied into shm
    st = await rt.stats()
    assert set(st) == {"driver", "actors", "total", "unresponsive"}
    assert set(st["actors"]) == {a.actor_id, b.actor_id} and st["unresponsive"] == []
    assert st["actors"][a.actor_id]["calls_received"] == 4  # __init__ and three pings
    assert st["actors"][b.actor_id]["arenas_mapped"] == 1
    assert st["driver"]["bytes_copied"] == actorshm.stats()["bytes_copied"] >= 8000
    for key, value in st["total"].items():
        if key == "shm_budget":  # a limit (the runtime's, for all its processes)
            assert value == st["driver"][key] == actorshm.stats()[key]
            continue
        assert value == st["driver"].get(key, 0) + sum(
            c.get(key, 0) for c in st["actors"].values()), key


async def test_stats_answers_for_an_actor_stuck_in_a_sync_method(rt):
    a = await Probed.spawn()
    stuck = asyncio.ensure_future(a.wait_forever_in_sync())
    await asyncio.sleep(0.2)
    st = await rt.stats(timeout=10)
    assert st["actors"][a.actor_id]["calls_received"] >= 2
    await rt.kill(a.actor_id)
    with pytest.raises(actorshm.ActorDiedError):
        await stuck


async def test_an_actor_that_cannot_answer_is_listed_and_a_late_answer_dropped(rt):
    a, b = await Probed.spawn(), await Probed.spawn()
    os.kill(a.pid, signal.SIGSTOP)  # frozen: not even its probe thread runs
    try:
        await stopped(a.pid)
        st = await rt.stats(timeout=0.5)
        assert st["unresponsive"] == [a.actor_id] and list(st["actors"]) == [b.actor_id]
        text = await rt.dump_stacks(timeout=0.5, file=io.StringIO())
        assert f"(Probed pid={a.pid})" in text and "no answer within 0.5 s" in text
        # and no faulthandler dump is asked of it: one that ran as it went on, its
        # threads running again, crashed it (Python 3.13)
        assert "its process is stopped" in text
        # requests made at once each wait their own time-out, not one after another
        # (they took 1, 2 and 3 s: each waited for the socket behind the one before)
        t0 = time.monotonic()
        got = await asyncio.gather(rt.stats(timeout=1), rt.stats(timeout=1),
                                   rt.memory(timeout=1))
        assert time.monotonic() - t0 < 2.5
        assert all(a.actor_id in g["unresponsive"] for g in got[:2])
    finally:
        os.kill(a.pid, signal.SIGCONT)
    await a.ping()
    # The answers to the requests that timed out arrive now, and are not taken for
    # the answer to this one.
    st = await rt.stats(timeout=10)
    assert st["unresponsive"] == [] and st["actors"][a.actor_id]["calls_received"] == 2
    assert "Thread MainThread" in await rt.dump_stacks(file=io.StringIO())


async def test_memory_names_each_block_its_owner_and_its_holders(rt):
    a, b = await Probed.spawn(), await Probed.spawn()
    x = actorshm.zeros(100_000)  # the driver's block, kept by actor a too
    await a.keep(x)
    y = await b.make(300_000)  # actor b's block, held by the driver only
    report = await rt.memory()
    rows = {r["size"]: r for r in report.rows}
    ra, rb = rt.record(a.actor_id), rt.record(b.actor_id)
    big = next(r for r in report.rows if r["owner"] == rb.label)
    assert big["held_by"] == ["driver"] and big["size"] >= y.nbytes
    assert big["device"] == "host"
    mine = next(r for r in report.rows if r["owner"] == "driver")
    assert mine["held_by"] == ["driver", ra.label] and mine["size"] >= x.nbytes
    assert report.total_bytes == sum(rows) and not report.unresponsive
    assert report.processes["driver"]["arena_bytes_owned"] > 0
    assert report.processes[rb.label]["blocks_live"] == 1
    table = str(report)
    assert "owner" in table and "held by" in table and rb.label in table
    assert "2 live blocks" in table

    # The driver drops its arrays: a still holds x (the driver's block stays, kept
    # by a only), and b's block goes home.
    del x, y
    gc.collect()
    await a.ping()
    await b.ping()
    report = await rt.memory()
    assert [(r["owner"], r["held_by"]) for r in report.rows] == [("driver", [ra.label])]
    await a.drop()
    await asyncio.sleep(0.05)
    report = await rt.memory()
    assert report.rows == []
    assert "0 live blocks" in str(report)


async def test_dump_stacks_shows_an_actor_stuck_in_a_sync_method(rt_each):
    rt = rt_each
    a, b = await Probed.spawn(), await Probed.spawn()
    stuck = asyncio.ensure_future(a.wait_forever_in_sync())
    waiting = asyncio.ensure_future(b.wait_forever_in_async())
    await asyncio.sleep(0.3)
    out = io.StringIO()
    text = await rt.dump_stacks(file=out)
    assert out.getvalue() == text
    lines_a = [ln for ln in text.splitlines() if ln.startswith(f"(Probed pid={a.pid}) ")]
    lines_b = [ln for ln in text.splitlines() if ln.startswith(f"(Probed pid={b.pid}) ")]
    assert len(lines_a) + len(lines_b) == len(text.splitlines())
    assert any("in wait_forever_in_sync" in ln for ln in lines_a)
    assert any("in wait_forever_in_async" in ln for ln in lines_b)  # the task's stack
    for h in (a, b):
        await rt.kill(h.actor_id)
    for f in (stuck, waiting):
        with pytest.raises(actorshm.ActorDiedError):
            await f


async def test_an_actor_holding_the_gil_in_c_code_dumps_its_stacks_to_stderr(rt_each,
                                                                             capsys):
    rt = rt_each
    a = await Probed.spawn()
    spinning = asyncio.ensure_future(a.spin_in_c())
    await asyncio.sleep(0.3)
    text = await rt.dump_stacks(timeout=1, file=io.StringIO())
    assert "no answer within 1 s" in text and "faulthandler" in text
    err = ""
    for _ in range(100):  # forwarded from its stderr by the driver's loop
        await asyncio.sleep(0.05)
        err += capsys.readouterr().err
        if "in spin_in_c" in err:
            break
    assert f"(Probed pid={a.pid}) " in err and "in spin_in_c" in err
    await rt.kill(a.actor_id)
    with pytest.raises(actorshm.ActorDiedError):
        await spinning


async def test_a_restarted_actor_answers_through_its_new_process(rt):
    a = await Probed.options(max_restarts=1).spawn()
    old = a.pid
    os.kill(old, signal.SIGKILL)
    for _ in range(200):
        await asyncio.sleep(0.05)
        if a.pid != old and rt.record(a.actor_id).alive:
            break
    await a.ping()
    st = await rt.stats()
    assert st["actors"][a.actor_id]["calls_received"] == 2  # the new process's
    assert f"(Probed pid={a.pid})" in await rt.dump_stacks(file=io.StringIO())


async def test_introspection_needs_an_open_runtime():
    rt = actorshm.Runtime()
    with pytest.raises(RuntimeError, match="not open"):
        await rt.stats()


async def stopped(pid):
    for _ in range(500):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


@pytest.fixture
def fake_oom(tmp_path, monkeypatch):
    """A memory cgroup whose oom_kill count the test sets: this machine does not let a
    test be OOM-killed for real. The kernel log is made unreadable."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    monkeypatch.setattr(_oom, "memory_events_path", lambda pid: str(events))
    monkeypatch.setattr(_oom, "kernel_log", lambda: [])
    return events


async def test_an_oom_kill_counted_by_the_cgroup_is_named(rt, fake_oom):
    a = await Probed.spawn()
    fake_oom.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    os.kill(a.pid, signal.SIGKILL)  # what the OOM killer sends
    with pytest.raises(actorshm.ActorDiedError) as info:
        await a.ping()
    msg = str(info.value)
    assert "SIGKILL" in msg and "OOM killer" in msg and str(fake_oom) in msg
    assert "1 OOM kill(s) since it started" in msg


async def test_a_plain_sigkill_is_not_called_an_oom_kill(rt, fake_oom):
    fake_oom.write_text("oom_kill 4\n")  # OOM kills before the actor started
    a = await Probed.spawn()
    os.kill(a.pid, signal.SIGKILL)
    with pytest.raises(actorshm.ActorDiedError) as info:
        await a.ping()
    assert "SIGKILL" in str(info.value) and "OOM" not in str(info.value)


async def test_an_oom_kill_in_the_kernel_log_is_named(rt, monkeypatch):
    a = await Probed.spawn()
    pid = a.pid
    line = (f"Out of memory: Killed process {pid} (python) total-vm:9000000kB, "
            "anon-rss:8000000kB, file-rss:0kB")
    now = time.monotonic()
    monkeypatch.setattr(_oom, "kernel_log", lambda: [(now, "unrelated\n"),
                                                     (now, line + "\n")])
    monkeypatch.setattr(_oom, "memory_events_path", lambda pid: None)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(actorshm.ActorDiedError) as info:
        await a.ping()
    assert "OOM killer killed it" in str(info.value) and line in str(info.value)


async def test_an_oom_kill_of_an_earlier_process_with_its_number_is_not_named(
        rt, monkeypatch):
    # The log keeps records since boot: an earlier OOM victim's number, reused by this
    # actor, was taken for its own (a plain kill -9 was called an OOM kill)
    a = await Probed.spawn()
    pid = a.pid
    line = (f"Out of memory: Killed process {pid} (python) total-vm:9000000kB, "
            "anon-rss:8000000kB, file-rss:0kB")
    long_ago = time.monotonic() - 3600
    monkeypatch.setattr(_oom, "kernel_log", lambda: [(long_ago, line + "\n")])
    monkeypatch.setattr(_oom, "memory_events_path", lambda pid: None)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(actorshm.ActorDiedError) as info:
        await a.ping()
    assert "SIGKILL" in str(info.value) and "OOM" not in str(info.value)


def test_the_kernel_logs_clock_is_ours():
    # what telling an actor's own OOM record from an earlier one relies on
    records = _oom.kernel_log()
    if not records:
        pytest.skip("the kernel log cannot be read here")
    assert 0 < records[-1][0] <= time.monotonic() + 1.0


def test_the_real_cgroup_count_is_read_where_there_is_one():
    path = _oom.memory_events_path(os.getpid())
    if path is None:
        pytest.skip("no memory cgroup file here")
    found = _oom.oom_kill_count(os.getpid())
    assert found is not None and found[0] == path and found[1] >= 0
