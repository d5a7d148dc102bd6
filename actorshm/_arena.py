"""A memfd arena (the host's kind of region), its blocks, and arrays on them.

``new_arena`` makes the memfd behind one of a pool's arenas (``_shm.HostPool``); a peer
maps one it received with ``map_fd``. The pages are reserved at once
(``posix_fallocate``) so that running out is an error and never a SIGBUS on first touch,
and the file is sealed against shrinking, so no peer can make the owner's mapping fault.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import operator
import os
import resource
import weakref
from typing import Any

import numpy as np

from . import _leases
from ._errors import SharedMemoryError
from ._leases import Block, Region
from ._registry import plugin_is_shared
from ._util import fmt_bytes, off_stdio, require_linux

__all__ = ["Arena", "HostBlock", "find_block", "is_shared", "map_fd", "new_arena",
           "array_from_block", "nbytes_of"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_fd(fd: int, size: int) -> int:
    """Map ``size`` bytes of memfd ``fd`` shared and writable; its address."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise SharedMemoryError(f"actorshm: mmap of a {fmt_bytes(size)} arena failed: "
                                f"{os.strerror(err)}{_address_space_hint(err)}")
    return addr


def _address_space_hint(err: int) -> str:
    """Where mmap failed for want of address space under a limit, the limit and the fix."""
    if err != errno.ENOMEM:
        return ""
    try:
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (OSError, ValueError):  # pragma: no cover
        return ""
    if soft == resource.RLIM_INFINITY:
        return ""
    return (f" (this process's address space is limited to {fmt_bytes(soft)}: ulimit -v, "
            "RLIMIT_AS; every shared array this process makes or receives maps its arena "
            "whole: raise or lift the limit)")


class Arena(Region):
    """One memfd file mapped into this process."""

    __slots__ = ("fd", "addr")

    def __init__(self, key: tuple, fd: int, size: int, addr: int, owned: bool,
                 dedicated: bool) -> None:
        super().__init__(key, size, owned, dedicated)
        self.fd = fd
        self.addr = addr

    def block(self, offset: int, size: int, pool) -> "HostBlock":
        return HostBlock(self, offset, size, pool)

    def close(self) -> None:
        if self.addr:
            _libc.munmap(self.addr, self.size)
            self.addr = 0
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


class HostBlock(Block):
    """A host block: the ``base`` of every numpy array that views it."""

    __slots__ = ("__array_interface__",)

    def __init__(self, arena: Arena, offset: int, size: int, pool) -> None:
        super().__init__(arena, offset, size, pool)
        self.__array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (arena.addr + offset, False),
            "version": 3,
        }



def find_block(arr: np.ndarray) -> "HostBlock | None":
    """The shared block an array views, or None.

    Found through the array's ``base`` chain; an array whose memory another object
    owns (``np.frombuffer(w.data)``, ``torch.from_numpy(w).numpy()``) by its address.
    """
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if type(base) is HostBlock:
        return base
    if base is None or arr.size == 0:
        return None  # memory the array owns: not shared
    lo, hi = _byte_bounds(arr)
    return _leases.block_at(lo, hi)


try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy < 2
    _byte_bounds = np.byte_bounds


def is_shared(arr: Any) -> bool:
    """Whether ``arr`` (or the array it is a view of) lives in actorshm shared memory.

    Another library's array asks its plug-in (``_registry.register_shared_check``): a
    torch tensor is answered as ``actorshm.torch.is_shared`` does (whether it travels by
    reference), so that a view of shared memory is one whatever library made it
    (``torch.from_numpy(actorshm.zeros(n))``), and a CuPy array as
    ``actorshm.cuda.is_shared`` does; ``False`` for them would be a silent wrong answer."""
    if isinstance(arr, np.ndarray):
        return find_block(arr) is not None
    return plugin_is_shared(arr)


def array_from_block(view: HostBlock, shape, dtype, offset: int = 0, strides=None,
                    order: str = "C") -> np.ndarray:
    a = np.ndarray(shape, dtype, buffer=np.asarray(view), offset=offset, strides=strides,
                   order=order)
    if a.size:  # (an empty array is never sent by reference)
        remember_offset(a, view, offset)
    return a


class _Offset(weakref.ref):
    """Where an array's data starts in its block (``offsets``), while it lives."""

    __slots__ = ("key", "block", "offset")


def _forget_offset(ref: _Offset) -> None:
    if offsets.get(ref.key) is ref:
        del offsets[ref.key]


# id(array) -> its ``_Offset``: sending an array skips finding its block and reading its
# address (``__array_interface__`` builds a dict: the dearest step of sending one, ~1 us
# warm, ~9 us with the caches cold, as after a batch was filled). Recorded when
# ``empty`` makes the array (a new batch each step) or when it is first sent (weights
# every step). An array's data never moves (one viewing another's memory cannot be
# resized), and its entry goes when it dies, before its id can be reused.
offsets: dict = {}


def remember_offset(a: np.ndarray, view: HostBlock, offset: int) -> None:
    """Record that ``a``'s data starts ``offset`` bytes into block ``view``."""
    ref = _Offset(a, _forget_offset)
    ref.key, ref.block, ref.offset = id(a), view, offset
    offsets[id(a)] = ref


def nbytes_of(shape, dtype) -> tuple[tuple, np.dtype, int]:
    # As numpy: each dimension an integer (2.5 or "3" is a TypeError, not truncated).
    shape = (operator.index(shape),) if not hasattr(shape, "__iter__") else \
        tuple(operator.index(s) for s in shape)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        if type(dtype).__module__ == "torch":  # torch.float32: a tensor was meant
            raise TypeError(f"actorshm.empty/zeros make numpy arrays and take numpy dtypes, "
                            f"not {dtype}; for a tensor use actorshm.torch.empty/zeros")
        raise
    if dtype.hasobject:
        raise TypeError("actorshm: object arrays cannot live in shared memory; "
                        "use a numeric or structured dtype")
    n = dtype.itemsize
    for s in shape:
        if s < 0:
            raise ValueError(f"negative dimensions are not allowed: {shape}")
        n *= s
    return shape, dtype, n


# A copy of an ordinary array (or tensor) keeps the sender's layout (strides, the gaps
# between elements; a tensor's storage offset) when the memory that layout spans is at
# most KEEP_LAYOUT_RATIO times the array's bytes plus KEEP_LAYOUT_SLACK: a small view of
# a much larger array is copied compactly instead, in its own axis order, so that
# sending it does not copy the rest. Four: every other row and column of an image or a
# matrix (``a[::2, ::2]``) keeps its strides, as API.md promises, at four times its bytes.
KEEP_LAYOUT_RATIO = 4
KEEP_LAYOUT_SLACK = 64 << 10


def keeps_layout(span: int, nbytes: int) -> bool:
    """Whether a copy of an array of ``nbytes`` spanning ``span`` bytes keeps its layout."""
    return span <= KEEP_LAYOUT_RATIO * nbytes + KEEP_LAYOUT_SLACK


def copy_layout(arr: np.ndarray) -> tuple[int, int, tuple]:
    """How a copy of ordinary array ``arr`` is laid out in its new memory:
    ``(offset of its first element, bytes, strides)``. Its own strides (memory order,
    gaps and negative strides included; the gaps are zeroed by whoever copies) where
    ``keeps_layout`` says so and no two of its elements share memory, else compact in
    its own axis order (a sliding-window view becomes independent elements, as numpy's
    own copy does; a broadcast view, whose repeated axes have stride 0, is C-ordered
    unless its other axes are in Fortran order, where ``np.copy`` would make it
    Fortran-ordered: the repeats come last there)."""
    lo = hi = 0
    dims = []
    for n, st in zip(arr.shape, arr.strides):
        if n == 0:
            return 0, 0, arr.strides
        if n > 1:
            dims.append((abs(st), n))
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    span = hi - lo + arr.itemsize
    if keeps_layout(span, arr.nbytes) and _apart(dims, arr.itemsize):
        return -lo, span, arr.strides
    order = "K"
    if any(st == 0 and n > 1 for n, st in zip(arr.shape, arr.strides)):
        # a broadcast (an axis of length 1 may have any stride): its real axes say the order
        real = [abs(st) for n, st in zip(arr.shape, arr.strides) if st and n > 1]
        order = "F" if len(real) > 1 and real == sorted(real) else "C"
    return 0, arr.nbytes, np.empty_like(arr, order=order).strides


def copy_nbytes(arr: np.ndarray) -> int:
    """The bytes a copy of ordinary array ``arr`` takes (``copy_layout``)."""
    fl = arr.flags
    return arr.nbytes if fl.c_contiguous or fl.f_contiguous else copy_layout(arr)[1]


def _apart(dims: list, itemsize: int) -> bool:
    """Whether no two elements of a layout (``(abs(stride), size)`` of its dimensions
    longer than 1) share memory: each dimension, by increasing stride, steps over all
    that the smaller ones span. (Enough, not necessary: a layout it rejects is copied
    compactly, which is always right.)"""
    extent = itemsize
    for st, n in sorted(dims):
        if st < extent:
            return False
        extent += st * (n - 1)
    return True


def new_arena(key: tuple, size: int, dedicated: bool, pool) -> Arena:
    """A new owned arena of ``size`` bytes for ``pool`` (a ``_shm.HostPool``).

    Raises:
        SharedMemoryError: out of fds (after ``pool.free_idle()``), or the machine has
            no room for the pages.
    """
    require_linux("shared memory")
    try:
        fd = off_stdio(os.memfd_create("actorshm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        pool.free_idle()  # idle arenas hold fds: close them
        try:
            fd = off_stdio(os.memfd_create("actorshm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
        except OSError as exc2:
            if exc2.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise SharedMemoryError(
                f"actorshm: cannot allocate {fmt_bytes(size)} of shared memory: this "
                f"process is out of file descriptors ({exc2.strerror}; "
                f"{len(pool.regions)} arenas are in use, one fd each). Drop arrays you "
                "no longer need, use fewer larger arrays, or raise the limit "
                "(ulimit -n).") from None
    try:
        os.ftruncate(fd, size)
        try:
            # Reserve the pages now, so that running out is an error here and
            # never a SIGBUS on first touch (torch.multiprocessing's "Bus error").
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise SharedMemoryError(
                    f"actorshm: the machine has no room for {fmt_bytes(size)} more of "
                    f"shared memory ({exc.strerror}); {fmt_bytes(pool.reserved)} is in use "
                    "by this process. Free memory, or use smaller arrays."
                ) from None
            raise
        # Peers cannot shrink the file under our feet (which would be a SIGBUS).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        addr = map_fd(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return Arena(key, fd, size, addr, owned=True, dedicated=dedicated)

