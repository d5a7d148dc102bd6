"""Ray's side of a call's errors: what is refused before sending, and Ray's errors for
a call, spawn or result turned into what the local backend raises.

``check_args`` catches what Ray's own pickling would let through silently (a tensor in
an autograd graph, a dtype torch cannot rebuild, a shared array whose writes would not
come back); ``translate`` and ``outcome`` turn what Ray hands back into a result or the
local backend's exception (``ActorDiedError``, ``TypeError``, the method's own error).
"""

from __future__ import annotations

import pickle
import re
import sys
import types
import warnings
from typing import Any

from . import _shm
from ._culprit import arguments_error
from ._errors import ActorDiedError, RemoteError, RemoteTraceback, undeserializable_arguments
from ._remote_errors import decode_exception
from ._serialization import (FILE_TYPES, PROCESS_BOUND, THREAD_FUTURE, encode_part,
                             refuse_file, refuse_process_bound, result_mistake)

__all__ = ["check_args", "check_result", "translate", "outcome", "unavailable_error",
           "died", "pickling_failed", "arguments_unsent"]


def died(exc: BaseException, what: str) -> ActorDiedError:
    text = str(exc).strip().splitlines()
    return ActorDiedError(f"{what}: the actor died ({text[0] if text else type(exc).__name__})")


# Where Ray pickles a task's arguments (and the picklers it calls): an exception raised
# below one of these came from an argument's own pickling (its ``__reduce__`` or
# ``__getstate__`` raising whatever it likes), not from Ray.
_PICKLING = frozenset({"ray._private.serialization", "ray.cloudpickle.cloudpickle",
                       "cloudpickle.cloudpickle", "pickle", "copyreg"})


def pickling_failed(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a Ray ``.remote()`` call, means an argument could not
    be pickled: its words say so, or it was raised while Ray pickled the arguments.
    (The local backend makes any such error a ``TypeError``; so must Ray's.)"""
    if isinstance(exc, MemoryError):  # (out of memory is not the argument's fault)
        return False
    text = str(exc).lower()
    if "serializ" in text or "pickl" in text:
        return True
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") in _PICKLING:
            return True
        tb = tb.tb_next
    return False


_RAY_REPORT = "could not serialize the argument"
_RAY_FAIL = re.compile(r"FAIL serialization: (.*)")


def arguments_unsent(exc: BaseException, what: str, args: tuple, kwargs: dict,
                     std: tuple) -> TypeError:
    """The ``TypeError`` of a call or spawn whose arguments Ray could not serialize, as
    the local backend words it (what pickling raised, where in the arguments, what to
    do), not Ray's report on its whole payload, internal names and all.

    ``std``: ``sys.stdout`` and ``sys.stderr`` before Ray was handed the call, put
    back. Ray's report (``ray.util.check_serialize``) calls ``colorama.init()`` at every
    level it inspects, each time wrapping both streams once more: after some hundreds of
    calls that failed so, a write went through so many wrappers that it passed Python's
    recursion limit, and the driver died ("lost sys.stderr")."""
    sys.stdout, sys.stderr = std
    inner = exc
    while inner.__cause__ is not None and _RAY_REPORT in str(inner).lower():
        inner = inner.__cause__  # (Ray raises its report from pickling's own error)
    if _RAY_REPORT in str(inner).lower():
        found = _RAY_FAIL.search(str(inner))
        inner = TypeError(found.group(1).strip() if found else "it cannot be pickled")
    return arguments_error(what, inner, args, kwargs, encode_part)


_UNCOMPUTED = "input arguments for this task could not be computed"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def undeserializable(exc: BaseException) -> TypeError:
    """Ray could not unpickle an argument in the actor: the local backend's error, with
    the last line of Ray's text (the exception the argument's unpickling raised)."""
    lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    err = undeserializable_arguments(lines[-1] if lines else type(exc).__name__)
    hint = _dtype_hint(str(exc))
    return TypeError(f"{err}{hint}") if hint else err


def _dtype_hint(text: str) -> str:
    """Advice for torch's failure to rebuild a tensor of a dtype it cannot pickle (the
    checks before sending look three containers deep, not into objects' attributes)."""
    if "UntypedStorage" not in text or "dtype" not in text:
        return ""
    return (" (a torch tensor of a dtype that torch's own pickling cannot rebuild, such "
            "as uint16/uint32/uint64, complex32 or a float8 kind, or a "
            "torch.UntypedStorage, lies in it, deeper than the checks before sending "
            "look: on the Ray backend tensors travel by torch's pickling. Send "
            "`t.view(torch.uint8)` and view it back with `.view(dtype)` on the other "
            "side, a tensor over a storage, or use the local backend)")


def translate(exc: BaseException, what: str, sent: str | None = "result") -> BaseException:
    """Ray's error for a call (``sent``: "result"), a stream (``"item"``) or a spawn
    (None) -> what the local backend raises."""
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
        whose = f"an item of {what}" if sent == "item" else f"the result of {what}"
        return TypeError(f"{whose} could not be deserialized here: {text}"
                         f"{_dtype_hint(text)}")
    if isinstance(exc, rex.RayTaskError):  # the host failed, e.g. a result that won't pickle
        cause = getattr(exc, "cause", None)
        if isinstance(cause, rex.RaySystemError) and _UNCOMPUTED in str(exc):
            return undeserializable(cause)  # a call's argument: the call never ran
        text = _ANSI.sub("", str(exc))  # (Ray colours its traceback for terminals)
        if sent is not None and isinstance(cause, Exception) and \
                not isinstance(cause, rex.RayError):
            # The host answers every error of the method itself: this one came after,
            # from Ray pickling what the method returned or yielded.
            err = TypeError(f"the result of {what} cannot be sent back: {cause}"
                            if sent == "result" else f"an item of {what} cannot be sent: "
                            f"{cause}")
            err.__cause__ = RemoteTraceback(text)
            if hasattr(err, "add_note"):  # (as locally, where the actor's reply says it)
                err.add_note(f"(raised in {what})")
            return err
        if isinstance(cause, Exception) and not isinstance(cause, rex.RayError):
            cause.__cause__ = RemoteTraceback(text)
            return cause
        return RemoteError(type(exc).__name__, text)
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
    read-only on arrival): a tensor in an autograd graph, a dtype torch cannot pickle, an
    open file are a ``TypeError`` (as on the local backend); an actorshm shared array or
    tensor, or a module with shared parameters, warns once that writes will not come
    back."""
    _check((*args, *kwargs.values()), f"cannot send the arguments of {what}()", what)


def check_result(value: Any, what: str, item: bool = False) -> None:
    """The same checks (but the warning) for a result or a stream ``item``, in the actor
    before Ray takes it: ``TypeError`` worded as on the local backend."""
    if type(value) not in _SCALARS:
        refused = f"an item of {what} cannot be sent" if item else \
            f"the result of {what} cannot be sent back"
        # (one isinstance for the common result: the mistakes' words only for those)
        if not item and isinstance(value, _MISTAKES or _mistake_types()):
            mistake = result_mistake(value) or _unawaited(value)
            if mistake is not None:
                raise TypeError(f"{refused}: {mistake}")
        _check((value,), refused, None)


_MISTAKES: tuple = ()  # the types of results made by mistake (``_mistake_types``)


def _mistake_types() -> tuple:
    """The types ``result_mistake`` and ``_unawaited`` name: generator and coroutine
    objects, and calls' futures (imported on first use)."""
    global _MISTAKES
    from ._client import ThreadCallFuture
    from ._results import CallFuture
    _MISTAKES = (types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType,
                 ThreadCallFuture, CallFuture)
    return _MISTAKES


def _unawaited(value: Any) -> str | None:
    """What the local backend says of a result that is a call's awaitable, unfinished
    (Ray would fail to pickle it, saying only that a lock cannot be pickled)."""
    from ._client import ThreadCallFuture
    from ._results import CallFuture, Unfinished
    if isinstance(value, ThreadCallFuture):
        return THREAD_FUTURE
    if isinstance(value, CallFuture) and not value.done():
        return str(Unfinished(value))
    return None


def _check(values: tuple, refused: str, warn_for: str | None) -> None:
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else None
    module = torch.nn.Module if torch is not None else None
    warned = warn_for is None
    todo = [(x, 0) for x in values]
    while todo:
        x, depth = todo.pop()
        t = type(x)
        items = _contents(x, t)
        if items is not None:
            # (a long list of numbers is common: one pass in C says there is nothing in it)
            if depth < 3 and not set(map(type, items)) <= _SCALARS:
                todo.extend((y, depth + 1) for y in items if type(y) not in _SCALARS)
        elif tensor is not None and isinstance(x, tensor):
            from ._torch import check_sendable, tensor_is_shared
            try:
                check_sendable(x)
                _check_picklable_dtype(x.dtype)
            except TypeError as exc:
                raise TypeError(f"{refused}: {exc}") from None
            if not warned and tensor_is_shared(x):  # (sparse, a wrapper subclass: no
                # storage of their own to ask about)
                warned = _warn_shared(warn_for, "an actorshm shared tensor")
        elif tensor is not None and isinstance(x, torch.UntypedStorage):
            if not _torch_pickles("storage", lambda: torch.zeros(1).untyped_storage()):
                raise TypeError(
                    f"{refused}: a torch.UntypedStorage cannot travel on the Ray backend: "
                    "Ray passes it by torch's own pickling, which cannot rebuild one in "
                    "this torch version. Send a tensor over it instead "
                    "(`torch.empty(0, dtype=torch.uint8).set_(storage)`; its "
                    "`.untyped_storage()` in the actor), or use the local backend")
        elif module is not None and isinstance(x, module):
            from ._torch import tensor_is_shared
            if not warned and any(tensor_is_shared(p)
                                  for p in (*x.parameters(), *x.buffers())):
                warned = _warn_shared(warn_for, "a module whose parameters are shared "
                                                "(share_module)")
        elif t in FILE_TYPES and x is not sys.stdout and x is not sys.stderr:
            try:
                refuse_file(x)
            except TypeError as exc:
                raise TypeError(f"{refused}: {exc}") from None
        elif getattr(t, "__module__", None) in PROCESS_BOUND:
            try:
                refuse_process_bound(x, t.__module__)
            except TypeError as exc:
                raise TypeError(f"{refused}: {exc}") from None
        elif not warned and _shm.is_shared(x):
            warned = _warn_shared(warn_for, "an actorshm shared array")


def _contents(x, t: type):
    """What container ``x`` (of type ``t``) holds, or None: not a container. Lists,
    tuples and dicts, their subclasses (a namedtuple, an OrderedDict) and a dataclass's
    fields, so that the checks find what the local backend refuses at any depth."""
    if t is list or t is tuple:
        return x
    if t is dict:
        return x.values()
    if t in _SCALARS:
        return None
    if isinstance(x, (list, tuple)):
        return x
    if isinstance(x, dict):
        return x.values()
    fields = getattr(t, "__dataclass_fields__", None)
    if isinstance(fields, dict):
        return [getattr(x, f, None) for f in fields]
    return None


def _warn_shared(what: str, thing: str) -> bool:
    warnings.warn(
        f"{what}(): {thing} is passed on the Ray backend; it travels as a copy through "
        "Ray's object store, so writes in the actor are not seen by the caller (return "
        "the result instead)", RuntimeWarning, stacklevel=6)
    return True


_pickles: dict = {}  # what torch's own pickling can rebuild (a dtype, "storage") -> bool


def _torch_pickles(key, sample) -> bool:
    """Whether torch's own pickling, which Ray uses, rebuilds ``sample()`` (asked once
    per ``key``: some torch versions cannot for some dtypes, or for an untyped storage)."""
    ok = _pickles.get(key)
    if ok is None:
        with warnings.catch_warnings():  # (torch deprecates making quantized tensors)
            warnings.simplefilter("ignore")
            try:
                pickle.loads(pickle.dumps(sample()))
                ok = True
            except Exception:
                ok = False
        _pickles[key] = ok
    return ok


def _check_picklable_dtype(dtype) -> None:
    """Ray passes tensors by torch's own pickling, which some torch versions cannot do
    for some dtypes (the float8 kinds): say so before sending rather than let the actor
    fail to unpickle the call."""
    def sample():
        import torch
        from ._torch import QUANTIZED
        # (``check_sendable`` refused a tensor of a quantized dtype that is not
        # quantized; ``torch.empty`` of such a dtype fails, so make one that is)
        return torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, dtype) \
            if dtype in QUANTIZED else torch.empty(1, dtype=dtype)
    ok = _torch_pickles(dtype, sample)
    if not ok:
        raise TypeError(
            f"a {dtype} tensor cannot travel on the Ray backend: Ray passes tensors by "
            "torch's own pickling, which cannot rebuild this dtype in this torch version. "
            f"Send `t.view(torch.uint8)` and view it back with `.view({dtype})` in the "
            "actor, or use the local backend")
