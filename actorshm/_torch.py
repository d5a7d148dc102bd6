"""The torch plug-in: ``torch.Tensor`` travels like a numpy array.

Loaded once torch is imported in a process that sends a message (``_plugins``), or when
a message carrying a tensor is unpickled; it registers a reducer for ``torch.Tensor``
with ``_serialization``. A CPU tensor whose storage lies in an actorshm host block goes
by reference to that block: the receiver rebuilds a tensor of the same dtype, shape,
strides and storage offset over the same memory, writable. Any other CPU tensor's
storage is first copied into this process's pool (counted in ``bytes_copied``), as
``torch.multiprocessing`` moves a tensor to shared memory.

The bytes travel dtype-blind (a uint8 view of the storage), so every torch dtype
travels, those numpy lacks (``bfloat16``, the float8 kinds) included. An
``nn.Parameter`` arrives as an ``nn.Parameter``; a leaf's ``requires_grad`` is kept; a
tensor that is part of an autograd graph (a non-leaf that requires grad) is refused:
its graph cannot travel.

Tensors on other devices (CUDA, MPS) and other layouts (sparse, quantized) are pickled
by torch itself (by value).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from . import _leases, _serialization, _shm

__all__ = ["storage_block", "tensor_over"]

_Parameter = torch.nn.Parameter
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}

# Storage base address -> the live block holding that storage: the tensors this module
# made (``tensor_over``) and those looked up once. Sending the same weights every step,
# or a fresh ``actorshm.torch.empty`` tensor, then costs one dict lookup, however many
# blocks are live (``_leases.block_at`` scans them all).
_known: "weakref.WeakValueDictionary[int, _leases.Block]" = weakref.WeakValueDictionary()


def _covers(block, lo: int, hi: int) -> bool:
    base = block.region.addr + block.offset
    return base <= lo and hi <= base + block.size


def storage_block(t: torch.Tensor):
    """The host block holding ``t``'s whole storage, or None."""
    st = t.untyped_storage()
    n = st.nbytes()
    if n == 0 or t.device.type != "cpu":
        return None
    lo = st.data_ptr()
    block = _known.get(lo)
    # A live block's memory is never reused, so a hit that still covers the storage is it.
    if block is not None and block.region.addr and _covers(block, lo, lo + n):
        return block
    block = _leases.block_at(lo, lo + n)
    if block is not None:
        _known[lo] = block
    return block


def tensor_over(buf: np.ndarray, dtype: torch.dtype, size, stride, offset: int, block=None):
    """A tensor viewing the bytes of the uint8 array ``buf`` (which it keeps alive);
    ``block``, the host block ``buf`` lies in, makes the tensor's later sends cheap."""
    t8 = torch.from_numpy(buf)
    if block is not None:
        _known[t8.data_ptr()] = block
    return torch.empty(0, dtype=dtype).set_(t8.untyped_storage(), offset, size, stride)


def _reduce_tensor(enc, t: torch.Tensor):
    kind = type(t)
    if kind is not torch.Tensor and kind is not _Parameter:
        return NotImplemented  # another subclass: torch pickles it
    if t.requires_grad and not t.is_leaf:
        raise TypeError(
            "a tensor that requires grad and is not a leaf (it is part of an autograd "
            "graph) cannot be sent: send `t.detach()` (or a leaf, e.g. a Parameter)")
    if t.device.type != "cpu" or t.layout is not torch.strided or t.is_quantized:
        return NotImplemented
    st = t.untyped_storage()
    n = st.nbytes()
    if n == 0:
        return NotImplemented
    counters = _leases.counters
    block = storage_block(t)
    if block is None:
        if n > 2 * t.numel() * t.element_size() + 4096:
            t = t.detach().clone()  # a small view of a large storage: copy the view only
            st = t.untyped_storage()
            n = st.nbytes()
        copy = _shm.empty(n, np.uint8)
        torch.from_numpy(copy).copy_(torch.empty(0, dtype=torch.uint8).set_(st, 0, (n,), (1,)))
        block = _shm.find_block(copy)
        counters["bytes_copied"] += n
        counters["arrays_copied"] += 1
        base = copy.__array_interface__["data"][0]
    else:
        counters["bytes_zero_copy"] += t.numel() * t.element_size()
        counters["arrays_zero_copy"] += 1
        base = st.data_ptr()
    row = _serialization.lease_host_block(enc, block)
    start = base - block.region.addr - block.offset
    return _rebuild_tensor, (row, start, n, str(t.dtype), tuple(t.shape), t.stride(),
                             t.storage_offset(), kind is _Parameter, t.requires_grad)


def _rebuild_tensor(row, start, n, dtype, size, stride, offset, parameter, requires_grad):
    block = _serialization.leased_block(row)
    t = tensor_over(np.asarray(block)[start:start + n], _DTYPES[dtype], size, stride, offset,
                    block)
    if parameter:
        return _Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


_serialization.register_reducer(torch.Tensor, _reduce_tensor)
