"""Small ordinary arrays in band, and dtypes as the message carries them.

An ordinary array (not in shared memory) of up to ``INLINE_MAX`` bytes travels inside
the pickle itself (protocol 5, in band), up to ``INLINE_BUDGET`` bytes of them per
message (one of up to ``ALWAYS_IN_BAND`` bytes always): it is a copy either way, and a
shared block would cost more than the bytes it carries. The receiver gets a writable copy with the same shape, dtype, strides and
memory order (a small view of a much larger array: compact, ``_arena.copy_layout``).
``dtype_token`` is how any array's dtype travels (in band or leased).
"""

from __future__ import annotations

import pickle

import numpy as np

from ._arena import copy_layout

__all__ = ["INLINE_MAX", "INLINE_BUDGET", "ALWAYS_IN_BAND", "in_band", "dtype_token",
           "inline_array", "rebuild_inline"]

_tokens: dict = {}  # dtype -> its token (a bounded cache)


def dtype_token(dtype: np.dtype):
    """What a dtype travels as: a plain one as its string ('<f8', '<M8[ns]'), ten times
    cheaper to pickle than the dtype object; a structured or sub-array one as itself.
    The same string object each time, so a message of many arrays pickles it once."""
    token = _tokens.get(dtype)
    if token is None:
        token = dtype.str
        if dtype.fields is not None or dtype.subdtype is not None or \
                np.dtype(token) != dtype:  # e.g. ml_dtypes' bfloat16: its str is '<V2'
            token = dtype
        if len(_tokens) < 256:
            _tokens[dtype] = token
    return token


# Ordinary arrays up to this size travel in band (a copy inside the pickle), up to this
# many bytes of them per message; bigger ones, and the rest, are copied into shared memory.
INLINE_MAX = 16 << 10
INLINE_BUDGET = 1 << 20
# ... but one of up to this many bytes always does: the smallest shared block is this
# big, and a block costs tens of microseconds each way (200,000 arrays of 16 bytes took
# 5 s, against 1 s for a pickle round trip of them, once 134,000 went to blocks).
ALWAYS_IN_BAND = 256


def in_band(n: int, inlined: int) -> bool:
    """Whether an ordinary array (or storage) of ``n`` bytes travels in band, in a
    message that carries ``inlined`` bytes in band already."""
    return n <= ALWAYS_IN_BAND or (n <= INLINE_MAX and inlined + n <= INLINE_BUDGET)


_PickleBuffer = pickle.PickleBuffer


def inline_array(a: np.ndarray):
    """The reduce value of a small ordinary array, its bytes in band: a writable copy
    on the other side, with the same shape, dtype, strides and memory order (a small
    view of a much larger array compactly, in its own axis order: ``copy_layout``)."""
    fl = a.flags
    if fl.c_contiguous and fl.writeable:  # the common case
        dt = a.dtype
        try:
            buf = _PickleBuffer(a)
        except (ValueError, BufferError):  # datetime64/timedelta64 export no buffer
            buf = _PickleBuffer(a.reshape(-1).view(np.uint8))
        shape = a.shape
        if 1 in shape:  # (an axis of length 1 may have any stride: ``a[:, None]``)
            return rebuild_inline, (buf, _tokens.get(dt) or dtype_token(dt), shape,
                                    a.strides)
        return rebuild_inline, (buf, _tokens.get(dt) or dtype_token(dt), shape)
    if fl.c_contiguous or fl.f_contiguous:  # read-only, or F order
        b = a.copy(order="K") if not fl.writeable else a  # (read-only bytes would arrive so)
        return rebuild_inline, (_PickleBuffer(b.ravel(order="K").view(np.uint8)),
                                dtype_token(a.dtype), a.shape, a.strides)
    offset, n, strides = copy_layout(a)
    b = np.zeros(n, np.uint8) if n > a.nbytes else np.empty(n, np.uint8)  # (gaps zeroed)
    np.copyto(np.ndarray(a.shape, a.dtype, buffer=b, offset=offset, strides=strides), a,
              casting="no")
    return rebuild_inline, (_PickleBuffer(b), dtype_token(a.dtype), a.shape, strides, offset)


def rebuild_inline(buf, dtype, shape, strides=None, offset=0):
    """The receiver's copy of an array sent by ``inline_array``."""
    return np.ndarray(shape, dtype, buffer=buf, strides=strides, offset=offset)
