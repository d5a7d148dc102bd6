"""The driver's watch over its actor processes: deaths, restarts and broken connections.

A mixin of ``Runtime``. A death is seen through the actor's pidfd and its socket
together: its pending calls fail with ``ActorDiedError`` naming the exit code or signal
(and an OOM kill where the kernel says so), a ``died`` event goes out, and an actor with
restarts left is started again behind a fresh connection, so that calls made meanwhile
wait for the new process (at-most-once, as in Ray). Start-ups that keep dying back off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from . import _events, _introspect
from ._errors import ActorDiedError
from ._launch import ActorRecord
from ._protocol import Connection
from ._util import describe_exit, first_line

logger = logging.getLogger("actorshm")


class Supervisor:
    """Death, restart and connection-loss handling for ``Runtime`` (which provides
    ``loop``, ``_actors``, ``_closing``, ``_gpus``, ``_forkserver`` and ``_start_process``)."""

    def connection_eof(self, conn: Connection) -> None:
        """An actor's connection broke (``Host``): close it once its process is gone."""
        rec = self._actors.get(conn.peer_id)
        if rec is not None and rec.conn is conn and rec.alive:
            # The process is exiting; give its pidfd a moment to tell us how.
            self.loop.create_task(self._await_exit_then_close(rec))
        elif rec is not None and rec.conn is conn and rec.death:
            conn.close(ActorDiedError(rec.death))  # (read to its end after the death)
        else:
            conn.close()

    async def _await_exit_then_close(self, rec: ActorRecord) -> None:
        try:
            await asyncio.wait_for(rec.exited.wait(), 0.3)
        except asyncio.TimeoutError:
            if rec.conn is not None:
                rec.conn.close(ActorDiedError(f"{rec.label} closed its connection"))
            try:
                os.kill(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def connection_closed(self, conn: Connection) -> None:
        """An actor's connection closed (``Host``)."""
        rec = self._actors.get(conn.peer_id)
        if rec is not None and rec.conn is conn and rec.alive and not self._closing:
            # The connection broke (protocol error): the actor is unusable.
            try:
                os.kill(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- death and shutdown ------------------------------------------------------
    def _on_exit(self, rec: ActorRecord) -> None:
        rec.unwatch_exit(self.loop)
        if rec.popen is not None:
            self._exited(rec, rec.popen.wait())
        else:  # a forked child: its exit code comes from the fork server
            self.loop.create_task(self._forkserver.exit_code(rec.pid)).add_done_callback(
                lambda f: f.cancelled() or self._exited(rec, f.result()))

    def _exited(self, rec: ActorRecord, code: int | None) -> None:
        rec.alive = False
        why = rec.death or f"{rec.label} died: {describe_exit(code)}" \
            f"{_introspect.oom_note(rec, code)}"
        if self._closing and rec.death is None:
            why = f"{rec.label} was stopped because its runtime closed"
        rec.death = why
        self._gpus.release(rec)
        rec.close_probe()  # (a restart gets a fresh one)
        for fwd in rec.pipes:
            fwd.drain()
        if rec.conn is not None:
            rec.conn.drain()  # what it wrote before it died: replies, releases, notices
            rec.conn.close(ActorDiedError(why))
        rec.exited.set()
        limit = rec.options.max_restarts
        restart = (not self._closing and not rec.no_restart
                   and (limit == -1 or rec.restarts < limit))
        _events.emit(self, "died", rec, why, will_restart=restart)
        if restart:
            # Calls made from now on wait in a fresh connection for the new process;
            # the ones that were pending have failed (at-most-once, as in Ray).
            rec.restarts += 1
            rec.conn = Connection(self.loop, self, label=rec.label)
            rec.conn.peer_id = rec.actor_id
            self.loop.create_task(self._restart(rec, why))

    async def _restart(self, rec: ActorRecord, why: str) -> None:
        conn = rec.conn  # this attempt's; a death during start-up makes the next one's
        if rec.failed_starts:  # back off while new processes keep dying as they start
            await asyncio.sleep(min(5.0, 0.05 * 2 ** rec.failed_starts))
        if self._closing or rec.no_restart:  # closed or killed meanwhile
            if rec.conn is conn and conn is not None:
                conn.close(ActorDiedError(rec.death or f"{rec.label} was stopped"))
            return
        try:
            if rec.options.num_gpus:
                rec.gpus = self._gpus.take(rec.options.num_gpus, rec.cls_name)
            rec.death = None
            await self._start_process(rec)
            rec.failed_starts = 0
            if rec.no_restart:  # killed while it was starting
                rec.death = f"{rec.label} was killed by actorshm kill()"
                os.kill(rec.pid, signal.SIGKILL)
                return
            logger.warning("actorshm: restarted %s (restart %d of %s) after: %s", rec.label,
                           rec.restarts, rec.options.max_restarts, first_line(why))
            _events.emit(self, "restarted", rec, why)
        except BaseException as exc:
            if rec.conn is not conn:
                # The new process died while starting; the next restart is on its way.
                rec.failed_starts += 1
                logger.warning("actorshm: restart %d of %s of %s failed while starting: %s",
                               rec.restarts - 1, rec.options.max_restarts, rec.label,
                               first_line(str(exc)))
                return
            rec.death = (f"{rec.label} could not be restarted: {first_line(str(exc))} "
                         f"(after: {first_line(why)})")
            if rec.conn is not None:
                rec.conn.close(ActorDiedError(rec.death))
            if rec.alive:
                await rec.stop(0.5)

    def _reap(self, rec: ActorRecord) -> None:
        rec.close_process(self.loop)
        rec.alive = False
        if rec.conn is not None and not rec.conn.closed:
            rec.conn.close(ActorDiedError(rec.death or f"{rec.label} was stopped"))
