"""Where, in a message that cannot be sent, lies the part that cannot: a path such as
``args[0]['batch'][3].lock`` for the error's message.

Pickling stops at the first object it cannot take and says only what that object is
("cannot pickle '_thread.lock' object"); in a dict of lists of objects a user is left to
guess which one. On that error path only, the parts of the message are pickled again one
by one, in the order pickling took them, going down into the first part that fails the
same way until none of its own parts does: that part is the culprit. The encoder tries
them with nothing done (``_serialization.encode_part``: no copies into shared memory,
nothing counted); a part's own ``__reduce__`` runs again, once for each level of the
path. The search is bounded in tries, depth and time: past a bound, the error says what
failed without where.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from ._errors import PICKLING_FAILURES, Unsendable

__all__ = ["culprit_path", "at", "arguments_error", "too_deep", "TOO_DEEP"]

TOO_DEEP = ("nested too deeply to pickle (Python's recursion limit, "
            "sys.getrecursionlimit()): flatten the data (a list of rows, a numpy array), or "
            "raise the limit with sys.setrecursionlimit.")


def too_deep(exc: BaseException) -> bool:
    """Whether pickling failed for want of recursion depth."""
    return isinstance(exc, RecursionError) or \
        isinstance(exc.__cause__ or exc.__context__, RecursionError)


def arguments_error(what: str, exc: BaseException, args: tuple, kwargs: dict,
                    encode: Callable[[Any], Any]) -> TypeError:
    """The error of a call (or spawn) whose arguments could not be encoded (``exc``):
    what failed, where it lies (``at``: ``encode`` encodes one part), and what to do.
    Both backends."""
    deep = too_deep(exc)
    where = "" if deep else at([*((f"args[{i}]", a) for i, a in enumerate(args)),
                                *((f"kwargs[{k!r}]", v) for k, v in kwargs.items())],
                               exc, encode)
    if isinstance(exc, Unsendable):  # says what to do already
        return TypeError(f"cannot send the arguments of {what}(): {where}{exc}")
    hint = f"They are {TOO_DEEP}" if deep else (
        "Arguments must be picklable (cloudpickle); pass data, not open files, locks or "
        "sockets.")
    return TypeError(f"cannot send the arguments of {what}(): "
                     f"{where}{str(exc).rstrip('.')}. {hint}")


# Encodes tried at most, and how deep the search goes: it runs after a failure only, and
# each try encodes a whole part again (a large part, a large encode), so it is bounded;
# past a bound the error is raised without a path, as before.
MAX_TRIES = 300
MAX_DEPTH = 32
MAX_SECONDS = 0.25  # (parts that share one big object each pickle it again)

_ATOMS = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None)})
_DEFAULT_STATE = getattr(object, "__getstate__", None)  # (Python 3.11 on)


def culprit_path(roots: Iterable[tuple[str, Any]], message: str,
                 fails: Callable[[Any], str | None]) -> str | None:
    """The path to the innermost part of the message that fails to encode as it did.

    Args:
        roots: the message's parts, each with its name (``("args[0]", a)``), in the
            order they are encoded.
        message: the message of the error that encoding the whole message raised.
        fails: encodes one part, returns the message of the error it raised (None: it
            encodes). (A message, not the error: an error kept here would hold, through
            its traceback's frames, the search's own frames and itself, a cycle.)

    Returns:
        The path, e.g. ``"args[1]['x'].lock"``; None where no part fails with the same
        message, or the search ran past its bounds.
    """
    tries = 0
    give_up = time.perf_counter() + MAX_SECONDS

    def same(x: Any) -> bool:
        nonlocal tries
        tries += 1
        if time.perf_counter() > give_up:
            tries = MAX_TRIES
            return False
        return fails(x) == message

    path = None
    node = None
    for name, root in roots:
        if tries >= MAX_TRIES:
            return None
        if type(root) not in _ATOMS and same(root):
            path, node = name, root
            break
    if path is None:
        return None
    for _ in range(MAX_DEPTH):
        for step, part in _parts(node):
            if tries >= MAX_TRIES:
                return None
            if type(part) not in _ATOMS and same(part):
                path += step
                node = part
                break
        else:
            return path  # none of its parts fails as it does: this is the culprit
    return None


def at(roots: list[tuple[str, Any]], exc: BaseException, encode: Callable[[Any], Any],
       failures: tuple = PICKLING_FAILURES) -> str:
    """``"at <path>, "`` for an error's message: where in a message (its ``roots``, as for
    ``culprit_path``) lies the part that ``encode`` (one part; raises as it fails) fails
    on as the whole message failed with ``exc``; ``""`` where that says nothing more
    (the one root as a whole, or no such part). ``failures``: what the pickling code may
    raise that fails a part (``_errors.REPLY_PICKLING_FAILURES`` in an actor)."""
    def fails(part: Any) -> str | None:
        try:
            encode(part)
        except failures as e:  # (what the whole message raised, or another)
            return str(e)
        return None

    try:
        path = culprit_path(roots, str(exc), fails)
    except failures:  # (the parts' own code: a dict's items(), a property)
        path = None  # the error goes as it is, without a path
    if path is None or (len(roots) == 1 and path == roots[0][0]):
        return ""
    return f"at {path}, "


def _parts(x: Any) -> Iterable[tuple[str, Any]]:
    """``x``'s parts with the step to each (``[2]``, ``['key']``, ``.name``), where ``x``
    pickles as its parts (a list, tuple, dict or object pickled by its ``__dict__`` or
    slots, not its own ``__reduce__``); nothing for anything else."""
    t = type(x)
    if t.__reduce_ex__ is not object.__reduce_ex__ or t.__reduce__ is not object.__reduce__ \
            or getattr(t, "__getstate__", None) is not _DEFAULT_STATE:
        if not (t is list or t is tuple or t is dict):
            return ()
    if isinstance(x, (list, tuple)):
        return ((f"[{i}]", v) for i, v in enumerate(x))
    if isinstance(x, dict):
        return ((f"[{_key(k)}]", v) for k, v in x.items())
    if isinstance(x, (set, frozenset)) or isinstance(x, type):
        return ()
    own = getattr(x, "__dict__", None)
    attrs = list(own.items()) if isinstance(own, dict) else []
    for cls in t.__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for s in (slots,) if isinstance(slots, str) else slots:
            if s not in ("__dict__", "__weakref__") and hasattr(x, s):
                attrs.append((s, getattr(x, s)))
    return ((f".{k}", v) for k, v in attrs)


def _key(k: Any) -> str:
    r = repr(k)
    return r if len(r) <= 40 else r[:37] + "..."
