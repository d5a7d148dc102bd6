"""The PyTorch path: tensors travel like numpy arrays. Imported only when a tensor does.

A host tensor is a view of an untyped *storage*: a range of bytes. When those bytes lie
in an actorshm block (found by address, ``_shm.view_at``), the tensor travels as a
reference to the block: the storage's place in the block and its size, plus the
tensor's dtype (by name, so that dtypes numpy lacks -- ``bfloat16``, the float8 kinds --
travel too), size, stride and storage offset. The receiver wraps the same bytes in a
storage of its own and sets a tensor of that dtype on it, so views stay views and writes
go through both ways. A storage that is not in shared memory is copied into this
process's pool first (counted in ``bytes_copied``): all of it when the tensor covers at
least half of it (strides and storage offset kept exactly), else only the tensor's own
elements (a compact copy, in the same axis order).

Tensors that are not dense host tensors (sparse, quantized, meta, nested, CUDA) are
left to torch's own pickling (by value).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _shm

_stats = _shm._stats
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_u8 = torch.uint8


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)[6:]  # 'torch.bfloat16' -> 'bfloat16'


def _blank(dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``dtype`` to ``set_`` onto a storage (a view of an empty byte
    tensor: ``torch.empty`` warns about some dtypes, such as ``complex32``)."""
    return torch.empty(0, dtype=_u8).view(dtype)


def _storage_bytes(storage) -> torch.Tensor:
    """A flat uint8 tensor over every byte of an untyped storage."""
    return torch.empty(0, dtype=_u8).set_(storage)


def _over(view, start: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of a host block, from byte ``start``: its
    storage keeps the block (and so the lease) alive."""
    return torch.from_numpy(np.asarray(view)[start:start + nbytes])


def _lookup(t: torch.Tensor):
    """(block, byte offset of the storage in it) for a host tensor's storage, or None."""
    st = t.untyped_storage()
    lo = st.data_ptr()
    view = _shm.view_at(lo, lo + st.nbytes())
    if view is None:
        return None
    return view, lo - view.region.addr - view.offset


def is_shared(t) -> bool:
    """Whether a tensor's memory lies in actorshm shared memory (host or GPU)."""
    if not isinstance(t, _Tensor):
        return False
    if t.device.type != "cpu" or t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
        return False
    return _lookup(t) is not None


def _copy(t: torch.Tensor):
    """A copy of a host tensor in a fresh block: (block, storage start, storage bytes,
    storage offset, stride), the whole storage when the tensor covers at least half of
    it, else a compact copy of its elements."""
    st = t.untyped_storage()
    n = st.nbytes()
    size = t.element_size()
    if t.numel() * size * 2 >= n:
        view = _shm.pool().alloc(n)
        _over(view, 0, n).copy_(_storage_bytes(st))
        return view, n, t.storage_offset(), t.stride()
    tmpl = torch.empty_like(t, memory_format=torch.preserve_format)
    n = tmpl.untyped_storage().nbytes()
    view = _shm.pool().alloc(n)
    out = _blank(t.dtype).set_(_over(view, 0, n).untyped_storage(), 0,
                                             t.size(), tmpl.stride())
    out.copy_(t)
    return view, n, 0, tmpl.stride()


def check_sendable(t: torch.Tensor) -> None:
    if t.requires_grad and not t.is_leaf:
        raise TypeError(
            "actorshm: cannot send a tensor that requires grad and is not a leaf (it is "
            "the result of an operation on the autograd graph, which cannot cross "
            "processes); send `tensor.detach()` instead, or a leaf tensor or nn.Parameter")


def reduce_tensor(enc, t):
    """The pickle reduction of a tensor for ``enc`` (``NotImplemented``: torch's own)."""
    check_sendable(t)
    dev = t.device.type
    if dev != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented
    cls = type(t)
    sub = None if cls is _Tensor else ("param" if cls is _Parameter else cls)
    rg = t.requires_grad
    if rg:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # lazy flags: make the bytes say what it holds
    st = t.untyped_storage()
    n = st.nbytes()
    if n == 0:
        return NotImplemented  # nothing to share: torch pickles it by value, cheaply
    found = _lookup(t)
    nbytes = t.numel() * t.element_size()
    if found is None:
        view, n, offset, stride = _copy(t)
        start = 0
        _stats["bytes_copied"] += nbytes
        _stats["arrays_copied"] += 1
    else:
        view, start = found
        offset, stride = t.storage_offset(), t.stride()
        _stats["bytes_zero_copy"] += nbytes
        _stats["arrays_zero_copy"] += 1
    row = enc.lease_host(view)
    return enc.rebuild_block, (row, __name__, "_rebuild_tensor", start, n,
                               _dtype_name(t.dtype), tuple(t.size()), tuple(stride),
                               offset, rg, sub)


def _rebuild_tensor(view, start, nbytes, dtype, size, stride, offset, requires_grad, sub):
    storage = _over(view, start, nbytes).untyped_storage()
    t = _blank(getattr(torch, dtype)).set_(storage, offset, size, stride)
    return _finish(t, requires_grad, sub)


def _finish(t, requires_grad, sub):
    if sub == "param":
        return _Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    if sub is not None:
        t = t.as_subclass(sub)
    return t


# -- actorshm.torch ------------------------------------------------------------------

def _size(size) -> tuple:
    if len(size) == 1 and not isinstance(size[0], int):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def empty(size, dtype=None, device="cpu", requires_grad=False) -> torch.Tensor:
    size = _size(size)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    device = torch.device(device)
    if device.type != "cpu":
        raise ValueError(f"actorshm.torch: device {device} is not supported yet; "
                         "shared tensors live on the host ('cpu')")
    numel = 1
    for s in size:
        if s < 0:
            raise ValueError(f"negative dimension in size {size}")
        numel *= s
    n = numel * dtype.itemsize
    view = _shm.pool().alloc(n)
    t = _blank(dtype).set_(_over(view, 0, n).untyped_storage(), 0, size)
    return t.requires_grad_(requires_grad)


def share(t) -> torch.Tensor:
    if not isinstance(t, _Tensor):
        raise TypeError(f"actorshm.torch.share: expected a torch.Tensor, got "
                        f"{type(t).__name__}")
    if is_shared(t):
        return t
    src = t.detach()
    if src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg()
    out = empty(tuple(src.size()), dtype=src.dtype, device=src.device)
    if src.device.type == "cpu" and src.dim() > 0 and not src.is_contiguous():
        # Keep the memory order (a transposed tensor stays transposed).
        tmpl = torch.empty_like(src, memory_format=torch.preserve_format)
        if tmpl.stride() != out.stride():
            out = _blank(src.dtype).set_(
                out.untyped_storage(), 0, src.size(), tmpl.stride())
    with torch.no_grad():
        out.copy_(src)
    if type(t) is _Parameter:
        return _Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.is_leaf else out


def share_module(module):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"actorshm.torch.share_module: expected a torch.nn.Module, got "
                        f"{type(module).__name__}")

    def move(t):
        return t if is_shared(t) else share(t).detach()

    with torch.no_grad():
        module._apply(move)
    return module
