"""Flat messages: builtin scalars and shared arrays, with no pickler of our own.

Most calls that carry arrays carry them flat: ``step(weights, grad, lr=0.1)``, each
argument a builtin scalar or a numpy array already in shared memory, and most results
are such arrays or flat tuples of them. For those the full encoder
(``_serialization``: a pickler subclass asked about every object, a decoding context)
is most of the cost of a call. A flat message is instead the block table and one plain
pickle of the message in which each array is a *hole*: a tuple of its block's row in
the table, its offset in the block, shape, dtype and strides (frame flags
``HAS_BLOCKS | FLAT``). Scalars are never tuples, so every tuple in a flat container is
a hole. The receiver adopts the table as for any message, then makes each hole an array
on its block: the same writable view, by reference, that the full encoder gives. An
array that recurs is one hole, and arrives as one array.

A message with an array that is not in shared memory (it is copied, or pickled in band
when small) is not flat: ``encode_flat`` returns None and the full encoder makes it.

Plug-in objects that lie in shared memory travel flat too (a torch tensor:
``_registry.register_flat``): their hole is ``(maker, row, ...)``, and the receiver calls
``maker(blocks, row, ...)``; ``maker`` goes by name, so its plug-in loads where it lands.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from . import _arena, _leases, _shm
from ._encoding import SCALARS, Encoding, arena_fd, check_size
from ._errors import ProtocolError
from ._inband import dtype_token
from ._registry import _flat_holes, _flat_makers
from ._wire import ARENA, FLAT, HAS_BLOCKS, LEN

__all__ = ["encode_flat", "decode_flat"]

_ndarray = np.ndarray
_find_block = _shm.find_block
_first_sends = _shm.first_sends
_dumps = pickle.dumps
_loads = pickle.loads
_LEN = LEN


class _FlatEncoding(Encoding):
    """The blocks of a flat message (``encode_flat``): no pickler of its own."""

    def __init__(self, conn) -> None:
        self._start(conn)
        self.holes: dict = {}  # id(object) -> its hole: one sent twice arrives once
        self.zc_bytes = 0  # numpy arrays passed by reference (settled with ``counts``)
        self.zc_arrays = 0


_offsets = _arena.offsets
_remember_offset = _arena.remember_offset


def _hole(enc: _FlatEncoding, a: np.ndarray):
    """Where shared array ``a`` lies: ``(row, offset in its block, shape, dtype, strides)``,
    its block leased in ``enc``; None when ``a`` is not in shared memory (or is empty)."""
    ref = _offsets.get(id(a))
    if ref is not None and ref() is a:
        view, aoff = ref.block, ref.offset
    else:
        view = _find_block(a)
        if view is None or not a.size:
            return None
        aoff = a.__array_interface__["data"][0] - view.region.addr - view.offset
        _remember_offset(a, view, aoff)
    row = enc.lease(view, ARENA, arena_fd)
    if not (_first_sends and _shm.first_send(enc, a)):  # (a group's fresh copy: copied)
        enc.zc_bytes += a.nbytes
        enc.zc_arrays += 1
    return (row, aoff, a.shape, dtype_token(a.dtype), a.strides)


_NOT_FLAT = object()


def _item(enc: _FlatEncoding, x):
    """Item ``x`` of a flat container as the message carries it: a builtin scalar as it
    is, a shared array (or a plug-in's object in shared memory) as its hole; ``_NOT_FLAT``
    for anything else (a nested container, which plain pickle would copy arrays out of; a
    tuple, which would read as a hole). The same hole object each time ``x`` recurs, so
    the receiver makes one object of it, as pickle's memo does for the other messages."""
    tx = type(x)
    if tx is _ndarray:
        make_hole = _hole
    elif tx in SCALARS:
        return x
    else:
        make_hole = _flat_holes.get(tx)  # a plug-in's object (a torch tensor)
        if make_hole is None:
            return _NOT_FLAT
    holes = enc.holes
    hole = holes.get(id(x)) if holes else None
    if hole is None:
        hole = make_hole(enc, x)
        if hole is None:
            return _NOT_FLAT
        holes[id(x)] = hole
    return hole


def _holed(enc: _FlatEncoding, c):
    """Flat container ``c`` with each array a hole (``_item``), or None: not flat."""
    t = type(c)
    if t is tuple or t is list:
        out = []
        for x in c:
            if type(x) not in SCALARS:
                x = _item(enc, x)
                if x is _NOT_FLAT:
                    return None
            out.append(x)
        return tuple(out) if t is tuple else out
    if t is dict:
        out = {}
        for k, x in c.items():
            if type(k) is not str:
                return None
            if type(x) not in SCALARS:
                x = _item(enc, x)
                if x is _NOT_FLAT:
                    return None
            out[k] = x
        return out
    return None  # (a container is expected here)


def encode_flat(obj: Any, conn):
    """A message of builtin scalars and shared arrays, flat (a call with such arguments,
    such a result), as a block table and a plain pickle with the arrays as holes
    (``FLAT``): no pickler subclass, no decoding context. None when an array or plug-in
    object is not in shared memory (``_serialization``'s picklers do those).

    ``obj`` is an array (or plug-in object), one flat container, or a call ``(method,
    args, kwargs[, meta])`` whose args and kwargs are flat and whose meta
    (``_serialization.encode`` checked it) is builtins only. Every container is checked
    here: only builtin scalars, arrays and registered plug-in objects in it, so that each
    tuple the receiver finds in it is a hole."""
    enc = _FlatEncoding(conn)
    t = type(obj)
    if t is tuple and 3 <= len(obj) <= 4 and type(obj[0]) is str and type(obj[1]) is tuple \
            and type(obj[2]) is dict:
        args = _holed(enc, obj[1])
        if args is None:
            return None
        kwargs = _holed(enc, obj[2]) if obj[2] else {}
        if kwargs is None:
            return None
        body = (0, (obj[0], args, kwargs, *obj[3:]))
    elif t is _ndarray or t in _flat_holes:
        body = (1, _item(enc, obj))
        if body[1] is _NOT_FLAT:
            return None
    else:  # one flat container (anything else, e.g. a call-shaped tuple, is not flat)
        sk = _holed(enc, obj)
        if sk is None:
            return None
        body = (2, sk)
    data = _dumps(body, 5)
    check_size(len(data))
    if enc.waits:  # (a plug-in's hole may ask, ``before_send``)
        for fn, items in enc.waits.items():
            fn(items)
    counters = _leases.counters
    if enc.zc_arrays:
        counters["bytes_zero_copy"] += enc.zc_bytes
        counters["arrays_zero_copy"] += enc.zc_arrays
    if enc.counts:
        enc.settle_counts(counters)
    table = _dumps(enc.table, 5)
    return [_LEN.pack(len(table)), table, data], enc.fds, enc, HAS_BLOCKS | FLAT


def _unholed(c, blocks: list, made: dict):
    """Container ``c`` of a flat message, each hole (a tuple) its object again."""
    t = type(c)
    if t is tuple:
        return tuple([_from_hole(x, blocks, made) if type(x) is tuple else x for x in c])
    if t is list:
        for i, x in enumerate(c):
            if type(x) is tuple:
                c[i] = _from_hole(x, blocks, made)
        return c
    if t is dict:
        for k, x in list(c.items()):
            if type(x) is tuple:
                c[k] = _from_hole(x, blocks, made)
    return c


class _MakerFailed(Exception):
    """A plug-in's maker raised ``exc``: that message fails as an object whose unpickling
    raises does (the call fails), not as a malformed frame (the connection closes)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _from_hole(hole: tuple, blocks: list, made: dict):
    """The array (or plug-in object) ``hole`` names, over its adopted block."""
    a = made.get(id(hole))  # (the same hole twice: one object sent twice)
    if a is None:
        row = hole[0]
        if type(row) is int:
            row, aoff, shape, dtype, strides = hole
            if row < 0:
                raise ValueError(f"a hole names row {row}")
            a = _ndarray(shape, dtype, buffer=np.asarray(blocks[row]), offset=aoff,
                         strides=strides)
        elif row in _flat_makers:  # a plug-in's object: ``(maker, row, ...)``
            try:
                a = row(blocks, *hole[1:])
            except Exception as exc:  # (its library lacks a dtype, say)
                raise _MakerFailed(exc) from None
        else:
            raise ValueError(f"a hole names {row!r}, which is no registered maker")
        made[id(hole)] = a
    return a


def decode_flat(payload, blocks: list):
    """What ``encode_flat`` made, its block table already adopted as ``blocks``.

    Raises:
        ProtocolError: the message is malformed (the connection closes).
        Exception: what unpickling it raised (a plug-in that cannot be imported here), or
            a plug-in's maker: as for any message, only that call fails.
    """
    body = _loads(payload)
    try:
        kind, sk = body
        made: dict = {}
        if kind == 0:  # a call (with its meta)
            method, args, kwargs, *meta = sk
            return (method, _unholed(args, blocks, made), _unholed(kwargs, blocks, made),
                    *meta)
        if kind == 1:
            return _from_hole(sk, blocks, made)
        return _unholed(sk, blocks, made)
    except _MakerFailed as failed:
        raise failed.exc from None
    except Exception as exc:
        raise ProtocolError(f"malformed flat message: {exc!r}") from None
