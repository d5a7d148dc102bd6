"""Shared memory: regions, per-process pools, blocks, leases and recycling.

Host memory comes from anonymous ``memfd_create`` files ("arenas"), never from named
segments, so nothing can leak in /dev/shm and its mount size does not matter. Each
process owns a pool; small blocks are carved from 64 MiB chunk arenas, and blocks of
4 MiB or more get an arena of their own. An arena's fd crosses to a peer once (over
SCM_RIGHTS, see ``_protocol``) and is mapped once there; after that a block travels as
``(arena, offset, size)``. GPU memory (``_cuda``) is the same mechanism with another
kind of region: a slab of device memory whose CUDA IPC handle crosses once.

Every block a process can see is represented there by exactly one ``Block`` object,
the owner of all the arrays that view the block. A block remembers who leased it to
us (``upstream``: connection -> number of grants); when its last array is garbage
collected, it sends those grants back (batched, one-way) and, in the owner's process,
returns to the pool's free list. A connection that sends a block keeps the sender's
``Block`` alive (``Connection.grants``) until the receiver releases it. So a block is
recycled only after every process has dropped every reference to it, and nobody has to
write code for buffers to go home.

Leases are hop by hop: a process that passes on a block it was leased (a relay) holds
its own lease until everyone it passed the block to let go. Should the relay die, its
upstream would see its leases come back while processes downstream still use the
block; so an actor that passes on a peer's block tells its upstream first (a forward
notice, ``Connection.send_forward``), and a process whose peer dies holding forwarded
blocks keeps them (``quarantine``) instead of letting them go home. The driver sends no
notices: when it dies, every actor dies with it.
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

from ._errors import ActorDiedError, ProtocolError, SharedMemoryError

__all__ = ["Pool", "HostPool", "Region", "Block", "adopt", "empty", "zeros", "share", "is_shared", "stats", "pool"]

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
     "arenas_mapped", "releases_sent", "releases_received", "calls_sent", "calls_received",
     "forward_notices_sent",
     # GPU arrays (``_cuda``): present, at zero, also where CuPy was never imported.
     "cuda_bytes_zero_copy", "cuda_bytes_copied", "cuda_arrays_zero_copy",
     "cuda_arrays_copied", "cuda_pool_allocs", "cuda_pool_reuses", "cuda_handles_opened",
     "cuda_blocks_live", "cuda_slabs_owned", "cuda_slab_bytes_owned"],
    0,
)


def stats() -> dict[str, int]:
    """This process's cumulative shared-memory and call counters, as a plain dict."""
    gauges: dict[str, int] = {"blocks_quarantined": len(_quarantine)}
    for p in _pools:
        p.report(gauges)
    out = dict(_stats)
    out.update(gauges)
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


class Region:
    """One allocation that a pool carves blocks from, as seen by one process.

    On the host a region is a memfd arena (``Arena``); on a GPU it is a slab of device
    memory (``actorshm._cuda.Slab``). Everything else -- blocks, leases, free lists,
    recycling, retirement -- is the same for both and lives in this module.
    """

    __slots__ = ("key", "size", "owned", "dedicated", "device", "sent_to", "sources",
                 "asked", "retiring", "live", "__weakref__")

    def __init__(self, key: tuple, size: int, owned: bool, dedicated: bool,
                 device: int | None = None) -> None:
        self.key = key  # (owner pool token, index)
        self.size = size
        self.owned = owned
        self.dedicated = dedicated  # holds one block only (so it can be freed alone)
        self.device = device  # None on the host, the CUDA ordinal in this process on a GPU
        # Connections we introduced this region on, told when the region is retired.
        self.sent_to: weakref.WeakSet = weakref.WeakSet()
        # Connections that introduced it to us (a peer's region is closed when none is left).
        self.sources: weakref.WeakSet = weakref.WeakSet()
        self.asked: weakref.WeakSet = weakref.WeakSet()  # sources told we let go
        self.retiring = False  # a source let go: close it once no source or block is left
        self.live = 0  # blocks of a peer's region alive here (kept on the loop thread)

    def block(self, offset: int, size: int, pool: "Pool | None") -> "Block":
        raise NotImplementedError

    def retirable(self) -> bool:
        """Whether the owner may free this region while peers may still have it open."""
        return True

    def close(self) -> None:
        raise NotImplementedError


class Arena(Region):
    """One memfd file mapped into this process."""

    __slots__ = ("fd", "addr")

    def __init__(self, key: tuple, fd: int, size: int, addr: int, owned: bool,
                 dedicated: bool) -> None:
        super().__init__(key, size, owned, dedicated)
        self.fd = fd
        self.addr = addr

    def block(self, offset: int, size: int, pool: "Pool | None") -> "_View":
        return _View(self, offset, size, pool)

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


# Regions opened or owned in this process, host and GPU alike, by key (owner token, index).
_regions: dict[tuple, Region] = {}
# Regions a peer introduced that could not be opened here, with why: later blocks of them
# fail the same way (their calls fail; the connection lives on).
_unopenable: dict[tuple, str] = {}
# One live block object per block in this process: key (owner token, index, offset) ->
# its ``_Lease`` (a weak reference to the block).
_views: dict[tuple, "_Lease"] = {}
# Tokens of the pools this process owns (one host pool, one pool per GPU in use).
_own_tokens: set[int] = set()
# Grants to give back, appended when a block dies (any thread), flushed on the loop:
# (upstream, block key, region).
_releases: collections.deque = collections.deque()
# GPU grants whose device work has finished (see ``_cuda.fence``): ready to go back.
_fenced: collections.deque = collections.deque()
# Regions retired by their owner (any thread), announced to peers on the loop.
_retired: collections.deque = collections.deque()
_flush_hook: list = [None]  # set by the runtime: schedules ``flush_releases`` on its loop
# Whether this process tells its upstream when it passes a peer's block on (actors do;
# the driver does not need to, see the module docstring).
_forward_notices = [False]
# Blocks kept from going home: a process downstream may still use them, and nothing will
# tell us when it stops (a peer that passed them on ended, or we closed a connection to a
# peer that lives on; see ``Connection.close``).
_quarantine: list = []


def forwarded(block: "Block", conn) -> tuple | None:
    """We are about to pass ``block`` (a peer's) on over ``conn``: tell its upstream first.

    Returns the connections told, to be told again when ``conn``'s lease comes back
    (``unforwarded``). The notice is written before the frame that passes the block on,
    so if we die after passing it, our upstream knows the block may still be in use.
    """
    if not _forward_notices[0] or block.region.owned:
        return None
    told = tuple(u for u in (block.lease.upstream or ()) if u is not conn and not u.closed)
    for u in told:
        pending = u.send_forward(block.key, 1)
        if pending is not None:
            # Its socket is full: what passes the block on waits until the notice is out.
            u.after_item(pending, _release_hold(conn, conn.hold()))
    _stats["forward_notices_sent"] += len(told)
    return told or None


def _release_hold(conn, hold: list):
    def done(ok: bool) -> None:
        if ok:  # the notice is out, or its reader is gone (and so is its use)
            conn.unhold(hold)
        else:
            # We closed the upstream while it lives on, with the notice unsent: what we
            # passed on must never reach the peer, or the upstream could recycle it.
            conn.close(ActorDiedError(
                f"the connection to {conn.label} was closed: a block passed on over it "
                "could not be accounted for (its upstream's connection closed first)"),
                peer_gone=False)
    return done


def unforwarded(key: tuple, told: tuple) -> None:
    """The lease we passed on came back (or its holder died): withdraw the notice."""
    for u in told:
        u.send_forward(key, -1)


def quarantine(blocks: list) -> None:
    """Keep these blocks from going home: a peer they were passed to may still use them
    through a process that passed them on, and nothing will tell us when it stops."""
    _quarantine.extend(blocks)


def release_quarantine() -> None:
    """Every process that could hold a quarantined block is gone (the runtime closed)."""
    _quarantine.clear()


def _wake() -> None:
    hook = _flush_hook[0]
    if hook is not None:
        hook()


class _Lease(weakref.ref):
    """How ``_views`` finds a live block, and what gives its lease back when it dies.

    The callback runs once the block is unreachable and every weak reference to it is
    already cleared, so no other thread can pick the dying block up again (a ``__del__``
    could be raced: it runs while weak references still resolve).
    """

    __slots__ = ("key", "upstream", "pool", "region", "offset", "size")


def _block_died(lease: _Lease) -> None:
    try:
        if lease.upstream:
            _releases.append((lease.upstream, lease.key, lease.region))
            _wake()
        if lease.pool is not None:
            lease.pool._returned.append((lease.region, lease.offset, lease.size))
    except Exception:  # interpreter shutdown: nothing left to tell
        pass


class Block:
    """This process's handle on one block: the owner of every array that views it.

    A process has at most one live ``Block`` per block (``_views``). Its lease records
    who leased it to us (``upstream``: connection -> number of grants); when the last
    array on the block is garbage collected, the grants go back (batched, one-way), and
    in the owner's process the block returns to the pool's free list.
    """

    __slots__ = ("region", "offset", "size", "key", "lease", "__weakref__")

    def __init__(self, region: Region, offset: int, size: int, pool: "Pool | None") -> None:
        self.region = region
        self.offset = offset
        self.size = size
        self.key = key = (region.key[0], region.key[1], offset)
        self.lease = lease = _Lease(self, _block_died)
        lease.key = key
        lease.upstream = None
        lease.pool = pool
        lease.region = region
        lease.offset = offset
        lease.size = size
        _views[key] = lease
        if len(_views) > _prune_at[0]:
            _prune_views()


class _View(Block):
    """A host block: the ``base`` of every numpy array that views it."""

    __slots__ = ("__array_interface__",)

    def __init__(self, arena: Arena, offset: int, size: int, pool: "Pool | None") -> None:
        super().__init__(arena, offset, size, pool)
        self.__array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (arena.addr + offset, False),
            "version": 3,
        }


_prune_at = [4096]


def _prune_views() -> None:
    """Drop entries of dead views (the map is only ever read through live refs)."""
    for key, ref in list(_views.items()):
        if ref() is None and _views.get(key) is ref:
            _views.pop(key, None)
    _prune_at[0] = max(4096, 2 * len(_views))


def flush_releases() -> None:
    """Hand pending releases and retirements to their connections (on the event loop).

    A GPU grant goes back only once this process's work queued on that device before
    the block died has finished (``_cuda.fence``), so that its owner can reuse the
    memory at once; host grants go back straight away.
    """
    while _retired:
        _announce_retired(_retired.popleft())
    if _fenced:
        _give_back(_fenced)
    if not _releases:
        return
    host: collections.deque = collections.deque()
    gpu = []
    while _releases:  # take a snapshot first: other threads may append meanwhile
        item = _releases.popleft()
        (host if item[2].device is None else gpu).append(item)
    _give_back(host)
    if gpu:
        from ._cuda import fence
        try:
            fence(gpu)  # moves them to _fenced, now or from a helper thread that wakes us
        except Exception:  # a broken CUDA context: nothing left to wait for
            _fenced.extend(gpu)
        _give_back(_fenced)


def _give_back(ready: collections.deque) -> None:
    """Send released grants upstream; close peers' regions whose last block this was."""
    closable = []
    while ready:
        upstream, key, region = ready.popleft()
        for conn, n in upstream.items():
            conn.queue_release(key, n)
        region.live -= 1
        if region.live <= 0 and region.retiring:
            closable.append(region.key)
    for rkey in closable:
        _try_close(rkey)


def adopt(conn, opener, rkey: tuple, rsize: int, intro, boff: int, bsize: int,
          ctx=None) -> Block:
    """The block a peer just leased to us over ``conn``: every receive path ends here.

    A process holds at most one lease per block: a grant for a block we already hold
    (or own) goes straight back, since holding both would let two processes that passed
    a block back and forth pin it for each other forever. Otherwise the block's region
    is opened once per process, with ``opener(ctx, rkey, rsize, intro)``; ``intro`` is
    what the peer sent to open it (an fd, an IPC handle), only the first time the
    region crosses this connection. A region that cannot be opened here fails this
    block (its grant goes back) and every later block of it the same way, without
    closing the connection.
    """
    bkey = (rkey[0], rkey[1], boff)
    region = _regions.get(rkey)
    if region is not None and intro is not None:
        region.sources.add(conn)
        conn.received_regions.add(rkey)
        region.retiring = False  # a live peer sends it: nothing to close until one lets go
        region.asked.discard(conn)
    ref = _views.get(bkey)
    view = ref() if ref is not None else None
    if view is not None:
        conn.queue_release(bkey, 1)
        return view
    if rkey[0] in _own_tokens:
        # Ours, but recycled: a process that relayed it died while another still held
        # it (see docs/shared-memory.md). That call fails; the connection is fine.
        conn.queue_release(bkey, 1)
        raise SharedMemoryError(
            "actorshm: an array came back to the process that owns its memory after that "
            "memory was recycled (a process that passed it on died while others still "
            "held it); its contents are not what the sender had. Copy arrays you keep "
            "from actors that may die.")
    if region is None:
        try:
            why = _unopenable.get(rkey)
            if why is not None and intro is None:  # (a new introduction is tried afresh)
                raise RuntimeError(why)
            region = opener(ctx, rkey, rsize, intro)
        except ProtocolError:
            raise  # the connection closes, and with it every lease on it
        except Exception as exc:
            _unopenable[rkey] = str(exc)
            conn.queue_release(bkey, 1)  # this block fails; its grant must not leak
            raise
        _regions[rkey] = region
        region.sources.add(conn)
        conn.received_regions.add(rkey)
    if boff < 0 or bsize < 0 or boff + bsize > region.size:
        raise ProtocolError("block lies outside its region")
    view = region.block(boff, bsize, None)
    view.lease.upstream = {conn: 1}
    region.live += 1
    return view


def connection_closed(conn) -> None:
    """A connection closed: every region it brought in has lost that source."""
    for rkey in list(conn.received_regions):
        source_gone(conn, rkey)


def source_gone(conn, rkey: tuple) -> None:
    """``conn`` will send no more blocks of a peer's region (it retired the region, or
    closed). With no live source left, the region is closed here once no block of it is
    in use, so a dead peer's memory does not stay mapped forever."""
    conn.received_regions.discard(rkey)
    # The peer let go of it: should we send it blocks of the region again, the region
    # must be introduced afresh.
    conn.sent_regions.discard(rkey)
    region = _regions.get(rkey)
    if region is None or region.owned:
        return
    region.sources.discard(conn)
    region.retiring = True
    _try_close(rkey)


def _try_close(rkey: tuple) -> None:
    region = _regions.get(rkey)
    if region is None or not region.retiring:
        return
    if region.live > 0:
        return  # in use here: tried again when its last block dies
    live = [c for c in region.sources if not c.closed]
    if not live:
        del _regions[rkey]
        _announce_retired(region)
        region.close()
    else:
        # The peers left may hold it only through us: a block handed back, or passed
        # round a loop, after its owner let go. Tell them, and everyone we passed it
        # to, that we let go: each forgets it introduced the region to us, and lets go
        # in turn if it has no other source. We close once every source has (its
        # RETIRE), so frames in flight stay valid; one that keeps it (its live owner)
        # simply introduces it afresh next time.
        for conn in live:
            if conn not in region.sent_to and conn not in region.asked:
                region.asked.add(conn)
                conn.send_retire(rkey)
        _announce_retired(region)


def _announce_retired(region: Region) -> None:
    """Tell every peer we introduced ``region`` to that we will send no more of it."""
    for conn in list(region.sent_to):
        conn.send_retire(region.key)
        conn.sent_regions.discard(region.key)  # introduced afresh if we ever send it again
    region.sent_to.clear()


def find_view(arr: np.ndarray) -> "_View | None":
    """The shared block an array views, or None."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if type(base) is _View:
        return base
    if base is None or arr.size == 0:
        return None  # the array owns its memory: numpy allocated it, not actorshm
    # Memory reached through something other than ndarray ``.base`` (a memoryview, a
    # torch tensor, a ctypes buffer): recognise it by address.
    lo, hi = extent(arr.__array_interface__["data"][0], arr.shape, arr.strides,
                    arr.itemsize)
    return view_at(lo, hi)


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


# Every pool this process owns, for ``stats()``.
_pools: list = []


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
        _own_tokens.add(self.token)
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
            f"actorshm: cannot allocate {_fmt(size)} of shared memory: this process's "
            f"budget is {_fmt(self.budget)} and {_fmt(self.reserved)} is already in "
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
        _regions[region.key] = region
        self.reserved += size
        return region

    def _retire_free(self, needed: int) -> None:
        """Free unused dedicated regions (largest first) until ``needed`` bytes are back."""
        candidates = []
        for blocks in self.free.values():
            for blk in blocks:
                if blk[0].dedicated and blk[0].retirable():
                    candidates.append(blk)
        candidates.sort(key=lambda b: -b[2])
        for blk in candidates:
            if needed <= 0:
                break
            self.free[blk[2]].remove(blk)
            needed -= blk[0].size
            self._retire(blk[0])

    def _retire(self, region: Region) -> None:
        del self.regions[region.key[1]]
        _regions.pop(region.key, None)
        self.reserved -= region.size
        region.close()
        if region.sent_to:  # allocation may run in any thread: peers are told on the loop
            _retired.append(region)
            _wake()

    def drain(self) -> None:
        """Move blocks returned by ``_block_died`` (any thread) back onto the free lists."""
        ret = self._returned
        if ret:
            with self.lock:
                while ret:
                    blk = ret.popleft()
                    self.free[blk[2]].append(blk)
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
                _stats[self._k_reuses] += 1
            elif size >= self.large:
                region, offset = self._new_region(size, dedicated=True), 0
                _stats[self._k_allocs] += 1
            else:
                chunk = self._chunk
                if chunk is None or self._chunk_pos + size > chunk.size:
                    chunk = self._chunk = self._new_region(self.chunk_size, dedicated=False)
                    self._chunk_pos = 0
                region, offset = chunk, self._chunk_pos
                self._chunk_pos += size
                _stats[self._k_allocs] += 1
            self.blocks_live += 1
        return region.block(offset, size, self)

    def close(self) -> None:
        for region in list(self.regions.values()):
            _regions.pop(region.key, None)
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
        return Arena(key, fd, size, addr, owned=True, dedicated=dedicated)

    def report(self, out: dict) -> None:
        super().report(out)
        out["shm_budget"] = self.budget


def default_budget() -> int:
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


def extent(addr: int, shape, strides, itemsize: int) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` that a strided array starting at ``addr`` touches."""
    lo = hi = addr
    for n, st in zip(shape, strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + itemsize


def view_at(lo: int, hi: int) -> "_View | None":
    """The live host block that holds the bytes ``[lo, hi)``, or None.

    How memory is recognised as shared when no ``.base`` chain leads to its block
    (``torch.from_numpy(w).numpy()``, ``np.frombuffer(w.data)``, a tensor's storage):
    the arena mapped at that address, then the live block of it that covers the range.
    """
    for region in list(_regions.values()):
        addr = getattr(region, "addr", 0)
        if addr and addr <= lo and hi <= addr + region.size:
            break
    else:
        return None
    off, end = lo - addr, hi - addr
    rk0, rk1 = region.key
    ref = _views.get((rk0, rk1, 0))  # a large block has its arena to itself
    v = ref() if ref is not None else None
    if type(v) is _View and end <= v.size:
        return v
    for key, ref in list(_views.items()):
        if key[0] == rk0 and key[1] == rk1 and key[2] <= off:
            v = ref()
            if type(v) is _View and v.region is region and end <= key[2] + v.size:
                return v
    return None
