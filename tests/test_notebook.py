"""actorshm from a notebook: an event loop already runs, and each cell is its own block."""

import asyncio
import inspect
import os

import pytest

import actorshm
from actorshm import _client

from actors import Counter


async def test_run_inside_a_running_loop_says_what_to_do_instead():
    async def main():
        return 1

    coro = main()
    with pytest.raises(RuntimeError, match="running event loop") as e:
        actorshm.run(coro)
    msg = str(e.value)
    assert "`await main()`" in msg and "async with actorshm.Runtime()" in msg
    assert "await actorshm.Runtime().start()" in msg and "await rt.close()" in msg
    # the coroutine is closed (no "never awaited" warning on top), no runtime left open
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    assert not _client._runtimes


def test_run_with_a_function_says_to_call_it():
    async def main():
        return 1

    with pytest.raises(TypeError, match=r"actorshm\.run\(main\(\)\), not actorshm\.run\(main\)"):
        actorshm.run(main)
    with pytest.raises(TypeError, match="takes a coroutine.*not int"):
        actorshm.run(5)
    assert not _client._runtimes


def test_run_with_a_bad_option_closes_the_coroutine():
    async def main():
        return 1

    coro = main()
    with pytest.raises(TypeError, match="bogus"):
        actorshm.run(coro, bogus=1)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # no "never awaited"
    with pytest.raises(ValueError, match="start_method"):
        actorshm.run(main(), start_method="fork")  # (the warning would fail the test)
    assert not _client._runtimes


def test_run_whose_runtime_cannot_start_closes_the_coroutine(monkeypatch):
    # (a Ray that cannot start, as with a ray.init option it refuses: run raises that)
    async def refuse(self):
        raise OSError("cannot start")

    async def main():
        return 1

    monkeypatch.setattr(actorshm.Runtime, "start", refuse)
    coro = main()
    with pytest.raises(OSError, match="cannot start"):
        actorshm.run(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # no "never awaited"
    assert not _client._runtimes


def test_a_runtime_kept_open_across_cells():
    """Each cell a separate run on one loop, as a notebook kernel runs them."""
    loop = asyncio.new_event_loop()
    cell = loop.run_until_complete
    try:
        rt = cell(actorshm.Runtime(shutdown_grace=1.0).start())
        assert isinstance(rt, actorshm.Runtime)
        assert cell(_current()) is rt

        c = cell(Counter.spawn(5))  # no `async with` around it
        assert cell(c.incr(2)) == 7
        assert cell(c.incr(1)) == 8  # the actor lives on between cells
        pid = c.pid
        assert [a["pid"] for a in rt.actors()] == [pid]

        cell(rt.close())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(RuntimeError, match="no actorshm runtime is open"):
            cell(_current())
        cell(rt.close())  # a second close does nothing
        with pytest.raises(RuntimeError, match="was closed; open a new one"):
            cell(rt.start())
    finally:
        if _client._runtimes:  # pragma: no cover - only when the test failed
            loop.run_until_complete(_client._runtimes[-1].close())
        loop.close()


async def _current():
    return actorshm.current_runtime()


def test_an_array_kept_past_its_runtime_is_let_go_in_a_later_cell():
    """The kernel's loop runs on after `await rt.close()`: an actor's array dropped in a
    later cell is released there, and the dead actor's memory unmapped (closing the last
    runtime unset the release hook: it stayed mapped)."""
    import gc

    from actorshm import _leases, _shm
    from actors import Arrays

    loop = asyncio.new_event_loop()
    cell = loop.run_until_complete
    try:
        rt = cell(actorshm.Runtime(shutdown_grace=1.0).start())
        a = cell(Arrays.spawn())
        x = cell(a.make(1 << 16, 1.0))  # in the actor's memory
        cell(rt.close())
        key = _shm.find_block(x).region.key
        assert x.sum() == 1 << 16 and key in _leases._regions
        del x
        gc.collect()
        for _ in range(100):
            cell(asyncio.sleep(0.01))  # (later cells)
            if key not in _leases._regions:
                break
        assert key not in _leases._regions and not _leases.pending_releases
    finally:
        if _client._runtimes:  # pragma: no cover - only when the test failed
            loop.run_until_complete(_client._runtimes[-1].close())
        loop.close()


async def test_start_twice_and_async_with_after_start():
    rt = await actorshm.Runtime().start()
    try:
        with pytest.raises(RuntimeError, match="already open"):
            await rt.start()
        with pytest.raises(RuntimeError, match="already open"):
            async with rt:
                pass
        assert actorshm.current_runtime() is rt
    finally:
        await rt.close()
    assert not _client._runtimes


_CELLS = [
    "import actorshm, os\n"
    "async def main():\n    return 1\n"
    "try:\n    actorshm.run(main())\n"
    "except RuntimeError as e:\n    print('refused:', e)",
    "rt = await actorshm.Runtime().start()\nprint('current:', actorshm.current_runtime() is rt)",
    "from actorshm import actor\n"
    "@actor\nclass Counter:\n    def __init__(self, start=0):\n        self.n = start\n"
    "    def incr(self, k=1):\n        self.n += k\n        return self.n",
    "c = await Counter.spawn(5)\nprint('incr:', await c.incr(2))",
    "x = actorshm.zeros(4)\nprint('next cell:', await c.incr(1), actorshm.is_shared(x))",
    "pid = c.pid\nawait rt.close()\n"
    "try:\n    os.kill(pid, 0)\nexcept ProcessLookupError:\n    print('closed: actor gone')",
]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter's own path notices
def test_the_pattern_in_a_real_jupyter_kernel():
    """The documented cells, run by a Jupyter kernel (ipykernel's own running loop)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in _CELLS])
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    out = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "refused: actorshm.run() cannot be called from a running event loop" in out, out
    assert "`await main()`" in out, out
    assert "current: True" in out and "incr: 7" in out and "next cell: 8 True" in out, out
    assert "closed: actor gone" in out, out
