"""The calls a Ray runtime keeps pending on each actor's host, and SIGTERM.

The runtime that spawned an actor on Ray learns of its death and of the actors it spawns
from two calls it keeps pending on the actor's host (``_ray_events``): ``watch_death``,
which Ray fails when the process dies, and ``next_children``, which answers once the
actor has spawned actors. Both wait in the host (``park``) until woken.

A Ray worker that gets SIGTERM raises ``SystemExit`` from its signal handler and then
waits for every call in flight to end before its process exits, so a call kept pending
forever would keep it from ever leaving: the actor would answer nothing and die never
(its callers would hang). So the host hooks Ray's exit on SIGTERM: when the process
starts leaving, both calls return; the runtime takes it as the process's death (and
waits for the restarted one where restarts are left), and the process leaves as any
Ray actor does. A ``watch_death`` sent to a process already leaving runs on the one
restarted in its place: it names the process it watches, and returns at once there.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

__all__ = ["Watched"]


class Watched:
    """What the host of an actor answers to its runtime's watchers (a mixin of
    ``_ray_host.Host``)."""

    def _watched(self, client: Any) -> None:
        """Set up (from the host's ``__init__``): hear of spawns and of SIGTERM."""
        self._children: list = []  # (handle, options) spawned here, for ``next_children``
        self._parked: list = []  # (loop, future) of the calls waiting in ``_park``
        self._park_lock = threading.Lock()
        self._leaving = False
        client.on_spawn(self._child_spawned)
        _on_leaving(self._leave)

    async def watch_death(self, pid: int | None = None) -> str:
        """Returns ``"leaving"`` once the process starts leaving (SIGTERM), or
        ``"replaced"`` at once when this is not process ``pid`` (the one the caller
        watches died, and Ray ran this call on the process restarted in its place):
        until then the runtime that spawned the actor keeps this call pending, and Ray
        failing it tells that runtime of the process's death (lifecycle events)."""
        if pid is not None and pid != os.getpid():
            return "replaced"
        while not self._leaving:
            await self._park(lambda: self._leaving)
        return "leaving"

    async def next_children(self) -> list:
        """The actors spawned in this actor since the last call, once there are any
        (none once the process is leaving): the runtime keeps this call pending to watch
        them too (lifecycle events)."""
        while not self._children and not self._leaving:
            await self._park(lambda: self._children or self._leaving)
        out, self._children = self._children, []
        return out

    def _child_spawned(self, handle: Any, options: Any) -> None:
        self._children.append((handle, options))
        self._wake()

    def _leave(self) -> None:
        self._leaving = True
        self._wake()

    async def _park(self, ready) -> None:
        """Wait for the next ``_wake``, unless ``ready()`` already (checked under the
        lock that ``_wake`` takes, so that a wake from another thread is never lost)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._park_lock:
            if ready():
                return
            self._parked.append((loop, fut))
        await fut

    def _wake(self) -> None:
        """Let every parked call look again (from any thread)."""
        with self._park_lock:
            parked, self._parked = self._parked, []
        for loop, fut in parked:
            try:
                loop.call_soon_threadsafe(_settle, fut)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _on_leaving(callback) -> None:
    """Call ``callback()`` when this Ray worker starts leaving on SIGTERM.

    Ray's worker handles SIGTERM by calling ``raise_sys_exit_with_custom_error_message``
    of ``ray._private.worker``; actorshm wraps that function (once per process). A Ray
    without it leaves SIGTERM as that Ray handles it.
    """
    try:
        from ray._private import worker
        raise_exit = worker.raise_sys_exit_with_custom_error_message
    except (ImportError, AttributeError):  # pragma: no cover - another Ray
        return
    callbacks = getattr(raise_exit, "actorshm_callbacks", None)
    if callbacks is None:
        callbacks = []

        def leaving(*args, **kwargs):
            for cb in list(callbacks):
                try:
                    cb()
                except Exception:  # pragma: no cover - leaving anyway
                    pass
            return raise_exit(*args, **kwargs)

        leaving.actorshm_callbacks = callbacks
        worker.raise_sys_exit_with_custom_error_message = leaving
    callbacks.append(callback)
