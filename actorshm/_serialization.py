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
        self.new_arenas: list = []
        self.grants: list = []
        self.cuda_grants: list = []

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
    arena = view.arena
    fd_index = -1
    key = arena.key
    if key not in enc.conn.sent_arenas and arena not in enc.new_arenas:
        fd_index = len(enc.fds)
        enc.fds.append(arena.fd)
        enc.new_arenas.append(arena)
    enc.grants.append(view)
    data = a.__array_interface__["data"][0]
    t = type(a)
    sub = None if (t is _ndarray or t is _memmap) else t
    # A plain dtype travels as its string ('<f8'): much cheaper to pickle than the object.
    dt = dtype.str if dtype.fields is None and dtype.subdtype is None else dtype
    return _rebuild_array, (key, arena.size, fd_index, view.offset, view.size,
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
    bkey = (key[0], key[1], boff)
    ref = _shm._views.get(bkey)
    view = ref() if ref is not None else None
    if view is None:
        if _shm._pool is not None and key[0] == _shm._pool.token:
            raise ProtocolError("peer sent back a block of ours that is no longer leased")
        arena = _shm._arenas.get(key)
        if arena is None:
            if fd_index < 0:
                raise ProtocolError("peer referred to an arena it never sent")
            fd = ctx.take_fd(fd_index)
            import os
            if os.fstat(fd).st_size < arena_size:
                raise ProtocolError("arena fd is smaller than the peer claims")
            addr = _shm._map(fd, arena_size)
            arena = _shm.Arena(key, fd, arena_size, addr, owned=False,
                               dedicated=arena_size >= _shm.LARGE)
            _shm._arenas[key] = arena
            _shm._stats["arenas_mapped"] += 1
        if boff < 0 or bsize < 0 or boff + bsize > arena.size:
            raise ProtocolError("block lies outside its arena")
        view = _shm._View(arena, boff, bsize, None)
        view.upstream = {ctx.conn: 1}
    else:
        # We already hold this block through an earlier lease (or own it): one lease per
        # process is enough, so this grant goes straight back. Holding both would let two
        # processes that passed a block back and forth pin it for each other forever.
        ctx.conn.queue_release(bkey, 1)
    arr = np.ndarray(shape, dtype, buffer=np.asarray(view), offset=aoff, strides=strides)
    if sub is not None:
        arr = arr.view(sub)
    return arr


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
    for arena in enc.new_arenas:
        conn.sent_arenas.add(arena.key)
        arena.sent_to.add(conn)
    if enc.cuda_grants:
        from . import _cuda
        _cuda.commit(conn, enc.cuda_grants)


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
            import os
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
