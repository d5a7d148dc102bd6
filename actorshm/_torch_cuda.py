"""Torch CUDA tensors in actorshm's GPU pool: by CUDA IPC reference, like CuPy arrays.

The CUDA half of the torch plug-in; it needs CuPy (the GPU pool, ``_cuda``) and loads
when ``actorshm.torch`` makes a CUDA tensor, when a CUDA tensor is first sent (``_torch``
asks the loader ``_plugins`` gave it), or when one arrives (pickle imports
``_rebuild_cuda_tensor``).

- ``empty(size, dtype, device)`` carves the bytes from this process's GPU pool on that
  device (``_cuda.empty``) and wraps them as a torch CUDA tensor (``as_tensor``).
- A CUDA tensor whose storage lies in a GPU block (found by address: ``_cuda.block_at``,
  and a map of storages this module made or looked up once) travels as a lease on that
  block: the slab's IPC handle rides along the first time, the receiver opens it once.
  Any other CUDA tensor (torch's caching allocator hands out pieces of larger
  allocations, whose IPC handle would name more than the tensor) is first copied on the
  device into a pool block, counted in ``cuda_bytes_copied``.
- Ordering: the copy runs on torch's current stream, and before the message leaves the
  sender synchronizes torch's current stream (and CuPy's) on each device involved, so
  the receiver sees every write the sender queued. Leases come back through ``_cuda``'s
  fence, which waits for the work the receiver queued on the device's blocking streams
  (torch's default stream is one).
- The receiver views the block's bytes as a CuPy array (``GpuBlock.array``) and
  converts it with ``as_tensor`` (DLPack), with the sender's dtype, shape, strides and
  storage offset, on its own ordinal of the same GPU (found by PCI bus id).

``as_tensor``, ``current_device`` and the copy in ``_copy_into_pool`` are the only places
a CUDA build of torch is needed; everything else runs on the simulated GPU of the tests
(tests/simgpu). The copy is torch's own, so no CuPy stream wraps torch's (CuPy 14
deprecates ``cupy.cuda.ExternalStream``, and a warning turned error would fail a send).
"""

from __future__ import annotations

import cupy
import torch

from . import _cuda, _serialization, _torch

__all__ = ["empty", "storage_block", "reduce_cuda_tensor", "as_tensor", "current_device"]

# Storage base address -> the lease of the GPU block holding that storage (as
# ``_torch._known``).
_known: dict = {}


def as_tensor(arr, dtype: torch.dtype, size, stride, offset: int):
    """A torch CUDA tensor over the bytes of the uint8 CuPy array ``arr`` (kept alive by
    the tensor), viewed as ``dtype`` with these size, strides and storage offset."""
    t8 = torch.from_dlpack(arr)  # the same device memory; torch holds ``arr``
    return torch.empty(0, dtype=dtype, device=t8.device).set_(
        t8.untyped_storage(), offset, size, stride)


def current_device() -> int:
    """The device ``"cuda"`` means here: torch's current device."""
    return torch.cuda.current_device()


def _sync_torch_streams(devices) -> None:
    """Synchronize torch's current stream on each device (its side streams do not block
    on the legacy default stream, so ``_cuda``'s waits alone would miss them)."""
    if torch.cuda.is_available():
        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()


def _wait_for_senders_work(devices) -> None:
    """Before a message with CUDA tensors leaves: the receiver must see our queued work,
    on torch's current stream and on CuPy's."""
    _sync_torch_streams(devices)
    _cuda.wait_for_senders_work(devices)


def _wait_for_call_work(devices) -> None:
    """Before the reply to a call that received CUDA tensors leaves (``_cuda``'s rule)."""
    _sync_torch_streams(devices)
    _cuda.wait_for_call_work(devices)


def _contiguous_strides(size) -> tuple:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def empty(size: tuple, dtype: torch.dtype, device: int | None):
    """A new contiguous CUDA tensor in a block of this process's GPU pool on ``device``
    (default: ``current_device()``)."""
    dev = current_device() if device is None else device
    n = torch.empty(0, dtype=dtype).element_size()
    for s in size:
        n *= s
    with cupy.cuda.Device(dev):
        arr = _cuda.empty((max(n, 1),), "u1")
    t = as_tensor(arr, dtype, size, _contiguous_strides(size), 0)
    _torch.remember(_known, arr.data.ptr, _cuda.find_block(arr))
    return t


def _span(t) -> tuple[int, int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes(), t.device.index


def storage_block(t):
    """The GPU block holding CUDA tensor ``t``'s whole storage, or None."""
    lo, n, dev = _span(t)
    if n == 0:
        return None
    ref = _known.get(lo)
    block = ref() if ref is not None else None
    if block is not None and block.region.ptr and block.region.device == dev and \
            block.ptr <= lo and lo + n <= block.ptr + block.size:
        return block
    block = _cuda.block_at(lo, lo + n, dev)
    if block is not None:
        _torch.remember(_known, lo, block)
    return block


def _copy_into_pool(t, lo: int, n: int, dev: int):
    """A pool block holding a copy of the ``n`` bytes of ``t``'s storage, which start
    at device address ``lo``; copied on the device, on torch's current stream."""
    with cupy.cuda.Device(dev):
        dst = _cuda.empty((n,), "u1")
        if torch.cuda.is_available():  # torch orders the copy after the sender's work
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                t.untyped_storage(), 0, (n,), (1,))
            torch.from_dlpack(dst).copy_(src)
        else:  # the simulated GPU of the tests (tests/simgpu): no streams to follow
            dst[...] = cupy.ndarray((n,), "u1", cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(lo, n, t, dev), 0))
    return dst


def reduce_cuda_tensor(enc, t):
    """How a CUDA tensor travels (``_torch`` calls it for ``t.device.type == "cuda"``): a
    lease on its GPU block, copied into one on the device first if it is not in one."""
    _torch.check_sendable(t)
    lo, n, dev = _span(t)
    if n == 0:
        return NotImplemented  # nothing to share: torch pickles it
    parameter, requires_grad = type(t) is torch.nn.Parameter, t.requires_grad
    block = storage_block(t)
    if block is None:
        if n > 2 * t.numel() * t.element_size() + 4096:
            t = t.detach().clone()  # a small view of a large storage: copy the view only
            lo, n, dev = _span(t)
        copy = _copy_into_pool(t, lo, n, dev)
        block = _cuda.find_block(copy)
        start = copy.data.ptr - block.ptr
        enc.count("cuda_bytes_copied", n)
        enc.count("cuda_arrays_copied", 1)
    else:
        start = lo - block.ptr
        enc.count("cuda_bytes_zero_copy", t.numel() * t.element_size())
        enc.count("cuda_arrays_zero_copy", 1)
    enc.before_send(_wait_for_senders_work, dev)
    row = _cuda.lease_block(enc, block)
    return _rebuild_cuda_tensor, (row, start, n, str(t.dtype), tuple(t.shape),
                                  tuple(t.stride()), t.storage_offset(),
                                  parameter, requires_grad, _torch.view_bits(t))


def _rebuild_cuda_tensor(row, start, n, dtype, size, stride, offset, parameter,
                         requires_grad, bits=0):
    block = _serialization.leased_block(row)
    _serialization.reply_waits_for(_wait_for_call_work, block.region.device)
    with cupy.cuda.Device(block.region.device):
        arr = block.array((n,), "u1", start)
        t = as_tensor(arr, _torch._DTYPES[dtype], size, stride, offset)
    _torch.remember(_known, arr.data.ptr, block)
    return _torch.finish(t, parameter, requires_grad, bits)


_torch.set_cuda_path(reducer=reduce_cuda_tensor, storage_block=storage_block)
