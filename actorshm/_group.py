"""``ActorGroup``: one call broadcast to a set of actors, results gathered in member order.

Written against the public handle API only (calls, ``kill``) and the classes' own
``spawn``, so it works the same on every backend.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Iterable, Iterator

import numpy as np

from . import _client, _shm
from ._actor import (RAY_CALLS, STREAM, ActorHandle, _Spawner, kill_from_thread,
                     no_attribute, refuse_options_as_init_args, start_shielded)
from ._client import ThreadCallFuture
from ._errors import ActorError, ActorGroupError
from ._pool import check_handles
from ._results import JoinedFuture

__all__ = ["ActorGroup"]


class ActorGroup:
    """A fixed list of actors that a call goes to at once: ``await group.step(x)``.

    ``group.method(*args, **kwargs)`` sends the call to every member now and returns an
    awaitable of the list of results, in member order. The ``await`` returns only once
    every member's call has finished or failed; if any failed it raises
    ``ActorGroupError`` (an ``ExceptionGroup`` and an ``ActorError``) naming the failed
    members, with every result in its ``results``. Cancelling the awaitable cancels
    every member's call. From another thread it returns a ``concurrent.futures.Future``
    (``.result(timeout=...)``, or ``await`` on that thread's own loop), as a single call.

    Arrays: a shared array (``actorshm.empty``/``zeros``/``share``) goes to every member
    by reference, nothing copied. An ordinary ndarray given as an argument, or inside a
    list, tuple or dict argument, is copied into shared memory once for the whole group
    and then passed by reference to all. On the local backend the call is encoded once
    for every member (``_multicast``), so arrays deeper in other objects are copied once
    too; where it goes one call per member (a member with ``max_pending_calls``, a
    streaming method, a call made from another thread, an unfinished call's result as
    an argument), they are copied once per member, as for single calls.

    ``len(group)``, ``group[i]`` and iteration give the handles; ``group[a:b]`` is a
    group of those members.

    Args:
        handles: the actors (a non-empty list of distinct handles). Members may be of
            different classes: a method is callable on the group when every member has it.

    Raises:
        TypeError: ``handles`` is not a list of actor handles.
        ValueError: it is empty or lists an actor twice.
    """

    __slots__ = ("_handles", "_methods")

    def __init__(self, handles: Iterable[ActorHandle]) -> None:
        self._handles: tuple[ActorHandle, ...] = tuple(check_handles(handles, "ActorGroup"))
        self._methods: dict[str, GroupMethod] = {}

    @classmethod
    async def spawn(cls, actor_cls: Any, n: int, /, *args: Any,
                    **kwargs: Any) -> "ActorGroup":
        """Start ``n`` actors of ``actor_cls`` at once and return them as a group.

        Every start-up runs concurrently (``asyncio.gather`` of the spawns), so ``n``
        actors take about as long as the slowest one (with ``start_method="forkserver"``
        or when ``__init__`` waits on I/O) instead of ``n`` times one. Each member gets the
        same ``*args, **kwargs`` for its ``__init__``.

        Args:
            actor_cls: an ``@actor`` class, or ``Cls.options(...)`` for per-spawn options
                (without ``name``: names are unique, so give each member its own with
                ``Cls.options(name=...)`` spawned one by one).
            n: how many actors (>= 1).

        Raises:
            TypeError: ``actor_cls`` is not an actor class, or ``n`` is not an int.
            ValueError: ``n < 1``, or a ``name`` option with ``n > 1``.
            ActorGroupError: some members failed to start (each one's error inside, e.g.
                the exception its ``__init__`` raised); the ones that started are
                stopped first, so nothing is left running.
        """
        spawner = _spawner_of(actor_cls)
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"ActorGroup.spawn: n must be an int, not {type(n).__name__}")
        if n < 1:
            raise ValueError(f"ActorGroup.spawn: n must be >= 1, not {n}")
        if n > 1 and spawner._options.name is not None:
            raise ValueError(f"ActorGroup.spawn: cannot give {n} actors the one name "
                             f"{spawner._options.name!r}; names are unique. Spawn "
                             "without name=, or spawn named actors one by one and "
                             "pass them to ActorGroup([...])")
        if kwargs:  # (said once, before any process starts)
            refuse_options_as_init_args(spawner._cls, kwargs, "ActorGroup.spawn()")
        what = f"{spawner._cls.__qualname__}.__init__"
        outs = await _gather_all([spawner.spawn(*args, **kwargs) for _ in range(n)])
        failed = [i for i, (ok, _) in enumerate(outs) if not ok]
        if failed:
            started = [v for ok, v in outs if ok]
            await asyncio.gather(*(h.kill() for h in started), return_exceptions=True)
            errors = [outs[i][1] for i in failed]
            raise ActorGroupError(
                f"{len(failed)} of {n} actors failed to start ({what}): "
                + "; ".join(f"member {i}: {_brief(e)}" for i, e in zip(failed, errors))
                + (f"; the {len(started)} that started were stopped" if started else ""),
                errors, failed, None)
        return cls([v for _, v in outs])

    # -- the members ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._handles)

    def __iter__(self) -> Iterator[ActorHandle]:
        return iter(self._handles)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return ActorGroup(self._handles[i])
        return self._handles[i]

    def __repr__(self) -> str:
        names = sorted({h._cls_name for h in self._handles})
        return f"<ActorGroup of {len(self._handles)} {'/'.join(names)} actors>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorGroup) and other._handles == self._handles

    def __hash__(self) -> int:
        return hash(self._handles)

    def __reduce__(self):
        return (ActorGroup, (list(self._handles),))

    def __getattr__(self, name: str) -> "GroupMethod":
        if name.startswith("_"):
            raise AttributeError(name)
        m = self._methods.get(name)
        if m is None:
            missing = [i for i, h in enumerate(self._handles) if name not in h._methods]
            if missing:
                h = self._handles[missing[0]]
                raise AttributeError(
                    f"ActorGroup: member {missing[0]} (actor {h._cls_name}) has no public "
                    f"method {name!r}; its methods are {sorted(h._methods)}")
            m = self._methods[name] = GroupMethod(self._handles, name)
        return m

    def __dir__(self):
        common = set.intersection(*(set(h._methods) for h in self._handles))
        return sorted(set(super().__dir__()) | common)

    def kill(self) -> Awaitable[None]:
        """End every member's process (``handle.kill()`` on each, at once); a future,
        as ``handle.kill()`` returns: cancelling the wait does not stop the kills."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # (no event loop runs here: as ``handle.kill()`` does)
            return kill_from_thread(self._handles[0]._client, self.kill, self._kill_all)
        return start_shielded(self._kill_all())

    async def _kill_all(self) -> None:
        await asyncio.gather(*(h.kill() for h in self._handles), return_exceptions=True)


class GroupMethod:
    """One method of every member of a group: calling it sends the call to all."""

    __slots__ = ("_handles", "_name", "_send", "_ids", "_whats")

    def __init__(self, handles: tuple, name: str) -> None:
        self._handles = handles
        self._name = name
        # Encoded once for all members (``call_group``: the local runtime and actor
        # processes; on Ray each member's call goes on its own), unless a member is
        # called in a way of its own (a ``max_pending_calls`` limit).
        client = handles[0]._client
        self._send = getattr(client, "call_group", None) if len(handles) > 1 and all(
            h._client is client and h._max_pending <= 0 for h in handles) else None
        self._ids = [h._actor_id for h in handles]
        self._whats = [f"{h._cls_name}.{name}" for h in handles]

    def __repr__(self) -> str:
        return f"<group method {self._name} of {len(self._handles)} actors>"

    def __getattr__(self, attr: str):
        no_attribute(self, attr, RAY_CALLS, lambda: (
            f"group.{self._name}.{attr}: a group's method is called directly, and the "
            f"calls are sent at once: `await group.{self._name}(...)` gives the list of "
            "the members' results"))

    def __call__(self, *args: Any, **kwargs: Any) -> asyncio.Future | ThreadCallFuture:
        """Send the call to every member now; return an awaitable of the results list.

        Made from a thread other than the event loop's (a driver thread, a sync method of
        a ``max_concurrency > 1`` actor), it returns a ``concurrent.futures.Future``, as
        a single call from a thread does: block on it with ``.result(timeout=...)``, or
        ``await`` it on an event loop of that thread's own.

        Raises:
            TypeError: an argument cannot be serialized (nothing is sent to anyone).
            PendingCallsLimitError: the first member's ``max_pending_calls`` calls are
                all unanswered (nothing is sent); for a later member it is that member's
                failure in the ``ActorGroupError``.
            TypeError: the method streams (a generator): a group call waits for one
                result per member, so each member's stream is iterated on its own.
        """
        if any(h._methods.get(self._name) == STREAM for h in self._handles):
            what = f"{self._handles[0]._cls_name}.{self._name}"
            raise TypeError(
                f"{what} is a streaming method (a generator), and a group call waits for "
                f"one result per member; nothing was sent. Iterate each member's stream: "
                f"`[h.{self._name}(...) for h in group]`, each an async iterator")
        if len(self._handles) > 1 and getattr(self._handles[0]._client, "shares_memory", True):
            args, kwargs = _share_once((args, kwargs))  # not on Ray: it copies arguments
        futs = None if self._send is None else self._send(self._ids, self._name, args,
                                                           kwargs, self._whats)
        if futs is not None:  # (only on the event loop's thread: the loop is running)
            del args, kwargs
            return _gather(asyncio.get_running_loop(), futs, self._handles, self._name)
        futs = []
        for i, h in enumerate(self._handles):
            try:
                futs.append(getattr(h, self._name)(*args, **kwargs))
            except Exception as exc:
                if i == 0:
                    raise  # nothing was sent: as for a single call
                futs.append(_client.failed_call(exc))
        del args, kwargs  # the members hold what they need (shared copies go home)
        if all(isinstance(f, asyncio.Future) for f in futs):
            return _gather(futs[0].get_loop(), futs, self._handles, self._name)
        # Made from a thread other than the event loop's: each call is a
        # ``concurrent.futures.Future`` that the loop's thread completes, so the results
        # are gathered into one too, as a single call from a thread returns.
        return _gather_from_thread(futs, self._handles, self._name)


def _gather(loop, futs: list, handles: tuple, name: str) -> asyncio.Future:
    """A future of every call's result, once all are done; cancelling it cancels them."""
    out = JoinedFuture(loop, futs)  # (cancelling it cancels them)
    left = [len(futs)]

    def one_done(_f) -> None:
        left[0] -= 1
        if left[0] or out.done():
            return
        _settle(out, futs, handles, name)

    for f in futs:
        f.add_done_callback(one_done)
    return out


def _gather_from_thread(futs: list, handles: tuple, name: str) -> ThreadCallFuture:
    """``_gather`` for a group call made from a thread other than the event loop's: a
    ``ThreadCallFuture`` (block on it with ``.result()``, or await it on that thread's
    own loop). Its calls' futures are completed in the loop's thread (or, one that
    failed at once, already done), so the count is kept under a lock."""
    out = ThreadCallFuture()
    left = [len(futs)]
    lock = threading.Lock()

    def one_done(_f) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            _settle(out, futs, handles, name)
        except concurrent.futures.InvalidStateError:  # the thread cancelled it meanwhile
            pass

    def cancel_calls(o) -> None:  # in the thread that cancelled ``out``
        if o.cancelled():
            for f in futs:
                if isinstance(f, asyncio.Future):  # (one that failed at once: done)
                    f.get_loop().call_soon_threadsafe(f.cancel)
                else:
                    f.cancel()  # (a ThreadCallFuture hands the cancel to its loop)

    for f in futs:
        if isinstance(f, asyncio.Future) and f.done():
            one_done(f)  # (failed at once, on this thread's loop, which may be blocked)
        else:
            f.add_done_callback(one_done)
    out.add_done_callback(cancel_calls)
    return out


def _settle(out, futs: list, handles: tuple, name: str) -> None:
    """Give ``out`` every call's result in member order, or the ``ActorGroupError``
    naming those that failed; every future of ``futs`` is done."""
    if out.done():  # cancelled: its calls, cancelled with it, owe it nothing
        return  # (their CancelledErrors cannot make an ActorGroupError, an ExceptionGroup)
    results, errors, failed = [], [], []
    for i, f in enumerate(futs):
        if f.cancelled():
            errors.append(ActorError(f"the call to member {i} was cancelled"))
            failed.append(i)
            results.append(None)
        elif f.exception() is not None:
            exc = f.exception()
            if not isinstance(exc, Exception):  # (an ExceptionGroup holds Exceptions only:
                # it refused one, and the group call never ended)
                err = ActorError(f"the call to member {i} failed: {exc!r}")
                err.__cause__ = exc
                exc = err
            errors.append(exc)
            failed.append(i)
            results.append(None)
        else:
            results.append(f.result())
    if not failed:
        out.set_result(results)
        return
    what = f"{handles[0]._cls_name}.{name}"
    out.set_exception(ActorGroupError(
        f"{len(failed)} of {len(futs)} calls of {what} failed: "
        + "; ".join(f"member {i} ({_who(handles[i])}): {_brief(e)}"
                    for i, e in zip(failed, errors)),
        errors, failed, results))


async def _gather_all(aws: list) -> list[tuple[bool, Any]]:
    """Run every awaitable to its end; (True, result) or (False, exception) each.

    Cancelled, it cancels them all and waits for them, so nothing runs on unseen: also
    when cancelled again meanwhile (an outer time-out on top of a cancel), since a
    spawn left running, or one that ended and was not killed, is an actor nobody holds."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        while not all(t.done() for t in tasks):
            try:
                await asyncio.wait(tasks)
            except BaseException:  # (cancelled again: the first cancel is raised below)
                pass
        # Kill what started before the cancellation reached it: every kill begins now
        # and goes through, however this wait for them ends.
        kills = [t.result().kill() for t in tasks
                 if not t.cancelled() and t.exception() is None]
        if kills:
            await asyncio.gather(*kills, return_exceptions=True)
        raise
    return [(False, t.exception()) if t.exception() is not None else (True, t.result())
            for t in tasks]


def _spawner_of(actor_cls: Any) -> _Spawner:
    if isinstance(actor_cls, _Spawner):
        return actor_cls
    # (an undecorated subclass of an actor class spawns as ``Sub.spawn()`` does)
    if isinstance(actor_cls, type) and hasattr(actor_cls, "__actorshm_options__"):
        return actor_cls.options()
    raise TypeError(f"ActorGroup.spawn takes an @actor class or Cls.options(...), not "
                    f"{actor_cls!r}; decorate the class with @actorshm.actor")


def _who(h: ActorHandle) -> str:
    return f"actor {h._cls_name} id={h._actor_id}"


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _share_once(obj: Any, memo: dict | None = None) -> Any:
    """``obj`` with every ordinary ndarray in it (through lists, tuples and dicts) replaced
    by a shared copy, made once: each member's call then passes that copy by reference.
    What recurs (an array passed twice, a list that holds itself) is rebuilt once, as
    pickle keeps it in a single call."""
    if memo is None:
        memo = {}
    done = memo.get(id(obj))
    if done is not None:
        return done[1]
    t = type(obj)
    if t is np.ndarray:
        if obj.dtype.hasobject or obj.size == 0 or _shm.is_shared(obj):
            return obj
        shared = _shm.copy_to_shared(obj)
        # counted copied by the first member's call, by reference by the others' (as a
        # group call encoded once counts a tensor, and a single call an array)
        _shm.copied_for_sending(shared, _shm.copy_nbytes(obj))
        memo[id(obj)] = (obj, shared)  # (``obj`` kept: its id stays its own meanwhile)
        return shared
    if t is list:
        out: Any = []
        memo[id(obj)] = (obj, out)  # before its items: one of them may be this list
        out.extend([_share_once(x, memo) for x in obj])
        return out
    if t is dict:
        out = {}
        memo[id(obj)] = (obj, out)
        for k, v in obj.items():
            out[k] = _share_once(v, memo)
        return out
    if t is tuple or (isinstance(obj, tuple) and hasattr(obj, "_fields")):  # namedtuple
        items = [_share_once(x, memo) for x in obj]
        out = tuple(items) if t is tuple else t(*items)
        memo[id(obj)] = (obj, out)
        return out
    return obj
