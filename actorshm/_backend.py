"""Choosing a runtime's backend: ``Runtime(backend="local" | "ray", ...)``."""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["BackendChoice"]


class _ChoiceMeta(type):
    """``isinstance(rt, Runtime)`` holds for a runtime of every backend."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        return BackendChoice in cls.__bases__ and getattr(obj, "backend", None) == "ray"


class BackendChoice(metaclass=_ChoiceMeta):
    """Base of ``Runtime``: ``Runtime(backend="ray", ...)`` makes a ``RayRuntime`` instead.

    Ray is imported only then; the local backend never needs it.
    """

    backend = "local"

    def __new__(cls, *args: Any, backend: str = "local", **options: Any):
        if backend == "ray":
            from ._ray_runtime import RayRuntime
            return RayRuntime(*args, **options)
        if backend != "local":
            raise ValueError(f"backend must be 'local' or 'ray', not {backend!r}")
        params = inspect.signature(cls.__init__).parameters
        known = sorted(n for n, p in params.items() if p.kind == p.KEYWORD_ONLY)
        unknown = sorted(set(options) - set(params))
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            # (``address``, ``num_cpus``, ...: ray.init's, as a Ray user writes them)
            raise TypeError(f"Runtime() got unknown option(s) {unknown}; the local backend "
                            f"takes {known}. Ray's options "
                            "(address, ray.init keywords) need backend='ray': "
                            "Runtime(backend='ray', ...)")
        return super().__new__(cls)
