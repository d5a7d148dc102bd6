"""Shared memory: arenas, the per-process pool, views, leases and recycling.

Memory comes from anonymous ``memfd_create`` files ("arenas"), never from named
segments, so nothing can leak in /dev/shm and its mount size does not matter. Each
process owns a pool of arenas; small blocks are carved from 64 MiB chunk arenas, and
blocks of 4 MiB or more get an arena of their own. An arena's fd crosses to a peer once
(over SCM_RIGHTS, see ``_protocol``) and is mapped once there; after that a block
travels as ``(arena, offset, size)``.

Every block a process can see is represented there by exactly one ``_View`` object,
the ``base`` of all the numpy arrays that view the block. A view remembers who it got
the block from (``upstream``: connection -> number of grants); when its last array is
garbage collected, the view sends those grants back (batched, one-way) and, in the
owner's process, returns the block to the pool's free list. A connection that sends a
block keeps the sender's view alive (``Connection.grants``) until the receiver releases
it. So a block is recycled only after every process has dropped every reference to it,
and nobody has to write code for buffers to go home.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np

from ._errors import SharedMemoryError

__all__ = ["Pool", "empty", "zeros", "share", "is_shared", "stats", "pool"]

PAGE = mmap.PAGESIZE
CHUNK_SIZE = 64 << 20  # arena size for small blocks
LARGE = 4 << 20  # blocks of this size or more get an arena of their own
MIN_BLOCK = 256
ALIGN = 64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

# This process's counters; ``stats()`` returns a copy. Plain ints in a dict: cheap.
_stats: dict[str, int] = dict.fromkeys(
    ["bytes_copied", "bytes_zero_copy", "arrays_copied", "arrays_zero_copy",
     "pool_allocs", "pool_reuses", "blocks_live", "arenas_owned", "arena_bytes_owned",
     "arenas_mapped", "releases_sent", "releases_received", "calls_sent", "calls_received"],
    0,
)


def stats() -> dict[str, int]:
    """This process's cumulative shared-memory and call counters, as a plain dict."""
    out = dict(_stats)
    p = _pool
    if p is not None:
        p.drain()
        out["blocks_live"] = p.blocks_live
        out["arenas_owned"] = len(p.arenas)
        out["arena_bytes_owned"] = p.reserved
        out["shm_budget"] = p.budget
    return out


def _map(fd: int, size: int) -> int:
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise SharedMemoryError(f"actorshm: mmap of a {_fmt(size)} arena failed: "
                                f"{os.strerror(err)}")
    return addr


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class Arena:
    """One memfd file mapped into this process."""

    __slots__ = ("key", "fd", "size", "addr", "owned", "dedicated", "sent_to", "__weakref__")

    def __init__(self, key: tuple, fd: int, size: int, addr: int, owned: bool,
                 dedicated: bool) -> None:
        self.key = key
        self.fd = fd
        self.size = size
        self.addr = addr
        self.owned = owned
        self.dedicated = dedicated
        # Connections this arena's fd was sent over, told when the arena is retired.
        self.sent_to: weakref.WeakSet = weakref.WeakSet()

    def close(self) -> None:
        if self.addr:
            _libc.munmap(self.addr, self.size)
            self.addr = 0
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


# Arenas mapped in this process, owned or not, by key (owner token, index).
_arenas: dict[tuple, Arena] = {}
# One live view per block in this process: key (owner token, arena index, offset) -> ref.
_views: dict[tuple, weakref.ref] = {}
# Grants to give back, appended from ``_View.__del__`` (any thread), flushed on the loop.
_releases: collections.deque = collections.deque()
_flush_hook: list = [None]  # set by the runtime: schedules ``flush_releases`` on its loop


class _View:
    """The base object of every numpy array that views one shared block."""

    __slots__ = ("__array_interface__", "arena", "offset", "size", "key", "pool",
                 "upstream", "__weakref__")

    def __init__(self, arena: Arena, offset: int, size: int, pool: "Pool | None") -> None:
        self.arena = arena
        self.offset = offset
        self.size = size
        self.key = (arena.key[0], arena.key[1], offset)
        self.pool = pool
        self.upstream: dict | None = None
        self.__array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (arena.addr + offset, False),
            "version": 3,
        }
        _views[self.key] = weakref.ref(self)
        if len(_views) > _prune_at[0]:
            _prune_views()

    def __del__(self) -> None:
        try:
            if self.upstream:
                _releases.append((self.upstream, self.key))
                hook = _flush_hook[0]
                if hook is not None:
                    hook()
            if self.pool is not None:
                self.pool._returned.append((self.arena, self.offset, self.size))
        except Exception:  # interpreter shutdown: nothing left to tell
            pass


_prune_at = [4096]


def _prune_views() -> None:
    """Drop entries of dead views (the map is only ever read through live refs)."""
    for key, ref in list(_views.items()):
        if ref() is None and _views.get(key) is ref:
            _views.pop(key, None)
    _prune_at[0] = max(4096, 2 * len(_views))


def flush_releases() -> None:
    """Hand every pending release to its connection (runs on the event loop)."""
    while _releases:
        upstream, key = _releases.popleft()
        for conn, n in upstream.items():
            conn.queue_release(key, n)


def find_view(arr: np.ndarray) -> "_View | None":
    """The shared block an array views, or None."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if type(base) is _View:
        return base
    return None


def is_shared(arr: Any) -> bool:
    """Whether ``arr`` (or the array it is a view of) lives in actorshm shared memory."""
    if isinstance(arr, np.ndarray):
        return find_view(arr) is not None
    return False


def size_class(n: int) -> int:
    """Round a request up to its size class: four classes per power of two."""
    if n <= MIN_BLOCK:
        return MIN_BLOCK
    step = 1 << (n.bit_length() - 3)
    c = (n + step - 1) // step * step
    if c >= LARGE:
        c = (c + PAGE - 1) // PAGE * PAGE
    return c


class Pool:
    """The shared memory this process owns: arenas, free lists, the budget."""

    def __init__(self, budget: int | None = None) -> None:
        self.token = secrets.randbits(63)
        self.budget = int(budget) if budget else default_budget()
        self.lock = threading.Lock()
        self.arenas: dict[int, Arena] = {}
        self.free: dict[int, list] = collections.defaultdict(list)
        self._returned: collections.deque = collections.deque()
        self._next_index = 0
        self._chunk: Arena | None = None
        self._chunk_pos = 0
        self.reserved = 0
        self.blocks_live = 0

    # -- arenas ---------------------------------------------------------------
    def _new_arena(self, size: int, dedicated: bool) -> Arena:
        if self.reserved + size > self.budget:
            self._retire_free(self.reserved + size - self.budget)
        if self.reserved + size > self.budget:
            raise SharedMemoryError(
                f"actorshm: cannot allocate {_fmt(size)} of shared memory: this process's "
                f"budget is {_fmt(self.budget)} and {_fmt(self.reserved)} is already in "
                "use. Drop arrays you no longer need, or raise the budget with "
                "actorshm.Runtime(shm_budget=...) (or ACTORSHM_SHM_BUDGET=bytes)."
            )
        fd = os.memfd_create("actorshm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            try:
                # Reserve the pages now, so that running out is an error here and
                # never a SIGBUS on first touch (torch.multiprocessing's "Bus error").
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise SharedMemoryError(
                        f"actorshm: the machine has no room for {_fmt(size)} more of "
                        f"shared memory ({exc.strerror}); {_fmt(self.reserved)} is in use "
                        "by this process. Free memory, or use smaller arrays."
                    ) from None
                raise
            # Peers cannot shrink the file under our feet (which would be a SIGBUS).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            addr = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        index = self._next_index
        self._next_index += 1
        arena = Arena((self.token, index), fd, size, addr, owned=True, dedicated=dedicated)
        self.arenas[index] = arena
        _arenas[arena.key] = arena
        self.reserved += size
        return arena

    def _retire_free(self, needed: int) -> None:
        """Unmap free dedicated arenas (largest first) until ``needed`` bytes are back."""
        candidates = []
        for size, blocks in self.free.items():
            for blk in blocks:
                if blk[0].dedicated:
                    candidates.append(blk)
        candidates.sort(key=lambda b: -b[2])
        for arena, offset, size in candidates:
            if needed <= 0:
                break
            self.free[size].remove((arena, offset, size))
            needed -= arena.size
            self._retire(arena)

    def _retire(self, arena: Arena) -> None:
        del self.arenas[arena.key[1]]
        _arenas.pop(arena.key, None)
        self.reserved -= arena.size
        for conn in list(arena.sent_to):
            conn.send_retire(arena.key)
        arena.close()

    def drain(self) -> None:
        """Move blocks returned by ``_View.__del__`` back onto the free lists."""
        ret = self._returned
        if ret:
            with self.lock:
                while ret:
                    blk = ret.popleft()
                    self.free[blk[2]].append(blk)
                    self.blocks_live -= 1

    # -- blocks ---------------------------------------------------------------
    def alloc(self, nbytes: int) -> _View:
        """A block of at least ``nbytes``: a recycled one when one fits, else a new one."""
        size = size_class(max(int(nbytes), 1))
        self.drain()
        with self.lock:
            free = self.free.get(size)
            if free:
                arena, offset, _ = free.pop()
                _stats["pool_reuses"] += 1
            elif size >= LARGE:
                arena, offset = self._new_arena(size, dedicated=True), 0
                _stats["pool_allocs"] += 1
            else:
                chunk = self._chunk
                if chunk is None or self._chunk_pos + size > chunk.size:
                    chunk = self._chunk = self._new_arena(CHUNK_SIZE, dedicated=False)
                    self._chunk_pos = 0
                arena, offset = chunk, self._chunk_pos
                self._chunk_pos += size
                _stats["pool_allocs"] += 1
            self.blocks_live += 1
        return _View(arena, offset, size, self)

    def close(self) -> None:
        for arena in list(self.arenas.values()):
            _arenas.pop(arena.key, None)
            arena.close()
        self.arenas.clear()
        self.free.clear()
        self.reserved = 0


def default_budget() -> int:
    env = os.environ.get("ACTORSHM_SHM_BUDGET")
    if env:
        return int(float(env))
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        total = 16 << 30
    return total // 2


_pool: Pool | None = None
_pool_lock = threading.Lock()


def pool() -> Pool:
    """This process's pool, made on first use."""
    global _pool
    p = _pool
    if p is None:
        with _pool_lock:
            if _pool is None:
                _pool = Pool()
            p = _pool
    return p


def set_budget(budget: int | None) -> None:
    if budget:
        pool().budget = int(budget)


def array_from_view(view: _View, shape, dtype, offset: int = 0, strides=None,
                    order: str = "C") -> np.ndarray:
    base = np.asarray(view)
    return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides, order=order)


def _nbytes(shape, dtype) -> tuple[tuple, np.dtype, int]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError("actorshm: object arrays cannot live in shared memory; "
                        "use a numeric or structured dtype")
    n = dtype.itemsize
    for s in shape:
        if s < 0:
            raise ValueError(f"negative dimensions are not allowed: {shape}")
        n *= s
    return shape, dtype, n


def empty(shape, dtype=float, order: str = "C") -> np.ndarray:
    """A new array in shared memory owned by this process (contents undefined)."""
    shape, dtype, n = _nbytes(shape, dtype)
    return array_from_view(pool().alloc(n), shape, dtype, order=order)


def zeros(shape, dtype=float, order: str = "C") -> np.ndarray:
    """A new zero-filled array in shared memory owned by this process."""
    a = empty(shape, dtype, order)
    a.fill(0)
    return a


def share(arr) -> np.ndarray:
    """``arr`` itself if it is already shared, else a copy of it in shared memory."""
    arr = np.asanyarray(arr)
    if find_view(arr) is not None:
        return arr
    return copy_to_shared(arr)


def copy_to_shared(arr: np.ndarray) -> np.ndarray:
    """Copy an ordinary array into this process's pool, keeping its memory order."""
    order = "F" if (arr.flags.f_contiguous and not arr.flags.c_contiguous) else "C"
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        # Keep the axis order of a permuted view; drop the gaps of a strided one.
        tmpl = np.empty_like(arr, order="K")
        out = np.ndarray(tmpl.shape, arr.dtype, buffer=np.asarray(pool().alloc(arr.nbytes)),
                         strides=tmpl.strides)
    else:
        out = empty(arr.shape, arr.dtype, order=order)
    np.copyto(out, arr, casting="no")
    return out
