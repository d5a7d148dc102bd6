"""The lease engine: regions, blocks, who holds them, and bringing them home.

Memory that travels between processes lives in regions (a host arena, ``_shm``; a GPU
slab, ``_cuda``), each owned by the pool of one process and opened once by each peer it
is sent to. A pool carves blocks out of its regions; every block a process can see is
represented there by exactly one ``Block`` object, the owner of all the arrays on it.

A block remembers who leased it to us (``upstream``: connection -> number of grants);
when its last array is garbage collected, its ``_Lease`` (a weak reference) queues those
grants to go back (batched, one-way, ``dispatch_releases``) and, in the owner's process,
returns the block to its pool's free list. A connection that sends a block keeps the
sender's ``Block`` alive (its ``_ledger``) until the receiver releases it. So a block is
recycled only after every process has dropped every reference to it, and nobody has to
write code for buffers to go home.

Leases are hop by hop: a process that passes on a block it was leased (a relay) holds
its own lease until everyone it passed the block to let go. Should the relay die, its
upstream would see its leases come back while processes downstream still use the
block; so an actor that passes on a peer's block tells its upstream first (a forward
notice, ``forwarded``), and a process whose peer dies holding forwarded blocks keeps
them (``quarantine``) instead of letting them go home. The driver sends no notices:
when it dies, every actor dies with it.

This module talks to connections only through ``Channel`` (what a connection offers a
lease), and knows no kind of memory: a region subclass says how it is mapped, closed and
fenced.
"""

from __future__ import annotations

import collections
import os
import weakref
from typing import Any, Protocol

from ._errors import ActorDiedError, ProtocolError, SharedMemoryError
from ._quarantine import (process_gone, process_started, quarantine,  # noqa: F401
                          quarantined, release_quarantine, set_census)

__all__ = ["Region", "Block", "Channel", "adopt", "forwarded", "unforwarded", "quarantine",
           "dispatch_releases", "counters"]


class Channel(Protocol):
    """What a lease needs of a connection (``_protocol.Connection`` provides it)."""

    label: str
    closed: bool
    sent_regions: set  # regions we introduced on it
    received_regions: set  # regions it introduced to us

    def queue_release(self, key: tuple, n: int) -> None: ...
    def send_forward(self, key: tuple, n: int) -> Any: ...
    def send_retire(self, key: tuple) -> None: ...
    def hold(self) -> Any: ...
    def unhold(self, hold: Any) -> None: ...
    def after_item(self, item: Any, callback) -> None: ...
    def close(self, exc: BaseException | None = None, *, peer_gone: bool = True) -> None: ...

# This process's counters; ``stats()`` returns a copy. Plain ints in a dict: cheap.
counters: dict[str, int] = dict.fromkeys(
    ["bytes_copied", "bytes_zero_copy", "arrays_copied", "arrays_zero_copy",
     "pool_allocs", "pool_reuses", "blocks_live", "arenas_owned", "arena_bytes_owned",
     "arenas_mapped", "releases_sent", "releases_received", "calls_sent", "calls_received",
     "forward_notices_sent", "messages_spilled", "bytes_spilled",
     # GPU arrays (``_cuda``): present, at zero, also where CuPy was never imported.
     "cuda_bytes_zero_copy", "cuda_bytes_copied", "cuda_arrays_zero_copy",
     "cuda_arrays_copied", "cuda_pool_allocs", "cuda_pool_reuses", "cuda_handles_opened",
     "cuda_blocks_live", "cuda_slabs_owned", "cuda_slab_bytes_owned"],
    0,
)


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

    def block(self, offset: int, size: int, pool: Any) -> "Block":
        raise NotImplementedError

    def retirable(self) -> bool:
        """Whether the owner may free this region while peers may still have it open."""
        return True

    @staticmethod
    def fence(releases: list) -> None:
        """Hand ``releases`` of this kind of region to ``releases_ready`` once they may go
        home. Host memory needs nothing to finish first; a GPU slab overrides this to
        wait for the work queued on its device (``actorshm._cuda``).

        Args:
            releases: ``(upstream, block key, region)`` items, all of this class.
        """
        releases_ready(releases)

    def close(self) -> None:
        raise NotImplementedError


# Regions opened or owned in this process, host and GPU alike, by key (owner token, index).
_regions: dict[tuple, Region] = {}
# Regions a peer introduced that could not be opened here, with why: later blocks of them
# fail the same way (their calls fail; the connection lives on): the error's type and text.
_unopenable: dict[tuple, tuple] = {}
# One live block object per block in this process: key (owner token, index, offset) ->
# its ``_Lease`` (a weak reference to the block).
_blocks: dict[tuple, "_Lease"] = {}
# Tokens of the pools this process owns (one host pool, one pool per GPU in use).
_own_tokens: set[int] = set()
# Grants to give back, appended when a block dies (any thread), flushed on the loop:
# (upstream, block key, region).
pending_releases: collections.deque = collections.deque()
# Grants whose region's fence has passed (``Region.fence``): ready to go back.
_fenced: collections.deque = collections.deque()
# Regions retired by their owner (any thread), announced to peers on the loop.
_retired: collections.deque = collections.deque()
_release_hook = None  # ``set_release_hook``: schedules ``dispatch_releases`` on the loop
# Whether this process tells its upstream when it passes a peer's block on (actors do;
# the driver does not need to, see the module docstring): ``set_forward_notices``.
_forward_notices = False


def _no_notices_after_fork() -> None:
    """A child forked from an actor is no actor (it may open a runtime of its own, a
    driver's role): a notice would go out on the actor's connection it inherited."""
    global _forward_notices
    _forward_notices = False


os.register_at_fork(after_in_child=_no_notices_after_fork)


def live_blocks() -> tuple[list, set]:
    """This process's live ``Block`` objects, and its own pools' tokens (any thread)."""
    return [b for b in (r() for r in list(_blocks.values())) if b is not None], set(_own_tokens)


def block_at(lo: int, hi: int, device: int | None = None) -> "Block | None":
    """The live block holding the bytes ``[lo, hi)`` at these addresses, or None: how
    memory reached some other way than through a block's arrays is recognised."""
    for region in list(_regions.values()):
        base = getattr(region, "addr", 0)
        if region.device != device or not (base and base <= lo and hi <= base + region.size):
            continue
        off, end, k0, k1 = lo - base, hi - base, region.key[0], region.key[1]
        for k, ref in list(_blocks.items()):
            b = ref() if k[0] == k0 and k[1] == k1 else None
            if b is not None and b.offset <= off and end <= b.offset + b.size:
                return b
        return None
    return None


def register_region(region: Region) -> None:
    """A pool made ``region`` (any thread): blocks of it can now be found here."""
    _regions[region.key] = region


def unregister_region(region: Region) -> None:
    """A pool freed or closed ``region``: no block of it can be found here any more."""
    _regions.pop(region.key, None)


def region_retired(region: Region) -> None:
    """Its pool freed ``region`` (any thread): peers it was sent to are told on the loop."""
    if region.sent_to:
        _retired.append(region)
        _wake()


def own_token(token: int) -> None:
    """Blocks of regions keyed with ``token`` are this process's own (a pool's)."""
    _own_tokens.add(token)


def forwarded(block: "Block", conn) -> tuple | None:
    """We are about to pass ``block`` (a peer's) on over ``conn``: tell its upstream first.

    Returns the connections told, to be told again when ``conn``'s lease comes back
    (``unforwarded``). The notice is written before the frame that passes the block on,
    so if we die after passing it, our upstream knows the block may still be in use.
    """
    if not _forward_notices or block.region.owned:
        return None
    told = tuple(u for u in (block.lease.upstream or ()) if u is not conn and not u.closed)
    for u in told:
        pending = u.send_forward(block.key, 1)
        if pending is not None:
            # Its socket is full: what passes the block on waits until the notice is out.
            u.after_item(pending, _release_hold(conn, conn.hold()))
    counters["forward_notices_sent"] += len(told)
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


def _wake() -> None:
    hook = _release_hook
    if hook is not None:
        hook()


def set_release_hook(hook) -> None:
    """Install what schedules ``dispatch_releases`` on this process's event loop.

    Args:
        hook: a callable safe to call from any thread, or None to stop scheduling.
    """
    global _release_hook
    _release_hook = hook


def release_hook():
    """The hook ``set_release_hook`` installed last (None: none yet)."""
    return _release_hook


def set_forward_notices(on: bool) -> None:
    """Whether this process sends forward notices (actors do; see the module docstring)."""
    global _forward_notices
    _forward_notices = bool(on)


def releases_ready(releases) -> None:
    """Releases whose fence has passed (any thread): sent on the loop's next flush."""
    _fenced.extend(releases)
    _wake()


class _Lease(weakref.ref):
    """How ``_blocks`` finds a live block, and what gives its lease back when it dies.

    The callback runs once the block is unreachable and every weak reference to it is
    already cleared, so no other thread can pick the dying block up again (a ``__del__``
    could be raced: it runs while weak references still resolve).
    """

    __slots__ = ("key", "upstream", "pool", "region", "offset", "size")


def _block_died(lease: _Lease) -> None:
    upstream, region, pool = lease.upstream, lease.region, lease.pool
    # The dead lease stays in ``_blocks`` (and in a plug-in's map) until they are
    # pruned: it must not keep its connections and region alive meanwhile (a driver
    # that spawns and kills actors that send it arrays kept each one's connection).
    lease.upstream = lease.region = lease.pool = None
    try:
        if upstream:
            pending_releases.append((upstream, lease.key, region))
            _wake()
        if pool is not None:
            pool.block_returned(region, lease.offset, lease.size)
    except Exception:  # interpreter shutdown: nothing left to tell
        pass


class Block:
    """This process's handle on one block: the owner of every array that views it.

    A process has at most one live ``Block`` per block (``_blocks``). Its lease records
    who leased it to us (``upstream``: connection -> number of grants); when the last
    array on the block is garbage collected, the grants go back (batched, one-way), and
    in the owner's process the block returns to the pool's free list.
    """

    __slots__ = ("region", "offset", "size", "key", "lease", "__weakref__")

    def __init__(self, region: Region, offset: int, size: int, pool: Any) -> None:
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
        _blocks[key] = lease
        if len(_blocks) > _prune_at:
            _prune_blocks()


_prune_at = 4096  # prune dead entries of ``_blocks`` once it grows past this


def _prune_blocks() -> None:
    """Drop entries of dead views (the map is only ever read through live refs)."""
    for key, ref in list(_blocks.items()):
        if ref() is None and _blocks.get(key) is ref:
            _blocks.pop(key, None)
    global _prune_at
    _prune_at = max(4096, 2 * len(_blocks))


def dispatch_releases() -> None:
    """Hand pending releases and retirements to their connections (on the event loop).

    A grant goes back once its region's fence has passed (``Region.fence``): at once on
    the host; on a GPU once this process's work queued on that device before the block
    died has finished, so that its owner can reuse the memory at once.
    """
    while _retired:
        _announce_retired(_retired.popleft())
    if _fenced:
        _give_back(_fenced)
    if not pending_releases:
        return
    host: collections.deque = collections.deque()
    fenced: dict = {}  # a region class's fence -> its releases
    host_fence = Region.fence
    while pending_releases:  # a snapshot first: other threads may append meanwhile
        item = pending_releases.popleft()
        fence = item[2].fence
        if fence is host_fence:
            host.append(item)
        else:
            fenced.setdefault(fence, []).append(item)
    _give_back(host)
    for fence, items in fenced.items():
        try:
            fence(items)  # to ``releases_ready``, now or from a thread that wakes us
        except Exception:  # e.g. a broken CUDA context: nothing left to wait for
            _fenced.extend(items)
    if fenced:
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
    ref = _blocks.get(bkey)
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
                raise why[0](why[1])  # (as the first block of it failed)
            region = opener(ctx, rkey, rsize, intro)
        except ProtocolError:
            raise  # the connection closes, and with it every lease on it
        except Exception as exc:
            _unopenable[rkey] = (SharedMemoryError if isinstance(exc, SharedMemoryError)
                                 else RuntimeError, str(exc))
            conn.queue_release(bkey, 1)  # this block fails; its grant must not leak
            if intro is not None:
                # The peer forgets it introduced the region here (as when we let go of
                # one), so that it introduces it afresh with its next block of it, which
                # is tried again: out of fds or address space now, maybe not then.
                conn.send_retire(rkey)
            raise
        _unopenable.pop(rkey, None)
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
