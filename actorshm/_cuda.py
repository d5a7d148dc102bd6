"""The CuPy path: GPU slabs, CUDA IPC handles, GPU leases. Imported only when needed.

GPU memory is the host mechanism (``_shm``) with another kind of region. Each process
owns one pool per GPU; its regions are slabs it allocated itself with
``cupy.cuda.Memory`` (so a slab's pointer is its allocation base, and its IPC handle
names exactly that slab). Small blocks are carved from chunk slabs, large ones get a
slab of their own, and free blocks are recycled by size class, exactly as on the host.
A block travels as (slab, offset, size) plus shape, dtype and strides; the first time a
slab crosses a connection its IPC handle and PCI bus id ride along, and the receiver
opens the handle once and keeps it open. The receiver's ``GpuBlock`` is a lease given
back over the same RELEASE frames as host blocks (``_leases.adopt``), so the sender's
block stays alive until every receiver let go, and then returns to the sender's pool.

Ordering: before a message leaves, the sender synchronizes its current stream on each
GPU involved, so the receiver's work runs after the sender's pending work; the reply to
a call that received GPU arrays leaves after the actor's work on their devices finished
(``wait_for_call_work``), so the caller sees what the call wrote into them even when
the reply carries no GPU array; a lease goes back only once the releasing process's
work queued on that device has finished, so the owner can reuse the block at once. See
docs/gpu.md.
"""

from __future__ import annotations

import threading
import weakref

import cupy

from . import _leases, _serialization, _shm
from ._errors import ProtocolError, SharedMemoryError
from ._inband import dtype_token
from ._util import fmt_bytes
from ._wire import GPU_SLAB

_stats = _leases.counters  # its cuda_* keys are ours

_runtime = cupy.cuda.runtime
_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation

# Block base pointer -> live GpuBlock in this process: how an array finds its block.
_by_ptr: "weakref.WeakValueDictionary[int, GpuBlock]" = weakref.WeakValueDictionary()


def device_count() -> int:
    """How many GPUs CuPy sees in this process."""
    return _runtime.getDeviceCount()


def _local_device(bus_id: str) -> int:
    """This process's ordinal for the GPU at ``bus_id`` (ordinals differ per process)."""
    try:
        return _runtime.deviceGetByPCIBusId(bus_id)
    except _runtime.CUDARuntimeError:
        raise RuntimeError(
            f"actorshm: the GPU at PCI bus {bus_id} holds this array but is not visible "
            "in this process; an actor spawned with num_gpus sees only its own GPU "
            "(CUDA_VISIBLE_DEVICES). Send it to an actor on that GPU, or copy it to the "
            "host first.") from None


class Slab(_leases.Region):
    """One allocation of device memory: owned (ours) or opened from a peer's IPC handle."""

    __slots__ = ("mem", "ptr", "bus_id", "handle")

    def __init__(self, key: tuple, size: int, device: int, bus_id: str, *, dedicated: bool,
                 mem=None, ptr: int = 0, handle: bytes | None = None) -> None:
        super().__init__(key, size, owned=mem is not None, dedicated=dedicated,
                         device=device)
        self.mem = mem
        self.ptr = mem.ptr if mem is not None else ptr
        self.bus_id = bus_id
        self.handle = handle

    def block(self, offset: int, size: int, pool) -> "GpuBlock":
        return GpuBlock(self, offset, size, pool)

    def ipc_handle(self) -> bytes:
        """The slab's IPC handle, exported once (only owned slabs export; peers forward)."""
        if self.handle is None:
            self.handle = bytes(_runtime.ipcGetMemHandle(self.ptr))
        return self.handle

    @staticmethod
    def fence(releases: list) -> None:
        fence(releases)

    def retirable(self) -> bool:
        # A peer may hold an exported slab open, and freeing memory that another process
        # still has open is undefined behaviour in CUDA: only never-exported slabs go.
        return self.handle is None

    def close(self) -> None:
        if self.mem is not None:
            self.mem = None  # cupy frees it
        elif self.ptr:
            try:
                with cupy.cuda.Device(self.device):
                    _runtime.ipcCloseMemHandle(self.ptr)
            except Exception:
                pass
        self.ptr = 0


class GpuBlock(_leases.Block):
    """A GPU block in this process: the owner of the memory under its CuPy arrays."""

    __slots__ = ("ptr",)

    def __init__(self, slab: Slab, offset: int, size: int, pool) -> None:
        super().__init__(slab, offset, size, pool)
        self.ptr = slab.ptr + offset
        _by_ptr[self.ptr] = self

    def array(self, shape, dtype, offset: int = 0, strides=None, order: str = "C"):
        mem = cupy.cuda.UnownedMemory(self.ptr, self.size, self, self.region.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset), strides,
                            order)


class GpuPool(_shm.Pool):
    """This process's memory on one GPU: slabs, recycled by size class."""

    chunk_size = 32 << 20
    large = 2 << 20  # CUDA maps IPC memory at 2 MiB granularity
    prefix = "cuda_"
    region_noun = "cuda_slabs"

    def __init__(self, device: int) -> None:
        self.bus_id = _runtime.deviceGetPCIBusId(device)  # fails first for a bad device
        self.device = device
        super().__init__(budget=1 << 62)  # the device's memory is the limit

    def size_class(self, nbytes: int) -> int:
        return (_shm.size_class(nbytes) + 255) & ~255  # CUDA's allocation alignment

    def _make_region(self, key: tuple, size: int, dedicated: bool) -> Slab:
        with cupy.cuda.Device(self.device):
            try:
                mem = cupy.cuda.Memory(size)
            except _runtime.CUDARuntimeError as exc:
                if exc.status != _ERROR_MEMORY_ALLOCATION:
                    raise
                # Give back what is cached and unused, then try once more.
                cupy.get_default_memory_pool().free_all_blocks()
                self._retire_free(size)
                try:
                    mem = cupy.cuda.Memory(size)
                except _runtime.CUDARuntimeError as exc2:
                    if exc2.status != _ERROR_MEMORY_ALLOCATION:
                        raise
                    free, total = _runtime.memGetInfo()
                    raise SharedMemoryError(
                        f"actorshm: GPU {self.device} has no room for "
                        f"{fmt_bytes(size)} more ({fmt_bytes(free)} of "
                        f"{fmt_bytes(total)} free; {fmt_bytes(self.reserved)} is held by "
                        "this process's actorshm pool). Drop GPU arrays you no longer "
                        "need, in this process and in the actors you sent them to."
                    ) from None
        return Slab(key, size, self.device, self.bus_id, dedicated=dedicated, mem=mem)


_pools: dict[int, GpuPool] = {}
_pools_lock = threading.Lock()


def pool(device: int | None = None) -> GpuPool:
    """This process's pool on ``device`` (default: the current device), made on first use."""
    if device is None:
        device = _runtime.getDevice()
    p = _pools.get(device)
    if p is None:
        with _pools_lock:
            p = _pools.get(device)
            if p is None:
                p = _pools[device] = GpuPool(device)
    return p


def find_block(arr) -> GpuBlock | None:
    """The actorshm GPU block a CuPy array views, or None."""
    # Every array on a block shares the block's UnownedMemory, whose pointer is the
    # block's base; device pointers are unique within a process (unified addressing).
    return _by_ptr.get(arr.data.mem.ptr)


def block_at(lo: int, hi: int, device: int) -> GpuBlock | None:
    """The live GPU block in this process holding the device bytes ``[lo, hi)`` on
    ``device``, or None: how memory reached other than through a CuPy array of a block
    (a torch tensor's storage) is recognised. A block's base is one dict lookup; an
    address inside a block scans this process's live GPU blocks."""
    b = _by_ptr.get(lo)
    if b is not None and b.region.device == device and hi <= b.ptr + b.size:
        return b
    for b in list(_by_ptr.values()):
        if b.region.device == device and b.ptr <= lo and hi <= b.ptr + b.size and b.region.ptr:
            return b
    return None


def empty(shape, dtype=float, order="C"):
    """A new CuPy array in a block of this process's pool on the current device.

    Raises:
        ValueError: ``order`` is not ``"C"`` or ``"F"``.
        TypeError: an object dtype.
        SharedMemoryError: the GPU has no room.
    """
    shape, dtype, n = _shm.nbytes_of(shape, dtype)
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', not {order!r}")
    block = pool().alloc(n)
    with cupy.cuda.Device(block.region.device):
        return block.array(shape, dtype, order=order)


def zeros(shape, dtype=float, order="C"):
    """``empty``, filled with zeros."""
    a = empty(shape, dtype, order)
    a.fill(0)
    return a


def share(arr):
    """``arr`` itself if it is already in an actorshm block, else a copy in one.

    Raises:
        TypeError: ``arr`` is not a ``cupy.ndarray``.
    """
    if not isinstance(arr, cupy.ndarray):
        raise TypeError(f"actorshm.cuda.share needs a cupy.ndarray, not "
                        f"{type(arr).__name__}; use actorshm.share for numpy arrays")
    if find_block(arr) is not None:
        return arr
    with arr.device:
        out = empty(arr.shape, arr.dtype, "F" if arr.flags.f_contiguous and
                    not arr.flags.c_contiguous else "C")
        out[...] = arr  # device to device, on the current stream
    return out


def is_shared(arr) -> bool:
    """Whether ``arr`` is a CuPy array on an actorshm GPU block."""
    return isinstance(arr, cupy.ndarray) and find_block(arr) is not None


def wait_for_senders_work(devices) -> None:
    """Before a message with GPU arrays leaves: the receiver must see our queued work.

    Synchronizes this thread's current stream on each device the message's blocks live
    on, after every copy the message itself queued (``share`` of a CuPy-pool array).
    """
    for dev in devices:
        with cupy.cuda.Device(dev):
            cupy.cuda.get_current_stream().synchronize()


def device_event(dev: int):
    """An event recorded now on ``dev``'s legacy default stream: it completes after the
    work queued before it on every blocking stream of the device, from any thread. Made
    blocking, so that a thread waiting on it sleeps instead of spinning a CPU core."""
    with cupy.cuda.Device(dev):
        ev = cupy.cuda.Event(block=True, disable_timing=True)
        _runtime.eventRecord(ev.ptr, _runtime.streamLegacy)
    return ev


def wait_for_call_work(devices) -> None:
    """Before the reply to a call that received GPU arrays leaves: the caller must see
    what the call wrote into them. Besides this thread's current stream
    (``wait_for_senders_work``), the device's blocking streams (``device_event``): the
    method may have run in an executor thread (``max_concurrency`` > 1)."""
    wait_for_senders_work(devices)
    for dev in devices:
        device_event(dev).synchronize()


_fence_lock = threading.Lock()
_fence_queue: list = []
_fence_thread: threading.Thread | None = None


def fence(items) -> None:
    """Give GPU leases back once this process's work on their devices has finished.

    ``items`` are (upstream, key, region) releases. A ``device_event`` is recorded on
    each device. When the events are done already (a consumer that finished its work),
    the releases go straight to ``_leases.releases_ready``; otherwise a helper thread
    waits for them, so the event loop never blocks on the GPU.
    """
    global _fence_thread
    events = [device_event(dev) for dev in {item[2].device for item in items}]
    if all(ev.done for ev in events):
        _leases.releases_ready(items)
        return
    with _fence_lock:
        _fence_queue.append((events, items))
        if _fence_thread is None:
            th = threading.Thread(target=_fence_loop, name="actorshm-gpu-fence", daemon=True)
            _fence_thread = th
            th.start()


def _fence_loop() -> None:
    global _fence_thread
    while True:
        with _fence_lock:
            if not _fence_queue:
                _fence_thread = None
                return
            events, items = _fence_queue.pop(0)
        try:
            for ev in events:
                ev.synchronize()
        except Exception:  # a broken CUDA context: nothing left to wait for
            pass
        _leases.releases_ready(items)


def reduce_cupy(enc, a):
    """How a ``cupy.ndarray`` travels (registered with ``register_reducer``): a lease on
    its block, copied into one first if it is not in one yet."""
    view = find_block(a)
    if view is None:
        # CuPy's own pool hands out chunks of bigger allocations; their IPC handle would
        # name the whole allocation, so copy once into a block of ours.
        a = share(a)
        view = find_block(a)
        enc.count("cuda_bytes_copied", a.nbytes)
        enc.count("cuda_arrays_copied", 1)
    else:
        enc.count("cuda_bytes_zero_copy", a.nbytes)
        enc.count("cuda_arrays_zero_copy", 1)
    enc.before_send(wait_for_senders_work, view.region.device)
    row = lease_block(enc, view)
    return _rebuild, (row, a.data.ptr - view.ptr, a.shape, dtype_token(a.dtype), a.strides)


def lease_block(enc, block: GpuBlock) -> int:
    """Lease GPU ``block`` in the message ``enc`` is encoding; returns its table row (for
    plug-ins sending objects that live in the GPU pool, e.g. torch CUDA tensors)."""
    return enc.lease(block, GPU_SLAB, _slab_intro)


def _slab_intro(enc, slab: Slab) -> tuple:
    return slab.ipc_handle(), slab.bus_id


def _rebuild(row, aoff, shape, dtype, strides):
    view = _serialization.leased_block(row)
    # the caller sees what this call's work writes into the array once it returns
    _serialization.reply_waits_for(wait_for_call_work, view.region.device)
    with cupy.cuda.Device(view.region.device):
        return view.array(shape, dtype, aoff, strides)


def open_slab(ctx, key: tuple, size: int, intro) -> Slab:
    """Open a slab a peer introduced in this frame (its IPC handle rode along)."""
    if intro is None:
        raise ProtocolError("peer referred to a GPU slab it never sent")
    handle, bus_id = intro
    dev = _local_device(bus_id)
    with cupy.cuda.Device(dev):
        ptr = _runtime.ipcOpenMemHandle(handle)
    _stats["cuda_handles_opened"] += 1
    return Slab(key, size, dev, bus_id, dedicated=size >= GpuPool.large, ptr=ptr,
                handle=handle)



_serialization.register_reducer(cupy.ndarray, reduce_cupy)
_serialization.register_shared_check(cupy.ndarray, is_shared)  # (``actorshm.is_shared``)
_serialization.register_region_kind(GPU_SLAB, open_slab)
