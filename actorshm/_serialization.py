"""Serialization: pickle protocol 5, with arrays and fds travelling out of band.

Messages are pickled with a cloudpickle-based pickler, so that classes and functions
defined in ``__main__``, a notebook cell or a closure travel by value. Every numpy
array at any depth is replaced by a small descriptor of the shared block it lives in:
``(arena, offset, size)`` plus shape, dtype, strides and offset inside the block. An
array that is not yet in shared memory is first copied into this process's pool (once
per send; counted in ``bytes_copied``). A view of a shared block travels as a view:
strides, negative strides and offsets survive exactly, and nothing is copied.

An arena's fd rides along (SCM_RIGHTS) the first time it is needed on a connection.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import threading
import traceback
from typing import Any

import cloudpickle
import numpy as np

from . import _shm
from ._errors import ProtocolError, RemoteError, RemoteTraceback

__all__ = ["encode", "decode", "encode_exception", "decode_exception", "PassFd"]

_ndarray = np.ndarray
_memmap = np.memmap


class PassFd:
    """Wraps a file descriptor so that it travels with a message (SCM_RIGHTS)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd


class _Encoder(cloudpickle.Pickler):
    def __init__(self, file, conn) -> None:
        super().__init__(file, protocol=5)
        self.conn = conn
        self.fds: list[int] = []
        self.new_regions: list = []
        self.grants: list = []
        self.cuda_synced: set = set()  # GPUs whose sender-side work this message waited for

    def lease(self, view) -> bool:
        """Grant ``view`` to the peer with this message (host and GPU blocks alike).

        Returns True when the block's region is new to this connection, so that the
        descriptor must carry what opens it (an arena's fd, a slab's IPC handle).
        """
        self.grants.append(view)
        region = view.region
        if region.key in self.conn.sent_regions or region in self.new_regions:
            return False
        self.new_regions.append(region)
        return True

    def reducer_override(self, obj):
        t = type(obj)
        if obj is _rebuild_array:  # ours, importable: plain pickling by name is enough
            return NotImplemented
        if t is _ndarray or (isinstance(obj, _ndarray)):
            r = _reduce_array(self, obj)
            if r is not None:
                return r
            return NotImplemented
        if t is PassFd:
            self.fds.append(obj.fd)
            return _rebuild_fd, (len(self.fds) - 1,)
        cp = sys.modules.get("cupy")
        if cp is not None and t is cp.ndarray:
            from . import _cuda
            return _cuda.reduce_cupy(self, obj)
        return super().reducer_override(obj)


def _reduce_array(enc: _Encoder, a: np.ndarray):
    dtype = a.dtype
    if dtype.hasobject or a.size == 0:
        return None  # by value, in band (object arrays hold Python objects, not bytes)
    view = _shm.find_view(a)
    stats = _shm._stats
    if view is None:
        a = _shm.copy_to_shared(a)
        view = _shm.find_view(a)
        stats["bytes_copied"] += a.nbytes
        stats["arrays_copied"] += 1
    else:
        stats["bytes_zero_copy"] += a.nbytes
        stats["arrays_zero_copy"] += 1
    arena = view.region
    fd_index = -1
    if enc.lease(view):
        fd_index = len(enc.fds)
        enc.fds.append(arena.fd)
    data = a.__array_interface__["data"][0]
    t = type(a)
    sub = None if (t is _ndarray or t is _memmap) else t
    # A plain dtype travels as its string ('<f8'): much cheaper to pickle than the object.
    dt = dtype.str if dtype.fields is None and dtype.subdtype is None else dtype
    return _rebuild_array, (arena.key, arena.size, fd_index, view.offset, view.size,
                            data - arena.addr - view.offset, a.shape, dt, a.strides, sub)


class _DecodeCtx:
    __slots__ = ("conn", "fds", "taken")

    def __init__(self, conn, fds) -> None:
        self.conn = conn
        self.fds = fds
        self.taken: set[int] = set()

    def take_fd(self, index: int) -> int:
        if not 0 <= index < len(self.fds) or index in self.taken:
            raise ProtocolError(f"frame refers to fd #{index}, which it did not carry")
        self.taken.add(index)
        return self.fds[index]


_tls = threading.local()


def current_decode_conn():
    ctx = getattr(_tls, "ctx", None)
    return ctx.conn if ctx is not None else None


def _ctx() -> _DecodeCtx:
    ctx = getattr(_tls, "ctx", None)
    if ctx is None:
        raise ProtocolError("actorshm arrays can only be unpickled by actorshm itself")
    return ctx


def _rebuild_fd(index: int) -> int:
    return _ctx().take_fd(index)


def _rebuild_array(key, arena_size, fd_index, boff, bsize, aoff, shape, dtype, strides, sub):
    ctx = _ctx()
    view = _shm.adopt(ctx.conn, key, boff, bsize, _open_arena, ctx, key, arena_size, fd_index)
    arr = np.ndarray(shape, dtype, buffer=np.asarray(view), offset=aoff, strides=strides)
    if sub is not None:
        arr = arr.view(sub)
    return arr


def _open_arena(ctx: _DecodeCtx, key: tuple, size: int, fd_index: int) -> _shm.Arena:
    """Map an arena a peer introduced in this frame (its fd rode along)."""
    if fd_index < 0:
        raise ProtocolError("peer referred to an arena it never sent")
    fd = ctx.take_fd(fd_index)
    if os.fstat(fd).st_size < size:
        raise ProtocolError("arena fd is smaller than the peer claims")
    addr = _shm._map(fd, size)
    _shm._stats["arenas_mapped"] += 1
    return _shm.Arena(key, fd, size, addr, owned=False, dedicated=size >= _shm.LARGE)


_SIMPLE = frozenset({int, float, str, bytes, bool, type(None), complex})
_dumps = pickle.dumps


def _simple(obj: Any) -> bool:
    """Scalars, and flat tuples/lists/dicts of scalars: plain pickle does them right."""
    t = type(obj)
    if t in _SIMPLE:
        return True
    if t is tuple or t is list:
        return all(type(x) in _SIMPLE for x in obj)
    if t is dict:
        return all(type(v) in _SIMPLE and type(k) is str for k, v in obj.items())
    return False


def encode(obj: Any, conn) -> tuple[bytes, list[int], "_Encoder | None"]:
    """Pickle ``obj`` for ``conn``. Nothing is committed until ``commit`` is called."""
    # Fast path (most calls): builtin scalars need neither cloudpickle nor our reducers.
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is str:
        if _simple(obj[1]) and _simple(obj[2]):
            return _dumps(obj, 5), [], None
    elif _simple(obj):
        return _dumps(obj, 5), [], None
    f = io.BytesIO()
    enc = _Encoder(f, conn)
    enc.dump(obj)
    return f.getvalue(), enc.fds, enc


def commit(enc: _Encoder) -> None:
    """Record the grants and arena fds of a message that is about to be sent."""
    if enc is None:
        return
    conn = enc.conn
    grants = conn.grants
    for view in enc.grants:
        g = grants.get(view.key)
        if g is None:
            grants[view.key] = [view, 1]
        else:
            g[1] += 1
    for region in enc.new_regions:
        conn.sent_regions.add(region.key)
        region.sent_to.add(conn)


def decode(payload, fds, conn) -> Any:
    """Unpickle a message received on ``conn`` with the fds its frame carried."""
    ctx = _DecodeCtx(conn, fds)
    prev = getattr(_tls, "ctx", None)
    _tls.ctx = ctx
    try:
        return pickle.loads(payload)
    finally:
        _tls.ctx = prev
        if fds:
            for i, fd in enumerate(fds):
                if i not in ctx.taken:
                    try:
                        os.close(fd)
                    except OSError:
                        pass


def encode_exception(exc: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = cloudpickle.dumps(exc, protocol=5)
    except Exception:
        blob = None
    t = type(exc)
    name = t.__qualname__ if t.__module__ in ("builtins", "__main__") else \
        f"{t.__module__}.{t.__qualname__}"
    try:
        msg = str(exc)
    except Exception:
        msg = "<unprintable exception>"
    return pickle.dumps((blob, name, msg, tb), protocol=5)


def decode_exception(payload: bytes, where: str = "") -> BaseException:
    """Rebuild an exception sent by ``encode_exception``: same type where possible."""
    try:
        blob, name, msg, tb = pickle.loads(payload)
    except Exception as exc:  # pragma: no cover - a peer bug
        return ProtocolError(f"undecodable error reply: {exc!r}")
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        return RemoteError(name, msg, tb)
    exc.__cause__ = RemoteTraceback(tb)
    if hasattr(exc, "add_note"):
        try:
            exc.add_note(f"(raised in {where})" if where else "(raised in an actor)")
        except Exception:
            pass
    return exc
