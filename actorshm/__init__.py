"""actorshm: actors in their own processes on one machine, with zero-copy arrays.

```python
import actorshm
from actorshm import actor

@actor
class Counter:
    def __init__(self, start=0): self.n = start
    def incr(self, k=1): self.n += k; return self.n

async def main():
    c = await Counter.spawn(5)
    assert await c.incr(2) == 7

actorshm.run(main())
```
"""

from __future__ import annotations

from ._actor import ActorHandle, actor
from ._errors import (ActorDiedError, ActorError, ActorGroupError, PendingCallsLimitError,
                      ReentrantCallError, RemoteError, SharedMemoryError)
from ._events import ActorEvent
from ._group import ActorGroup
from ._introspect import MemoryReport
from ._pool import ActorPool
from ._runtime import Runtime, current_runtime, get_actor, run
from ._shm import empty, is_shared, share, stats, zeros

__version__ = "0.1.0"

__all__ = [
    "actor",
    "ActorHandle",
    "Runtime",
    "run",
    "current_runtime",
    "get_actor",
    "ActorError",
    "ActorDiedError",
    "RemoteError",
    "SharedMemoryError",
    "PendingCallsLimitError",
    "ReentrantCallError",
    "ActorGroupError",
    "ActorPool",
    "ActorGroup",
    "ActorEvent",
    "MemoryReport",
    "empty",
    "zeros",
    "share",
    "is_shared",
    "stats",
    "cuda",
]
# ``actorshm.torch`` (PyTorch tensors) is loaded on first use too, but is not in
# ``__all__``: ``from actorshm import *`` must not need torch.

for _name in __all__:
    _obj = globals().get(_name)
    if getattr(_obj, "__module__", "").startswith("actorshm._"):
        try:
            _obj.__module__ = "actorshm"
        except (AttributeError, TypeError):
            pass
del _name, _obj, annotations  # (the last: ``from __future__``'s, not an API)


def __getattr__(name: str):
    if name in ("cuda", "torch"):  # lazily: importing actorshm needs no CuPy, GPU or torch
        import importlib
        try:
            mod = importlib.import_module("actorshm." + name)
        except ImportError as exc:
            if not isinstance(exc.__cause__, ModuleNotFoundError):
                raise  # (its library is there, and broken: say so)
            # Its library is not installed: hasattr() is False, and the message says
            # what to install.
            raise AttributeError(str(exc)) from exc
        globals()[name] = mod
        return mod
    from ._habits import MODULE  # (Ray's ``ray.get`` and kin: say how it is spelled)
    hint = MODULE.get(name)
    raise AttributeError(f"module 'actorshm' has no attribute {name!r}" +
                         (f": {hint}" if hint else ""))
