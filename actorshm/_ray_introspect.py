"""``rt.stats()``, ``rt.memory()`` and ``rt.dump_stacks()`` on the Ray backend.

Each actor answers through its host's ``probe`` method, which Ray runs in the host's
``control`` concurrency group (a thread and event loop of its own), so an actor busy in
a sync method answers as well. What differs from the local backend: arrays passed
between actors on Ray live in Ray's object store, not in actorshm's shared memory, so
``memory()`` shows only the blocks actorshm itself holds (``actorshm.empty``/``share``
in some process) and says where to look for the rest (``ray memory``).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, TextIO

from ._introspect import (MemoryReport, check_file, check_timeout, held_blocks,
                          memory_report, stats_report)
from ._ray import CLIENT

__all__ = ["RayInspectable", "RayMemoryReport"]

OBJECT_STORE_NOTE = (
    "on the Ray backend, arrays passed to and from actors travel through Ray's object "
    "store, not actorshm shared memory: see `ray memory` (or the Ray dashboard) for them")


class RayMemoryReport(MemoryReport):
    """``RayRuntime.memory()``'s answer: a ``MemoryReport`` of actorshm's own blocks in
    each process, and a ``note`` saying that arrays passed in calls are Ray's."""

    note = OBJECT_STORE_NOTE

    def __str__(self) -> str:
        return super().__str__() + "\n" + self.note


def _label(h: Any) -> str:
    return f"actor {h._cls_name}(id={h._actor_id}, pid={h.pid})"


class RayInspectable:
    """Mixed into ``RayRuntime``: counters, memory and stacks of every live actor."""

    def _live(self) -> list:
        return [h for h in self._spawned if h._actor_id.key not in CLIENT._dead
                and h._actor_id.key not in self._given_up]

    async def _ask_all(self, what: str, timeout: float) -> tuple[list, list]:
        check_timeout(what, timeout)
        self._check_open()
        handles = self._live()

        async def ask(h):
            ref = h._actor_id.handle.probe.options(concurrency_group="control").remote(what)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
        answers = await asyncio.gather(*(ask(h) for h in handles), return_exceptions=True)
        got = [(h, a) for h, a in zip(handles, answers) if not isinstance(a, BaseException)]
        missed = [(h, a) for h, a in zip(handles, answers) if isinstance(a, BaseException)]
        return got, missed

    async def stats(self, timeout: float = 5.0) -> dict:
        """The counters of the driver and of every live actor, and their sums.

        As on the local backend (``Runtime.stats``); on Ray the shared-memory counters
        of the actors stay near zero (arrays travel through Ray's object store) and
        ``calls_received`` counts the calls each actor was sent.

        Args:
            timeout: seconds to wait for each actor's answer.

        Returns:
            ``{"driver": {...}, "actors": {actor_id: {...}}, "total": {...},
            "unresponsive": [actor_id, ...]}``.

        Raises:
            RuntimeError: the runtime is not open.
        """
        got, missed = await self._ask_all("stats", timeout)
        return stats_report([(h._actor_id, c) for h, c in got],
                            [h._actor_id for h, _ in missed])

    async def memory(self, timeout: float = 5.0) -> RayMemoryReport:
        """The actorshm shared blocks alive in the driver and each live actor.

        Arrays passed in calls on Ray are in Ray's object store, not here: the report's
        ``note`` (printed with it) says so; ``ray memory`` lists those.

        Args:
            timeout: seconds to wait for each actor's answer.

        Returns:
            A ``RayMemoryReport`` (a ``MemoryReport``).

        Raises:
            RuntimeError: the runtime is not open.
        """
        got, missed = await self._ask_all("memory", timeout)
        views = [("driver", held_blocks(()))] + [(_label(h), a) for h, a in got]
        report = memory_report(views, [_label(h) for h, _ in missed])
        return RayMemoryReport(report.rows, report.processes, report.unresponsive)

    async def dump_stacks(self, timeout: float = 5.0, file: TextIO | None = None) -> str:
        """Every live actor's Python stacks: its threads', and its pending async calls'.

        As on the local backend (``Runtime.dump_stacks``), answered by each actor's
        host in a thread of its own, so an actor stuck in a sync method shows where.
        An actor that does not answer within ``timeout`` is listed as such (Ray's own
        ``ray stack`` on its node can still show it).

        Args:
            timeout: seconds to wait for each actor's answer.
            file: where to print them (default ``sys.stderr``).

        Returns:
            The text printed.

        Raises:
            RuntimeError: the runtime is not open.
        """
        check_file(file)
        got, missed = await self._ask_all("stacks", timeout)
        parts = []
        for h, text in got:
            prefix = f"({h._cls_name} pid={h.pid}) "
            parts.append("".join(prefix + ln + "\n" for ln in
                                 [f"{_label(h)}:"] + text.rstrip("\n").split("\n")))
        for h, exc in missed:
            why = (f"no answer within {timeout} s (busy in C code holding the GIL?); "
                   "try `ray stack` on its node" if isinstance(exc, asyncio.TimeoutError)
                   else f"{exc!r}")
            parts.append(f"({h._cls_name} pid={h.pid}) {_label(h)}: {why}\n")
        text = "".join(parts)
        print(text, end="", file=file if file is not None else sys.stderr, flush=True)
        return text
