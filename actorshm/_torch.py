"""The torch plug-in: ``torch.Tensor`` travels like a numpy array.

Loaded once torch is imported in a process that sends a message (``_plugins``), or when
a message carrying a tensor is unpickled; it registers a reducer for ``torch.Tensor``
with ``_serialization``, and a flat hole for shared CPU tensors (``register_flat``: a
call of shared tensors, arrays and scalars then goes with no pickler). A CPU tensor
whose storage lies in an actorshm host block goes by reference to that block: the
receiver rebuilds a tensor of the same dtype, shape, strides and storage offset over
the same memory, writable. Any other CPU tensor's storage is first copied into this
process's pool (counted in ``bytes_copied``), as ``torch.multiprocessing`` moves a
tensor to shared memory; a small one (``_inband.in_band``: up to ``INLINE_MAX`` bytes
of storage within the message's budget, as for numpy arrays) travels inside the message
instead, and arrives as a writable copy.

The bytes travel dtype-blind (a uint8 view of the storage), so every torch dtype
travels, those numpy lacks (``bfloat16``, the float8 kinds) included. An
``nn.Parameter`` arrives as an ``nn.Parameter``; a leaf's ``requires_grad`` is kept; a
tensor that is part of an autograd graph (a non-leaf that requires grad) is refused:
its graph cannot travel.

CUDA tensors go through ``_torch_cuda`` (actorshm's GPU pool, CUDA IPC), which needs
CuPy; it registers itself here (``set_cuda_path``) and ``_plugins`` sets how to load it.
A sparse tensor travels as its parts (indices and values: tensors like any other) and
is rebuilt over them. Without CuPy, and for tensors on other devices (MPS) or of other
layouts (quantized, nested), torch pickles the tensor itself (by value).
"""

from __future__ import annotations

import pickle

import numpy as np
import torch

from . import _leases, _serialization, _shm
from ._inband import in_band
from ._util import warn_at_caller

__all__ = ["storage_block", "tensor_over", "finish", "set_cuda_path", "tensor_is_shared"]

_Parameter = torch.nn.Parameter
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}

# Storage base address -> the lease (a weak reference) of the block holding that
# storage: the tensors this module made (``tensor_over``) and those looked up once.
# Sending the same weights every step, or a fresh ``actorshm.torch.empty`` tensor, then
# costs one dict lookup, however many blocks are live (``_leases.block_at`` scans them).
_known: dict = {}


def remember(known: dict, ptr: int, block) -> None:
    """Note in ``known`` that the storage at ``ptr`` lies in ``block`` (dead entries are
    dropped each time the map reaches a power of two from 1024 on)."""
    known[ptr] = block.lease
    n = len(known)
    if n >= 1024 and not n & (n - 1):
        for k, ref in list(known.items()):
            if ref() is None:
                known.pop(k, None)


def _covers(block, lo: int, hi: int) -> bool:
    base = block.region.addr + block.offset
    return base <= lo and hi <= base + block.size


def storage_block(t: torch.Tensor):
    """The host block holding ``t``'s whole storage, or None."""
    st = t.untyped_storage()
    n = st.nbytes()
    if n == 0 or not t.is_cpu:
        return None
    return _block_of(st.data_ptr(), n)


def _block_of(lo: int, n: int):
    ref = _known.get(lo)
    block = ref() if ref is not None else None
    # A live block's memory is never reused, so a hit that still covers the storage is it.
    if block is not None and block.region.addr and _covers(block, lo, lo + n):
        return block
    block = _leases.block_at(lo, lo + n)
    if block is not None:
        remember(_known, lo, block)
    return block


def tensor_over(buf: np.ndarray, dtype: torch.dtype, size, stride, offset: int, block=None):
    """A tensor viewing the bytes of the uint8 array ``buf`` (which it keeps alive);
    ``block``, the host block ``buf`` lies in, makes the tensor's later sends cheap."""
    # Two torch calls at most: each costs microseconds in a process that just woke up.
    try:
        t = torch.frombuffer(buf, dtype=dtype)
    except ValueError:  # a byte count that is not a multiple of the item size
        t = torch.empty(0, dtype=dtype).set_(torch.from_numpy(buf).untyped_storage())
    if block is not None:
        remember(_known, t.data_ptr(), block)
    if offset or len(size) != 1 or stride[0] != 1 or t.shape[0] != size[0]:
        t.set_(t.untyped_storage(), offset, size, stride)
    return t


_warned = [False]  # the warning about tensors shared by torch itself: once per process

_cuda_reducer = None  # ``_torch_cuda.reduce_cuda_tensor`` once that module is loaded
_cuda_storage_block = None  # ``_torch_cuda.storage_block``, likewise
_cuda_loader = None  # imports ``_torch_cuda`` (set by ``_plugins``; it needs CuPy)


def set_cuda_path(*, reducer=None, storage_block=None, loader=None) -> None:
    """Register how CUDA tensors travel (``reducer(enc, tensor)``) and how to find the
    GPU block of one (``storage_block(tensor)``), or how to load the module that
    registers them (``loader()``, tried once, on the first CUDA tensor sent or asked
    about)."""
    global _cuda_reducer, _cuda_storage_block, _cuda_loader
    if reducer is not None:
        _cuda_reducer = reducer
    if storage_block is not None:
        _cuda_storage_block = storage_block
    if loader is not None:
        _cuda_loader = loader


def _cuda_path():
    global _cuda_loader
    if _cuda_reducer is None and _cuda_loader is not None:
        load, _cuda_loader = _cuda_loader, None
        try:
            load()
        except ImportError:  # no CuPy: torch pickles CUDA tensors (by value)
            pass
    return _cuda_reducer


def tensor_is_shared(t: torch.Tensor) -> bool:
    """``actorshm.torch.is_shared`` (and ``actorshm.is_shared`` of a tensor): whether
    ``t``'s storage lies in shared memory or a GPU pool (it travels by reference); for a
    sparse tensor, whether its index and value tensors all do. A nested or quantized
    tensor never does (torch pickles it, by value), nor one of a subclass that pickles
    itself its own way (``_reduce_subclass``), nor a wrapper subclass (no storage). A
    subclass of ``nn.Parameter`` that keeps its pickling does: torch reduces it to its
    ``.data``, a plain tensor that travels as any (it arrives as an ``nn.Parameter``)."""
    if not _pickled_as_tensor(type(t)):
        return False
    if t.layout in SPARSE:
        return all(tensor_is_shared(p) for p in sparse_parts(t) if isinstance(p, torch.Tensor))
    if t.layout is not torch.strided or t.is_nested or t.is_quantized:
        return False
    if t.device.type == "cuda":
        _cuda_path()  # (no CuPy: no GPU pool, nothing on the GPU is shared)
        return _cuda_storage_block is not None and _cuda_storage_block(t) is not None
    try:
        return storage_block(t) is not None
    except RuntimeError:  # a wrapper subclass (``_make_wrapper_subclass``): no storage
        return False


def _pickled_as_tensor(kind: type) -> bool:
    """Whether a tensor of class ``kind`` reaches ``_reduce_bare`` as a tensor (and so
    travels by reference when shared): a plain tensor or Parameter, a subclass keeping
    torch's pickling (``_reduce_subclass``), or a Parameter subclass keeping Parameter's
    (torch reduces it to its ``.data``). Any other subclass pickles itself, by value."""
    reduce = kind.__reduce_ex__
    return kind is torch.Tensor or kind is _Parameter or \
        reduce is torch.Tensor.__reduce_ex__ or \
        (reduce is _Parameter.__reduce_ex__ and issubclass(kind, _Parameter))


# The quantized dtypes: a tensor of one that is not quantized (``.view(torch.qint32)`` of
# raw bytes) has no quantizer, and torch rebuilds it as a quantized one without any (its
# own pickling too): the receiver crashed on it (SIGSEGV).
QUANTIZED = frozenset(getattr(torch, name) for name in
                      ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                      if hasattr(torch, name))


def check_sendable(t: torch.Tensor) -> None:
    """Refuse a tensor that is part of an autograd graph, of a quantized dtype but not
    quantized, or without a storage (MKL-DNN), before anything is sent."""
    if t.requires_grad and not t.is_leaf:
        raise _serialization.Unsendable(  # (a TypeError whose message says it all)
            "a tensor that requires grad and is not a leaf (it is part of an autograd "
            "graph) cannot be sent: send `t.detach()` (or a leaf, e.g. a Parameter)")
    if t.dtype in QUANTIZED and not t.is_quantized:
        raise _serialization.Unsendable(
            f"a tensor of dtype {t.dtype} that is not quantized (a .view({t.dtype}) of "
            "raw memory: it has no scale or zero point) cannot be sent, as torch cannot "
            "rebuild it: send its raw memory (e.g. t.view(torch.int32)), or a quantized "
            "tensor (torch.quantize_per_tensor)")
    if t.layout == MKLDNN:
        raise _serialization.Unsendable(
            "an MKL-DNN tensor (t.to_mkldnn()) has no storage to send or share, and torch "
            "cannot pickle it: send `t.to_dense()`")


MKLDNN = getattr(torch, "_mkldnn", None)  # (the layout of t.to_mkldnn())


def view_bits(t: torch.Tensor) -> int:
    """The lazy views torch keeps as bits on a tensor, not in its memory: conjugate (1)
    and negative (2). The memory travels as it is; the receiver sets the same bits."""
    return (1 if t.is_conj() else 0) | (2 if t.is_neg() else 0)


def without_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` with its ``view_bits`` ``bits`` taken off: a view of the same memory, read
    as it lies (``finish`` sets them again on a copy of it)."""
    if bits & 2:
        t = torch._neg_view(t)
    if bits & 1:
        t = t.conj()
    return t


def finish(t: torch.Tensor, parameter: bool, requires_grad: bool, bits: int = 0):
    """The received tensor ``t`` as the sender had it: a Parameter, requiring grad, a
    conjugate or negative view (``view_bits``)."""
    if bits & 1:
        t = t.conj()
    if bits & 2:
        t = torch._neg_view(t)
    if parameter:
        return _Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(enc, t: torch.Tensor):
    kind = type(t)
    if kind is not torch.Tensor and kind is not _Parameter:
        return _reduce_subclass(enc, t)
    out = _reduce_bare(enc, t)
    if t.__dict__ and out is not NotImplemented:
        # Attributes set on it (``p.no_decay = True``) go along, as torch's pickling
        # (and so the Ray backend) keeps them. As the pickle's state, set once the
        # tensor is rebuilt: an attribute may refer to the tensor itself (as arguments
        # of its rebuild, it recursed without end).
        return (*out, dict(t.__dict__), None, None, _set_attributes)
    return out


def _set_attributes(t: torch.Tensor, state: dict) -> None:
    t.__dict__.update(state)


def _reduce_subclass(enc, t: torch.Tensor):
    """A tensor of a subclass of ``torch.Tensor`` (torchvision's ``tv_tensors.Image``, a
    class of one's own) travels as its plain tensor would, by reference when shared,
    and is made one of its class again where it arrives, with the state torch's own
    pickling keeps (its ``__dict__``, or what its ``__getstate__`` gives). Pickled by
    torch, by value, a shared one was copied each time (uncounted) and the actor's
    writes were lost. A subclass that pickles itself its own way (a ``__reduce_ex__``
    of its own) or has no storage of its own (a wrapper subclass) is left to torch (a
    ``Parameter`` subclass: torch's ``Parameter.__reduce_ex__`` sends its ``.data``,
    which this reducer then sends as a plain tensor, by reference when shared, and it
    arrives as an ``nn.Parameter``)."""
    kind = type(t)
    if kind.__reduce_ex__ is not torch.Tensor.__reduce_ex__ or \
            not torch._C._has_storage(t):
        return NotImplemented
    check_sendable(t)
    with torch._C.DisableTorchFunctionSubclass():  # (its own overrides would re-wrap)
        base = t.detach().as_subclass(torch.Tensor)
    if t.requires_grad:  # a leaf (``_make_subclass``): the plain tensor is one too
        base.requires_grad_(True)
    out = _reduce_bare(enc, base)
    if out is NotImplemented:  # (quantized, nested, another device: torch pickles it)
        return out
    # The state is set once the tensor is rebuilt, as for attributes above.
    return (_as_subclass, (kind, *out), torch._utils._get_obj_state(t), None, None,
            _set_subclass_state)


def _as_subclass(kind, rebuild, args) -> torch.Tensor:
    """The received plain tensor made a ``kind``: a leaf over the same memory (as an
    ``nn.Parameter`` is made), keeping its ``requires_grad``."""
    t = rebuild(*args)
    return torch.Tensor._make_subclass(kind, t.detach(), t.requires_grad)


def _set_subclass_state(t: torch.Tensor, state) -> None:
    """Restore a subclass's state as torch's unpickling does (``_rebuild_from_type_v2``)."""
    if getattr(type(t), "__setstate__", torch.Tensor.__setstate__) is not \
            torch.Tensor.__setstate__:
        t.__setstate__(state)
    else:
        torch._utils._set_obj_state(t, state)


def state_for(state, tensor: torch.Tensor, copy: torch.Tensor):
    """``tensor``'s attribute state (``_get_obj_state``) for its copy ``copy``: an
    attribute that is ``tensor`` itself is ``copy``, as pickling's memo makes it."""
    def own(d):
        if type(d) is not dict or not any(v is tensor for v in d.values()):
            return d
        return {k: copy if v is tensor else v for k, v in d.items()}
    if type(state) is tuple and len(state) == 2:  # (its __dict__, its slots)
        return own(state[0]), own(state[1])
    return own(state)


def _from_another_process(st) -> bool:
    """Whether storage ``st``, in torch's shared memory, is one ``torch.multiprocessing``
    carried between processes (a ``DataLoader``'s batch from its workers, an item of a
    torch queue): data, copied as any other, not one the user shared here with
    ``share_memory_()`` and expects actors to write (what the warning is for; a model's
    parameters always warn). Torch keeps each storage it received or sent in
    ``reductions.shared_cache``; a torch without it answers False (the warning stays).
    (A scan of that cache, up to a few microseconds, for each such tensor sent until
    the warning has fired.)"""
    try:
        from torch.multiprocessing import reductions
        cdata = st._cdata
        return any(ref.cdata == cdata for ref in list(reductions.shared_cache.values()))
    except Exception:
        return False


def _reduce_bare(enc, t: torch.Tensor):
    """The reduction of tensor ``t`` without its attributes."""
    kind = type(t)
    if kind is not torch.Tensor and kind is not _Parameter:
        return NotImplemented  # another subclass: torch pickles it
    check_sendable(t)
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        if t.layout in SPARSE:
            return _rebuild_sparse, (t.layout, sparse_parts(t.detach()), kind is _Parameter,
                                     t.requires_grad)
        return NotImplemented  # torch pickles it, by value
    if not t.is_cpu:
        reducer = _cuda_path() if t.is_cuda else None
        return NotImplemented if reducer is None else reducer(enc, t)
    st = t.untyped_storage()
    n = st.nbytes()
    if n == 0:  # no bytes to carry (not torch's pickling: it cannot rebuild every dtype)
        return _rebuild_empty_tensor, (str(t.dtype), tuple(t.shape), t.stride(),
                                       t.storage_offset(), kind is _Parameter,
                                       t.requires_grad, view_bits(t))
    copies = enc.copies  # (an ordinary storage this message copied already: no lookup)
    made = copies.get(st.data_ptr()) if copies else None
    if made is None:
        where = _shared(enc, t)
        if where is not None:
            if kind is _Parameter:
                _note_parameter(enc, True)
            return _rebuild_tensor, where
    if st.is_shared() and not _warned[0] and (
            kind is _Parameter or t.requires_grad or not _from_another_process(st)):
        _warned[0] = True
        warn_at_caller(
            "a tensor in torch's shared memory (share_memory_(), Module.share_memory()) is "
            "copied each time actorshm sends it, so an actor's writes to it do not reach "
            "this process: share it with actorshm instead, actorshm.torch.share_module("
            "model) or actorshm.torch.share(t) (once), and send what they return (and do "
            "not call share_memory() after them, here or in an actor: it moves the "
            "tensors back out)", RuntimeWarning)
    requires_grad = t.requires_grad  # (a clone below would drop it)
    # The storage up to the view's last element, so that strides and storage offset stay.
    numel = t.numel()
    nbytes = numel * t.element_size()
    end = t.storage_offset()  # (an empty tensor: the storage up to its offset)
    if numel:
        for size, stride in zip(t.shape, t.stride()):
            end += (size - 1) * stride
    span = min(n, (end + 1) * t.element_size())
    # One copy per storage and message serves every tensor on it that it covers: views
    # of one tensor sent together stay views of one copy, as torch.multiprocessing keeps
    # them, and the rows of a batch (``list(batch)``) do not each copy the storage up to
    # themselves. The whole storage is copied once the views of it met in this message,
    # this one included, would keep its layout (``keeps_layout``: their bytes are at
    # least about a quarter of it; a single view, as when sent alone), or once the
    # pieces copied so far and this one would add up to more than the storage (so that
    # it is copied less than twice). Until then a view has its own copy, up to its last
    # element (strides and storage offset kept), or compactly when that would span much
    # more than its bytes (a small view of a much larger storage).
    if made is not None and made[1] is not None and span <= made[0]:
        return _copied(enc, t, made, kind, requires_grad)
    covered, where, spent, seen = made if made is not None else (0, None, 0, 0)
    keep = _shm.keeps_layout(span, nbytes)
    if _shm.keeps_layout(n, seen + nbytes) or spent + (span if keep else nbytes) > n:
        span = n
    elif not keep:  # (a clone resolves the view bits: they are set again on it, its
        bits = view_bits(t)  # memory as is)
        c = finish(without_bits(t.detach(), bits).clone(), False, False, bits)
        cst = c.untyped_storage()
        own = _copy(enc, cst, cst.nbytes())
        if copies is None:
            copies = enc.copies = {}
        copies[st.data_ptr()] = (covered, where, spent + own[0], seen + nbytes)
        return _copied(enc, c, own, kind, requires_grad)
    if copies is None:
        copies = enc.copies = {}
    made = copies[st.data_ptr()] = _copy(enc, st, span, spent, seen + nbytes)
    return _copied(enc, t, made, kind, requires_grad)


def _copy(enc, st, n: int, spent: int = 0, seen: int = 0) -> tuple:
    """A copy of the first ``n`` bytes of storage ``st`` for this message: in band when
    small, as a small numpy array goes (a copy either way, and a shared block would cost
    more than the bytes it carries; ``encode`` counts it), else in a new shared block.
    ``(n, where, bytes of this storage copied so far in the message, bytes of the views
    of it sent so far)``; ``where`` is the in-band buffer (pickled once however many
    tensors use it), or the copy's array."""
    if in_band(n, enc.inlined):
        enc.inlined += n
        enc.n_inlined += 1
        return n, pickle.PickleBuffer(_bytes_of(st, n)), spent + n, seen
    copy = _shm.empty(n, np.uint8)
    # numpy's memcpy, not torch's copy_: torch splits a copy over its intra-op
    # threads, which on a busy machine took 10 ms for 1 MiB instead of 50 µs.
    np.copyto(copy, _bytes_of(st, n))
    enc.count("bytes_copied", n)
    enc.count("arrays_copied", 1)
    return n, copy, spent + n, seen


def _note_parameter(enc, shared: bool) -> None:
    """A Parameter goes by reference (``shared``) or as a copy in message ``enc``. Both
    in one message is a model partly shared (a layer added or replaced after
    ``share_module``, ``.half()`` or ``.to()`` after it): its copied parameters never
    learn from an actor's steps, so say so, once per process."""
    if _warned_mixed[0]:
        return
    copies = enc.copies
    if copies is None:
        copies = enc.copies = {}
    # (one lookup per Parameter sent, a hot path in Hogwild: the first one's kind is
    # kept, under a key that is no storage's address)
    first = copies.get("parameters")
    if first is None:
        copies["parameters"] = shared
    elif first is not shared:
        _warned_mixed[0] = True
        warn_at_caller(
            "parameters of a model are sent partly by reference (shared with "
            "actorshm.torch.share_module) and partly as copies (not in shared memory: "
            "added or replaced after share_module, or moved by .to(), .half() or "
            "share_memory() since): an actor's updates to the copies do not reach this "
            "process. Call actorshm.torch.share_module(model) again after changing the "
            "model (it moves only what is not shared yet)", RuntimeWarning)


_warned_mixed = [False]  # (``_note_parameter``: once per process)


def _copied(enc, t: torch.Tensor, made: tuple, kind, requires_grad: bool):
    """The reduction of ordinary tensor ``t`` over the copy ``made`` (``_copy``)."""
    if kind is _Parameter:
        _note_parameter(enc, False)
    n, where = made[0], made[1]
    if type(where) is pickle.PickleBuffer:
        return _rebuild_inline_tensor, (
            where, str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset(),
            kind is _Parameter, requires_grad, view_bits(t))
    return _rebuild_tensor, _where(enc, t, _shm.find_block(where),
                                   where.__array_interface__["data"][0], n, kind,
                                   requires_grad)


def _bytes_of(st, n: int) -> np.ndarray:
    """The first ``n`` bytes of storage ``st``, as a uint8 numpy view."""
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (n,), (1,)).numpy()


def _rebuild_inline_tensor(buf, dtype, size, stride, offset, parameter, requires_grad,
                           bits):
    """The receiver's writable copy of a small tensor sent in band: its storage bytes
    (a bytearray, or bytes from a read-only source, copied so that it is writable)."""
    if type(buf) is not bytearray:
        buf = bytearray(buf)
    t = tensor_over(np.frombuffer(buf, np.uint8), _DTYPES[dtype], size, stride, offset)
    return finish(t, parameter, requires_grad, bits)


def _rebuild_empty_tensor(dtype, size, stride, offset, parameter, requires_grad, bits):
    """The receiver's tensor over an empty storage, as the sender had it."""
    t = torch.empty(0, dtype=_DTYPES[dtype])
    t.set_(t.untyped_storage(), offset, size, stride)
    return finish(t, parameter, requires_grad, bits)


def _shared(enc, t: torch.Tensor):
    """``_where`` of strided CPU tensor ``t`` when its storage lies in a host block (that
    block leased in ``enc``, the tensor counted as passed by reference), else None."""
    st = t.untyped_storage()
    n = st.nbytes()
    block = _block_of(st.data_ptr(), n) if n else None
    if block is None:
        return None
    enc.count("bytes_zero_copy", t.numel() * t.element_size())
    enc.count("arrays_zero_copy", 1)
    return _where(enc, t, block, st.data_ptr(), n, type(t), t.requires_grad)


SPARSE = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                     torch.sparse_bsc})


def sparse_parts(t: torch.Tensor) -> tuple:
    """What makes sparse ``t`` (detached): its index and value tensors (strided, so they
    travel as any tensor: by reference when shared, else copied once) and its size."""
    size = tuple(t.shape)
    if t.layout is torch.sparse_coo:
        return t._indices(), t._values(), size, t.is_coalesced()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values(), size
    return t.ccol_indices(), t.row_indices(), t.values(), size


def _rebuild_sparse(layout, parts: tuple, parameter: bool, requires_grad: bool):
    """A sparse tensor over the parts ``sparse_parts`` sent. (Not torch's own
    unpickling: that queues each sparse tensor for ``torch.load`` to check, and outside
    ``torch.load`` nothing empties the queue, so every tensor received would stay alive,
    its shared memory leased.) The sender's invariants held; they are not checked again."""
    t = sparse_over(layout, parts)
    return finish(t, parameter, requires_grad)


def sparse_over(layout, parts: tuple) -> torch.Tensor:
    """The sparse tensor of ``layout`` made of ``parts`` (as ``sparse_parts`` gives
    them), viewing their memory; invariants not checked again."""
    if layout is torch.sparse_coo:
        indices, values, size, coalesced = parts
        return torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced,
                                       check_invariants=False)
    compressed, plain, values, size = parts
    return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout,
                                          check_invariants=False)


def _where(enc, t: torch.Tensor, block, base: int, n: int, kind, requires_grad: bool):
    """What the receiver needs to rebuild CPU tensor ``t`` over its ``n`` storage bytes
    at ``base`` in ``block``, which this leases in ``enc``: (row, start, n, dtype, size,
    stride, storage offset, parameter, requires_grad, view bits)."""
    row = _serialization.lease_host_block(enc, block)
    return (row, base - block.region.addr - block.offset, n, str(t.dtype), tuple(t.shape),
            t.stride(), t.storage_offset(), kind is _Parameter, requires_grad, view_bits(t))


def _tensor_hole(enc, t: torch.Tensor):
    """A shared CPU tensor in a flat message (``_flat``): ``(_flat_tensor, *where)``;
    None for any other tensor (the full encoder sends it, or refuses it)."""
    if not t.is_cpu or (t.requires_grad and not t.is_leaf) or t.dtype in QUANTIZED or \
            t.layout is not torch.strided or t.is_nested or t.__dict__:
        return None
    where = _shared(enc, t)
    return None if where is None else (_flat_tensor, *where)


def _tensor_on(block, start, n, dtype, size, stride, offset, parameter, requires_grad,
               bits):
    """The tensor ``_where`` described, over received ``block``."""
    t = tensor_over(np.asarray(block)[start:start + n], _DTYPES[dtype], size, stride,
                    offset, block)
    return finish(t, parameter, requires_grad, bits)


def _rebuild_tensor(row, start, n, dtype, size, stride, offset, parameter, requires_grad,
                    bits=0):
    return _tensor_on(_serialization.leased_block(row), start, n, dtype, size, stride,
                      offset, parameter, requires_grad, bits)


def _flat_tensor(blocks, row, *where):
    if row < 0:
        raise ValueError(f"a tensor's hole names row {row}")
    return _tensor_on(blocks[row], *where)


def _reduce_storage(enc, st):
    """A CPU storage (``t.untyped_storage()``, or the older typed ``t.storage()``)
    travels as a byte tensor over all of it does, by reference when it lies in shared
    memory (the actor's writes to it reach ours), else copied once; the receiver gets a
    storage of the same kind over that memory. Other storages: torch pickles them."""
    typed = isinstance(st, torch.TypedStorage)
    untyped = st._untyped_storage if typed else st
    if untyped.device.type != "cpu":
        return NotImplemented
    whole = torch.empty(0, dtype=torch.uint8).set_(untyped, 0, (untyped.nbytes(),), (1,))
    return _rebuild_storage, (whole, str(st.dtype) if typed else None)


def _rebuild_storage(whole: torch.Tensor, dtype: str | None):
    untyped = whole.untyped_storage()
    if dtype is None:
        return untyped
    return torch.TypedStorage(wrap_storage=untyped, dtype=_DTYPES[dtype], _internal=True)


def _refuse_script_module(enc, m):
    """A TorchScript module's reduction: refused, saying what to send instead (torch
    cannot pickle one: "Tried to serialize object ... which does not have a __getstate__
    method defined", to which the generic advice about open files was added)."""
    raise _serialization.Unsendable(
        f"a TorchScript module ({type(m).__name__}, from torch.jit.script or "
        "torch.jit.trace) cannot be pickled, so it cannot be sent: send the nn.Module it "
        "was made from (shared with actorshm.torch.share_module for Hogwild) and script "
        "it in the actor, or torch.jit.save it to a file and torch.jit.load it there")


_serialization.register_reducer(torch.Tensor, _reduce_tensor, check_sendable)
_serialization.register_reducer(torch.UntypedStorage, _reduce_storage)
_serialization.register_reducer(torch.TypedStorage, _reduce_storage)
_serialization.register_reducer(torch.jit.ScriptModule, _refuse_script_module,
                                lambda m: _refuse_script_module(None, m))
for _kind in (torch.Tensor, _Parameter):
    _serialization.register_flat(_kind, _tensor_hole, _flat_tensor)
_serialization.register_shared_check(torch.Tensor, tensor_is_shared)
