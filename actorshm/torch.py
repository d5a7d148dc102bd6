"""PyTorch tensors in shared memory: ``actorshm.torch.empty/zeros/share/is_shared/share_module``.

Every ``torch.Tensor`` in the arguments or result of a call travels like a numpy array,
whether or not this module was imported: by reference when its memory lies in actorshm
shared memory, copied into it once otherwise. This module makes tensors that start out
shared, so that they are never copied; see docs/torch.md. Importing ``actorshm`` never
imports this module; importing this module needs PyTorch (``pip install 'actorshm[torch]'``).
"""

from __future__ import annotations

__all__ = ["empty", "zeros", "share", "is_shared", "share_module"]


def _impl():
    try:
        from . import _torch
    except ImportError as exc:
        raise ImportError("actorshm.torch needs PyTorch: pip install 'actorshm[torch]'") \
            from exc
    return _torch


def empty(*size, dtype=None, device="cpu", requires_grad: bool = False):
    """A new tensor in this process's shared memory (contents undefined).

    Args:
        *size: the shape, as integers or one sequence (like ``torch.empty``).
        dtype: any torch dtype; torch's default dtype when None.
        device: ``"cpu"`` (the default).
        requires_grad: whether autograd records operations on it (a leaf).

    Raises:
        ValueError: a negative dimension, or a device other than the host.
        SharedMemoryError: the shared-memory budget or the machine is out of room.
    """
    return _impl().empty(size, dtype, device, requires_grad)


def zeros(*size, dtype=None, device="cpu", requires_grad: bool = False):
    """A new zero-filled tensor in this process's shared memory.

    Args:
        *size: the shape, as integers or one sequence (like ``torch.zeros``).
        dtype: any torch dtype; torch's default dtype when None.
        device: ``"cpu"`` (the default).
        requires_grad: whether autograd records operations on it (a leaf).

    Raises:
        ValueError: a negative dimension, or a device other than the host.
        SharedMemoryError: the shared-memory budget or the machine is out of room.
    """
    t = _impl().empty(size, dtype, device, False)
    t.zero_()
    return t.requires_grad_(requires_grad)


def share(tensor):
    """``tensor`` itself if its memory is already shared, else a shared copy of it.

    The copy keeps the dtype, shape, memory order, ``requires_grad`` of a leaf, and the
    ``nn.Parameter`` type; it does not keep the autograd history of a non-leaf.

    Args:
        tensor: a host ``torch.Tensor``.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        ValueError: ``tensor`` is not on the host.
    """
    return _impl().share(tensor)


def is_shared(tensor) -> bool:
    """Whether a tensor's memory lies in actorshm shared memory (so it travels by
    reference). False for anything that is not a tensor.

    Args:
        tensor: any object.
    """
    import sys
    if "torch" not in sys.modules:
        return False  # no tensor can exist yet
    return _impl().is_shared(tensor)


def share_module(module):
    """Move a module's parameters, gradients and buffers into shared memory, in place.

    Like ``Module.share_memory()`` for torch.multiprocessing: afterwards, passing the
    module (or its tensors) to actors passes references, and their in-place updates
    (an optimizer's step) change this module's weights: Hogwild training.

    Args:
        module: a ``torch.nn.Module``.

    Returns:
        The same module.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
    """
    return _impl().share_module(module)
