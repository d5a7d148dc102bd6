"""Why the kernel killed an actor: an OOM kill named in its death message.

Read from the kernel log where this process may read it (``/dev/kmsg``), else from the
OOM-kill count of the actor's memory cgroup, compared with its count at start-up.
"""

from __future__ import annotations

import os
import signal


def memory_events_path(pid: int) -> str | None:
    """The file that counts OOM kills in ``pid``'s memory cgroup (``memory.events`` on
    cgroup v2, ``memory.oom_control`` on v1), or None where there is none."""
    for proc in (f"/proc/{pid}/cgroup", "/proc/self/cgroup") if pid else ("/proc/self/cgroup",):
        try:
            with open(proc) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                cand = f"/sys/fs/cgroup/memory{path}/memory.oom_control"
            elif controllers == "":
                cand = f"/sys/fs/cgroup{path}/memory.events"
            else:
                continue
            if os.path.exists(cand):
                return cand
    return None


def oom_kill_count(pid: int) -> tuple[str, int] | None:
    """``(path, oom_kill count)`` of ``pid``'s memory cgroup, or None."""
    path = memory_events_path(pid)
    if path is None:
        return None
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return path, int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def kernel_log() -> list[tuple[float, str]]:
    """The kernel log's records where this process may read it (``/dev/kmsg``), as
    ``(seconds since boot, line)``, or []. (The kernel stamps them with a clock that
    keeps ``time.monotonic()``'s time, to a small drift.)"""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    lines = []
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == 32:  # EPIPE: records overwritten meanwhile; read on
                    continue
                break
            if not rec:
                break
            head, _, line = rec.decode(errors="replace").partition(";")
            try:
                stamp = int(head.split(",")[2]) / 1e6  # (prio,seq,microseconds,flags)
            except (IndexError, ValueError):
                stamp = 0.0
            lines.append((stamp, line))
    finally:
        os.close(fd)
    return lines


def oom_note(rec, code: int | None) -> str:
    """What to add to ``rec``'s death message when the OOM killer killed it: where the
    kernel log shows it, or where its cgroup counted an OOM kill since it started."""
    if code != -signal.SIGKILL or not rec.pid:
        return ""
    pid = rec.pid
    # Only records from its own life: its number may have been an earlier OOM victim's
    # (numbers are reused), whose record the log keeps. The margin covers the drift
    # between the log's clock and ours (NTP slews ours by at most 0.05%).
    started = getattr(rec, "started", None)
    since = -1.0 if started is None else started - 2.0 - 5e-4 * started
    for stamp, line in kernel_log():
        if stamp < since:
            continue
        if f"Killed process {pid} " in line or f",pid={pid}," in line:
            return ("; the kernel's OOM killer killed it (out of memory: give it more "
                    f"memory, or have it use less). Kernel log: {line.strip()}")
    before = getattr(rec, "oom_baseline", None)
    now = oom_kill_count(pid) if before is not None else None
    if before is not None and now is not None and now[0] == before[0] and now[1] > before[1]:
        return (f"; probably the kernel's OOM killer (out of memory): its memory cgroup "
                f"counted {now[1] - before[1]} OOM kill(s) since it started ({now[0]}). "
                "Give it more memory, or have it use less")
    return ""
