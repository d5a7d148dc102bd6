"""Ray's side of a call's errors: what is refused before sending, and Ray's errors for
a call, spawn or result turned into what the local backend raises.

``check_args`` catches what Ray's own pickling would let through silently (a tensor in
an autograd graph, a dtype torch cannot rebuild, a shared array whose writes would not
come back); ``translate`` and ``outcome`` turn what Ray hands back into a result or the
local backend's exception (``ActorDiedError``, ``TypeError``, the method's own error).
"""

from __future__ import annotations

import pickle
import sys
import warnings
from typing import Any

from . import _shm
from ._errors import ActorDiedError, RemoteError, RemoteTraceback
from ._remote_errors import decode_exception

__all__ = ["check_args", "translate", "outcome", "unavailable_error", "died"]


def died(exc: BaseException, what: str) -> ActorDiedError:
    text = str(exc).strip().splitlines()
    return ActorDiedError(f"{what}: the actor died ({text[0] if text else type(exc).__name__})")


_UNCOMPUTED = "input arguments for this task could not be computed"


def undeserializable(exc: BaseException) -> TypeError:
    """Ray could not unpickle an argument in the actor: the local backend's error, with
    the last line of Ray's text (the exception the argument's unpickling raised)."""
    lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    return TypeError("the actor could not deserialize the call's arguments: "
                     f"{lines[-1] if lines else type(exc).__name__}")


def translate(exc: BaseException, what: str) -> BaseException:
    """Ray's error for a call -> what the local backend raises."""
    import ray.exceptions as rex
    if isinstance(exc, rex.RayActorError) and _UNCOMPUTED in str(exc):
        return undeserializable(exc)  # a spawn argument, in the new actor
    if isinstance(exc, (rex.RayActorError, getattr(rex, "ActorUnavailableError", ()))):
        return died(exc, what)
    if isinstance(exc, rex.RaySystemError) and "deserializ" in str(exc):
        # Ray could not unpickle the result here: as the local backend says it.
        cause = getattr(exc, "client_exc", None)
        text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) \
            else str(exc).strip().splitlines()[0]
        return TypeError(f"the result of {what} could not be deserialized here: {text}")
    if isinstance(exc, rex.RayTaskError):  # the host failed, e.g. a result that won't pickle
        cause = getattr(exc, "cause", None)
        if isinstance(cause, rex.RaySystemError) and _UNCOMPUTED in str(exc):
            return undeserializable(cause)  # a call's argument: the call never ran
        if isinstance(cause, Exception) and not isinstance(cause, rex.RayError):
            cause.__cause__ = RemoteTraceback(str(exc))
            return cause
        return RemoteError(type(exc).__name__, str(exc))
    return exc


def unavailable_error() -> type | tuple:
    """Ray's error for a call on an actor it is restarting (``()`` on a Ray that has none)."""
    import ray.exceptions as rex
    return getattr(rex, "ActorUnavailableError", ())


def outcome(value: Any, what: str):
    """``(ok, payload)`` from the host -> (result, None) or (None, exception)."""
    if type(value) is bytes:  # a simple reply, pickled by the host
        value = pickle.loads(value)
    ok, payload = value
    if ok:
        return payload, None
    return None, decode_exception(payload, what)


_SCALARS = frozenset({int, float, str, bytes, bool, type(None), complex})


def check_args(args: tuple, kwargs: dict, what: str) -> None:
    """What Ray's own pickling lets through silently, caught before sending, in the
    arguments and in lists, tuples and dicts up to three levels down (as arrays are made
    read-only on arrival): a tensor in an autograd graph is a ``TypeError`` (as on the
    local backend); an actorshm shared array warns once that writes will not come back."""
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else None
    warned = False
    todo = [(x, 0) for x in (*args, *kwargs.values())]
    while todo:
        x, depth = todo.pop()
        t = type(x)
        if t is list or t is tuple:
            if depth < 3:
                todo.extend((y, depth + 1) for y in x if type(y) not in _SCALARS)
        elif t is dict:
            if depth < 3:
                todo.extend((y, depth + 1) for y in x.values() if type(y) not in _SCALARS)
        elif tensor is not None and isinstance(x, tensor):
            from ._torch import check_sendable
            try:
                check_sendable(x)
                _check_picklable_dtype(x.dtype)
            except TypeError as exc:
                raise TypeError(f"cannot send the arguments of {what}(): {exc}") from None
        elif not warned and _shm.is_shared(x):
            warned = True
            warnings.warn(
                f"{what}(): an actorshm shared array is passed on the Ray backend; it "
                "travels as a read-only copy through Ray's object store, so writes in "
                "the actor are not seen by the caller (return the result instead)",
                RuntimeWarning, stacklevel=4)


_dtype_ok: dict = {}  # torch dtype -> whether torch can pickle a tensor of it


def _check_picklable_dtype(dtype) -> None:
    """Ray passes tensors by torch's own pickling, which some torch versions cannot do
    for some dtypes (the float8 kinds): say so before sending rather than let the actor
    fail to unpickle the call."""
    ok = _dtype_ok.get(dtype)
    if ok is None:
        import torch
        try:
            pickle.loads(pickle.dumps(torch.empty(1, dtype=dtype)))
            ok = True
        except Exception:
            ok = False
        _dtype_ok[dtype] = ok
    if not ok:
        raise TypeError(
            f"a {dtype} tensor cannot travel on the Ray backend: Ray passes tensors by "
            "torch's own pickling, which cannot rebuild this dtype in this torch version. "
            f"Send `t.view(torch.uint8)` and view it back with `.view({dtype})` in the "
            "actor, or use the local backend")
