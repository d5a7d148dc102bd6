"""Error replies: an exception raised by a call, pickled for the caller, and rebuilt there.

The caller gets the same exception type where it pickles, with the remote traceback as
its ``__cause__`` and a note naming the call: as pickle rebuilds it where that gives it
back as it was, else from its ``args``, slots and ``__dict__`` without ``__init__``;
otherwise (its type, or an attribute, does not pickle) ``RemoteError`` with the type's
name, the message and the traceback text. An exception too big for a frame (it holds
big data in its arguments) goes back as a new exception of its type with its message
cut short, so that ``except ValueError:`` still works and the call still finishes.
"""

from __future__ import annotations

import asyncio
import builtins
import copyreg
import pickle
import traceback
import types
import weakref
from typing import Any

import cloudpickle

from ._errors import PICKLING_FAILURES, ProtocolError, RemoteError, RemoteTraceback
from ._util import leave_if_forked, pipe_end
from ._wire import MAX_MESSAGE

__all__ = ["encode_exception", "encode_failure", "decode_exception", "call_in_thread",
           "call_caught", "UNPICKLING_ERRORS"]

_BRIEF = 1 << 16  # what a too-big exception keeps of its message and traceback text
try:  # exception groups: built in from Python 3.11, the backport's before
    _GROUPS: Any = builtins.BaseExceptionGroup
except AttributeError:  # pragma: no cover - Python 3.10
    try:
        from exceptiongroup import BaseExceptionGroup as _GROUPS
    except ImportError:
        _GROUPS = ()


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ in ("builtins", "__main__") else \
        f"{t.__module__}.{t.__qualname__}"


def encode_exception(exc: BaseException, dumps=cloudpickle.dumps) -> bytes:
    """Pickle an exception for an error reply: itself where it pickles, and its type
    name, message and traceback text. One over the frame limit (it holds big data)
    goes as a new exception of its type with its message cut short, or as its text.

    ``dumps`` pickles the exception itself: the pickler that brought the actor's class
    here, so that an exception class defined in the caller's ``__main__`` (pickled by
    value) is rebuilt there as the caller's own class (Ray's copy of cloudpickle on the
    Ray backend, which keeps its own record of such classes)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    t = type(exc)
    name = _type_name(t)
    msg = _text(exc)
    blob = _pickle_exception(exc, dumps, msg)
    if blob is not None and len(blob) + len(msg) + len(tb) > MAX_MESSAGE - _BRIEF:
        size = len(blob)
        note = (f" [actorshm: this {name} was {size / 2**20:.1f} MiB pickled, over the "
                "frame limit: it was sent back as a new one with its message cut short]")
        msg = msg[:_BRIEF] + note
        tb = tb[-_BRIEF:]
        try:
            small = t(msg)
            if type(small) is not t or _text(small) != msg:
                raise TypeError(msg)
        except PICKLING_FAILURES:  # its __init__ takes no message, or formats it again
            try:
                small = _rebuild_exception(t, (msg,), None)
            except PICKLING_FAILURES:
                small = None
        blob = None if small is None else _pickle_exception(small, dumps, msg)
        if blob is not None and len(blob) > _BRIEF * 2:
            blob = None
    elif len(msg) + len(tb) > MAX_MESSAGE - _BRIEF:  # unpicklable, with a huge text
        msg, tb = msg[:_BRIEF], tb[-_BRIEF:]
    return pickle.dumps((blob, name, msg, tb), protocol=5)


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except PICKLING_FAILURES:
        return "<unprintable exception>"


def _pickle_exception(exc: BaseException, dumps, msg: str) -> bytes | None:
    """``exc`` pickled so that it loads as its own type with its own message: the way
    pickle does it where that rebuilds it, else by its state (``_ByState``); ``None``
    where neither pickles (its type cannot be, or an attribute such as a lock), or it
    holds a ``multiprocessing`` pipe end (``_holds_a_pipe_end``)."""
    if _holds_a_pipe_end(exc):
        return None
    try:
        blob = dumps(exc, protocol=5)
    except PICKLING_FAILURES:  # its type or an attribute does not pickle, or its reduce
        blob = None  # fails
    if blob is not None and _rebuilds(blob, exc, msg):
        return blob
    try:
        return dumps(_ByState(exc, dumps), protocol=5)
    except PICKLING_FAILURES:
        pass
    try:  # a slot's value (say, AttributeError.obj) does not pickle: without the slots
        return dumps(_ByState(exc, dumps, slots=False), protocol=5)
    except PICKLING_FAILURES:
        return None


def _holds_a_pipe_end(exc: BaseException) -> bool:
    """Whether ``exc``'s arguments or attributes (or the items of a list, tuple or dict
    among them) hold a ``multiprocessing`` Connection: pickled, it would arrive as its
    fd's number and close another file of the caller's when dropped (an actor's socket,
    in the driver). Such an exception goes as its text (``RemoteError``), as arguments
    and results with one are refused (``_serialization.refuse_connection``)."""
    try:
        items = [*exc.args, *vars(exc).values()]
    except PICKLING_FAILURES:
        return False
    for x in list(items):
        if type(x) in (list, tuple):
            items.extend(x)
        elif type(x) is dict:
            items.extend(x.values())
    return any(pipe_end(x) for x in items)


def _rebuilds(blob: bytes, exc: BaseException, msg: str) -> bool:
    """Whether ``blob`` loads back (here) as ``exc``. Pickle rebuilds an exception with
    ``cls(*args)``: an ``__init__`` with keyword-only parameters, none at all, or more
    than it passes up refuses that, and one that formats its message formats it again
    (``code=code=4``). A class with a ``__reduce__`` or ``__setstate__`` of its own
    decides what it comes back as: for it, only that it loads is checked."""
    try:
        back = pickle.loads(blob)
    except PICKLING_FAILURES:
        return False
    if not _default_reduce(type(exc)):
        return True
    try:
        return type(back) is type(exc) and str(back) == msg
    except PICKLING_FAILURES:
        return False


def _default_reduce(t: type) -> bool:
    """Whether ``t``'s instances pickle as a built-in exception's do."""
    if t in copyreg.dispatch_table:
        return False
    for attr in ("__reduce_ex__", "__reduce__", "__setstate__"):
        owner = next((k for k in t.__mro__ if attr in k.__dict__), object)
        if owner.__module__ != "builtins":
            return False
    return True


# What the exception object keeps outside ``args`` and ``__dict__`` that is not state,
# or that the caller sets on its own.
_NOT_SLOTS = frozenset(("args", "__dict__", "__weakref__", "__traceback__", "__context__",
                        "__cause__", "__suppress_context__", "__notes__"))


def _slots(exc: BaseException) -> dict:
    """The values of ``exc``'s slots: its classes' ``__slots__``, and those of a built-in
    base (``OSError``'s ``errno``, ``strerror``, ``filename``; ``StopIteration.value``,
    ``ImportError.name``...), which ``__init__`` sets from its arguments and which a
    rebuild without ``__init__`` would leave unset."""
    out: dict = {}
    for attr, keep_none in _slot_attrs(type(exc)):
        try:
            value = getattr(exc, attr)
        except AttributeError:  # an empty slot (BlockingIOError.characters_written)
            continue
        if value is None and not keep_none:
            continue  # unset reads as None; set to None, OSError's str shows '-> None'
        out[attr] = value
    return out


_slot_attrs_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _slot_attrs(cls: type) -> tuple:
    """``(name, kept when None)`` of the slots ``_slots`` reads on a ``cls``, found once
    per class (a walk over every class of its MRO took most of ``copy_exc``'s time,
    which runs for each call a closed connection fails). ``kept when None``: a class
    not built in declares it (a built-in's unset slot reads as None)."""
    try:
        return _slot_attrs_of[cls]
    except (KeyError, TypeError):
        pass
    found: dict = {}
    for k in cls.__mro__:
        for attr, d in vars(k).items():
            if attr in _NOT_SLOTS or not isinstance(
                    d, (types.MemberDescriptorType, types.GetSetDescriptorType)):
                continue
            found[attr] = found.get(attr, False) or k.__module__ != "builtins"
    attrs = tuple(found.items())
    try:
        _slot_attrs_of[cls] = attrs
    except TypeError:  # pragma: no cover - a class that takes no weak reference
        pass
    return attrs


class _ByState:
    """Pickles an exception that pickle's own way does not rebuild as it was (its
    class's ``__init__`` cannot take back its ``args``: keyword-only parameters, none at
    all, more than it passes up; or formats them again; or a ``__reduce__`` that fails):
    its type (by reference, or by value as ``dumps`` does it), ``args``, slots and
    ``__dict__``, rebuilt without calling ``__init__``."""

    def __init__(self, exc: BaseException, dumps, slots: bool = True) -> None:
        self.exc = exc
        self.dumps = dumps
        self.slots = slots

    def __reduce__(self):
        exc = self.exc
        slots = _slots(exc) if self.slots else None
        args = exc.args
        if isinstance(exc, _GROUPS) and len(args) == 2:
            # (an ExceptionGroup of a TaskGroup): each exception in it as one raised
            # alone goes, so that ``except*`` finds its type
            args = (args[0], [_Member(e, self.dumps) for e in exc.exceptions])
            if slots:  # (made from the args again)
                slots = {k: v for k, v in slots.items() if k not in ("message", "exceptions")}
            # (the backport keeps them in its __dict__: they would come back unrebuilt)
            state = {k: v for k, v in vars(exc).items() if k not in ("_exceptions", "_message")}
        else:
            state = dict(vars(exc))
        return _rebuild_exception, (type(exc), args, state or None, slots or None)


class _Member:
    """An exception in a group, pickled as ``_pickle_exception`` would pickle it alone
    (a group, pickle's own way, fails as a whole where one of its exceptions does)."""

    def __init__(self, exc: BaseException, dumps) -> None:
        self.exc = exc
        self.dumps = dumps

    def __reduce__(self):
        exc = self.exc
        try:
            if _rebuilds(self.dumps(exc, protocol=5), exc, _text(exc)):
                return exc.__reduce_ex__(5)
        except Exception:
            pass
        return _ByState(exc, self.dumps).__reduce__()


def _rebuild_exception(cls: type, args: tuple, state: dict | None,
                       slots: dict | None = None) -> BaseException:
    try:
        exc = cls.__new__(cls, *args)
    except Exception:  # a __new__ of its own that refuses its args
        exc = None
    if not isinstance(exc, cls):  # the first __new__ written in C (BaseException's...)
        base = next(k for k in cls.__mro__ if "__new__" in vars(k) and not isinstance(
            vars(k)["__new__"], (staticmethod, types.FunctionType)))
        exc = base.__new__(cls, *args)
    exc.args = args
    for attr, value in (slots or {}).items():
        try:
            setattr(exc, attr, value)
        except (AttributeError, TypeError, ValueError):  # pragma: no cover - read-only
            pass
    if state:
        exc.__dict__.update(state)
    return exc


def encode_failure(exc: BaseException, why: BaseException) -> bytes:
    """A last-resort error reply: ``exc``'s type name and a short text (always fits)."""
    try:
        msg = str(exc)[:_BRIEF]
    except Exception:
        msg = "<unprintable exception>"
    msg += f" [actorshm: the error could not be sent back as it was: {why!r}]"[:_BRIEF]
    return pickle.dumps((None, _type_name(type(exc)), msg, ""), protocol=5)


def decode_exception(payload: bytes, where: str = "") -> BaseException:
    """Rebuild an exception sent by ``encode_exception``: same type where possible."""
    try:
        blob, name, msg, tb = pickle.loads(payload)
    except Exception as exc:  # pragma: no cover - a peer bug
        return ProtocolError(f"undecodable error reply: {exc!r}")
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        return RemoteError(name, msg, tb)
    if not isinstance(exc, Exception):
        # KeyboardInterrupt, SystemExit, GeneratorExit...: raised as itself here, it
        # would stop the caller's program (or task), which an actor's error must not.
        return RemoteError(name, f"{msg} [actorshm: not an Exception, so raised as "
                                 "RemoteError rather than as itself]", tb)
    exc.__cause__ = RemoteTraceback(tb)
    if isinstance(exc, StopIteration):
        # A future cannot hold it (it would end the coroutine awaiting it as a return):
        # what Python does for a coroutine that raises it (PEP 479).
        err = RuntimeError(f"{where or 'an actor method'} raised StopIteration")
        err.__cause__ = exc
        exc = err
    if hasattr(exc, "add_note"):
        try:
            exc.add_note(f"(raised in {where})" if where else "(raised in an actor)")
        except Exception:
            pass
    return exc


# What a result's or item's own unpickling code may raise, to fail that one call with:
# a CancelledError or GeneratorExit out of a __setstate__ must not escape the reader (it
# would end the read, and the replies behind it with it). KeyboardInterrupt and
# SystemExit still stop the caller's program, as Ctrl-C does.
UNPICKLING_ERRORS = (Exception, asyncio.CancelledError, GeneratorExit)


def call_in_thread(fn, args: tuple, kwargs: dict, what: str):
    """``fn(*args, **kwargs)``, for an executor thread. A ``StopIteration`` it raises
    comes out as ``RuntimeError``: a future cannot carry it (setting it fails inside the
    event loop's callback, and the call would never be answered)."""
    try:
        return fn(*args, **kwargs)
    except StopIteration as exc:
        raise RuntimeError(f"{what} raised StopIteration") from exc
    finally:
        leave_if_forked()


def call_caught(fn, args: tuple, kwargs: dict, what: str) -> tuple:
    """``(call_in_thread(...), None)``, or ``(None, exc)`` for what it raised: for an
    executor thread whose future a coroutine awaits. Raised through that future, a
    ``GeneratorExit`` would be thrown into the awaiting coroutines, which closes them
    (``coroutine ignored GeneratorExit``) instead of raising it where it is awaited."""
    try:
        return call_in_thread(fn, args, kwargs, what), None
    except BaseException as exc:
        return None, exc


def copy_exc(exc: BaseException) -> BaseException:
    """A fresh instance per waiter, so tracebacks do not pile up on one object: the same
    type, ``args``, slots and attributes, made without ``__init__`` (as ``_ByState``
    rebuilds: one that formats its message would format it twice), with the same
    cause (an actor's error: its remote traceback) and its own copy of the notes."""
    try:
        state = dict(vars(exc))
        if isinstance(state.get("__notes__"), list):
            state["__notes__"] = list(state["__notes__"])
        new = _rebuild_exception(type(exc), exc.args, state or None,
                                 _slots(exc) or None)
        new.__cause__ = exc.__cause__
        new.__context__ = exc.__context__
        new.__suppress_context__ = exc.__suppress_context__
    except Exception:
        return exc
    return new


def result_undecodable(fut, what: str, exc: Exception) -> None:
    """Fail call future ``fut`` (unless done): its result could not be unpickled here."""
    if not fut.done():
        err = TypeError(f"the result of {what or 'the call'} could not be deserialized "
                        f"here: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        # Its traceback's lines stay, not what its frames held: the objects rebuilt so
        # far (arrays leased from the actor, which must go back now, not when the
        # caller drops the error) and the frame that caught it (which holds ``fut``:
        # a cycle).
        tb = exc.__traceback__
        if tb is not None:
            exc.__traceback__ = tb.tb_next
        _clear_frames(exc, set())
        fut.set_exception(err)


def _clear_frames(exc: BaseException, seen: set) -> None:
    """Drop what the frames of ``exc``'s traceback, and of the exceptions chained to it
    (its cause, its context, a group's members), held; their lines stay."""
    if exc is None or id(exc) in seen:
        return
    seen.add(id(exc))
    traceback.clear_frames(exc.__traceback__)
    _clear_frames(exc.__cause__, seen)
    _clear_frames(exc.__context__, seen)
    if _GROUPS and isinstance(exc, _GROUPS):
        for member in exc.exceptions:
            _clear_frames(member, seen)
