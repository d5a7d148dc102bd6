"""The order of one caller's calls on the Ray backend, restarts included.

Ray starts an async actor's tasks in no promised order, so each call carries its number
and ``base``, the number of its caller's oldest call Ray has not finished; the host
(``_ray_host.Host``) starts a caller's calls in number order, from ``base`` in a new or
restarted process. What keeps that order whole is here, as ``CallOrder``, a part of
``RayClient``: numbering, cancels (messages to the host's control group, sent again
while Ray has yet to see a death), and after a death, the calls held until the restarted
process answers, what it is told of the calls that ended in the old one (``resync``),
and the lost calls cancelled there.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import sys
import threading
import uuid
from typing import Any

from ._errors import ActorDiedError
from ._ray_errors import unavailable_error

__all__ = ["CallOrder", "ray_up", "ready_after_restart", "RESTART_WAIT", "fail_on_its_loop"]

RESTART_WAIT = 300.0  # seconds a restart may take before a watch stops waiting for it


def ray_up() -> bool:
    """Whether this process is connected to Ray. Any Ray call made while it is not
    starts a new local Ray (Ray's auto-init): after a runtime shut its Ray down, the
    work still under way (a kill, a cancel sent again, a restart watch) must not."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def end_actor(handle: Any) -> None:
    """Tell Ray that an actor is done with for good (no restart), quietly: it ends one
    whose spawn failed or was given up, and frees the name of one that died for good
    at once (Ray kept it taken for up to a minute: a respawn under it failed)."""
    try:
        if ray_up():  # (a Ray that shut down ended it already)
            sys.modules["ray"].kill(handle, no_restart=True)
    except Exception:
        pass


async def ready_after_restart(host: Any) -> tuple:
    """``Host.ready`` of a restarted actor: ``(True, pid)``, or ``(False, error)`` when
    its ``__init__`` raised. A call that still reached the old process (Ray had not yet
    seen its death) is retried."""
    unavailable = unavailable_error()
    while True:
        if not ray_up():
            raise ActorDiedError("Ray was shut down")
        try:
            return await host.ready.remote()
        except unavailable:
            await asyncio.sleep(0.1)


class CallOrder:
    """Call numbering, cancels and restarts for ``RayClient``, which sends the calls
    (``_submit``, ``_settle_with``) and knows the actors killed or dead for good
    (``_dead``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caller = uuid.uuid4().hex[:16]  # calls from one caller start in order
        self._seqs: dict[str, int] = {}  # actor key -> the next call's number
        # Per actor, this caller's calls that Ray has not finished (in call order): the
        # oldest is each new call's ``base``, where a restarted host starts its turns.
        self._open: dict[str, collections.OrderedDict] = {}
        self._restarting: dict[str, list] = {}  # actor key -> calls waiting for it
        self._cancels: dict[str, tuple] = {}  # actor key -> cancels of this loop step
        self._pids: dict[str, int] = {}  # after a restart
        self._watching: set = set()  # actor keys whose restart is watched
        self._died: set = set()  # actor keys whose death a call saw, not restarted since
        self._watchers: set = set()  # (their tasks)

    def forget(self, key: str) -> None:
        """Actor ``key`` is dead for good: its call numbers go (kept, they grew by an
        entry per actor for the life of the process). (Its last pid stays: a handle's
        ``pid`` still names it.)"""
        with self._lock:
            self._seqs.pop(key, None)
            self._open.pop(key, None)
        self._died.discard(key)

    def _number(self, actor_id: Any) -> tuple:
        """Take the next call number of ``actor_id``: ``(seq, base)`` (see ``_submit``);
        its call must be sent with it (``_submit``), or dropped (``_drop``)."""
        with self._lock:
            seq, base, opened = self._next(actor_id.key)
            opened[seq] = None
            self._seqs[actor_id.key] = seq + 1
        return seq, base

    def _next(self, key: str) -> tuple:
        """``(seq, base, open calls)`` for the next call to actor ``key`` (under the lock)."""
        seq = self._seqs.get(key, 0)
        opened = self._open.get(key)
        if opened is None:
            opened = self._open[key] = collections.OrderedDict()
        return seq, next(iter(opened), seq), opened

    def _drop(self, actor_id: Any, seq: int) -> None:
        """Call ``seq`` was numbered but will not be sent: the actor skips its turn."""
        with self._lock:
            self._open.get(actor_id.key, {}).pop(seq, None)
        if actor_id.key not in self._dead:
            self._cancel(actor_id, seq)

    def _finished(self, actor_id: Any, seq: int, done: concurrent.futures.Future,
                  loop=None) -> None:
        """Ray ended call ``seq`` (``done``: its result or its task's end, in one of Ray's
        threads): it no longer holds back the ``base`` of later calls. A call lost with
        its actor's process, where a new process may come, is cancelled there too: the
        calls made after it may carry an older call as their ``base``, and the new
        process would wait for this one's turn. (``loop``: the caller's, where the
        cancels of the calls lost together are gathered into one message.)"""
        with self._lock:
            opened = self._open.get(actor_id.key)
            if opened is None or seq not in opened:
                return
            del opened[seq]
        if actor_id.restarts and done.exception() is not None:
            import ray.exceptions as rex
            if isinstance(done.exception(), rex.RayActorError):
                self._cancel(actor_id, seq, loop)

    def _cancel(self, actor_id: Any, seq: int, loop=None) -> None:
        """Ask the actor to cancel call ``seq`` (a message, not ``ray.cancel``: a task
        Ray drops before it arrives would leave a hole in the caller's call order).
        Also sent for a call Ray failed, perhaps before it reached the actor's code (an
        argument Ray could not unpickle there): the calls after it must not wait for its
        turn. A call already running is stopped as ``Host.cancel`` says. From another
        thread, ``loop`` (the caller's) gathers the message, else it goes at once.

        Cancellations made in one event-loop step travel as one message, so the actor
        cancels them together: a queued call cannot slip in when the running one ends.
        """
        with self._lock:
            batch = self._cancels.get(actor_id.key)
            if batch is not None:
                batch[1].append(seq)
                return
            self._cancels[actor_id.key] = (actor_id, [seq])
        try:
            asyncio.get_running_loop().call_soon(self._send_cancels, actor_id.key)
        except RuntimeError:  # not in a loop's thread
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._send_cancels, actor_id.key)
                    return
                except RuntimeError:  # (closed meanwhile)
                    pass
            self._send_cancels(actor_id.key)  # (no loop to gather them: at once)

    def _send_cancels(self, key: str) -> None:
        with self._lock:
            actor_id, seqs = self._cancels.pop(key)
        self._send_control(actor_id, "cancel", (self._caller, seqs))

    def _send_control(self, actor_id: Any, method: str, args: tuple,
                      tries: int = 0) -> None:
        """Send a message to the host's ``control`` group (``cancel``, ``resync``). One
        sent while Ray has yet to see the actor's process die fails as "unavailable" and
        is sent again (every 0.1 s, for up to 5 minutes), so that a restarted process
        learns of it: a call lost with the old process may be the ``base`` of calls made
        after it, which would wait for it there."""
        if not ray_up():
            return
        try:
            ref = getattr(actor_id.handle, method).options(
                concurrency_group="control").remote(*args)
        except Exception:  # Ray is gone
            return

        def sent(f: concurrent.futures.Future) -> None:
            if isinstance(f.exception(), unavailable_error()) and tries < 3000 \
                    and actor_id.key not in self._dead:
                again = threading.Timer(0.1, self._send_control,
                                        (actor_id, method, args, tries + 1))
                again.daemon = True
                again.start()

        try:
            ref.future().add_done_callback(sent)
        except Exception:  # Ray is shutting down
            pass

    def _resync(self, actor_id: Any) -> None:
        """Tell a restarted actor which of this caller's calls may still come: those
        Ray has not finished. The others ended in the old process, and the new one must
        not wait for their turns (a call that finished there while an older one, say a
        stream, was still open lies above every later call's ``base``)."""
        with self._lock:
            upto = self._seqs.get(actor_id.key, 0)
            still = list(self._open.get(actor_id.key, ()))
        if upto:
            self._send_control(actor_id, "resync", (self._caller, upto, still))

    def watch_restart(self, actor_id: Any, loop, hold: bool) -> None:
        """After a death: if Ray restarts the actor (``max_restarts``), learn its new pid
        and tell the new process which calls may still come (``_resync``). ``hold``: a
        new process may come (the actor has restarts, and Ray says "unavailable", not
        dead for good): calls made from now on wait for it (``_restarting``), as on the
        local backend, rather than fail while Ray has yet to learn of the death."""
        key = actor_id.key
        if key in self._dead:
            return
        self._died.add(key)
        if hold:
            with self._lock:
                self._restarting.setdefault(key, [])
        if key in self._watching:
            return
        self._watching.add(key)

        async def watch() -> None:
            try:
                ok, pid = await asyncio.wait_for(ready_after_restart(actor_id.handle),
                                                 RESTART_WAIT)
                if ok:
                    self._pids[key] = pid
                    self._died.discard(key)
                    self._resync(actor_id)
            except asyncio.TimeoutError:  # a slow restart: Ray holds the message for it
                self._died.discard(key)
                self._resync(actor_id)
            except BaseException as exc:  # not restarted (or Ray is gone): the pid stays
                # (a cycle otherwise: its traceback holds wait_for's frame, which holds
                # the task that holds it)
                exc.__traceback__ = None
                if isinstance(exc, asyncio.CancelledError):
                    # Its loop ends (a thread's ``asyncio.run``), the restart still under
                    # way: the loop of a call that waits for it goes on watching.
                    self._watching.discard(key)
                    if self._watch_elsewhere(actor_id, loop, hold):
                        return
            self._watching.discard(key)
            self._release(actor_id, loop)

        self._watchers.add(loop.create_task(watch()))
        for t in [t for t in self._watchers if t.done()]:
            self._watchers.discard(t)

    def _watch_elsewhere(self, actor_id: Any, loop, hold: bool) -> bool:
        """Hand the watch of a restart to the loop of a call held for it, other than
        ``loop``; False where there is none (or the actor was killed meanwhile)."""
        if actor_id.key in self._dead:
            return False
        with self._lock:
            held = list(self._restarting.get(actor_id.key, ()))
        for entry in held:
            other = entry[0].get_loop()
            if other is not loop and other.is_running() and not entry[0].done():
                try:
                    other.call_soon_threadsafe(self.watch_restart, actor_id, other, hold)
                except RuntimeError:  # (closed meanwhile)
                    continue
                return True
        return False

    def _hold(self, key: str, entry: tuple) -> bool:
        """Add a call to those waiting for actor ``key``'s restart (``watch_restart``);
        False where none waits (no restart, or its calls were just released)."""
        with self._lock:  # (a loop of another thread may release them meanwhile)
            held = self._restarting.get(key)
            if held is None:
                return False
            held.append(entry)
            return True

    def _release(self, actor_id: Any, loop) -> None:
        """Send the calls that waited for the restart (``watch_restart``), in order."""
        with self._lock:
            held = self._restarting.pop(actor_id.key, ())
        for fut, method, args, kwargs, what, number, link in held:
            if fut.done() or actor_id.key in self._dead or not ray_up():
                self._drop(actor_id, number[0])  # cancelled while it waited, or killed
                if not fut.done():
                    why = self._dead.get(actor_id.key) or "is gone (Ray was shut down)"
                    fail_on_its_loop(fut, ActorDiedError(f"{what}: the actor {why}"))
                continue
            try:
                ref, seq = self._submit(actor_id, None, method, args, kwargs, what, number,
                                        link)  # (the chain it was made in)
            except Exception as exc:
                self._drop(actor_id, number[0])
                fail_on_its_loop(fut, exc)
                continue
            # (on the loop of the call's caller: another thread's, maybe, not the loop
            # that saw the restart)
            self._settle_with(actor_id, fut, ref, seq, what, fut.get_loop())


def fail_on_its_loop(fut: asyncio.Future, exc: BaseException) -> None:
    """Fail ``fut`` with ``exc`` from any thread: on its own loop, which is woken (a
    future of another thread's loop set from here would wake nobody); nothing where
    that loop has closed (its caller is gone). A ``concurrent.futures.Future`` (a call
    made from a thread with no loop) is failed at once."""
    if isinstance(fut, concurrent.futures.Future):
        try:
            fut.set_exception(exc)
        except concurrent.futures.InvalidStateError:  # (done meanwhile)
            pass
        return
    loop = fut.get_loop()
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None

    def fail() -> None:
        if not fut.done():
            fut.set_exception(exc)
            fut.exception()  # (retrieved: a caller that left prints nothing)
    if here is loop:
        fail()
        return
    try:
        loop.call_soon_threadsafe(fail)
    except RuntimeError:  # its loop is closed
        pass
