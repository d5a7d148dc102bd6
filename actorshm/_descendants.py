"""The processes an actor starts end with it.

A method may start processes: a ``subprocess.Popen``, a ``multiprocessing`` pool, a
DataLoader's workers, and those may start more. Left alone they outlive the actor that
made them (they are reparented to init), holding memory, GPUs and ports after a
``kill()``, a crash or a restart. So each actor process leads a process group of its own
(``lead_own_group``, first thing at its start), which everything it starts joins unless it
leaves on purpose (``start_new_session=True``, ``setsid``). Once the driver has reaped an
actor process, for whatever reason it ended, it ends the rest of that group
(``end_group``): SIGTERM at once, so that programs may clean up (multiprocessing's
resource tracker ignores it and removes what the dead left behind), then SIGKILL after
``GRACE`` seconds for whatever is still running. A runtime's ``close`` waits for that
(``wait_all``), so that nothing an actor started outlives the runtime.

A group of its own also keeps an actor out of the terminal's foreground group: a Ctrl-C
reaches the driver alone, whose runtime then stops the actors.

The group's id is the actor's pid. The driver signals it only after reaping the actor:
then a group that still has members keeps that id from being reused, and a group with
none gives ``ProcessLookupError``, so nothing else is ever hit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

GRACE = 1.0  # seconds from SIGTERM to SIGKILL for what an actor left running

# group id -> (the time its SIGKILL is due, the loop's timer for it or None)
_ending: dict[int, tuple[float, asyncio.TimerHandle | None]] = {}


def lead_own_group() -> None:
    """In a new actor process: lead a process group of its own (before it starts any)."""
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover - already a session or group leader
        pass


def end_group(pgid: int) -> None:
    """The actor process ``pgid`` has exited and been reaped: SIGTERM what it left in its
    group now, and SIGKILL what is still there ``GRACE`` seconds later (on the running
    loop, or at the runtime's close)."""
    if pgid <= 1 or pgid in _ending:
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:  # nothing left (the common case), or not ours
        return
    try:
        timer = asyncio.get_running_loop().call_later(GRACE, _kill, pgid)
    except RuntimeError:  # no loop: ``wait_all`` or ``kill_remaining`` finishes it
        timer = None
    _ending[pgid] = (time.monotonic() + GRACE, timer)


def _kill(pgid: int) -> None:
    entry = _ending.pop(pgid, None)
    if entry is not None and entry[1] is not None:
        entry[1].cancel()
    if _has_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


async def wait_all(poll: float = 0.02) -> None:
    """Until every group being ended is empty: SIGKILL each one whose grace is over."""
    while _ending:
        now = time.monotonic()
        for pgid, (due, _) in list(_ending.items()):
            if now >= due or not _has_members(pgid):
                _kill(pgid)
        if _ending:
            await asyncio.sleep(poll)


def kill_remaining() -> None:
    """SIGKILL every group being ended, now (a runtime's close cut short)."""
    for pgid in list(_ending):
        _kill(pgid)


def kill_now(pid: int) -> None:
    """SIGKILL the live actor process ``pid`` and everything in its group, at once (a
    runtime dropped without ``close``). Its live leader keeps the id from reuse."""
    for kill in (os.killpg, os.kill):  # (the actor alone, if it has no group yet)
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _has_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running. A zombie does not count:
    it has exited, and in a container whose init reaps nobody it stays a zombie."""
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - no procfs: ask the kernel (zombies count)
        try:
            os.killpg(pgid, 0)
            return True
        except OSError:
            return False
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it exited meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
