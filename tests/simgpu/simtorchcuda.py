"""A stand-in for torch's CUDA tensors on the simulated GPU (see README.md).

A CPU build of torch has no CUDA tensors, so the two functions of
``actorshm._torch_cuda`` that need one are swapped by ``install()``: ``as_tensor``
(CuPy array -> torch CUDA tensor, DLPack on a real GPU) returns a ``SimCudaTensor``, and
``current_device`` asks the simulated CuPy. Everything else in actorshm's torch CUDA path
runs as it would on a GPU: the address lookup in GPU blocks, the copy into the pool, the
leases, the IPC handles, the record sent and the receiver's rebuild.

``SimCudaTensor`` is a ``torch.Tensor`` over simulated device memory (host memory, so
torch's CPU kernels read and write it) that reports ``device`` ``cuda:N``. Its storage's
``data_ptr()`` is the simulated device address, as a real CUDA tensor's is. Results of
operations on it are ``SimCudaTensor`` too (views stay views of device memory). It is registered with actorshm's CUDA tensor
path directly (a real CUDA tensor is a plain ``torch.Tensor``, which ``_torch`` routes
there by its device).
"""

import numpy as np
import torch

import cupy
from actorshm import _serialization, _torch_cuda


class SimCudaTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        dev = _device_of(args) if kwargs is None else _device_of((args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return _on_device(out, dev)

    @property
    def device(self):
        return torch.device("cuda", self._sim_device)

    @property
    def is_cuda(self):
        return True


def _device_of(args):
    for a in args:
        if isinstance(a, SimCudaTensor):
            return a._sim_device
        if isinstance(a, (list, tuple)):
            d = _device_of(a)
            if d is not None:
                return d
        if isinstance(a, dict):
            d = _device_of(tuple(a.values()))
            if d is not None:
                return d
    return None


def _on_device(out, dev):
    """An operation on a CUDA tensor gives CUDA tensors (views stay on the device)."""
    if dev is None or isinstance(out, SimCudaTensor):
        return out
    if type(out) is torch.Tensor:
        t = torch.Tensor._make_subclass(SimCudaTensor, out, out.requires_grad)
        t._sim_device = dev
        return t
    if isinstance(out, (list, tuple)) and type(out) in (list, tuple):
        return type(out)(_on_device(o, dev) for o in out)
    return out


class _Bytes:
    """Keeps the CuPy array (and so its actorshm block) alive under the numpy view."""

    def __init__(self, arr):
        self.arr = arr
        self.__array_interface__ = {"shape": (arr.nbytes,), "typestr": "|u1",
                                    "data": (arr.data.ptr, False), "version": 3}


def as_tensor(arr, dtype, size, stride, offset):
    """``_torch_cuda.as_tensor`` on the simulated GPU."""
    cpu = torch.from_numpy(np.asarray(_Bytes(arr)))
    t = torch.empty(0, dtype=dtype).set_(cpu.untyped_storage(), offset, size, stride)
    out = torch.Tensor._make_subclass(SimCudaTensor, t, False)
    out._sim_device = arr.data.device_id
    return out


def from_cupy(arr):
    """A "CUDA tensor" viewing any simulated CuPy array (as ``torch.from_dlpack``)."""
    flat = cupy.ndarray((arr.nbytes,), "u1", arr.data) if arr.nbytes else arr
    item = arr.dtype.itemsize
    return as_tensor(flat, getattr(torch, str(arr.dtype)), arr.shape,
                     tuple(s // item for s in arr.strides), 0)


def install():
    """Make this process's actorshm treat ``SimCudaTensor`` as a torch CUDA tensor."""
    _torch_cuda.as_tensor = as_tensor
    _torch_cuda.current_device = cupy.cuda.runtime.getDevice
    _serialization.register_reducer(SimCudaTensor, _torch_cuda.reduce_cuda_tensor)
