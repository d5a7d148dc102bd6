"""Simulated CuPy: ``ndarray`` over simulated device memory (see tests/simgpu/README.md).

Only what actorshm and its GPU tests use. Arithmetic runs in numpy on the mapped bytes;
an array made here without ``memptr`` comes from a simulated CuPy memory pool.
"""

import ctypes

import numpy as np

from . import cuda

__version__ = "0.0-simulated"
dtype = np.dtype
float32, float64, uint8, int32, int64 = (np.float32, np.float64, np.uint8, np.int32,
                                         np.int64)


class _Pool:
    def free_all_blocks(self):
        pass


_pool = _Pool()


def get_default_memory_pool():
    return _pool


class ndarray:
    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = np.dtype(dtype)
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        if memptr is None:  # "CuPy's own pool": an allocation actorshm did not make
            n = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            memptr = cuda.MemoryPointer(cuda.Memory(max(n, 1)), 0)
        self.data = memptr
        mem = memptr.mem
        if mem.size:
            buf = (ctypes.c_char * mem.size).from_address(mem.ptr)
            self._a = np.ndarray(shape, dtype, buffer=buf, offset=memptr.ptr - mem.ptr,
                                 strides=strides, order=order)
        else:
            self._a = np.ndarray(shape, dtype, strides=strides, order=order)

    @classmethod
    def _view(cls, parent, a):
        out = cls.__new__(cls)
        mem = parent.data.mem
        out.data = cuda.MemoryPointer(mem, a.__array_interface__["data"][0] - mem.ptr)
        out._a = a
        return out

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    strides = property(lambda self: self._a.strides)
    nbytes = property(lambda self: self._a.nbytes)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    flags = property(lambda self: self._a.flags)
    device = property(lambda self: cuda.Device(self.data.device_id))
    T = property(lambda self: ndarray._view(self, self._a.T))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"simulated cupy array({self._a!r})"

    def __getitem__(self, key):
        r = self._a[key]
        return ndarray._view(self, r) if isinstance(r, np.ndarray) else r

    def __setitem__(self, key, value):
        self._a[key] = value._a if isinstance(value, ndarray) else value

    def __iadd__(self, other):
        self._a += other._a if isinstance(other, ndarray) else other
        return self

    def fill(self, value):
        self._a.fill(value)

    def sum(self):
        return self._a.sum()

    def get(self, out=None):
        if out is None:
            return self._a.copy()
        out[...] = self._a
        return out


def empty(shape, dtype=float):
    return ndarray(shape, dtype)


def zeros(shape, dtype=float):
    a = ndarray(shape, dtype)
    a.fill(0)
    return a


def asarray(a):
    a = np.asarray(a)
    out = ndarray(a.shape, a.dtype)
    out._a[...] = a
    return out
