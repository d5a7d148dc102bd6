import asyncio
import gc
import os

import pytest

import actorshm
from recorder import connection_pair


def pytest_addoption(parser):
    parser.addoption("--soak-seconds", type=float, default=3.0,
                     help="how long tests/test_soak.py loads the actors (default 3)")


@pytest.fixture(scope="session")
def event_loop_policy():
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        import asyncio
        return asyncio.DefaultEventLoopPolicy()
    return uvloop.EventLoopPolicy()


def _children() -> set[int]:
    pid = os.getpid()
    out = set()
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            out = {int(x) for x in f.read().split()}
    except OSError:  # pragma: no cover
        pass
    return out


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Every test must leave no child process behind."""
    before = _children()
    yield
    import time
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = _children() - before
        if not left:
            break
        time.sleep(0.05)
    assert not left, f"test leaked child processes {left}"


@pytest.fixture
async def rt():
    async with actorshm.Runtime(shutdown_grace=1.0) as runtime:
        yield runtime
    gc.collect()


@pytest.fixture
async def pair():
    """A sender and a receiver connection over a socket pair, in this process."""
    sender, receiver = connection_pair(asyncio.get_running_loop())
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.fixture(params=["spawn", "forkserver"])
def start_method(request):
    """Runs a test once per start method (as loky runs its suite per start method):
    for the tests where how an actor process starts matters."""
    return request.param


@pytest.fixture
async def rt_each(start_method):
    """A runtime, once per start method (see ``start_method``)."""
    async with actorshm.Runtime(start_method=start_method, shutdown_grace=1.0) as runtime:
        yield runtime
    gc.collect()
