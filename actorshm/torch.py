"""PyTorch tensors in shared memory: ``actorshm.torch.empty/zeros/share/is_shared/share_module``.

Every ``torch.Tensor`` in the arguments or result of a call travels like a numpy array:
by reference when its storage lies in actorshm shared memory (or, for CUDA tensors, in
actorshm's GPU pool: ``device="cuda"``, which needs CuPy), copied into it once
otherwise; see docs/torch.md. Importing ``actorshm`` never imports this module or torch;
this module needs torch (``pip install 'actorshm[torch]'``).
"""

from __future__ import annotations

import operator

try:
    import torch as _t
except ImportError as exc:  # pragma: no cover - exercised without torch only
    raise ImportError("actorshm.torch needs PyTorch: pip install 'actorshm[torch]'") from exc

import numpy as np

from . import _shm, _torch

__all__ = ["empty", "zeros", "share", "is_shared", "share_module"]


def _size(size) -> tuple:
    """The dimensions, taken as ``torch.empty`` takes them: ints, or anything with
    ``__index__`` (a numpy integer, a 0-d integer tensor: what shapes are computed
    from), or one sequence of them. A bool, a float or a string is a ``TypeError``, a
    negative size a ``ValueError``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, _t.Size)):
        size = tuple(size[0])
    dims = []
    for s in size:
        try:
            if isinstance(s, bool):
                raise TypeError
            dims.append(operator.index(s))
        except TypeError:
            raise TypeError(f"actorshm.torch.empty: sizes must be ints >= 0, got {size!r}: "
                            f"{s!r} is of type {type(s).__name__}, not an integer") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"actorshm.torch.empty: sizes must be ints >= 0, got {tuple(dims)}")
    return tuple(dims)


def _cuda_plugin(what: str):
    """The CUDA half of the torch plug-in (it needs CuPy for the GPU pool)."""
    try:
        from . import _torch_cuda
    except ImportError as exc:
        raise ImportError(
            f"actorshm.torch.{what} on a CUDA device needs CuPy (actorshm's GPU pool): "
            "pip install 'actorshm[cuda]'") from exc
    return _torch_cuda


def empty(*size, dtype=None, device="cpu"):
    """A new tensor in shared memory owned by this process (contents undefined).

    It travels to actors without a copy, writable on both sides, and its memory comes
    back to this process's pool once every process has dropped it. On a CUDA device it
    lies in actorshm's GPU pool and travels as a CUDA IPC reference (see docs/torch.md).

    Args:
        *size: the dimensions, as ints or one tuple (``empty(2, 3)``, ``empty((2, 3))``).
        dtype: any torch dtype (default: ``torch.get_default_dtype()``).
        device: ``"cpu"`` (host shared memory, the default), or ``"cuda"`` /
            ``"cuda:N"`` / a ``torch.device`` (the GPU pool; needs CuPy).

    Raises:
        ValueError: a negative size, or a device other than the CPU or CUDA.
        TypeError: a size that is not an integer (a float, a bool).
        TypeError: a quantized dtype (a quantized tensor travels by value).
        ImportError: a CUDA device without CuPy installed.
        SharedMemoryError: over the shared-memory budget, as ``actorshm.empty``, or no
            room on the GPU.
    """
    size = _size(size)
    dtype = dtype or _t.get_default_dtype()
    if not isinstance(dtype, _t.dtype):
        try:  # what torch takes as a dtype (float, int, bool) it turns into one
            dtype = _t.empty(0, dtype=dtype).dtype
        except TypeError:
            raise TypeError(f"actorshm.torch.empty(dtype=...) takes a torch dtype "
                            f"(torch.float32), not {dtype!r}; a numpy array is made with "
                            f"actorshm.empty(..., dtype="
                            f"{getattr(dtype, '__name__', dtype)!r})") from None
    if dtype in _torch.QUANTIZED:
        raise TypeError(
            f"actorshm.torch.empty: {dtype} is a quantized dtype, and a quantized tensor "
            "cannot live in shared memory (torch pickles it, by value); share the "
            "float tensor and quantize it where it is used")
    dev = _t.device(device)
    if dev.type == "cuda":
        return _cuda_plugin("empty").empty(size, dtype, dev.index)
    if dev.type != "cpu":
        raise ValueError(
            f"actorshm.torch.empty(device={device!r}): the device must be 'cpu' or "
            "'cuda' (actorshm's shared memory is host memory or its CUDA GPU pool)")
    itemsize = _t.empty(0, dtype=dtype).element_size()
    n = itemsize
    for s in size:
        n *= s
    buf = _shm.empty(max(n, 1), np.uint8)
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return _torch.tensor_over(buf, dtype, size, tuple(reversed(stride)), 0,
                              _shm.find_block(buf))


def zeros(*size, dtype=None, device="cpu"):
    """A new zero-filled tensor in shared memory. Args and errors as ``empty``."""
    return empty(*size, dtype=dtype, device=device).zero_()


def is_shared(tensor) -> bool:
    """Whether ``tensor``'s storage lies in actorshm shared memory (it travels by
    reference); for a sparse tensor, whether its index and value tensors all do. A
    nested or quantized tensor never does (torch pickles it, by value).

    Args:
        tensor: a ``torch.Tensor``.

    Raises:
        TypeError: not a tensor.
    """
    _require_tensor(tensor, "is_shared")
    if tensor.device.type == "cuda":
        try:
            from . import _torch_cuda  # noqa: F401  (registers its GPU blocks' lookup)
        except ImportError:  # no CuPy: no GPU pool, nothing on the GPU is shared
            return False
    return _torch.tensor_is_shared(tensor)


def share(tensor):
    """``tensor`` itself if it is already shared, else a shared copy of it: same dtype,
    shape, device and values, the same strides where they cover its elements densely
    (``channels_last`` stays so; any other view's copy is contiguous), an
    ``nn.Parameter`` as a Parameter, a leaf's ``requires_grad`` kept. A CUDA tensor's
    copy lies in the GPU pool on the same device; a sparse tensor's copy has shared
    index and value tensors.

    Args:
        tensor: a ``torch.Tensor`` on the CPU or a CUDA device.

    Raises:
        TypeError: not a tensor; a nested or quantized one (torch pickles those); or a
            non-leaf that requires grad (share ``tensor.detach()``).
        ValueError: on another device (e.g. MPS).
        ImportError: a CUDA tensor without CuPy installed.
        SharedMemoryError: over budget, as ``empty``.
    """
    _require_tensor(tensor, "share")
    if is_shared(tensor):
        return tensor
    _check_shareable(tensor, "share")
    if tensor.requires_grad and not tensor.is_leaf:
        raise TypeError("actorshm.torch.share: the tensor requires grad and is not a leaf "
                        "(it is part of an autograd graph); share `t.detach()`")
    src = tensor.detach()
    if tensor.layout in _torch.SPARSE:
        parts = _torch.sparse_parts(src)
        out = _torch.sparse_over(tensor.layout, tuple(
            share(p) if isinstance(p, _t.Tensor) else p for p in parts))
    else:
        bits = _torch.view_bits(src)  # a conjugate or negative view: its memory as it is,
        src = _torch.without_bits(src, bits)  # the bits set again on the copy, as
        out = empty(src.numel() if _dense(src) else src.shape,  # sending does
                    dtype=src.dtype, device=src.device)
        if out.shape != src.shape:  # (dense: its own strides over the flat copy)
            out = out.as_strided(src.shape, src.stride())
        try:
            out.copy_(src)
        except NotImplementedError:
            # A dtype torch has no copy kernel for (the bit-packed kinds: uint1-7, int1-7,
            # bits8...): its bytes, as sending copies them (one byte per element).
            out.view(_t.uint8).copy_(src.view(_t.uint8))
        out = _torch.finish(out, False, False, bits)
    return _dressed(tensor, out)


def _dressed(tensor, out):
    """Shared copy ``out`` of ``tensor`` as ``tensor`` was, as it arrives where it is
    sent: a Parameter (``requires_grad`` kept), of its class with its state (its
    attributes, the same objects; one that refers to the tensor itself refers to the
    copy) when that class has no ``__reduce_ex__`` of its own, a leaf's
    ``requires_grad`` kept."""
    kind = type(tensor)
    if isinstance(tensor, _t.nn.Parameter):
        out = _t.nn.Parameter(out, requires_grad=tensor.requires_grad)
        if kind is not _t.nn.Parameter:  # (a subclass: it arrives as a Parameter too,
            return out                   # without its state, which may not fit one)
    elif kind is not _t.Tensor and kind.__reduce_ex__ is _t.Tensor.__reduce_ex__:
        out = _t.Tensor._make_subclass(kind, out, tensor.requires_grad)
    else:
        out.requires_grad_(tensor.requires_grad)
        if kind is not _t.Tensor:  # (its own __reduce_ex__: a plain tensor, no state)
            return out
    state = _t._utils._get_obj_state(tensor)
    if state:
        _torch._set_subclass_state(out, _torch.state_for(state, tensor, out))
    return out


def _dense(t) -> bool:
    """Whether ``t``'s strides cover its elements exactly once each, in some order of
    its dimensions (contiguous, transposed, ``channels_last``)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _require_tensor(obj, what: str) -> None:
    if not isinstance(obj, _t.Tensor):
        hint = ""
        if isinstance(obj, np.ndarray):
            hint = f"; for a numpy array, use actorshm.{what}"
        elif isinstance(obj, _t.nn.Module):
            hint = "; a module's parameters are shared with actorshm.torch.share_module"
        raise TypeError(f"actorshm.torch.{what} takes a torch.Tensor, not "
                        f"{type(obj).__name__}{hint}")


def _check_shareable(tensor, what: str) -> None:
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"actorshm.torch.{what} takes CPU or CUDA tensors, not "
                         f"{tensor.device.type!r} ones; move it with .cpu()")
    if tensor.dtype in _torch.QUANTIZED and not tensor.is_quantized:
        raise TypeError(
            f"actorshm.torch.{what}: a tensor of dtype {tensor.dtype} that is not "
            f"quantized (a .view({tensor.dtype}) of raw memory: it has no scale or zero "
            "point) cannot be shared, as torch cannot rebuild it: share its raw memory "
            "(e.g. t.view(torch.int32)), or a quantized tensor's dequantize()")
    if tensor.layout == _torch.MKLDNN:
        raise TypeError(f"actorshm.torch.{what}: an MKL-DNN tensor (t.to_mkldnn()) has no "
                        "storage to share; share `t.to_dense()`")
    if tensor.is_nested or tensor.is_quantized:
        kind = "nested" if tensor.is_nested else "quantized"
        raise TypeError(
            f"actorshm.torch.{what}: a {kind} tensor cannot live in shared memory (it "
            "travels by value, pickled by torch); share a dense tensor instead "
            f"({'unbind() its parts' if tensor.is_nested else 'dequantize() it'})")


def share_module(module):
    """Move a module's parameters and buffers into shared memory, in place.

    Passing the module (or its tensors) to actors then shares its weights: an actor's
    in-place updates are seen by every holder, as with ``Module.share_memory()`` in
    ``torch.multiprocessing`` (Hogwild). Parameters stay the same ``nn.Parameter``
    objects (their ``.data`` moves), so optimizers made before keep working.

    Args:
        module: a ``torch.nn.Module`` on the CPU or a CUDA device (its CUDA tensors
            move into the GPU pool).

    Returns:
        ``module``.

    Raises:
        TypeError: not a module.
        ValueError: a parameter or buffer on another device (e.g. MPS), or one not
            initialized yet (a lazy module's, before its first forward pass).
        ImportError: CUDA parameters without CuPy installed.
        SharedMemoryError: over budget.
    """
    if not isinstance(module, _t.nn.Module):
        raise TypeError(f"share_module takes an nn.Module, not {type(module).__name__}")
    # By storage, as torch's in-place share_memory_() goes: tensors that view one
    # storage (tied weights, one buffer registered twice, views of a flat parameter
    # vector) view one shared copy of it afterwards, with their own offsets and strides.
    # Every tensor is checked before any moves, and the storages move one at a time, so
    # each old one is freed as soon as its tensors have moved (peak: the module plus its
    # largest storage, not twice the module).
    groups = _groups(module)
    with _t.no_grad():
        while groups:
            _move_storage(groups.pop(next(iter(groups))))
    return module


def _groups(module) -> dict:
    """``share_module``'s tensors to move, by storage: ``{key: [(module, kind ("p" or
    "b"), name, tensor)]}`` in module order, each checked. (A function of its own: a
    loop variable left in ``share_module`` would hold the last storage met past its
    move.)"""
    groups: dict = {}  # storage key -> [(module, kind, name, tensor)], in module order
    for m in module.modules():
        for kind, slots in (("p", m._parameters), ("b", m._buffers)):
            for name, v in slots.items():
                if isinstance(v, _t.nn.parameter.UninitializedTensorMixin):
                    # (a lazy module's, before its first forward: no memory to share
                    # yet; the memory it gets then would be a private tensor's)
                    raise ValueError(
                        f"share_module: {type(m).__name__}.{name} is uninitialized (a "
                        "lazy module's, such as LazyLinear): run a forward pass first "
                        "(its shape is known then), then share the module")
                t = None if v is None else v.data if kind == "p" else v
                if t is None or is_shared(t):
                    continue
                _check_shareable(t, "share_module")
                st = t.untyped_storage() if t.layout is _t.strided else None
                key = ((t.device, st.data_ptr()) if st is not None and st.nbytes()
                       else id(v))  # (a sparse or empty tensor: on its own)
                groups.setdefault(key, []).append((m, kind, name, v))
    return groups


def _move_storage(group: list) -> None:
    """Re-make every tensor of ``group`` (the tensors on one storage) over one shared
    copy of that storage, each with its own offset, shape and strides. A Parameter
    keeps its object (its ``.data`` moves: optimizers hold it); a buffer is replaced by
    its shared copy, of its class with its attributes and ``requires_grad``
    (``_dressed``), which frees the old memory even when it was a view (``.data``
    moved in place keeps a view's base) and moves a sparse compressed one whole."""
    flat = None
    moved: dict = {}  # id(v) -> (its shared tensor, its replacement): one registered twice
    for m, kind, name, v in group:
        t = v.data if kind == "p" else v
        if is_shared(t):  # (one Parameter registered twice: moved already)
            continue
        new, obj = moved.get(id(v), (None, None))
        if new is None and t.layout is not _t.strided:
            new = share(t.detach())
        elif new is None:
            if flat is None:  # (tensors from one address may see storages of two
                st = max((x.untyped_storage() for x in _strided(group)),  # sizes)
                         key=lambda st: st.nbytes())
                flat = empty(st.nbytes(), dtype=_t.uint8, device=t.device)
                flat.copy_(_t.empty(0, dtype=_t.uint8, device=t.device).set_(st))
                del st
            new = _t.empty(0, dtype=t.dtype, device=t.device).set_(
                flat.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            new = _torch.finish(new, False, False, _torch.view_bits(t))
        if kind == "p" and t.layout in (_t.strided, _t.sparse_coo):
            v.data = new
        else:  # (a buffer; ``.data`` of a sparse compressed one would keep its old parts)
            obj = _dressed(v, new) if obj is None else obj
            (m._buffers if kind == "b" else m._parameters)[name] = obj
        moved[id(v)] = new, obj


def _strided(group: list):
    """The strided tensors of a ``share_module`` group."""
    for _m, kind, _name, v in group:
        t = v.data if kind == "p" else v
        if t.layout is _t.strided:
            yield t
