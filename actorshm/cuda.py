"""GPU arrays: ``actorshm.cuda.empty/zeros/share/is_shared`` for CuPy.

A ``cupy.ndarray`` in the arguments or result of a call travels as a CUDA IPC reference
to a slab of the sender's GPU pool; see docs/gpu.md. Importing ``actorshm`` never imports
this module; importing this module needs CuPy (``pip install 'actorshm[cuda]'``).
"""

from __future__ import annotations

__all__ = ["empty", "zeros", "share", "is_shared", "available"]


def available() -> bool:
    """Whether CuPy is installed and sees at least one GPU."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _impl():
    try:
        from . import _cuda
    except ImportError as exc:
        raise ImportError("actorshm.cuda needs CuPy: pip install 'actorshm[cuda]' "
                          "(cupy-cuda12x)") from exc
    return _cuda


def empty(shape, dtype=float, order: str = "C"):
    """A new CuPy array in this process's shareable GPU pool (contents undefined)."""
    return _impl().empty(shape, dtype, order)


def zeros(shape, dtype=float, order: str = "C"):
    """A new zero-filled CuPy array in this process's shareable GPU pool."""
    return _impl().zeros(shape, dtype, order)


def share(arr):
    """``arr`` if it already lives in an actorshm GPU slab, else a device copy in one."""
    return _impl().share(arr)


def is_shared(arr) -> bool:
    """Whether a CuPy array lives in an actorshm GPU slab."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return _impl().is_shared(arr)
