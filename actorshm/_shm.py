"""Host shared memory: memfd arenas, this process's pool, its budget, ``empty/zeros/share``.

Host memory comes from anonymous ``memfd_create`` files ("arenas"), never from named
segments, so nothing can leak in /dev/shm and its mount size does not matter. Each
process owns a pool; small blocks are carved from 64 MiB chunk arenas, and blocks of
4 MiB or more get an arena of their own. Free blocks are recycled by size class. An
arena's fd crosses to a peer once (over SCM_RIGHTS, see ``_framing``) and is mapped
once there; after that a block travels as ``(arena, offset, size)``. Leases, recycling
and retirement are ``_leases``'s, the same for every kind of region; ``Pool`` is shared
with the GPU plug-in (``_cuda.GpuPool``).
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
from typing import Any

import numpy as np

from . import _leases
from ._errors import SharedMemoryError
from ._leases import Block, Region, counters
from ._util import fmt_bytes

__all__ = ["Pool", "HostPool", "Arena", "HostBlock", "empty", "zeros", "share", "is_shared",
           "stats", "pool"]

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

def map_fd(fd: int, size: int) -> int:
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise SharedMemoryError(f"actorshm: mmap of a {fmt_bytes(size)} arena failed: "
                                f"{os.strerror(err)}")
    return addr


class Arena(Region):
    """One memfd file mapped into this process."""

    __slots__ = ("fd", "addr")

    def __init__(self, key: tuple, fd: int, size: int, addr: int, owned: bool,
                 dedicated: bool) -> None:
        super().__init__(key, size, owned, dedicated)
        self.fd = fd
        self.addr = addr

    def block(self, offset: int, size: int, pool: "Pool | None") -> "HostBlock":
        return HostBlock(self, offset, size, pool)

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


class HostBlock(Block):
    """A host block: the ``base`` of every numpy array that views it."""

    __slots__ = ("__array_interface__",)

    def __init__(self, arena: Arena, offset: int, size: int, pool: "Pool | None") -> None:
        super().__init__(arena, offset, size, pool)
        self.__array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (arena.addr + offset, False),
            "version": 3,
        }


def find_block(arr: np.ndarray) -> "HostBlock | None":
    """The shared block an array views, or None.

    Found through the array's ``base`` chain; an array whose memory another object
    owns (``np.frombuffer(w.data)``, ``torch.from_numpy(w).numpy()``) by its address.
    """
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if type(base) is HostBlock:
        return base
    if base is None or arr.size == 0:
        return None  # memory the array owns: not shared
    lo, hi = _byte_bounds(arr)
    return _leases.block_at(lo, hi)


try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy < 2
    _byte_bounds = np.byte_bounds


def is_shared(arr: Any) -> bool:
    """Whether ``arr`` (or the array it is a view of) lives in actorshm shared memory."""
    if isinstance(arr, np.ndarray):
        return find_block(arr) is not None
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


# Every pool this process owns, for ``stats()``.
_pools: list = []


def stats() -> dict[str, int]:
    """This process's cumulative shared-memory and call counters, as a plain dict."""
    gauges: dict[str, int] = {"blocks_quarantined": _leases.quarantined()}
    for p in _pools:
        p.report(gauges)
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
        self._k_reuses = self.prefix + "pool_reuses"
        self._k_allocs = self.prefix + "pool_allocs"
        _pools.append(self)

    # -- regions ----------------------------------------------------------------
    def _make_region(self, key: tuple, size: int, dedicated: bool) -> Region:
        raise NotImplementedError

    def _over_budget(self, size: int) -> SharedMemoryError:
        return SharedMemoryError(
            f"actorshm: cannot allocate {fmt_bytes(size)} of shared memory: this process's "
            f"budget is {fmt_bytes(self.budget)} and {fmt_bytes(self.reserved)} is already in "
            "use. Drop arrays you no longer need, or raise the budget with "
            "actorshm.Runtime(shm_budget=...) (or ACTORSHM_SHM_BUDGET=bytes)."
        )

    def _new_region(self, size: int, dedicated: bool) -> Region:
        if self.reserved + size > self.budget:
            self._retire_free(self.reserved + size - self.budget)
        if self.reserved + size > self.budget:
            raise self._over_budget(size)
        index = self._next_index
        region = self._make_region((self.token, index), size, dedicated)
        self._next_index += 1
        self.regions[index] = region
        _leases.register_region(region)
        self.reserved += size
        return region

    def _retire_free(self, needed: int) -> None:
        """Free unused dedicated regions (largest first) until ``needed`` bytes are back."""
        candidates = []
        for blocks in self.free.values():
            for free in blocks:  # (region, offset, size)
                if free[0].dedicated and free[0].retirable():
                    candidates.append(free)
        candidates.sort(key=lambda free: -free[2])
        for free in candidates:
            region, _, size = free
            if needed <= 0:
                break
            self.free[size].remove(free)
            needed -= region.size
            self._retire(region)

    def _retire(self, region: Region) -> None:
        del self.regions[region.key[1]]
        _leases.unregister_region(region)
        self.reserved -= region.size
        region.close()
        _leases.region_retired(region)  # (allocation may run in any thread)

    def block_returned(self, region: Region, offset: int, size: int) -> None:
        """A block of ours died here (any thread, from a ``_Lease`` callback): it goes
        back on its free list at the next ``drain``."""
        self._returned.append((region, offset, size))

    def drain(self) -> None:
        """Move blocks returned (``block_returned``) back onto the free lists."""
        ret = self._returned
        if ret:
            with self.lock:
                while ret:
                    free = ret.popleft()  # (region, offset, size)
                    self.free[free[2]].append(free)
                    self.blocks_live -= 1

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

    def alloc(self, nbytes: int) -> Block:
        """A block of at least ``nbytes``: a recycled one when one fits, else a new one."""
        size = self.size_class(max(int(nbytes), 1))
        self.drain()
        with self.lock:
            free = self.free.get(size)
            if free:
                region, offset, _ = free.pop()
                counters[self._k_reuses] += 1
            elif size >= self.large:
                region, offset = self._new_region(size, dedicated=True), 0
                counters[self._k_allocs] += 1
            else:
                chunk = self._chunk
                if chunk is None or self._chunk_pos + size > chunk.size:
                    chunk = self._chunk = self._new_region(self.chunk_size, dedicated=False)
                    self._chunk_pos = 0
                region, offset = chunk, self._chunk_pos
                self._chunk_pos += size
                counters[self._k_allocs] += 1
            self.blocks_live += 1
        return region.block(offset, size, self)

    def close(self) -> None:
        for region in list(self.regions.values()):
            _leases.unregister_region(region)
            region.close()
        self.regions.clear()
        self.free.clear()
        self.reserved = 0


class HostPool(Pool):
    """This process's shared memory on the host: memfd arenas."""

    def _make_region(self, key: tuple, size: int, dedicated: bool) -> Arena:
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
                        f"actorshm: the machine has no room for {fmt_bytes(size)} more of "
                        f"shared memory ({exc.strerror}); {fmt_bytes(self.reserved)} is in use "
                        "by this process. Free memory, or use smaller arrays."
                    ) from None
                raise
            # Peers cannot shrink the file under our feet (which would be a SIGBUS).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            addr = map_fd(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return Arena(key, fd, size, addr, owned=True, dedicated=dedicated)

    def report(self, out: dict) -> None:
        super().report(out)
        out["shm_budget"] = self.budget


def default_budget() -> int:
    """``ACTORSHM_SHM_BUDGET`` bytes, else half the machine's RAM."""
    env = os.environ.get("ACTORSHM_SHM_BUDGET")
    if env:
        return int(float(env))
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        total = 16 << 30
    return total // 2


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


def set_budget(budget: int | None) -> None:
    """Set this process's host budget (``Runtime(shm_budget=...)``); None keeps it."""
    if budget:
        pool().budget = int(budget)


def array_from_block(view: HostBlock, shape, dtype, offset: int = 0, strides=None,
                    order: str = "C") -> np.ndarray:
    base = np.asarray(view)
    return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides, order=order)


def nbytes_of(shape, dtype) -> tuple[tuple, np.dtype, int]:
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
    a.fill(0)
    return a


def share(arr) -> np.ndarray:
    """``arr`` itself if it is already shared, else a copy of it in shared memory.

    Args:
        arr: an array, or anything ``numpy.asanyarray`` takes.

    Raises:
        TypeError: an object dtype.
        SharedMemoryError: over budget, as ``empty``.
    """
    arr = np.asanyarray(arr)
    if find_block(arr) is not None:
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
