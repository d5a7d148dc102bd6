"""Plug-ins that load on first use, registered by the clients (driver and actor).

A plug-in module (``_cuda`` for CuPy, ``_torch`` for torch, ``_torch_cuda`` for torch's
CUDA tensors) imports its library and registers itself with
``_serialization`` when it is imported: a reducer for its array type, an opener for its
kind of region. The base layers never import a plug-in; this module, imported by the
local runtime and by the actor process, makes sure each loads when first needed:

- on the sending side, once its library is imported by the user (``cupy`` in
  ``sys.modules``), before the next message is encoded;
- on the receiving side, when a peer introduces a region of its kind (CuPy is then
  imported only where GPU arrays arrive; without it, the ``ImportError`` fails that
  block like any region that cannot be opened here).

A new plug-in adds its two lines here, and registers its reducers the same way in its
own module (see ``_serialization.register_reducer``).
"""

from __future__ import annotations

from . import _serialization
from ._wire import GPU_SLAB


def _load_cuda() -> None:
    from . import _cuda  # noqa: F401  (registers itself)


def _load_torch() -> None:
    from . import _torch  # (registers itself)
    _torch.set_cuda_path(loader=_load_torch_cuda)


def _load_torch_cuda() -> None:
    from . import _torch_cuda  # noqa: F401  (registers itself; needs CuPy)


def _open_gpu_slab(ctx, key: tuple, size: int, intro):
    from . import _cuda
    return _cuda.open_slab(ctx, key, size, intro)


_serialization.register_lazy_plugin("cupy", _load_cuda)
_serialization.register_lazy_plugin("torch", _load_torch)
_serialization.register_region_kind(GPU_SLAB, _open_gpu_slab)
