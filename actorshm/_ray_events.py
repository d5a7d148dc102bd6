"""Lifecycle events on the Ray backend: the runtime watches each actor it spawned.

Each actor that ``RayRuntime`` spawns gets a watcher: a task in the driver that keeps a
call pending on the actor's host (``Host.watch_death``, which returns only when the
process starts leaving on SIGTERM: ``_ray_watched``; that is a death too). Ray fails
that call when the actor's process dies (``ActorUnavailableError``, or ``ActorDiedError``
where Ray already knows the actor is gone for good), and the restarts left
(``max_restarts``) say whether a new process comes. The watcher then reports ``"died"``
(``_events.emit``); where a new process comes, it holds the calls made meanwhile
(``RayClient.watch_restart``), waits for it (``Host.ready`` answers with its pid),
reports ``"restarted"`` and watches again.
"""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

from . import _events
from ._actor import ActorHandle
from ._ray_errors import unavailable_error
from ._ray_order import RESTART_WAIT, end_actor, ready_after_restart
from ._remote_errors import decode_exception

__all__ = ["watch", "describe"]

LEAVING_POLL = 0.05  # seconds between the questions to a process that is leaving


class _Record:
    """What ``_events.emit`` reads of an actor (as of the local runtime's records)."""

    def __init__(self, handle: ActorHandle, options: Any) -> None:
        self.actor_id = handle._actor_id
        self.cls_name = handle._cls_name
        self.methods = handle._methods
        self.options = options
        self.pid = handle._pid
        self.restarts = 0


def describe(exc: BaseException) -> str:
    """A short reason from Ray's error for a dead actor's call."""
    text = " ".join(str(exc).split())
    m = re.search(r"The actor is dead because (.*?)(?: Some common causes|$)", text)
    if m:
        text = m.group(1)
    elif "temporarily unavailable" in text:
        text = "its process is gone"
    return f"Ray: {text[:300]}"


def watch(runtime: Any, handle: ActorHandle, options: Any, client: Any) -> asyncio.Task:
    """Start watching ``handle``'s actor, and the actors it spawns, for ``runtime``'s
    lifecycle events (``runtime.adopt(handle, options)`` is told of each of those)."""
    return runtime.loop.create_task(_watch_all(runtime, _Record(handle, options), client))


async def _watch_all(runtime: Any, rec: _Record, client: Any) -> None:
    await asyncio.gather(_watch(runtime, rec, client),
                         _children(runtime, rec.actor_id.handle))


async def _children(runtime: Any, host: Any) -> None:
    """Learn of the actors this actor spawns (``Host.next_children``), to watch them."""
    while True:
        try:
            children = await host.next_children.remote()
        except unavailable_error():  # restarting: ask its next process (Ray queues the call)
            children = ()
        except Exception:  # the actor is gone: its watcher reports it
            return
        if not children:  # (its process is leaving, or restarting): ask again
            await asyncio.sleep(LEAVING_POLL)
            if runtime._closing:
                return
            continue
        for handle, options in children:
            if runtime._closing:
                return
            runtime.adopt(handle, options)


def _dead_for_good(runtime: Any, rec: _Record, sure: bool, death: str) -> None:
    """The actor will not come back (``death``: why); ``sure``: it is gone for certain,
    so that a name it has is freed at once, as locally (Ray kept it taken for a minute
    or so). The runtime then forgets it but for a summary row; one not sure to be gone
    (a restart slower than ``RESTART_WAIT``: it may yet come) is only listed as dead,
    and is still killed when the runtime closes."""
    if not sure:
        runtime.given_up(rec.actor_id, death)
        return
    if rec.options.name is not None:
        end_actor(rec.actor_id.handle)
    runtime.forget(rec.actor_id, death)


def _ray_says_dead(exc: BaseException | None) -> bool:
    rex = getattr(sys.modules.get("ray"), "exceptions", None)
    return rex is not None and isinstance(exc, rex.ActorDiedError)


def _ray_killed(exc: BaseException | None) -> bool:
    """Whether Ray says ``ray.kill`` ended the actor: ``kill()`` called inside an actor
    (whose process records it, not the driver's), as the program's other kills."""
    return _ray_says_dead(exc) and "killed by `ray.kill`" in str(exc)


async def _watch(runtime: Any, rec: _Record, client: Any) -> None:
    host, key = rec.actor_id.handle, rec.actor_id.key
    unavailable, limit = unavailable_error(), rec.options.max_restarts
    while True:
        try:
            # It returns when that process is leaving on SIGTERM, or is gone and another
            # answered in its place (``_ray_watched``).
            left = await host.watch_death.remote(rec.pid)
            death = None
        except Exception as exc:
            death = exc.with_traceback(None)  # (its traceback held this frame, and so it)
        if runtime._closing:
            return
        killed = key in client._dead or _ray_killed(death)
        # Ray says an actor is gone for good (``ActorDiedError``) only once it knows;
        # failing calls at once (``ray_env``), it first says "unavailable" for every
        # death. So the restarts left decide, and Ray's word where it has one (a process
        # leaving on SIGTERM is restarted as any other that dies).
        again = not killed and (limit == -1 or rec.restarts < limit)
        if death is not None and unavailable and not isinstance(death, unavailable):
            again = False
        reason = "kill()" if killed else describe(death) if death is not None else \
            "its process got SIGTERM" if left == "leaving" else \
            "its process died (another answered in its place)"
        _events.emit(runtime, "died", rec, reason, will_restart=again)
        if not again:  # (its name is freed where Ray's word or the restarts left say it
            # is gone: not on another error of the watch itself)
            _dead_for_good(runtime, rec, killed or _ray_says_dead(death) or (
                death is None or unavailable and isinstance(death, unavailable)), reason)
            return
        client.watch_restart(rec.actor_id, runtime.loop, True)  # calls wait for it
        try:  # queued by Ray until the restarted process runs
            ok, pid = await asyncio.wait_for(ready_after_restart(host), RESTART_WAIT)
        except Exception as exc:  # the restart failed (or never came)
            if not runtime._closing:  # (a restart slow to come is not ended)
                # (a kill() that cut the restart short is named as every kill is)
                killed = key in client._dead or _ray_killed(exc)
                why = "kill()" if killed else describe(exc)
                _dead_for_good(runtime, rec, killed or _ray_says_dead(exc), why)
                _events.emit(runtime, "died", rec, why)
            return
        if not ok:  # the restarted process's __init__ raised
            err = decode_exception(pid, f"{rec.cls_name}.__init__")
            why = f"__init__ raised on restart: {err!r}"
            _dead_for_good(runtime, rec, True, why)
            _events.emit(runtime, "died", rec, why)
            return
        rec.pid = pid
        rec.restarts += 1
        client._pids[key] = pid
        client.learn_where(rec.actor_id)  # (its spawn's answer was the old process's)
        _events.emit(runtime, "restarted", rec, reason)
