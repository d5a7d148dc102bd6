"""The Ray client's own logic, in this process, with Ray's side faked (no Ray started)."""

import asyncio
import concurrent.futures
from unittest import mock

from actorshm import _ray, _ray_order
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


async def test_a_stream_left_as_its_arguments_come_in_is_never_started():
    # Its start's wakeup was queued before the cancel that aclose() queued: the start
    # went on and sent the stream, which nobody stopped (its finally never ran there).
    sent, controls = [], []
    handle = mock.Mock(stream=_Remote([]), cancel=_Remote(controls))
    client = _ray.RayClient()
    aid = _ray.RayActorId(handle, "actor-B", frozenset({"gen"}))

    def submit(actor_id, remote, method, args, kwargs, what, number=None, link=None):
        sent.append((method, args))
        return _Gen(), number[0]

    client._submit = submit
    with mock.patch.object(_ray, "ray_up", lambda: True), \
            mock.patch.object(_ray_order, "ray_up", lambda: True):
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


async def test_a_stream_whose_argument_failed_raises_that_error_with_its_traceback():
    # ``raise copy_exc(...) from None`` dropped the remote traceback (its __cause__).
    from actorshm._errors import RemoteTraceback
    handle = mock.Mock(stream=_Remote([]), cancel=_Remote([]))
    client = _ray.RayClient()
    aid = _ray.RayActorId(handle, "actor-C", frozenset({"gen"}))
    client._submit = mock.Mock(side_effect=AssertionError("nothing is sent"))
    with mock.patch.object(_ray, "ray_up", lambda: True), \
            mock.patch.object(_ray_order, "ray_up", lambda: True):
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
