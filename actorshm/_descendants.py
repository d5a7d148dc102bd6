"""The processes an actor starts end with it, and an actor ends with its driver.

A method may start processes: a ``subprocess.Popen``, a ``multiprocessing`` pool, a
DataLoader's workers, and those may start more. Left alone they outlive the actor that
made them (they are reparented to init), holding memory, GPUs and ports after a
``kill()``, a crash or a restart. So each actor process leads a session (and process
group) of its own, which everything it starts joins unless it leaves on purpose
(``start_new_session=True``, ``setsid``, a program that makes a group of its own such as
``timeout``); and before anything else it forks a watchdog into that group
(``start_watchdog``).

The watchdog is a small process that waits on two pidfds, the actor's and the driver's.
When either exits it ends the group: SIGTERM to all of it (the actor too, if its driver
died), so that programs may clean up (multiprocessing's resource tracker ignores SIGTERM
and removes what the dead left behind), then, ``GRACE`` seconds later, SIGKILL to what
still runs, a resource tracker last, ``TRACKER_GRACE`` seconds after the rest. It needs no
GIL of the actor's (an actor stuck in a C call still dies), sees what is forked late (the
last SIGKILL goes to the whole group), and outlives a driver killed by any signal. While
it lives it is a member of the group, so the group's id cannot be reused: nothing else is
ever signalled.

The driver waits for it: once it has reaped an actor process, it keeps pidfds of what is
left in the actor's group (the watchdog among them) in its runtime's ``Ending``, whose
``wait`` (at ``close()``) returns when they have exited; what outlives the watchdog's
time (it was killed) is SIGKILLed there.

A session of its own also keeps an actor off the driver's terminal: a Ctrl-C or Ctrl-Z
there reaches the driver alone (its runtime stops the actors), and a program an actor
starts that opens ``/dev/tty`` gets an error (ENXIO) instead of being stopped for good
by SIGTTOU as a background job would.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import signal
import time

GRACE = 1.0  # seconds from SIGTERM to SIGKILL for what an actor left running
TRACKER_GRACE = 0.5  # then seconds a resource tracker gets to clean up after the rest
_POLL = 0.02
_POLL_NO_PIDFD = 0.1  # how often a watchdog without pidfds looks at the two processes


_started = False


def start_watchdog() -> None:
    """In a new actor process, before it starts a thread (a spawned one calls this from
    its bootstrap, before numpy is imported): lead a session of its own, and fork the
    watchdog that ends it when this process or the driver exits. The driver and the
    expected parent (the driver, or the fork server) are named in the environment
    (``ACTORSHM_DRIVER_PID``, ``ACTORSHM_PARENT_PID``). Exits at once if the parent is
    gone already. Once per process."""
    global _started
    if _started:
        return
    _started = True
    try:
        os.setsid()
    except OSError:  # pragma: no cover - already a group leader
        pass
    try:
        driver = _watchable(int(os.environ.pop("ACTORSHM_DRIVER_PID")))
    except ProcessLookupError:  # the driver is gone
        os._exit(1)
    if os.getppid() != int(os.environ.pop("ACTORSHM_PARENT_PID")):
        os._exit(1)  # its parent died before the pidfd was open: the pid may be another's
    group = os.getpid()
    if os.getpgid(0) != group:  # pragma: no cover - it leads no group of its own
        _close([w for w in (driver,) if isinstance(w, int)])
        return  # (the group it is in is another's: never signal that)
    actor = _watchable(os.getpid())
    # Forked twice, so that it is not the actor's child: code in the actor that waits
    # for or kills all its children (``os.wait()``, a library's clean-up) never meets it.
    try:
        middle = os.fork()
    except OSError as exc:  # (a limit on processes): say so, as a spawn's fork would
        os.write(2, f"actorshm: cannot start the actor's watchdog process: fork failed "
                    f"({exc.strerror}): the limit on processes may be reached (ulimit -u, "
                    f"or a container's pids.max): end processes you no longer need, or "
                    f"raise the limit\n".encode())
        os._exit(1)
    if middle == 0:
        try:
            if os.fork() == 0:
                _watch(actor, driver, group)
        finally:
            os._exit(0)
    os.waitpid(middle, 0)
    _close([w for w in (driver, actor) if isinstance(w, int)])


def _watchable(pid: int) -> int | tuple[int, bytes]:
    """What tells when running process ``pid`` exits: its pidfd, or, where the kernel
    gives none (before 5.3, or a seccomp filter that refuses the call, as Docker's did
    before 20.10), its number and start time, which the watchdog polls. Raises
    ``ProcessLookupError`` if it is gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):
        start = process_start(pid)
        if start is None:
            raise ProcessLookupError(pid) from None
        return pid, start


def _watch(actor: int | tuple, driver: int | tuple, group: int) -> None:
    """The watchdog: wait for the actor (``actor``, ``driver``: see ``_watchable``) or the
    driver to exit, then end ``group``, the one the actor leads (its id is the actor's
    pid)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # (its own group's SIGTERM among them)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # hold none of the actor's pipes or sockets open
        os.dup2(null, fd)
    pidfds = [w for w in (actor, driver) if isinstance(w, int)]
    polled = [w for w in (actor, driver) if not isinstance(w, int)]
    keep = sorted({0, 1, 2, *pidfds})
    for lo, hi in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(lo + 1, hi)
    p = select.poll()
    for fd in pidfds:
        p.register(fd, select.POLLIN)
    timeout = _POLL_NO_PIDFD * 1000 if polled else None
    while not p.poll(timeout):
        if any(process_start(pid) != start for pid, start in polled):
            break  # (exited: gone, a zombie, or its number another's)
    _end(group)


def _end(pgid: int) -> None:
    """End group ``pgid`` (the watchdog's own): SIGTERM, then SIGKILL after the grace."""
    me = os.getpid()
    os.killpg(pgid, signal.SIGTERM)
    if not os.path.isdir("/proc"):  # (its members cannot be named: all get the grace)
        time.sleep(GRACE + TRACKER_GRACE)
        os.killpg(pgid, signal.SIGKILL)
    due, trackers_last = time.monotonic() + GRACE, True
    while any(pid != me for pid in _members(pgid)):
        if time.monotonic() >= due:
            if not trackers_last:
                break
            trackers_last = False  # SIGKILL the rest now, the trackers after a moment
            if have_pidfds():
                for pid, fd in _open_members(pgid, pairs=True):
                    if pid != me and not _is_resource_tracker(pid):
                        _send(fd, signal.SIGKILL)
                    os.close(fd)
            else:  # by number, each checked a member just before (this process, a
                for pid in _members(pgid):  # member, keeps the group's id from reuse)
                    if pid != me and not _is_resource_tracker(pid):
                        _kill_member(pid, pgid)
            due = time.monotonic() + TRACKER_GRACE
        time.sleep(_POLL)
    os.killpg(pgid, signal.SIGKILL)  # what is left, this watchdog last


class Ending:
    """The driver's side, one per runtime: what the groups of its reaped actors still
    hold, until it has exited. Their watchdogs end them; the runtime's loop watches each
    process's pidfd (closed, and the process reaped if it is ours, as soon as it exits),
    SIGKILLs what outlives ``DEADLINE`` (the watchdog was killed), and ``wait`` (at
    ``close()``) returns once nothing is left."""

    # The watchdog's time, and a margin: what is still there then was missed by it.
    DEADLINE = GRACE + TRACKER_GRACE + 1.0

    def __init__(self) -> None:
        self.groups: dict[int, tuple[list[int], asyncio.TimerHandle]] = {}  # pgid ->
        self._loop: asyncio.AbstractEventLoop | None = None       # (pidfds, deadline)
        self._idle: asyncio.Future | None = None  # (``wait``: set once groups is empty)

    def end(self, pgid: int) -> None:
        """Actor process ``pgid`` has exited (on the runtime's loop; reaped, or its fork
        server's to reap): watch what is left in its group."""
        if pgid <= 1 or pgid in self.groups:
            return
        stat = _stat(pgid)
        if stat is not None and stat[0] not in ("Z", "X"):
            # A process runs with its number: not the actor (it has exited), so its
            # number was reused (a fork server reaps at once); the group of that id is
            # another's, if any. (The actor's own group, its watchdog in it, keeps the
            # number from reuse while it has members.)
            return
        if not have_pidfds():  # (looked at every ``_POLL_NO_PIDFD`` s instead)
            self._loop = loop = asyncio.get_running_loop()
            self._look(pgid, loop.time() + self.DEADLINE)
            return
        fds = _open_members(pgid, reap=True)
        if not fds:
            return
        self._loop = loop = asyncio.get_running_loop()
        self.groups[pgid] = (fds, loop.call_later(self.DEADLINE, self._overdue, pgid))
        for fd in fds:
            loop.add_reader(fd, self._exited, pgid, fd)

    def _look(self, pgid: int, due: float) -> None:
        """Without pidfds: whether group ``pgid`` has ended (its exited members that
        are ours reaped on the way), SIGKILLing it once ``due``."""
        self.groups.pop(pgid, None)
        again = False
        try:
            if _reused(pgid) or not _members(pgid, zombies_of=os.getpid()):
                pass
            elif self._loop.time() >= due:
                _kill_group(pgid)
            else:
                again = True
        finally:
            if again:
                self.groups[pgid] = (None, self._loop.call_later(
                    _POLL_NO_PIDFD, self._look, pgid, due))
            else:
                self._forget(pgid)

    def _exited(self, pgid: int, fd: int) -> None:
        entry = self.groups.get(pgid)
        if entry is None or fd not in entry[0]:
            return  # (already forgotten: a callback queued before its reader went)
        fds = entry[0]
        self._loop.remove_reader(fd)
        _reap(fd)
        os.close(fd)
        fds.remove(fd)
        if not fds:
            self._forget(pgid)

    def _overdue(self, pgid: int) -> None:
        for fd in self.groups[pgid][0]:
            _send(fd, signal.SIGKILL)
        self._forget(pgid)  # (a process stuck in the kernel is not waited for)

    def _forget(self, pgid: int) -> None:
        fds, timer = self.groups.pop(pgid, ([], None))
        try:
            if timer is not None:
                timer.cancel()
            for fd in fds or ():
                self._loop.remove_reader(fd)
        except Exception:  # pragma: no cover - the loop is closed (a finalizer)
            pass
        _close(fds or [])
        if not self.groups and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def wait(self) -> None:
        """Until what it watches has exited (at most ``DEADLINE`` and a SIGKILL)."""
        if self.groups:
            if self._idle is None or self._idle.done():
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)

    def kill(self) -> None:
        """SIGKILL what is left at once (a close cut short, a runtime dropped)."""
        for pgid in list(self.groups):
            fds = self.groups[pgid][0]
            if fds is None:  # (watched without pidfds)
                _kill_group(pgid)
            for fd in fds or ():
                _send(fd, signal.SIGKILL)
            self._forget(pgid)


_pidfds: bool | None = None


def have_pidfds() -> bool:
    """Whether this kernel gives pidfds (Linux 5.3 and later, unless a seccomp filter
    refuses them, as Docker's default one did before 20.10)."""
    global _pidfds
    if _pidfds is None:
        try:
            os.close(os.pidfd_open(os.getpid()))
            _pidfds = True
        except (AttributeError, OSError):
            _pidfds = False
    return _pidfds


def _kill_member(pid: int, pgid: int) -> None:
    """SIGKILL process ``pid`` by its number if it is still a member of group ``pgid``
    (without pidfds: the check and the kill leave a moment for its number's reuse)."""
    stat = _stat(pid)
    if stat is not None and stat[2] == pgid and stat[0] not in ("Z", "X"):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _reused(pgid: int) -> bool:
    """Whether a running process has number ``pgid``: not the ended actor (reaped or a
    zombie), so the group of that id, if any, is another's."""
    stat = _stat(pgid)
    return stat is not None and stat[0] not in ("Z", "X")


def _kill_group(pgid: int) -> None:
    """SIGKILL group ``pgid`` where it still has members that have not exited (their
    being there keeps its id from reuse), and no running process has its number (the
    group emptied and the id went to a new process's group)."""
    if not _reused(pgid) and _members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


def kill_now(pid: int) -> None:
    """SIGKILL actor process ``pid`` (running, or exited but not yet reaped, which keeps
    its number from reuse) and everything in its group, watchdog included, at once."""
    for kill in (os.killpg, os.kill):  # (the actor alone, if it has no group yet)
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _open_members(pgid: int, pairs: bool = False, reap: bool = False) -> list:
    """Pidfds of the running processes of group ``pgid`` (``(pid, pidfd)`` pairs if
    ``pairs``). ``reap``: reap its members that have exited and are this process's
    children (see ``_running``)."""
    try:
        os.killpg(pgid, 0)
    except OSError:  # nothing in it, or not ours
        return []
    fds = []
    for pid in _members(pgid, zombies_of=os.getpid() if reap else None):
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # exited meanwhile
            continue
        stat = _stat(pid)  # the pid could have been reused between the scan and the open
        if stat is None or stat[2] != pgid:
            os.close(fd)
        else:
            fds.append((pid, fd) if pairs else fd)
    return fds


def _members(pgid: int, zombies_of: int | None = None) -> list[int]:
    """The processes of group ``pgid`` that have not exited (a zombie has: in a container
    whose init reaps nobody it stays one). Those that have and are children of process
    ``zombies_of`` (this one) are reaped on the way."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (a chroot or sandbox without it): none can be named
        return out
    for name in names:
        if name.isdigit():
            # (getpgid first: a system call, where reading each process's stat file
            # took 16x as long, 60 ms a scan on a machine running 3,000 processes)
            try:
                if os.getpgid(int(name)) != pgid:
                    continue
            except OSError:  # exited meanwhile
                continue
            stat = _stat(int(name))
            if stat is None or stat[2] != pgid:
                continue
            if stat[0] not in ("Z", "X"):
                out.append(int(name))
            elif stat[1] == zombies_of:
                try:
                    os.waitpid(int(name), os.WNOHANG)
                except ChildProcessError:
                    pass
    return out


def _stat_fields(pid: int) -> list | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None
    if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def _stat(pid: int) -> tuple | None:
    """``(state, ppid, pgrp)`` of process ``pid``, or None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[2])


def process_start(pid: int) -> bytes | None:
    """When process ``pid`` of this machine started (clock ticks since boot), or None when
    there is none (or only its zombie): what tells a process from a later one given the
    same pid."""
    fields = _stat_fields(pid) if pid else None
    if fields is None or fields[0] in (b"Z", b"X"):
        return None
    return fields[19]


def machine() -> tuple | None:
    """What tells this machine and pid namespace from another: ``(boot id, inode of the
    pid namespace)``, or None where /proc does not say. A pid and its start time name
    one process only where this is the same (a Ray actor on another node, or in another
    container, may have the number of one of ours)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, Ctrl-Z, a debugger's stop)."""
    fields = _stat_fields(pid) if pid else None
    return fields is not None and fields[0] in (b"T", b"t")


def _is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker (it unlinks the shared memory
    and semaphores of processes that died without doing so)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _reap(pidfd: int) -> None:
    """Reap the exited process of ``pidfd`` if it is this process's child (orphans come
    to a driver that is PID 1 or a subreaper: the watchdog always, as it is forked
    twice)."""
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except (OSError, AttributeError):  # not ours to reap (no P_PIDFD: Python < 3.9)
        pass


def _send(pidfd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:  # it has exited
        pass


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:  # (closed already, by code that held a stale fd number:
            if exc.errno != errno.EBADF:  # the runtime's close must still end)
                raise
