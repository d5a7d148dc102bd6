"""The Ray client's own logic, in this process, with Ray's side faked (no Ray started)."""

import asyncio
import concurrent.futures
import contextlib
from unittest import mock

import pytest

from actorshm import _ray, _ray_order, _ray_stream
from actorshm._results import CallFuture


class _Completed:
    def future(self):  # a generator still running in the actor: it never ends
        return concurrent.futures.Future()


class _Gen:
    def completed(self):
        return _Completed()


class _Remote:
    def __init__(self, log: list) -> None:
        self.log = log

    def options(self, **kw):
        return self

    def remote(self, *args):
        self.log.append(args)
        done = concurrent.futures.Future()
        done.set_result(None)
        return mock.Mock(future=lambda: done)


def _ray_up():
    """Ray taken as running, for the client's own logic (no Ray started)."""
    stack = contextlib.ExitStack()
    for mod in (_ray, _ray_order, _ray_stream):
        stack.enter_context(mock.patch.object(mod, "ray_up", lambda: True))
    return stack


def _stream_client(key: str, submit) -> tuple:
    """A client whose sends go to ``submit``, an actor id for ``key`` with a streaming
    method ``gen``, and the list of the cancels it sends (``(caller, seqs)``)."""
    controls: list = []
    handle = mock.Mock(stream=_Remote([]), cancel=_Remote(controls))
    client = _ray.RayClient()
    client._submit = submit
    return client, _ray.RayActorId(handle, key, frozenset({"gen"})), controls


async def test_a_stream_left_as_its_arguments_come_in_is_never_started():
    # Its start's wakeup was queued before the cancel that aclose() queued: the start
    # went on and sent the stream, which nobody stopped (its finally never ran there).
    sent = []

    def submit(actor_id, remote, method, args, kwargs, what, number=None, link=None):
        sent.append((method, args))
        return _Gen(), number[0]

    client, aid, controls = _stream_client("actor-B", submit)
    with _ray_up():
        dep = CallFuture()
        s = client.stream(aid, "gen", (dep,), {}, "B.gen")
        await asyncio.sleep(0)  # its start waits for `dep`
        dep.set_result(1)
        await asyncio.sleep(0)  # (the start's wakeup is queued now)
        await s.aclose()
        for _ in range(5):
            await asyncio.sleep(0)
        assert sent == []
        assert [seqs for _, seqs in controls] == [[0]]  # its turn given up in the actor
        assert not client._open["actor-B"] and not client._waits_for_args


async def test_a_stream_left_from_another_thread_as_it_is_sent_is_stopped_there():
    # A garbage collection's _left() in another thread, between the start's check of
    # the mark and its send: the queued cancel of the start came after it had sent the
    # stream, which nobody then stopped.
    sent, box = [], []

    def submit(actor_id, remote, method, args, kwargs, what, number=None, link=None):
        box[0]._left()  # (as from another thread, at this instant)
        sent.append(method)
        return _Gen(), number[0]

    client, aid, controls = _stream_client("actor-D", submit)
    with _ray_up():
        dep = CallFuture()
        box.append(client.stream(aid, "gen", (dep,), {}, "D.gen"))
        await asyncio.sleep(0)
        dep.set_result(1)
        for _ in range(5):
            await asyncio.sleep(0)
        assert sent == ["gen"]
        assert [seqs for _, seqs in controls] == [[0]]  # stopped in the actor


async def test_a_stream_whose_argument_failed_raises_that_error_with_its_traceback():
    # ``raise copy_exc(...) from None`` dropped the remote traceback (its __cause__).
    from actorshm._errors import RemoteTraceback
    client, aid, _ = _stream_client(
        "actor-C", mock.Mock(side_effect=AssertionError("nothing is sent")))
    with _ray_up():
        dep = CallFuture()
        s = client.stream(aid, "gen", (dep,), {}, "C.gen")
        await asyncio.sleep(0)
        err = ValueError("bad input")
        err.__cause__ = RemoteTraceback("Traceback ...: in A.f")
        dep.set_exception(err)
        try:
            await s.__anext__()
        except ValueError as exc:
            assert str(exc) == "bad input" and exc is not err
            assert isinstance(exc.__cause__, RemoteTraceback)
        else:
            raise AssertionError("no error")


async def _host_of(cls):
    """The Ray host of an actor of ``cls``, run in this process (Ray faked), ready."""
    import sys
    from actorshm import _client, _ray_host, _ray_watched

    with mock.patch.dict(sys.modules, {"ray": None}), \
            mock.patch.object(_ray_watched, "_on_leaving", lambda f: None), \
            mock.patch.object(_client, "_worker", [None]):  # (the host sets this process's)
        host = _ray_host.Host(cls, (), {}, 1, mock.Mock, ())
    assert await host.ready() == (True, mock.ANY)
    return host


@pytest.mark.parametrize("first", ["call", "stream"])
async def test_a_call_cancelled_before_its_callers_first_call_came_passes_its_turn(first):
    # `await h.count(3)` (a TypeError: a stream is iterated) drops the stream at once;
    # its cancel, on the host's control thread, can come before the stream itself, and
    # before any call of that caller. The stream then came, was skipped, and the
    # caller's next call (base: the skipped one) waited for its turn forever.
    from actorshm._ray_errors import outcome

    class A:
        def m(self):
            return "m"

        async def gen(self):
            yield 1

    host = await _host_of(A)
    assert outcome(await host.call(("m", (), {}, "other", 0, 0)), "A.m") == ("m", None)
    await host.cancel("driver", [0])
    await asyncio.sleep(0)  # (``_apply_cancel``, from the loop)
    if first == "call":
        assert await host.call(("m", (), {}, "driver", 0, 0)) == (None, None)
    else:
        assert [x async for x in host.stream(("gen", (), {}, "driver", 0, 0))] == []
    # (a hang, before: waiting for the turn of call 0)
    assert outcome(await asyncio.wait_for(host.call(("m", (), {}, "driver", 1, 0)), 5),
                   "A.m") == ("m", None)
    items = [outcome(x, "A.gen")[0] async for x in host.stream(("gen", (), {}, "driver", 2, 0))]
    assert items == [1]


async def test_a_stream_refused_at_its_first_item_ends_without_waiting_for_a_slot():
    # The host (in this process) of an actor A with max_concurrency=1 runs A.m, which
    # made a stream of A: its first item is refused (re-entrant), and its close waited
    # for A's slot, held by A.m, which waits for the stream's end (aclose): a deadlock.
    from actorshm._errors import ReentrantCallError
    from actorshm._ray_errors import outcome

    hold = asyncio.Event()

    class A:
        async def m(self):
            await hold.wait()  # (as `await stream.aclose()` waits for its end)

        async def gen(self):
            yield 1

    host = await _host_of(A)
    m = asyncio.ensure_future(host.call(("m", (), {}, "driver", 0, 0)))
    try:
        await asyncio.sleep(0.05)
        link = (host.actor_id, "A.m", host.holding[("driver", 0)])
        items = host.stream(("gen", (), {}, "a", 0, 0, (link,)))
        _, err = outcome(await asyncio.wait_for(items.__anext__(), 5), "A.gen")
        assert isinstance(err, ReentrantCallError)
        done, _ = await asyncio.wait([asyncio.ensure_future(items.__anext__())],
                                     timeout=2)
        assert done and isinstance(done.pop().exception(), StopAsyncIteration)
    finally:
        hold.set()
        await m


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_stream_left_whose_generator_fails_to_close_ends_quietly(kind):
    # A generator that yields again in its finally ("generator ignored GeneratorExit"):
    # the consumer left, Ray closed the host's stream, and its close raised that error,
    # which asyncio printed from the actor ("Task exception was never retrieved", in the
    # driver's output). Locally nobody is told either: nobody is left to tell.
    from actorshm._ray_errors import outcome

    class A:
        def ping(self):
            return "pong"

        def gen(self):
            try:
                yield from range(100)
            finally:
                yield "in finally"

        async def agen(self):
            try:
                for i in range(100):
                    yield i
            finally:
                yield "in finally"

    host = await _host_of(A)
    method = "gen" if kind == "sync" else "agen"
    items = host.stream((method, (), {}, "driver", 0, 0))
    assert outcome(await items.__anext__(), "A." + method) == (0, None)
    await asyncio.wait_for(items.aclose(), 5)  # (as Ray does when the consumer leaves)
    # (it raised the close's RuntimeError here, before) and the actor goes on
    assert outcome(await asyncio.wait_for(host.call(("ping", (), {}, "driver", 1, 0)), 5),
                   "A.ping") == ("pong", None)


def test_check_result_looks_for_mistakes_only_in_results_that_may_be_one():
    # Every non-scalar result of every Ray call went through result_mistake and
    # _unawaited (two imports, three inspect calls): about 2 us more per call.
    import pytest
    from actorshm import _ray_errors
    from actorshm._client import ThreadCallFuture

    def gen():
        yield 1

    async def agen():
        yield 1

    async def coro():
        pass

    c, loop = coro(), asyncio.new_event_loop()
    with mock.patch.object(_ray_errors, "result_mistake",
                           mock.Mock(side_effect=AssertionError("looked"))):
        _ray_errors.check_result([1, (2, 3)], "A.m")
        _ray_errors.check_result({"a": [1.0]}, "A.m")
    for value in (gen(), agen(), c, CallFuture(loop=loop),
                  ThreadCallFuture()):
        with pytest.raises(TypeError, match="the result of A.m cannot be sent back: "):
            _ray_errors.check_result(value, "A.m")
    c.close()
    loop.close()
