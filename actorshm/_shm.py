"""Host shared memory: memfd arenas, this process's pool, its budget, ``empty/zeros/share``.

Host memory comes from anonymous ``memfd_create`` files ("arenas"), never from named
segments, so nothing can leak in /dev/shm and its mount size does not matter. Each
process owns a pool; small blocks are carved from 64 MiB chunk arenas, and blocks of
4 MiB or more get an arena of their own. Free blocks are recycled by size class. An
arena's fd crosses to a peer once (over SCM_RIGHTS, see ``_framing``) and is mapped
once there; after that a block travels as ``(arena, offset, size)``. Leases, recycling
and retirement are ``_leases``'s, the same for every kind of region; ``Pool`` is shared
with the GPU plug-in (``_cuda.GpuPool``). In a runtime, the host pools of the driver and
of its actors share one budget (``_budget.SharedBudget``); the arenas themselves and
their blocks are ``_arena``'s.
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import os
import secrets
import sys
import threading
import time
import weakref

import numpy as np

from . import _leases
from ._arena import (Arena, HostBlock, array_from_block, copy_layout,  # noqa: F401
                     copy_nbytes, find_block, is_shared, keeps_layout, map_fd, nbytes_of,
                     new_arena)  # (re-exported)
from ._budget import (MAX_BUDGET, MIN_BUDGET, SharedBudget, chunk_size_for, default_budget,  # noqa: F401
                      fd_limit, what_for)
from ._errors import SharedMemoryError
from ._leases import Block, Region, counters
from ._util import fmt_bytes

__all__ = ["Pool", "HostPool", "Arena", "HostBlock", "empty", "zeros", "share", "is_shared",
           "stats", "pool"]

PAGE = mmap.PAGESIZE
CHUNK_SIZE = 64 << 20  # arena size for small blocks
LARGE = MIN_BUDGET  # 4 MiB: blocks this big or more get an arena of their own
# The most a pool keeps idle of the regions made for memory to spare (and an eighth of
# its budget at most): the last one, for the next big message (``Pool._spare_returned``).
KEEP_SPARE = 128 << 20
MIN_BLOCK = 256
ALIGN = 64

def size_class(n: int) -> int:
    """Round a request up to its size class: four classes per power of two."""
    if n <= MIN_BLOCK:
        return MIN_BLOCK
    step = 1 << (n.bit_length() - 3)
    c = (n + step - 1) // step * step
    if c >= LARGE:
        c = (c + PAGE - 1) // PAGE * PAGE
    return c


# Every pool this process owns, for ``stats()``.
_pools: list = []


def stats() -> dict[str, int]:
    """This process's cumulative shared-memory and call counters, as a plain dict."""
    gauges: dict[str, int] = {"blocks_quarantined": _leases.quarantined()}
    for p in _pools:
        p.report(gauges)
    if "shm_budget" not in gauges:  # no pool yet: the budget its first block will meet
        gauges["shm_budget"] = list(_budgets.values())[-1] if _budgets else default_budget()
    out = dict(counters)
    out.update(gauges)
    return out


class Pool:
    """Memory this process owns: regions, free lists by size class, a budget.

    Small blocks are carved from shared chunk regions; a block of ``large`` bytes or
    more gets a region of its own, which can be freed alone (``_retire_free``) when the
    budget is short. Subclasses say how a region is made (``_make_region``).
    """

    chunk_size = CHUNK_SIZE
    large = LARGE
    prefix = ""  # of this pool's counters in ``stats()``
    region_noun = "arenas"

    def __init__(self, budget: int | None = None) -> None:
        self.token = secrets.randbits(63)
        _leases.own_token(self.token)
        self.budget = int(budget) if budget else default_budget()
        self.lock = threading.Lock()
        self.regions: dict[int, Region] = {}
        self.free: dict[int, list] = collections.defaultdict(list)
        self._returned: collections.deque = collections.deque()
        self._next_index = 0
        self._chunk: Region | None = None
        self._chunk_pos = 0
        self.reserved = 0
        self.blocks_live = 0
        self._in_use: dict[int, int] = collections.defaultdict(int)  # region -> live blocks
        # Regions made for one block of memory to spare (``alloc(spare=True)``), given
        # back to the system once that block comes home, but for the last one of up to
        # ``KEEP_SPARE`` bytes (and an eighth of the budget), kept idle for the next
        # (``_kept_spare``: its index).
        self._transient: set[int] = set()
        self._kept_spare: int | None = None
        self._k_reuses = self.prefix + "pool_reuses"
        self._k_allocs = self.prefix + "pool_allocs"
        _pools.append(self)

    # -- regions ----------------------------------------------------------------
    def _make_region(self, key: tuple, size: int, dedicated: bool) -> Region:
        raise NotImplementedError

    def _over_budget(self, size: int, want: int | None = None,
                     dedicated: bool = False) -> SharedMemoryError:
        return SharedMemoryError(
            f"actorshm: cannot allocate {what_for(size, want, dedicated)} of shared memory: "
            "this process's "
            f"budget is {fmt_bytes(self.budget)} and {fmt_bytes(self.reserved)} is already in "
            "use. Drop arrays you no longer need (a stream's items made ahead of its "
            "consumer count too: lower its run_ahead, h.method.options(run_ahead=2)(...)), "
            "or raise the budget with "
            "actorshm.Runtime(shm_budget=...) (or ACTORSHM_SHM_BUDGET=bytes)."
        )

    def _charge(self, size: int) -> int:
        """Take ``size`` bytes of the budget for a new region: 0 once taken, else by how
        many bytes it is short (``HostPool`` also charges the runtime's shared budget)."""
        return max(0, self.reserved + size - self.budget)

    def _refund(self, size: int) -> None:
        """Give back what ``_charge`` took (a region closed)."""

    def _wait_for_room(self, size: int) -> bool:
        """Short of budget with no idle region left here: whether room came (charged)."""
        return False

    def _spare(self, size: int) -> bool:
        """Whether a new region of ``size`` bytes leaves at least half the budget free
        (``alloc(spare=True)``)."""
        return self.reserved + size <= self.budget // 2

    def _alloc_spare(self, size: int):
        """``alloc(spare=True)`` when no recycled block fits (under the lock): a region
        of its own, given back once its block comes home (``_transient``), so that
        memory to spare never grows what the pool keeps; or None."""
        if not self._spare(size):
            return None
        region = self._new_region(size, dedicated=True, spare=True)
        self._transient.add(region.key[1])
        return region

    def _new_region(self, size: int, dedicated: bool, spare: bool = False,
                    want: int | None = None) -> Region:
        """A new region of ``size`` bytes (for a block of ``want``, named by the error
        when the budget has no room)."""
        short = self._charge(size)
        if short:
            if spare:  # (nothing idle given back, no wait: the caller has another way)
                raise self._over_budget(size, want, dedicated)
            self._retire_free(short)
            if self._charge(size) and not self._wait_for_room(size):
                raise self._over_budget(size, want, dedicated)
        index = self._next_index
        try:
            region = self._make_region((self.token, index), size, dedicated)
        except BaseException:
            self._refund(size)
            raise
        self._next_index += 1
        self.regions[index] = region
        _leases.register_region(region)
        self.reserved += size
        return region

    def _retire_free(self, needed: int, below: int | None = None) -> None:
        """Free idle regions (no live block; largest first) until ``needed`` bytes are
        back: a dedicated region whose block is free, or a chunk all of whose blocks are
        (so freed small blocks never keep the budget from a larger request); with
        ``below``, only regions whose index is below it."""
        idle = [r for i, r in self.regions.items()
                if not self._in_use.get(i) and r.retirable() and (below is None or i < below)]
        idle.sort(key=lambda r: -r.size)
        gone = set()
        for region in idle:
            if needed <= 0:
                break
            needed -= region.size
            gone.add(region.key[1])
            if region is self._chunk:
                self._chunk = None
            self._retire(region)
        if gone:
            for size in list(self.free):
                self.free[size] = [b for b in self.free[size] if b[0].key[1] not in gone]

    def trim(self) -> int:
        """Give every idle region back to the system (``Runtime`` close, fd pressure).

        Returns:
            How many regions were freed.
        """
        self.drain()
        with self.lock:
            before = len(self.regions)
            self._retire_free(self.reserved + 1)
            return before - len(self.regions)

    def _retire(self, region: Region) -> None:
        del self.regions[region.key[1]]
        self._transient.discard(region.key[1])
        if self._kept_spare == region.key[1]:
            self._kept_spare = None
        self._in_use.pop(region.key[1], None)
        _leases.unregister_region(region)
        self.reserved -= region.size
        self._refund(region.size)
        region.close()
        _leases.region_retired(region)  # (allocation may run in any thread)

    # Set once the last runtime of the process closed (``release_budget``): the regions
    # made before (index below it) that a user still held then go back to the system as
    # soon as they are dropped, not at exit. (Regions made later are kept for reuse.)
    trim_below = 0

    def block_returned(self, region: Region, offset: int, size: int) -> None:
        """A block of ours died here (any thread, from a ``_Lease`` callback): it goes
        back on its free list at the next ``drain``; with ``trim_below`` set, now, and
        its region to the system if that was its last block and is below it. (Not if
        this or another thread holds the pool's lock meanwhile: the next ``drain`` does
        it.)"""
        self._returned.append((region, offset, size))
        if (self.trim_below or region.key[1] in self._transient) and \
                self.lock.acquire(blocking=False):
            try:
                self._drain_locked()
                if self.trim_below:
                    self._retire_free(self.reserved + 1, self.trim_below)
            finally:
                self.lock.release()

    def drain(self) -> None:
        """Move blocks returned (``block_returned``) back onto the free lists (and, after
        the last runtime closed, the regions ``trim_below`` names that are idle now)."""
        if self._returned:
            with self.lock:  # (retiring, as allocating, only ever under the lock)
                self._drain_locked()
                if self.trim_below:
                    self._retire_free(self.reserved + 1, self.trim_below)
                self._idle_pressure()

    def _drain_locked(self) -> None:
        ret = self._returned
        while ret:
            free = ret.popleft()  # (region, offset, size)
            index = free[0].key[1]
            self.blocks_live -= 1
            self._in_use[index] -= 1
            if index in self._transient:
                self._spare_returned(free)
            else:
                self.free[free[2]].append(free)

    def _spare_returned(self, free: tuple) -> None:
        """The block of a region made for memory to spare came home (under the lock):
        the region is kept idle for the next such block if it is small enough (and the
        one kept before goes), else given back now."""
        region, _, size = free
        index = region.key[1]
        if region.size > min(KEEP_SPARE, self.budget // 8) and region.retirable():
            self._retire(region)
            return
        kept = self._kept_spare
        if kept is not None and kept != index:
            old = self.regions.get(kept)
            if old is not None and not self._in_use.get(kept) and old.retirable():
                for sz, blocks in self.free.items():
                    self.free[sz] = [b for b in blocks if b[0] is not old]
                self._retire(old)
        self._kept_spare = index
        self.free[size].append(free)

    def _idle_pressure(self) -> None:
        """Hook for subclasses: give idle regions back when a resource runs short (called
        with the pool's lock held)."""

    def report(self, out: dict) -> None:
        """Add this pool's gauges to a ``stats()`` dict (summed over pools of a kind)."""
        self.drain()
        for key, value in ((self.prefix + "blocks_live", self.blocks_live),
                           (f"{self.region_noun}_owned", len(self.regions)),
                           (f"{self.region_noun[:-1]}_bytes_owned", self.reserved)):
            out[key] = out.get(key, 0) + value

    # -- blocks -----------------------------------------------------------------
    def size_class(self, nbytes: int) -> int:
        return size_class(nbytes)

    def alloc(self, nbytes: int, spare: bool = False) -> Block | None:
        """A block of at least ``nbytes``: a recycled one when one fits, else a new one.

        With ``spare``, only memory to spare (a message that could go another way, such
        as a big pickle, ``_serialization.spill``): a recycled block, else a region of
        its own that goes back to the system with the block (``_alloc_spare``), made
        only while it leaves half the budget free, without giving idle regions back or
        waiting for room; else None."""
        size = self.size_class(max(int(nbytes), 1))
        self.drain()
        with self.lock:
            free = self.free.get(size)
            if free:
                region, offset, _ = free.pop()
                counters[self._k_reuses] += 1
                if region.key[1] == self._kept_spare:
                    self._kept_spare = None  # (in use again)
                    if not spare:  # an array's now: an ordinary region of the pool
                        self._transient.discard(region.key[1])
            elif spare:
                region, offset = self._alloc_spare(size), 0
                if region is None:
                    return None
                counters[self._k_allocs] += 1
            elif size >= self.large:
                region, offset = self._new_region(size, dedicated=True, want=int(nbytes)), 0
                counters[self._k_allocs] += 1
            else:
                chunk = self._chunk
                if chunk is None or self._chunk_pos + size > chunk.size:
                    chunk = self._chunk = self._new_region(self.chunk_size, dedicated=False,
                                                           want=int(nbytes))
                    self._chunk_pos = 0
                region, offset = chunk, self._chunk_pos
                self._chunk_pos += size
                counters[self._k_allocs] += 1
            self.blocks_live += 1
            self._in_use[region.key[1]] += 1
        return region.block(offset, size, self)

    def close(self) -> None:
        """Unmap every region (a pool made apart from this process's own; under the
        lock, as every change of its regions is)."""
        with self.lock:
            for region in list(self.regions.values()):
                _leases.unregister_region(region)
                region.close()
            self.regions.clear()
            self.free.clear()
            self._in_use.clear()
            self._transient.clear()
            self._kept_spare = None
            self._chunk = None
            self._refund(self.reserved)
            self.reserved = 0


class HostPool(Pool):
    """This process's shared memory on the host: memfd arenas.

    In a runtime, its arenas are also charged to the budget the driver and its actors
    share (``shared``, this process's ``slot`` in it; see ``_budget.SharedBudget``).
    """

    shared: SharedBudget | None = None
    slot = 0
    _short_shared = False  # the last ``_charge`` fell short of the shared budget

    def _make_region(self, key: tuple, size: int, dedicated: bool) -> Arena:
        return new_arena(key, size, dedicated, self)

    def free_idle(self) -> None:
        """Give back every idle arena (their fds too)."""
        self._retire_free(self.reserved + 1)

    def _charge(self, size: int) -> int:
        short = super()._charge(size)
        shared = self.shared
        self._short_shared = False
        if short or shared is None:
            return short
        short = shared.charge(self.slot, size)
        self._short_shared = bool(short)
        return short

    def _refund(self, size: int) -> None:
        if self.shared is not None and size:
            self.shared.refund(self.slot, size)

    def join(self, shared: SharedBudget | None, slot: int = 0) -> None:
        """Charge this pool's arenas to ``shared`` (slot ``slot``) from now on; None
        leaves it (what it owns is charged to this process's budget only)."""
        if self.shared is not None and shared is None:
            self.shared.refund(self.slot, self.reserved)
        elif shared is not None:
            shared.attach(slot, self.reserved)
            self.chunk_size = chunk_size_for(shared.budget, CHUNK_SIZE, LARGE, PAGE)
        self.shared, self.slot = shared, slot

    def _spare(self, size: int) -> bool:
        shared = self.shared
        return super()._spare(size) and \
            (shared is None or shared.total() + size <= shared.budget // 2)

    def _wait_for_room(self, size: int) -> bool:
        """Short of the shared budget: ask the runtime's other processes for their idle
        arenas (each looks every ``ROOM_POLL`` seconds) and wait for them, until each has
        answered (no more room will come) or ``ROOM_WAIT`` seconds passed. (The wait
        blocks this thread, an event loop's too: waiting for every answer, not the whole
        ``ROOM_WAIT``, keeps it short when all their memory is in use.)"""
        if not self._short_shared:
            return False
        shared = self.shared
        ask = shared.ask_for_room()
        for _ in range(int(ROOM_WAIT / 0.01)):
            time.sleep(0.01)
            answered = shared.answered(ask, self.slot)
            if not self._charge(size):
                return True
            if answered:
                return False
        return False

    def _over_budget(self, size: int, want: int | None = None,
                     dedicated: bool = False) -> SharedMemoryError:
        if self._short_shared:
            return SharedMemoryError(self.shared.over_budget_message(size, want, dedicated))
        return super()._over_budget(size, want, dedicated)

    def report(self, out: dict) -> None:
        super().report(out)
        out["shm_budget"] = self.budget

    def _idle_pressure(self) -> None:
        """Close idle arenas while this pool's arenas use over half of the fd limit
        (``RLIMIT_NOFILE``): the process must still be able to open files and spawn."""
        if len(self.regions) > fd_limit() // 2 and len(self.regions) > self.blocks_live:
            self._retire_free(self.reserved + 1)


_pool: HostPool | None = None
_pool_lock = threading.Lock()


def pool() -> HostPool:
    """This process's host pool, made on first use."""
    global _pool
    p = _pool
    if p is None:
        with _pool_lock:
            if _pool is None:
                _pool = HostPool()
            p = _pool
    return p


def _forget_pool_after_fork() -> None:
    """In a child forked from this process (a DataLoader's worker, a ``multiprocessing``
    pool's, an ``os.fork``): a pool of its own, made on first use. The inherited one's
    free lists name blocks the parent still hands out, so a block allocated from it
    would be written by both processes; its lock may be held by a thread that does not
    exist here, and the budget it shares is the parent's. Inherited arrays stay
    readable and writable (the mappings are shared); only allocation starts afresh."""
    global _pool, _pool_lock, _shared
    if _pool is not None and _pool in _pools:
        _pools.remove(_pool)  # (``stats()`` reports this process's own pool)
    _pool, _pool_lock, _shared = None, threading.Lock(), None
    _budgets.clear()


# Budgets of the open runtimes that set one (owner id -> bytes), latest last: the latest
# applies, and once none is open the default does again.
_budgets: dict[int, int] = {}


def set_budget(budget: int | None, owner: int = 0) -> None:
    """Set this process's host budget (``Runtime(shm_budget=...)``) while ``owner`` is
    open; None keeps the one in effect.

    Args:
        budget: bytes, or None.
        owner: who sets it (``id`` of the runtime); ``release_budget(owner)`` ends it.
    """
    if budget:
        _budgets[owner] = int(budget)
        pool().budget = int(budget)
        _sync_shared()
    if _pool is not None:
        _pool.trim_below = 0  # a runtime is open: keep idle memory for reuse


def release_budget(owner: int, trim: bool = False) -> None:
    """``owner`` closed: the budget of the latest other open owner applies again, else the
    default; with ``trim``, idle arenas go back to the system.

    Args:
        owner: as given to ``set_budget``.
        trim: give idle memory back (the last runtime of the process closed).
    """
    if _budgets.pop(owner, None) is not None and _pool is not None:
        _pool.budget = list(_budgets.values())[-1] if _budgets else default_budget()
        _sync_shared()
    if trim and _pool is not None:
        _pool.trim()
    global _shared
    if trim and _shared is not None:  # the last runtime closed: so does its budget
        # Under the pool's lock, as every charge is: a thread allocating meanwhile (a
        # driver thread, an actor's thread pool) charges it before, or not at all.
        with _pool.lock:
            _pool.join(None)
            shared, _shared = _shared, None
        shared.close()
    if trim and _pool is not None:  # and what is still held goes once it is dropped
        with _pool.lock:
            _pool.trim_below = _pool._next_index


# The budget this driver and its actors share, while a runtime is open (``Runtime``).
_shared: SharedBudget | None = None
os.register_at_fork(after_in_child=_forget_pool_after_fork)


def shared_budget() -> SharedBudget:
    """The budget this driver process and its actors share: made when the first
    runtime opens (its budget is this process's), closed when the last one closes."""
    global _shared
    if _shared is None:
        p = pool()
        _shared = SharedBudget.create(p.budget)
        p.join(_shared, 0)
    return _shared


def _sync_shared() -> None:
    """The driver's budget changed: so does the one it shares with its actors."""
    if _shared is not None and _pool is not None and _pool.shared is _shared \
            and _pool.slot == 0:
        _shared.budget = _pool.budget
        _pool.chunk_size = chunk_size_for(_pool.budget, CHUNK_SIZE, LARGE, PAGE)


ROOM_POLL = 0.1  # seconds between looks for another process asking for room
ROOM_WAIT = 0.35  # seconds a process short of the shared budget waits for room


def watch_for_room(loop, shared: SharedBudget | None = None) -> None:
    """Give idle arenas back, on ``loop``, whenever another process of the runtime runs
    short of the shared budget; ends when this process leaves it."""
    p = pool()
    shared = shared or p.shared
    if shared is None or loop.is_closed():
        return
    # (under the pool's lock, as the budget leaves the pool: the last runtime may close
    # on another thread's loop meanwhile)
    with p.lock:
        if p.shared is not shared:
            return
        pressed = shared.pressure()
    if pressed:
        p.trim()
        with p.lock:
            if p.shared is shared:
                shared.answer(p.slot)
    loop.call_later(ROOM_POLL, watch_for_room, loop, shared)


def join_budget(ticket: tuple | None, loop: asyncio.AbstractEventLoop) -> None:
    """In an actor: charge this process's arenas to its runtime's shared budget.

    Args:
        ticket: ``(fd, slot)`` from the driver (the memfd received, the slot it gave
            this process), or None to keep a budget of its own.
        loop: the actor's event loop, which watches the budget for room.
    """
    if ticket is not None:
        fd, slot = ticket
        pool().join(SharedBudget(fd), slot)
        watch_for_room(loop)


def empty(shape, dtype=float, order: str = "C") -> np.ndarray:
    """A new array in shared memory owned by this process (contents undefined).

    It travels to actors without a copy, and its block comes back to this process's
    pool once every process has dropped it.

    Args:
        shape: an int or a tuple of ints.
        dtype: any numpy dtype without Python objects.
        order: ``"C"`` or ``"F"``.

    Raises:
        TypeError: an object dtype.
        ValueError: a negative dimension.
        SharedMemoryError: over this process's budget (``Runtime(shm_budget=...)``),
            or the machine has no room.
    """
    shape, dtype, n = nbytes_of(shape, dtype)
    return array_from_block(pool().alloc(n), shape, dtype, order=order)


def zeros(shape, dtype=float, order: str = "C") -> np.ndarray:
    """A new zero-filled array in shared memory owned by this process.

    Args and errors as ``empty``.
    """
    a = empty(shape, dtype, order)
    np.copyto(a, np.zeros((), a.dtype))  # numpy's zero of any dtype ('' for strings)
    return a


def share(arr) -> np.ndarray:
    """``arr`` itself if it is already shared, else a copy of it in shared memory.

    The copy is of ``arr``'s class, as sending keeps it (``np.recarray``; a ``np.memmap``
    gives an ordinary array, its file staying its own): a masked array's copy is a
    masked array whose data and mask are both shared, so that neither the mask is lost
    nor the actor's writes to it.

    Args:
        arr: an array, or anything ``numpy.asanyarray`` takes.

    Raises:
        TypeError: an object dtype; a torch tensor or CuPy array (shared with
            ``actorshm.torch.share``, ``actorshm.cuda.share``).
        SharedMemoryError: over budget, as ``empty``.
    """
    if type(arr) is not np.ndarray:
        _refuse_other_library(arr)
    given = arr
    arr = np.asanyarray(arr)
    if arr.dtype.hasobject and not isinstance(given, np.ndarray):
        raise TypeError(f"actorshm.share takes an array (or numbers numpy makes one of), "
                        f"not {type(given).__name__}: numpy would make an object array of "
                        "it, which cannot live in shared memory")
    t = type(arr)
    if t is not np.ndarray:
        ma = sys.modules.get("numpy.ma")  # loaded wherever a masked array exists
        if ma is not None and isinstance(arr, ma.MaskedArray):
            if t is ma.MaskedArray:
                return _share_masked(arr, ma)
            if t.__new__ is ma.MaskedArray.__new__ and arr is not ma.masked:
                # (a subclass that builds itself as MaskedArray does: it is sent so)
                out = _share_masked(arr, ma)
                return out if type(out) is t else out.view(t)
            if arr is ma.masked:
                raise TypeError("np.ma.masked (numpy's constant for a masked element) "
                                "has no memory to share: send it as it is")
            # (its data alone would drop the mask in silence)
            raise TypeError(
                f"actorshm.share shares numpy arrays and np.ma.MaskedArray, not a "
                f"{t.__module__}.{t.__qualname__}: share its data and its mask "
                "(np.ma.getmaskarray) as arrays of their own, or send it as it is (it is "
                "then copied)")
    if find_block(arr) is not None:
        return arr
    out = copy_to_shared(arr)
    return out if t is np.ndarray or issubclass(t, np.memmap) else out.view(t)


def _refuse_other_library(arr) -> None:
    """``share`` of a torch tensor gave a numpy array, a CuPy array numpy's refusal:
    name the function that shares each."""
    for module, kind, share in (("torch", "Tensor", "actorshm.torch.share"),
                                ("cupy", "ndarray", "actorshm.cuda.share")):
        lib = sys.modules.get(module)  # (loaded wherever one of its arrays exists)
        if lib is not None and isinstance(arr, getattr(lib, kind, ())):
            raise TypeError(f"actorshm.share shares numpy arrays; a {module}.{kind} is "
                            f"shared with {share}")


def _share_masked(arr, ma):
    """A masked array whose data and mask both lie in shared memory: ``arr`` itself, or
    a copy. Built as a view, not by ``MaskedArray(...)``, which copies a structured
    dtype's mask into private memory."""
    mask = ma.getmask(arr)
    if find_block(arr) is not None and (mask is ma.nomask or find_block(mask) is not None):
        return arr
    out = share(arr.data).view(ma.MaskedArray)
    if mask is not ma.nomask:
        out._mask = share(mask)
        out._sharedmask = False
    out._hardmask = arr.hardmask
    out.fill_value = arr.fill_value
    return out


# Shared copies of ordinary arrays made for several messages at once (``ActorGroup``
# copies an argument once for all its members): the first message made with one counts
# it copied, not passed by reference, as a message that copies an array itself does.
# id(copy) -> (a weak reference to it, the bytes copied).
first_sends: dict = {}


def copied_for_sending(copy: np.ndarray, nbytes: int) -> None:
    """``copy`` is a fresh shared copy of an ordinary array of ``nbytes`` copied bytes,
    made to be sent: the first message made with it counts it copied (``first_send``)."""
    key = id(copy)

    def gone(ref, key=key) -> None:
        entry = first_sends.get(key)
        if entry is not None and entry[0] is ref:
            del first_sends[key]
    first_sends[key] = (weakref.ref(copy, gone), nbytes)


def first_send(enc, a: np.ndarray) -> bool:
    """Count shared array ``a`` in message ``enc`` as copied if this is the first message
    made with it of a copy ``copied_for_sending`` announced; True if so. (Only a message
    that is made counts, and takes the copy's first send: ``before_send``.)"""
    entry = first_sends.get(id(a))
    if entry is None or entry[0]() is not a:
        return False
    enc.count("bytes_copied", entry[1])
    enc.count("arrays_copied", 1)
    enc.before_send(_sent_first, id(a))
    return True


def _sent_first(keys) -> None:
    for key in keys:
        first_sends.pop(key, None)


def copy_to_shared(arr: np.ndarray) -> np.ndarray:
    """Copy an ordinary array into this process's pool, keeping its layout (strides and
    memory order; a small view of a much larger array compactly: ``copy_layout``)."""
    if arr.flags.c_contiguous or arr.flags.f_contiguous:
        order = "F" if (arr.flags.f_contiguous and not arr.flags.c_contiguous) else "C"
        out = empty(arr.shape, arr.dtype, order=order)
        if out.strides != arr.strides and arr.size:
            # an axis of length 1 with a stride of its own (``a[:, None]``: 0): kept,
            # as any other stride is (it never moves to another element)
            out = np.ndarray(arr.shape, arr.dtype, buffer=out, strides=arr.strides)
    else:
        offset, n, strides = copy_layout(arr)
        raw = np.asarray(pool().alloc(n))
        if n > arr.nbytes:
            raw[:n] = 0  # the gaps between its elements: nothing of the block's past
        out = np.ndarray(arr.shape, arr.dtype, buffer=raw, offset=offset, strides=strides)
    np.copyto(out, arr, casting="no")
    return out
