"""How much shared memory may be owned: the default budget, the fd limit, and the one
budget a driver and the actors it starts share.

``SharedBudget`` is a small memfd that the driver makes when a runtime opens and hands
to each actor it starts (with ``__init_actor__``). It holds the budget and one *slot*
per process: its pid, a label and its *charge*, the bytes of arenas its pool owns. A
pool charges its slot when it makes an arena and refunds it when it closes one, so the
shared page is touched per arena (64 MiB chunk or a large block's own), never per
array. Updates take an ``fcntl`` lock on the memfd (between processes) and a thread
lock (within one). The driver gives each actor process a slot and zeroes it once that
process has exited: its arenas are gone then, save those a peer still maps (counted no
more: the approximation this makes).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading

from ._util import fmt_bytes, off_stdio

__all__ = ["default_budget", "fd_limit", "SharedBudget", "chunk_size_for", "MIN_BUDGET",
           "MAX_BUDGET", "what_for"]

_HEAD = 8  # int64s: magic, budget, asks for room, (unused)
_SLOT = 8  # int64s per slot: pid, charge, a 40-byte label, the last ask it answered
_LABEL = (_SLOT - 3) * 8
_MAGIC = 0x4143_5453_484D_4244  # "ACTSHMBD"


# The smallest budget: one arena of the smallest size (``_shm.LARGE``); less and nothing
# could be allocated.
MIN_BUDGET = 4 << 20
# The largest: the ledger keeps the budget in an int64 (8 EiB, more than any machine has).
MAX_BUDGET = (1 << 63) - 1


_default: list = [None]  # this process's ``memory_default()``, once it was needed


def _forget_default() -> None:  # (a forked child measures for itself)
    _default[0] = None


os.register_at_fork(after_in_child=_forget_default)


def default_budget() -> int:
    """``ACTORSHM_SHM_BUDGET`` bytes, else ``memory_default()`` as it was when this
    process first needed it (measured again later, the memory its own arrays hold by
    then would count as other programs')."""
    env = os.environ.get("ACTORSHM_SHM_BUDGET")
    if env:
        try:
            n = int(float(env))
        except ValueError:
            n = -1
        except OverflowError:  # inf
            n = MAX_BUDGET + 1
        if not MIN_BUDGET <= n <= MAX_BUDGET:
            raise ValueError(f"ACTORSHM_SHM_BUDGET={env!r}: the shared-memory budget must "
                             f"be a number of bytes, at least {MIN_BUDGET} (one 4 MiB "
                             f"arena) and at most {MAX_BUDGET}, e.g. 8e9")
        return n
    if _default[0] is None:
        _default[0] = memory_default()
    return _default[0]


def memory_default() -> int:
    """Half the memory this process may use: the machine's RAM, or its cgroup's limit
    where that is lower (a container's ``docker run -m``, a systemd unit's
    ``MemoryMax``), so that shared arrays past it are a ``SharedMemoryError`` rather
    than the OOM killer's SIGKILL; and at most three quarters of the memory available
    now (``memory_available``), where other programs already use so much that half
    would not fit."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        total = 16 << 30
    limit = cgroup_memory_limit()
    if limit is not None:
        total = min(total, limit)
    budget = total // 2
    room = memory_available()
    if room is not None:
        budget = min(budget, room // 4 * 3)
    return max(budget, MIN_BUDGET)


def memory_available(meminfo: str = "/proc/meminfo", root: str = "/sys/fs/cgroup",
                     cgroups: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process could still take before memory runs out, or None where that
    cannot be read: the kernel's ``MemAvailable`` (free memory and page cache it can
    drop), or less where a cgroup's limit less its usage (page cache it can drop not
    counted) is lower."""
    found = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for directory, v2 in _cgroup_dirs(root, cgroups):
        limit = _read_limit(os.path.join(directory, "memory.max" if v2
                                         else "memory.limit_in_bytes"))
        used = _read_limit(os.path.join(directory, "memory.current" if v2
                                        else "memory.usage_in_bytes"))
        if limit is None or used is None:
            continue
        cache = _read_stat(os.path.join(directory, "memory.stat"),
                           "inactive_file" if v2 else "total_inactive_file")
        found.append(max(limit - used + min(cache, used), 0))
    return min(found) if found else None


def cgroup_memory_limit(root: str = "/sys/fs/cgroup",
                        cgroups: str = "/proc/self/cgroup") -> int | None:
    """The lowest memory limit set on this process's cgroup or one above it, in bytes
    (cgroup v2's ``memory.max``, v1's ``memory.limit_in_bytes``), or None where none is."""
    found = []
    for directory, v2 in _cgroup_dirs(root, cgroups):
        limit = _read_limit(os.path.join(directory, "memory.max" if v2
                                         else "memory.limit_in_bytes"))
        if limit is not None:
            found.append(limit)
    return min(found) if found else None


def _cgroup_dirs(root: str, cgroups: str):
    """The memory cgroup directories of this process and of those above it, each with
    whether it is cgroup v2 (else v1).

    In a container the cgroup file system shows the container's own cgroup at ``root``
    (the path in ``/proc/self/cgroup`` may then name nothing there): the walk up from the
    process's path to ``root`` itself finds its limit either way.
    """
    try:
        with open(cgroups) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].strip("/")
        if controllers == "":  # v2 (``unified``: v2 beside v1, the hybrid layout)
            bases, v2 = (root, os.path.join(root, "unified")), True
        elif "memory" in controllers.split(","):
            bases, v2 = (os.path.join(root, "memory"),), False
        else:
            continue
        for base in bases:
            p = path
            while True:
                yield os.path.join(base, p), v2
                if not p:
                    break
                p = os.path.dirname(p)


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    try:
        n = int(text)
    except ValueError:  # "max": no limit
        return None
    return n if 0 < n < 1 << 60 else None  # (v1 writes "no limit" as about 2**63)


def _read_stat(path: str, key: str) -> int:
    """The number ``key`` of a cgroup's ``memory.stat``, or 0."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def fd_limit() -> int:
    """This process's soft limit on open file descriptors."""
    import resource
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def chunk_size_for(budget: int, largest: int, smallest: int, page: int) -> int:
    """The chunk arena size under a runtime budget: ``largest``, or a sixteenth of a
    small budget (at least ``smallest``), so that many processes each carving small
    blocks do not use up a small budget with mostly empty chunks."""
    size = max(smallest, min(largest, budget // 16))
    return (size + page - 1) // page * page


class SharedBudget:
    """The budget of a driver and its actors together, in a memfd they all map.

    Args:
        fd: the memfd (the driver's own from ``create``, or as an actor received it).
        slots: how many processes it has room for (the driver's choice).
    """

    SLOTS = 1024

    def __init__(self, fd: int, slots: int = SLOTS) -> None:
        self.fd = fd
        self.slots = slots
        self._mm = mmap.mmap(fd, (_HEAD + slots * _SLOT) * 8)
        self._q = memoryview(self._mm).cast("q")
        self._lock = threading.Lock()
        self._free: list[int] = []  # the driver's: slots not in use
        self.pressure_seen = 0

    @classmethod
    def create(cls, budget: int) -> "SharedBudget":
        """A new ledger (in the driver) with ``budget``; slot 0 is this process's."""
        fd = off_stdio(os.memfd_create("actorshm-budget", os.MFD_CLOEXEC))
        try:
            os.ftruncate(fd, (_HEAD + cls.SLOTS * _SLOT) * 8)
            self = cls(fd)
        except BaseException:
            os.close(fd)
            raise
        self._q[0] = _MAGIC
        self._q[1] = int(budget)
        self._free = list(range(cls.SLOTS - 1, 0, -1))
        self.label(0, os.getpid(), "driver")
        return self

    def close(self) -> None:
        """Unmap it and close its fd (this process no longer charges it)."""
        self._q.release()
        self._mm.close()
        os.close(self.fd)
        self.fd = -1

    # -- under the lock --------------------------------------------------------------
    def _locked(self):
        return _Locked(self)

    @property
    def budget(self) -> int:
        """The bytes all processes together may own."""
        return self._q[1]

    @budget.setter
    def budget(self, value: int) -> None:
        self._q[1] = int(value)

    def total(self) -> int:
        """Bytes charged, all slots together."""
        return sum(self._q[_HEAD + 1::_SLOT])

    def charge(self, slot: int, size: int) -> int:
        """Charge ``size`` bytes to ``slot`` if the budget has room.

        Returns:
            0 once charged, else by how many bytes the budget is short (nothing charged).
        """
        with self._locked():
            short = self.total() + size - self.budget
            if short > 0:
                return short
            self._q[_HEAD + slot * _SLOT + 1] += size
            return 0

    def refund(self, slot: int, size: int) -> None:
        """Give ``size`` bytes charged to ``slot`` back (an arena closed)."""
        with self._locked():
            i = _HEAD + slot * _SLOT + 1
            self._q[i] = max(0, self._q[i] - size)

    def attach(self, slot: int, charge: int) -> None:
        """Take ``slot`` for this process (an actor, as it starts), charging what its
        pool already owns."""
        with self._locked():
            base = _HEAD + slot * _SLOT
            self._q[base] = os.getpid()
            self._q[base + 1] += charge

    def ask_for_room(self) -> int:
        """Tell every process that the budget is short: each gives back its idle arenas
        the next time it looks (``pressure``), then answers (``answer``).

        Returns:
            This ask's number (``answered``).
        """
        with self._locked():
            self._q[2] += 1
            return self._q[2]

    def answer(self, slot: int) -> None:
        """The process of ``slot`` gave back its idle arenas, as asked up to the last
        ask it saw (``pressure``)."""
        self._q[_HEAD + slot * _SLOT + _SLOT - 1] = self.pressure_seen

    def answered(self, ask: int, slot: int) -> bool:
        """Whether every process but the one of ``slot`` answered ask number ``ask``
        (or a later one)."""
        pids, asks = self._q[_HEAD::_SLOT], self._q[_HEAD + _SLOT - 1::_SLOT]
        return all(a >= ask for i, (pid, a) in enumerate(zip(pids, asks))
                   if pid and i != slot)

    def pressure(self) -> bool:
        """Whether room was asked for since this process last looked."""
        now = self._q[2]
        if now == self.pressure_seen:
            return False
        self.pressure_seen = now
        return True

    # -- the driver's slots ----------------------------------------------------------
    def take_slot(self, label: str) -> int | None:
        """A free slot for a new actor process named ``label``, or None when all are
        in use (that process then has its own budget only)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.label(slot, 0, label)
        return slot

    def free_slot(self, slot: int) -> None:
        """The process of ``slot`` has exited: zero it and make it free."""
        with self._locked():
            base = _HEAD + slot * _SLOT
            self._q[base:base + _SLOT] = memoryview(bytes(_SLOT * 8)).cast("q")
        self._free.append(slot)

    def label(self, slot: int, pid: int, label: str) -> None:
        with self._locked():
            base = _HEAD + slot * _SLOT
            self._q[base] = pid
            raw = label.encode()[:_LABEL].ljust(_LABEL, b"\0")
            self._q[base + 2:base + _SLOT - 1] = memoryview(raw).cast("q")

    def users(self) -> list[tuple[str, int, int]]:
        """``(label, pid, bytes)`` of every slot charged, largest first."""
        out = []
        with self._locked():
            for slot in range(self.slots):
                base = _HEAD + slot * _SLOT
                if self._q[base + 1]:
                    raw = bytes(self._q[base + 2:base + _SLOT - 1].cast("B"))
                    out.append((raw.rstrip(b"\0").decode(errors="replace"),
                                self._q[base], self._q[base + 1]))
        return sorted(out, key=lambda u: -u[2])

    def over_budget_message(self, size: int, want: int | None = None,
                            dedicated: bool = False) -> str:
        """The error text when ``size`` more bytes (an arena, for an array of ``want``)
        do not fit: the budget, who uses how much, and the fix."""
        users = self.users()
        used = sum(u[2] for u in users)
        who = ", ".join(f"{label or 'pid'} (pid {pid}) {fmt_bytes(n)}"
                        for label, pid, n in users[:8])
        if len(users) > 8:
            who += f", and {len(users) - 8} more"
        return (f"actorshm: cannot allocate {what_for(size, want, dedicated)} of shared "
                "memory: the "
                f"runtime's budget is {fmt_bytes(self.budget)} for the driver and its actors "
                f"together, and {fmt_bytes(used)} is in use ({who or 'none'}). Drop arrays "
                "you no longer need (a stream's items made ahead of its consumer count too: "
                "lower its run_ahead, h.method.options(run_ahead=2)(...)), or raise the "
                "budget with actorshm.Runtime(shm_budget=...) "
                "(or ACTORSHM_SHM_BUDGET=bytes).")


def what_for(size: int, want: int | None, dedicated: bool = False) -> str:
    """``size`` bytes, or, for an array of ``want`` bytes carved from a new arena of
    ``size`` (or given a region of ``size``, ``dedicated``), both (so that the error
    names the array's own size too)."""
    if want is None or want >= size:
        return fmt_bytes(size)
    if dedicated:
        return f"{fmt_bytes(want)} ({fmt_bytes(size)} as the pool rounds it, so that it " \
               "can be recycled for arrays of other sizes)"
    return f"{fmt_bytes(want)} (a new {fmt_bytes(size)} arena, which small arrays share)"


class _Locked:
    """The thread lock, then the ``fcntl`` lock on the memfd (between processes)."""

    __slots__ = ("b",)

    def __init__(self, b: SharedBudget) -> None:
        self.b = b

    def __enter__(self) -> None:
        self.b._lock.acquire()
        try:
            fcntl.lockf(self.b.fd, fcntl.LOCK_EX)
        except BaseException:
            self.b._lock.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            fcntl.lockf(self.b.fd, fcntl.LOCK_UN)
        finally:
            self.b._lock.release()
