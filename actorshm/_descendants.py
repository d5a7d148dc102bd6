"""The processes an actor starts end with it.

A method may start processes: a ``subprocess.Popen``, a ``multiprocessing`` pool, a
DataLoader's workers, and those may start more. Left alone they outlive the actor that
made them (they are reparented to init), holding memory, GPUs and ports after a
``kill()``, a crash or a restart. So each actor process leads a session (and process
group) of its own (``lead_own_session``, first thing at its start), which everything it
starts joins unless it leaves on purpose (``start_new_session=True``, ``setsid``, a
program that makes a group of its own such as ``timeout``).

A group is ended (``end_group``) in two steps: SIGTERM to the processes found in it,
so that they may clean up (multiprocessing's resource tracker ignores SIGTERM and
removes what the dead left behind once they are gone), then, ``GRACE`` seconds later,
SIGKILL to those still running, a resource tracker last, a moment after the rest. The
processes are signalled through pidfds opened when they were found, never by a group or
process id read later, so a number reused meanwhile is never hit.

Who ends it:

- the driver, once it has reaped an actor process, whatever ended it (``kill()``, a
  crash, a restart, the runtime's close): ``Ending``, one per runtime, whose ``close``
  waits until what it signalled has exited;
- the actor itself when it loses its driver (a driver killed by a signal never closes its
  runtime) and when it exits in order: ``end_own_group``.

A session of its own also keeps an actor off the driver's terminal: a Ctrl-C or Ctrl-Z
there reaches the driver alone (its runtime stops the actors), and a program an actor
starts that opens ``/dev/tty`` gets an error (ENXIO) instead of being stopped for good
by SIGTTOU as a background job would.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import time

GRACE = 1.0  # seconds from SIGTERM to SIGKILL for what an actor left running
TRACKER_GRACE = 0.5  # then seconds a resource tracker gets to clean up after the rest


def lead_own_session() -> None:
    """In a new actor process, before it starts anything: lead a session of its own."""
    try:
        os.setsid()
    except OSError:  # pragma: no cover - already a group leader
        pass


class _Group:
    """The processes found in one ended group: ``(pidfd, is a resource tracker)``."""

    __slots__ = ("procs", "due", "phase")

    def __init__(self, procs: list) -> None:
        self.procs = procs
        self.due = time.monotonic() + GRACE
        self.phase = 0  # 0: SIGTERMed; 1: SIGKILLed but trackers; 2: all SIGKILLed

    def running(self) -> list:
        live = [p for p in self.procs if not _exited(p[0])]
        for p in self.procs:
            if p not in live:
                os.close(p[0])
        self.procs = live
        return live

    def step(self) -> bool:
        """Signal what is due; True once nothing it found is running."""
        live = self.running()
        if not live:
            return True
        if time.monotonic() >= self.due and self.phase < 2:
            trackers_wait = self.phase == 0 and any(t for _, t in live)
            for fd, tracker in live:
                if not (tracker and trackers_wait):
                    _send(fd, signal.SIGKILL)
            self.phase = 1 if trackers_wait else 2
            self.due = time.monotonic() + (TRACKER_GRACE if trackers_wait else GRACE)
        elif time.monotonic() >= self.due:  # SIGKILLed a while ago, still there (D state)
            self.close()
            return True
        return False

    def close(self) -> None:
        for fd, _ in self.procs:
            os.close(fd)
        self.procs = []


class Ending:
    """The driver's side, one per runtime: the groups of its reaped actors being ended,
    each stepped by a timer on the runtime's loop and, at close, by ``wait``."""

    def __init__(self) -> None:
        self.groups: dict[int, _Group] = {}
        self._timer: asyncio.TimerHandle | None = None

    def end(self, pgid: int) -> None:
        """Actor process ``pgid`` has exited and been reaped: SIGTERM what it left."""
        if pgid <= 1 or pgid in self.groups:
            return
        group = _signal_group(pgid, exclude=0)
        if group is not None:
            self.groups[pgid] = group
            self._schedule()

    def _schedule(self) -> None:
        if self._timer is None and self.groups:
            try:
                self._timer = asyncio.get_running_loop().call_later(0.1, self._tick)
            except RuntimeError:  # no loop: ``wait`` or ``kill`` finishes them
                pass

    def _tick(self) -> None:
        self._timer = None
        self._step()
        self._schedule()

    def _step(self) -> None:
        for pgid, group in list(self.groups.items()):
            if group.step():
                del self.groups[pgid]

    async def wait(self, poll: float = 0.02) -> None:
        """Until everything signalled has exited (a SIGKILL ``GRACE`` after SIGTERM)."""
        while self.groups:
            self._step()
            if self.groups:
                await asyncio.sleep(poll)
        self.close()

    def kill(self) -> None:
        """SIGKILL what is left at once (a close cut short, a runtime dropped)."""
        for group in self.groups.values():
            for fd, _ in group.running():
                _send(fd, signal.SIGKILL)
            group.close()
        self.groups.clear()
        self.close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def end_own_group(kill_self: bool = False) -> None:
    """In an actor process, as it exits or loses its driver: end what it started, waiting
    (at most ``GRACE`` plus ``TRACKER_GRACE``) for it; then SIGKILL itself if asked."""
    me = os.getpid()
    group = _signal_group(me, exclude=me) if os.getpgid(0) == me else None
    if group is not None:  # its resource tracker ends once it has (it holds the tracker's pipe)
        for fd, tracker in group.procs:
            if tracker:
                os.close(fd)
        group.procs = [p for p in group.procs if not p[1]]
    while group is not None and not group.step():
        time.sleep(0.02)
    if kill_self:
        os.kill(me, signal.SIGKILL)


def kill_now(pid: int) -> None:
    """SIGKILL actor process ``pid`` (running, or exited but not yet reaped, which keeps
    its number from reuse) and everything in its group, at once."""
    for kill in (os.killpg, os.kill):  # (the actor alone, if it has no group yet)
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _signal_group(pgid: int, exclude: int) -> _Group | None:
    """SIGTERM the running processes of group ``pgid`` (but ``exclude``), through pidfds
    kept for what follows; None if there are none."""
    try:
        os.killpg(pgid, 0)
    except OSError:  # nothing in it (the common case), or not ours
        return None
    procs = []
    for pid in _members(pgid):
        if pid == exclude:
            continue
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # exited meanwhile
            continue
        stat = _stat(pid)  # the pid could have been reused between the scan and the open
        if stat is None or stat[2] != pgid:
            os.close(fd)
            continue
        procs.append((fd, _is_resource_tracker(pid)))
        _send(fd, signal.SIGTERM)
    return _Group(procs) if procs else None


def _members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited (a zombie has: in a container
    whose init reaps nobody it stays one)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[2] == pgid and stat[0] not in ("Z", "X"):
                out.append(int(name))
    return out


def _stat(pid: int) -> tuple | None:
    """``(state, ppid, pgrp)`` of process ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[2])


def _is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker (it unlinks the shared memory
    and semaphores of processes that died without doing so)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _exited(pidfd: int) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def _send(pidfd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:  # it has exited
        pass
