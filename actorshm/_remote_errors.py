"""Error replies: an exception raised by a call, pickled for the caller, and rebuilt there.

The caller gets the same exception type where it pickles, with the remote traceback as
its ``__cause__`` and a note naming the call; otherwise ``RemoteError`` with the type's
name, the message and the traceback text. An exception too big for a frame (it holds
big data in its arguments) goes back as a new exception of its type with its message
cut short, so that ``except ValueError:`` still works and the call still finishes.
"""

from __future__ import annotations

import asyncio
import pickle
import traceback

import cloudpickle

from ._errors import ProtocolError, RemoteError, RemoteTraceback
from ._util import leave_if_forked
from ._wire import MAX_MESSAGE

__all__ = ["encode_exception", "encode_failure", "decode_exception", "call_in_thread",
           "UNPICKLING_ERRORS"]

_BRIEF = 1 << 16  # what a too-big exception keeps of its message and traceback text


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
    try:
        blob = dumps(exc, protocol=5)
        try:
            pickle.loads(blob)
        except Exception:  # its type pickles, its __init__ cannot take back its args
            blob = dumps(_ByState(exc), protocol=5)
    except Exception:
        blob = None
    t = type(exc)
    name = _type_name(t)
    try:
        msg = str(exc)
    except Exception:
        msg = "<unprintable exception>"
    if blob is not None and len(blob) + len(msg) + len(tb) > MAX_MESSAGE - _BRIEF:
        size = len(blob)
        note = (f" [actorshm: this {name} was {size / 2**20:.1f} MiB pickled, over the "
                "frame limit: it was sent back as a new one with its message cut short]")
        msg = msg[:_BRIEF] + note
        tb = tb[-_BRIEF:]
        try:
            blob = dumps(t(msg), protocol=5)
        except Exception:
            blob = None
        if blob is not None and len(blob) > _BRIEF * 2:
            blob = None
    elif len(msg) + len(tb) > MAX_MESSAGE - _BRIEF:  # unpicklable, with a huge text
        msg, tb = msg[:_BRIEF], tb[-_BRIEF:]
    return pickle.dumps((blob, name, msg, tb), protocol=5)


class _ByState:
    """Pickles an exception whose class's ``__init__`` cannot take back its ``args``
    (keyword-only parameters, none at all, more than it passes up): its type, ``args``
    and ``__dict__``, rebuilt without calling ``__init__``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self):
        exc = self.exc
        return _rebuild_exception, (type(exc), exc.args, dict(vars(exc)) or None)


def _rebuild_exception(cls: type, args: tuple, state: dict | None) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
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


def copy_exc(exc: BaseException) -> BaseException:
    """A fresh instance per waiter, so tracebacks do not pile up on one object."""
    try:
        new = type(exc)(*exc.args)
    except Exception:
        return exc
    return new


def result_undecodable(fut, what: str, exc: Exception) -> None:
    """Fail call future ``fut`` (unless done): its result could not be unpickled here."""
    if not fut.done():
        err = TypeError(f"the result of {what or 'the call'} could not be deserialized "
                        f"here: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        fut.set_exception(err)
