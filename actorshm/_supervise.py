"""The driver's watch over its actor processes: deaths, restarts and broken connections.

A mixin of ``Runtime``. A death is seen through the actor's pidfd and its socket
together: its pending calls fail with ``ActorDiedError`` naming the exit code or signal
(and an OOM kill where the kernel says so), a ``died`` event goes out, and an actor with
restarts left is started again behind a fresh connection, so that calls made meanwhile
wait for the new process (at-most-once, as in Ray). Start-ups that keep dying back off.

An actor dead for good (killed, out of restarts, or never started) whose driver handles
are all gone (``track_handle``: a finalizer per handle the runtime makes) is forgotten:
its record goes, and a one-line summary (id, class, pid, name, why it died) stays for
``rt.actors()`` and for calls through handles the driver did not count (one an actor
passed back, one in an event), the latest ``DEAD_KEPT`` of them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import weakref

from . import _events, _oom
from ._client import DEAD_KEPT
from ._errors import ActorDiedError
from ._launch import ActorRecord
from ._protocol import Connection
from ._util import describe_exit, first_line

logger = logging.getLogger("actorshm")



class Supervisor:
    """Death, restart and connection-loss handling for ``Runtime`` (which provides
    ``loop``, ``_actors``, ``_names``, ``_closing``, ``_kill_begun``, ``_gpus``,
    ``_forkserver`` and ``_start_process``)."""

    _gone: "collections.OrderedDict[int, dict] | None" = None  # forgotten: id -> summary
    _handles_gone: "collections.deque | None" = None  # ids whose handle died (any thread)

    # -- forgetting the dead -----------------------------------------------------
    def track_handle(self, handle, rec: ActorRecord):
        """Count ``handle`` (made by this runtime, for ``rec``) until it is collected.

        Returns:
            The handle.
        """
        if self._handles_gone is None:
            self._handles_gone = collections.deque()
        rec.handles += 1
        fin = weakref.finalize(handle, _handle_gone, weakref.ref(self), rec.actor_id)
        fin.atexit = False
        return handle

    def _sweep_handles(self) -> None:
        """Count the handles collected since (on the loop: a finalizer only queues)."""
        gone = self._handles_gone
        while gone:
            rec = self._actors.get(gone.popleft())
            if rec is not None:
                rec.handles -= 1
                self._maybe_forget(rec)

    def _maybe_forget(self, rec: ActorRecord) -> None:
        """Forget ``rec`` if it is dead for good, reaped, and no handle of ours is left."""
        if rec.handles > 0 or rec.alive or rec.has_future or rec.pidfd >= 0 \
                or self._closing or self._actors.get(rec.actor_id) is not rec:
            return
        rec.close_process(self.loop)  # (its pipes and probe, should any be left)
        del self._actors[rec.actor_id]
        name = rec.options.name
        if name is not None and self._names.get(name) == rec.actor_id:
            del self._names[name]
        if self._gone is None:
            self._gone = collections.OrderedDict()
        self._gone[rec.actor_id] = {"id": rec.actor_id, "class": rec.cls_name,
                                    "pid": rec.pid, "alive": False, "name": name,
                                    "death": rec.death}
        while len(self._gone) > DEAD_KEPT:
            self._gone.popitem(last=False)

    def forgotten(self, actor_id: int) -> dict | None:
        """The summary of forgotten dead actor ``actor_id`` (as ``actors()`` lists it),
        or None."""
        return self._gone.get(actor_id) if self._gone else None

    def reachable(self, actor_id: int) -> bool | None:
        """Whether actor ``actor_id`` lives or a restart is coming; False once it is dead
        for good (killed, out of restarts, its ``__init__`` raised on a restart, or the
        runtime closes). Should its connection be closed while a restart is coming,
        the restarts left decide, as ``_after_death`` will."""
        rec = self._actors.get(actor_id)
        if rec is None or rec.no_restart or self._closing or actor_id in self._kill_begun:
            return False  # (kill_begun: kill() was called, its task is yet to run)
        if rec.conn is not None and not rec.conn.closed:
            return True
        limit = rec.options.max_restarts
        return rec.init_error is None and (limit == -1 or rec.restarts < limit)

    def takes_calls(self, actor_id: int) -> bool:
        """Whether a call made now on ``actor_id`` runs, or waits for a restart, rather
        than failing at once: False once the actor is dead for good. (A restarted
        process that dies while starting leaves a fresh connection in its place at
        once, ``_exited``: calls made then wait for the next attempt.)"""
        rec = self._actors.get(actor_id)
        return rec is not None and rec.conn is not None and not rec.conn.closed \
            and actor_id not in self._kill_begun

    def death_of(self, actor_id: int) -> str:
        """Why actor ``actor_id`` cannot be called: its death, or that it is unknown."""
        rec = self._actors.get(actor_id)
        gone = self.forgotten(actor_id)
        why = rec.death if rec is not None else gone["death"] if gone else None
        return why or (f"no actor with id {actor_id} in this runtime: its handle comes "
                       "from another Runtime, closed or open on another thread's event "
                       "loop (a handle works only while the runtime that spawned its "
                       "actor is open, and in actors of runtimes on that runtime's "
                       "loop), or the actor ended long ago")

    def connection_leaving(self, conn: Connection) -> None:
        """The actor on ``conn`` began to stop (``Host``; ``LEAVING``): it starts no call
        from now on, so the calls made from now on wait for its restart, if one comes."""
        rec = self._actors.get(conn.peer_id)
        if rec is not None and rec.conn is conn:
            self._hold_calls_for_restart(rec)

    def _hold_calls_for_restart(self, rec: ActorRecord) -> None:
        """``rec``'s process is ending (it stops, or its connection ended): if a restart
        follows, the calls made from now on wait for it in a fresh connection, as those
        made after its exit do (its own would fail them), and ``ended_conn`` keeps its
        connection to its exit (``_exited``)."""
        if rec.alive and not rec.starting and rec.ended_conn is None \
                and self.may_restart(rec):
            rec.ended_conn = rec.conn
            self._fresh_connection(rec)

    def connection_eof(self, conn: Connection) -> None:
        """An actor's connection broke (``Host``): close it once its process is gone."""
        rec = self._actors.get(conn.peer_id)
        ours = rec is not None and (rec.conn is conn or rec.ended_conn is conn)
        if ours and rec.alive:
            # The process is exiting; give its pidfd a moment to tell us how.
            self.loop.create_task(self._await_exit_then_close(rec, conn))
        elif ours and rec.death:
            conn.close(ActorDiedError(rec.death))  # (read to its end after the death)
        else:
            conn.close()

    async def _await_exit_then_close(self, rec: ActorRecord, conn: Connection) -> None:
        # An actor that stops (``sys.exit``, or its runtime's close) closes its connection
        # before its atexit functions run, having said how long they may take (it exits
        # then: ``_actor_process``); one that said nothing closed it by mistake (or had
        # no thread for its timer), and is killed 0.3 s on, so that a restart comes.
        conn.drain()  # (a write may have found it closed before its last frames were read)
        if rec.conn is conn:
            self._hold_calls_for_restart(rec)
        wait = 0.3 if conn.leaving is None else conn.leaving + 1.0
        try:
            await asyncio.wait_for(rec.exited.wait(), wait)
            return
        except asyncio.TimeoutError:
            pass
        if self._closing:
            # Stopping with its runtime: ``close`` gives it the grace (it waits for the
            # exit, then SIGTERM, SIGKILL).
            return
        why = (f"{rec.label} closed its connection" if conn.leaving is None else
               f"{rec.label} was killed: its clean-up (atexit functions) did not end "
               f"within {wait:.3g} s of closing its connection")
        if rec.send_signal(signal.SIGKILL):  # (not once its exit is seen: see there)
            rec.death = rec.death or why  # (its exit, next, reports it)
        conn.close(ActorDiedError(rec.death or why))

    def connection_closed(self, conn: Connection) -> None:
        """An actor's connection closed (``Host``)."""
        rec = self._actors.get(conn.peer_id)
        if rec is not None and rec.conn is conn and rec.alive and not self._closing:
            # The connection broke (protocol error): the actor is unusable.
            rec.send_signal(signal.SIGKILL)

    # -- death and shutdown ------------------------------------------------------
    def _on_exit(self, rec: ActorRecord) -> None:
        rec.unwatch_exit(self.loop)
        if rec.popen is not None:
            code = rec.popen.wait()
            self._ending.end(rec.pid)  # what it started goes too
            self._exited(rec, code)
        else:  # a forked child: its exit code comes from the fork server
            # (which has reaped it: what is left of its group is watched now, not once
            # the exit code comes, up to a second later)
            self._ending.end(rec.pid)
            self.loop.create_task(self._forkserver.exit_code(rec.pid)).add_done_callback(
                lambda f: f.cancelled() or self._forked_exited(rec, f.result()))

    def _forked_exited(self, rec: ActorRecord, code: int | None) -> None:
        if code is None and self._forkserver.orphan(rec.pid) and rec.death is None:
            rec.death = (f"{rec.label} died; its exit status is unknown: the fork server "
                         "that started it had died")
        self._exited(rec, code)

    def _exited(self, rec: ActorRecord, code: int | None) -> None:
        """Its process has exited and been reaped (``code``: its exit code, or None)."""
        rec.alive = False
        why = rec.death or f"{rec.label} died: {describe_exit(code)}" \
            f"{_oom.oom_note(rec, code)}"
        if self._closing and rec.death is None and not rec.stopping:
            why = f"{rec.label} was stopped because its runtime closed"
        rec.death = why
        self._gpus.release(rec)
        rec.close_probe()  # (a restart gets a fresh one)
        rec.free_budget_slot()
        for fwd in rec.pipes:
            fwd.drain()
        # (its ending process's connection, moved aside for calls that wait for a restart)
        conn = rec.ended_conn if rec.ended_conn is not None else rec.conn
        if conn is not None:
            conn.drain()  # what it wrote before it died: replies, releases, notices
            conn.close(ActorDiedError(why))
        rec.ended_conn = None
        rec.exited.set()
        if rec.starting and not self._closing and not rec.no_restart:
            # A restart's process ended while starting: ``_restart`` learns why. Until
            # it decides, calls made wait for the next attempt in a fresh connection (and
            # with it the record, its name and its handles stay the actor's own), if
            # one may come.
            if self.may_restart(rec):
                self._fresh_connection(rec)
            return
        self._after_death(rec, why)

    def _fresh_connection(self, rec: ActorRecord) -> None:
        """Give ``rec`` a connection that holds calls until its next process attaches
        (one not yet attached, if it has one)."""
        if rec.conn is None or rec.conn.closed or rec.conn.sock is not None:
            rec.conn = Connection(self.loop, self, label=rec.label)
            rec.conn.peer_id = rec.actor_id

    def _after_death(self, rec: ActorRecord, why: str) -> None:
        """Its process is gone: say so, and restart it if it may."""
        rec.death_told = True
        restart = self.may_restart(rec)
        _events.emit(self, "died", rec, why, will_restart=restart)
        if not restart:
            if rec.conn is not None and not rec.conn.closed and rec.conn.sock is None:
                rec.conn.close(ActorDiedError(why))  # (calls that waited for a restart)
            self._maybe_forget(rec)
        else:
            # Calls made from now on wait in a fresh connection for the new process;
            # the ones that were pending have failed (at-most-once, as in Ray).
            rec.restarts += 1
            self._fresh_connection(rec)
            self.loop.create_task(self._restart(rec, why))

    def may_restart(self, rec: ActorRecord) -> bool:
        """Whether ``rec``'s death, now, restarts it. (A spawn that failed, was cancelled
        or timed out raised to its caller: nothing of it restarts, and its ``__init__``
        does not run again, as in Ray.)"""
        limit = rec.options.max_restarts
        return (rec.spawned and not self._closing and not rec.no_restart
                and (limit == -1 or rec.restarts < limit))

    async def _restart(self, rec: ActorRecord, why: str) -> None:
        conn = rec.conn  # this attempt's; a death during start-up makes the next one's
        if rec.failed_starts:  # back off while new processes keep dying as they start
            await asyncio.sleep(min(5.0, 0.05 * 2 ** rec.failed_starts))
        if self._closing or rec.no_restart:  # closed or killed meanwhile
            if rec.conn is conn and conn is not None:
                conn.close(ActorDiedError(rec.death or f"{rec.label} was stopped"))
            return
        try:
            rec.death = None
            rec.death_told = False  # (this attempt's death is yet to be reported)
            rec.init_error = None
            if rec.options.num_gpus:
                rec.gpus = self._gpus.take(rec.options.num_gpus, rec.cls_name)
            rec.starting = True
            try:
                await self._start_process(rec)
            finally:
                rec.starting = False
            if rec.alive and rec.conn is not None and rec.conn.leaving is not None:
                self._hold_calls_for_restart(rec)  # (its LEAVING came while it started)
            if not rec.alive and not rec.death_told:  # it answered, then exited at once
                self._after_death(rec, rec.death)
                return
            rec.failed_starts = 0
            if rec.no_restart:  # killed while it was starting
                rec.death = rec.killed
                rec.send_signal(signal.SIGKILL)
                return
            if self._closing:  # the runtime began to close meanwhile: it stops this
                return  # process with the others (no "restarted" said of it, no event)
            logger.warning("actorshm: restarted %s (restart %d of %s) after: %s", rec.label,
                           rec.restarts, _limit(rec), first_line(why))
            _events.emit(self, "restarted", rec, why)
        except BaseException as exc:
            await self._restart_failed(rec, why, exc)

    async def _restart_failed(self, rec: ActorRecord, why: str, exc: BaseException) -> None:
        """A restart's start failed. If its ``__init__`` raised, the actor is dead for good
        (as at spawn, and as in Ray: a constructor that raises is not run again), and the
        calls waiting for it fail with why. Otherwise (its process died or hung while
        starting, or none could be started) it counts as a restart, and the next one waits
        a little longer. The death is reported once: by the process's exit when it is
        still alive, else here (an exit seen while starting was left to us)."""
        init_raised = exc is rec.init_error
        rec.init_error = None
        if init_raised:
            rec.no_restart = True
            rec.death = (f"{rec.label} could not be restarted: {first_line(str(exc))} "
                         f"(after: {first_line(why)})")
            if rec.conn is not None:
                rec.conn.close(ActorDiedError(rec.death))
        elif not (self._closing or rec.no_restart):
            rec.failed_starts += 1
            logger.warning("actorshm: restart %d of %s of %s failed while starting: %s",
                           rec.restarts, _limit(rec), rec.label, first_line(str(exc)))
            rec.death = rec.death or (f"{rec.label}: restart {rec.restarts} failed while "
                                      f"starting: {first_line(str(exc))}")
        if rec.alive:
            await rec.stop(0.5)  # its exit reports the death (and restarts it if it may)
        elif not rec.death_told:
            why = rec.death or f"{rec.label} was stopped"
            self._gpus.release(rec)
            rec.close_probe()
            rec.free_budget_slot()
            if rec.conn is not None and not rec.conn.closed and rec.conn.sock is not None:
                rec.conn.close(ActorDiedError(why))  # (one not attached holds the calls
            self._after_death(rec, why)  # made since, for the next attempt, or fails them)

    def _reap(self, rec: ActorRecord) -> None:
        rec.close_process(self.loop)
        rec.alive = False
        for conn in rec.open_conns:
            conn.close(ActorDiedError(rec.death or f"{rec.label} was stopped"))
        rec.ended_conn = None


def _limit(rec: ActorRecord) -> str:
    n = rec.options.max_restarts
    return "unlimited" if n == -1 else str(n)


def _handle_gone(rt_ref, actor_id: int) -> None:
    """A handle's finalizer (any thread, any moment): queue its actor for a count on
    the loop, never touching the runtime's dicts here."""
    rt = rt_ref()
    if rt is None:
        return
    rt._handles_gone.append(actor_id)
    loop = rt.loop
    if loop is not None and not loop.is_closed():
        try:
            loop.call_soon_threadsafe(rt._sweep_handles)
        except RuntimeError:  # the loop closed meanwhile
            pass
