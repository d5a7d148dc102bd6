"""Ray's tasks on an actor's event loop, and a sync method about to hold that loop.

Ray runs each task of an async actor, and the unpickling of each task's arguments, as a
coroutine on the actor's loop, started from one of its own task threads. That thread
wakes once the coroutine's last line has run, then waits, holding the thread, until the
loop has handed it the outcome: a done-callback, which runs one loop step later. A sync
method that starts holding the loop in between holds that thread as long, and with it
the tasks Ray delivers meanwhile, to the ``control`` group too. Traced: a cancel sent
0.1 s into a new actor's first 0.5 s sync method arrived only once the method ended,
and the call queued behind it started (6 in 220 tries), whenever the queued call's
arguments were unpickled on the loop in the very step the sync method started.

``TaskWatch(loop)`` keeps the tasks made on the loop (a task factory);
``await watch.settled()`` returns once every task that has ended has had its
done-callbacks run. A sync method run on the loop awaits it just before it starts.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

__all__ = ["TaskWatch"]


class TaskWatch:
    """The tasks made on ``loop`` whose done-callbacks may not all have run yet."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._live: weakref.WeakSet = weakref.WeakSet()  # (a task nobody keeps still goes)
        self._made_by = loop.get_task_factory()  # (one set before: it still makes them)
        loop.set_task_factory(self._make)

    def keep(self) -> None:
        """Stand in front of the loop's task factory again should it have changed (an
        ``__init__`` that sets its own): that one makes the tasks, and this keeps them."""
        made_by = self._loop.get_task_factory()
        if made_by != self._make:
            self._made_by = made_by
            self._loop.set_task_factory(self._make)

    def _make(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any):
        if self._made_by is not None:
            task = self._made_by(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        self._live.add(task)
        # Added before the callbacks of whoever made the task (Ray's, which hands the
        # outcome to its thread), so it runs just before them when the task ends: the
        # task is let go one step later, once they have run.
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._loop.call_soon(self._live.discard, task)

    async def settled(self) -> None:
        """Return once every task that had ended when it was called has had its
        done-callbacks run: at once as a rule; a task that ended in this loop step makes
        it wait a step or two (those that end meanwhile do not)."""
        ended = [t for t in list(self._live) if t.done()]
        while ended:
            await asyncio.sleep(0)
            ended = [t for t in ended if t in self._live]
