"""The CuPy path: GPU slabs, CUDA IPC handles, GPU leases. Imported only when needed.

The design mirrors the host path (``_shm``): each process owns a pool of slabs it
allocated itself with ``cupy.cuda.Memory`` (so each slab's pointer is its allocation
base, and an IPC handle names exactly that slab); a block travels as (slab IPC handle,
offset, shape, dtype, strides, device); the receiver opens each slab's handle once and
caches it. A receiver's view is a lease given back over the same RELEASE frames as host
blocks, so the sender's block stays alive until every receiver let go, and then returns
to the sender's GPU pool. Ordering: the sender synchronizes its current stream before
the descriptor leaves, so the receiver's work runs after the sender's pending work.

UNVERIFIED ON HARDWARE: no GPU was available where this was written; see docs/gpu.md.
"""

from __future__ import annotations

import collections
import threading
import weakref

import cupy

from . import _shm

_stats = _shm._stats
for _k in ("cuda_bytes_zero_copy", "cuda_bytes_copied", "cuda_pool_allocs",
           "cuda_pool_reuses", "cuda_blocks_live", "cuda_handles_opened"):
    _stats.setdefault(_k, 0)

_views: dict[tuple, weakref.ref] = {}  # block key -> live GPU view in this process
_opened: dict[tuple, int] = {}  # (owner token, slab id) -> pointer opened from its handle


def device_count() -> int:
    return cupy.cuda.runtime.getDeviceCount()


def _bus_id(dev: int) -> str:
    return cupy.cuda.runtime.deviceGetPCIBusId(dev)


def _local_device(bus_id: str) -> int:
    for d in range(device_count()):
        if _bus_id(d) == bus_id:
            return d
    raise RuntimeError(f"GPU {bus_id} is not visible in this process "
                       "(check CUDA_VISIBLE_DEVICES and num_gpus)")


class _Slab:
    __slots__ = ("sid", "mem", "size", "device", "handle", "__weakref__")

    def __init__(self, sid: int, size: int, device: int) -> None:
        self.sid = sid
        with cupy.cuda.Device(device):
            self.mem = cupy.cuda.Memory(size)  # our own allocation: ptr is its base
        self.size = size
        self.device = device
        self.handle: bytes | None = None

    def ipc_handle(self) -> bytes:
        if self.handle is None:
            self.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.mem.ptr))
        return self.handle


class _GpuView:
    """Owner of the memory under every CuPy array on one GPU block in this process."""

    __slots__ = ("key", "ptr", "size", "device", "slab", "pool", "upstream", "__weakref__")

    def __init__(self, key, ptr, size, device, slab, pool) -> None:
        self.key = key
        self.ptr = ptr
        self.size = size
        self.device = device
        self.slab = slab
        self.pool = pool
        self.upstream = None
        _views[key] = weakref.ref(self)

    def array(self, shape, dtype, offset=0, strides=None):
        mem = cupy.cuda.UnownedMemory(self.ptr, self.size, self, self.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset), strides)

    def __del__(self) -> None:
        try:
            if self.upstream:
                _shm._releases.append((self.upstream, self.key))
                hook = _shm._flush_hook[0]
                if hook is not None:
                    hook()
            if self.pool is not None:
                self.pool.returned.append(self.slab)
        except Exception:
            pass


class GpuPool:
    def __init__(self) -> None:
        self.token = _shm.pool().token
        self.lock = threading.Lock()
        self.free: dict[tuple, list] = collections.defaultdict(list)
        self.returned: collections.deque = collections.deque()
        self.next_sid = 0

    def alloc(self, nbytes: int, device: int | None = None) -> _GpuView:
        dev = cupy.cuda.runtime.getDevice() if device is None else device
        size = _shm.size_class(max(int(nbytes), 1))
        with self.lock:
            while self.returned:
                s = self.returned.popleft()
                self.free[(s.size, s.device)].append(s)
                _stats["cuda_blocks_live"] -= 1
            free = self.free.get((size, dev))
            if free:
                slab = free.pop()
                _stats["cuda_pool_reuses"] += 1
            else:
                slab = _Slab(self.next_sid, size, dev)
                self.next_sid += 1
                _stats["cuda_pool_allocs"] += 1
            _stats["cuda_blocks_live"] += 1
        return _GpuView((self.token, "gpu", slab.sid), slab.mem.ptr, size, dev, slab, self)


_pool: GpuPool | None = None


def pool() -> GpuPool:
    global _pool
    if _pool is None:
        _pool = GpuPool()
    return _pool


def find_view(arr) -> _GpuView | None:
    mem = arr.data.mem
    ref = _ptr_index.get(mem.ptr)
    v = ref() if ref is not None else None
    return v


_ptr_index: dict[int, weakref.ref] = {}


def _register(view: _GpuView) -> _GpuView:
    _ptr_index[view.ptr] = weakref.ref(view)
    return view


def empty(shape, dtype=float, order="C"):
    dtype = cupy.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    view = _register(pool().alloc(n))
    arr = view.array(shape, dtype)
    if order == "F":
        arr = cupy.ndarray(shape, dtype, arr.data, order="F")
    return arr


def zeros(shape, dtype=float, order="C"):
    a = empty(shape, dtype, order)
    a.fill(0)
    return a


def share(arr):
    if find_view(arr) is not None:
        return arr
    out = empty(arr.shape, arr.dtype, "F" if arr.flags.f_contiguous and
                not arr.flags.c_contiguous else "C")
    out[...] = arr  # device to device
    return out


def is_shared(arr) -> bool:
    return isinstance(arr, cupy.ndarray) and find_view(arr) is not None


def reduce_cupy(enc, a):
    view = find_view(a)
    if view is None:
        # CuPy's own pool hands out chunks of bigger allocations; their IPC handle would
        # name the whole allocation, so copy once into a slab of ours.
        a = share(a)
        view = find_view(a)
        _stats["cuda_bytes_copied"] += a.nbytes
    else:
        _stats["cuda_bytes_zero_copy"] += a.nbytes
    cupy.cuda.get_current_stream().synchronize()  # receiver runs after our pending work
    enc.cuda_grants.append(view)
    slab = view.slab
    if slab is not None:
        handle, sid, owner = slab.ipc_handle(), slab.sid, view.key[0]
        slab_size = slab.size
    else:  # forwarding a block we received
        owner, _, sid = view.key
        handle = _received_handles[(owner, sid)]
        slab_size = view.size
    return _rebuild, (owner, sid, handle, slab_size, a.data.ptr - view.ptr, a.shape,
                      a.dtype.str, a.strides, _bus_id(view.device))


_received_handles: dict[tuple, bytes] = {}


def commit(conn, views) -> None:
    grants = conn.grants
    for view in views:
        g = grants.get(view.key)
        if g is None:
            grants[view.key] = [view, 1]
        else:
            g[1] += 1


def _rebuild(owner, sid, handle, slab_size, offset, shape, dtype, strides, bus_id):
    from ._serialization import _ctx
    ctx = _ctx()
    key = (owner, "gpu", sid)
    ref = _views.get(key)
    view = ref() if ref is not None else None
    if view is None:
        dev = _local_device(bus_id)
        ptr = _opened.get((owner, sid))
        if ptr is None:
            with cupy.cuda.Device(dev):
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
            _opened[(owner, sid)] = ptr
            _received_handles[(owner, sid)] = handle
            _stats["cuda_handles_opened"] += 1
        view = _register(_GpuView(key, ptr, slab_size, dev, None, None))
        view.upstream = {ctx.conn: 1}
    else:
        ctx.conn.queue_release(key, 1)
    with cupy.cuda.Device(view.device):
        return view.array(shape, cupy.dtype(dtype), offset, strides)
