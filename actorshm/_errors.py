"""The library's own exceptions.

Each error says whose fault it is: the actor died (``ActorDiedError``), the actor's
method raised something that could not travel back (``RemoteError``), or shared memory
ran out (``SharedMemoryError``, also a ``MemoryError``).
"""

from __future__ import annotations

import asyncio
import re

__all__ = [
    "ActorError",
    "ActorDiedError",
    "RemoteError",
    "RemoteTraceback",
    "SharedMemoryError",
    "PendingCallsLimitError",
    "ReentrantCallError",
    "ProtocolError",
    "ActorGroupError",
    "Unsendable",
    "PICKLING_FAILURES",
    "REPLY_PICKLING_FAILURES",
]

# What user code run while a message is pickled (a ``__reduce__``, ``__getstate__``,
# ``__str__``) may raise that fails that message alone: any Exception, and a
# CancelledError too, which raised there cancels nothing (pickling awaits nothing); left
# to propagate, it ended the reply or the loop callback that was sending, and the call
# was never answered. (KeyboardInterrupt and SystemExit stay what they are: the process
# is interrupted, or exits.)
PICKLING_FAILURES = (Exception, asyncio.CancelledError)
# And in an actor, which leaves Ctrl-C to the driver (its SIGINT handler does nothing,
# ``_util.leave_ctrl_c_to_the_driver``), a KeyboardInterrupt raised while its result or
# stream item is pickled was raised by that pickling code too: it fails that reply
# (raised on, the actor ended as "killed by SIGINT" when no signal was sent).
REPLY_PICKLING_FAILURES = (*PICKLING_FAILURES, KeyboardInterrupt)


class ActorError(Exception):
    """Base class of every error raised by actorshm itself."""


class ActorDiedError(ActorError):
    """The actor's process is gone (it crashed, was killed, or exited).

    Every pending call and every later call on a handle to that actor raises this.
    """


def init_exit_error(cls_name: str, exc: BaseException) -> BaseException:
    """What ``spawn`` raises for ``exc`` from ``__init__``: ``exc`` itself, but a
    ``sys.exit()`` ends the actor, not the caller (both backends)."""
    if isinstance(exc, SystemExit):
        return ActorDiedError(f"actor {cls_name} exited in __init__ (sys.exit({exc.code!r}))")
    return exc


class Unsendable(TypeError):
    """An object that cannot travel, with a message that already says what to do."""


UNDESERIALIZABLE = "the actor could not deserialize the call's arguments: "


def undeserializable_arguments(what: str) -> TypeError:
    """The error of a call whose arguments the actor could not unpickle; ``what`` is the
    unpickling error as "Type: message". A module the actor cannot import gets the fix
    (both backends). It begins with ``UNDESERIALIZABLE``."""
    hint = ""
    missing = _MISSING_MODULE.search(what)
    if what.startswith("AuthenticationError"):
        hint = (" (a multiprocessing manager's proxy connects to its manager with the "
                "actor process's authentication key, which is not the driver's: keep the shared "
                "state in an actor, or in a shared array (actorshm.zeros); or set "
                "multiprocessing.current_process().authkey in the actor to the manager's)")
    elif missing and not all(part.isidentifier() for part in missing.group(1).split(".")):
        hint = (f" (it was defined in code run as module {missing.group(1)!r}, as "
                "runpy.run_path runs a file by default, and no process can import that: "
                "run the file with run_name='__main__', or define it in a module the "
                "actor can import)")
    elif missing:
        name = missing.group(1)
        hint = (f" (the actor's process cannot import {name!r}: actors import from the "
                f"sys.path the driver had when they were spawned; install the module, put "
                f"its folder on sys.path before the spawn, or send its code by value with "
                f"cloudpickle.register_pickle_by_value({name.split('.')[0]}))")
    return TypeError(f"{UNDESERIALIZABLE}{what}{hint}")


def class_not_loaded(cls: type, exc: Exception) -> Exception:
    """``exc``, or, where the actor could not unpickle its start (the class travels with
    the arguments of ``__init__``), the same error naming the class as well: "the call's
    arguments" read as if the arguments alone were wrong, even with none given (both
    backends)."""
    text = str(exc)
    if type(exc) is not TypeError or not text.startswith(UNDESERIALIZABLE):
        return exc
    better = TypeError(f"the actor could not deserialize its class {cls.__qualname__} (module "
                       f"{cls.__module__!r}) or the arguments of its __init__: "
                       f"{text[len(UNDESERIALIZABLE):]}")
    better.__cause__ = exc.__cause__
    notes = getattr(exc, "__notes__", None)
    if notes:
        better.__notes__ = list(notes)
    return better


_MISSING_MODULE = re.compile(r"No module named '([^']+)'")


class RemoteError(ActorError):
    """An actor method raised an exception whose type could not be sent back.

    ``type_name`` names the original type; the message carries its text and the
    remote traceback.
    """

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        super().__init__(f"{type_name}: {message}\n\nRemote traceback:\n{traceback_text}")
        self.type_name = type_name
        self.remote_message = message
        self.traceback_text = traceback_text

    def __reduce__(self):
        return (type(self), (self.type_name, self.remote_message, self.traceback_text))


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised in another process.

    Set as ``__cause__`` of the re-raised exception, so that the traceback printed in
    the caller shows where the error happened in the actor.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


class SharedMemoryError(ActorError, MemoryError):
    """Shared memory could not be allocated: the budget or the machine ran out."""


class PendingCallsLimitError(ActorError):
    """A call was refused because the actor's ``max_pending_calls`` were all unanswered.

    Nothing was sent. Await some of the calls in flight, or raise the limit.
    """


class ReentrantCallError(ActorError):
    """A call would wait on itself: it arrived at an actor that runs one call at a time
    (``max_concurrency=1``) while that call is waiting, through a chain of calls, for it
    (A -> B -> A). Raised at once, naming the chain, instead of hanging.
    """


class ProtocolError(ActorError):
    """A peer sent a frame that is not valid actorshm protocol; its connection closes."""


try:  # Python >= 3.11
    _ExceptionGroup = ExceptionGroup  # noqa: F821
except NameError:  # Python 3.10: the backport (a dependency there), else a plain error
    try:
        from exceptiongroup import ExceptionGroup as _ExceptionGroup
    except ImportError:  # pragma: no cover
        _ExceptionGroup = None

if _ExceptionGroup is not None:
    _GroupBase: tuple = (_ExceptionGroup, ActorError)
else:  # pragma: no cover
    _GroupBase = (ActorError,)


class ActorGroupError(*_GroupBase):
    """Some calls of a group call (or spawns of a group spawn) failed.

    An ``ExceptionGroup`` (on Python 3.10 the ``exceptiongroup`` backport's), so
    ``except* ValueError`` picks out the members that raised ``ValueError``, and an
    ``ActorError``, so ``except actorshm.ActorError`` catches it too.

    Attributes:
        exceptions: the members' exceptions, in member order.
        failed: the indices of the failed members, in the same order.
        results: the list of every member's result, ``None`` where it failed.
    """

    def __new__(cls, message: str, exceptions, failed=(), results=None):
        if _ExceptionGroup is None:  # pragma: no cover
            self = ActorError.__new__(cls, message)
        else:
            self = super().__new__(cls, message, list(exceptions))
        self.failed = list(failed)
        self.results = results
        return self

    def __init__(self, message: str, exceptions, failed=(), results=None) -> None:
        if _ExceptionGroup is None:  # pragma: no cover
            ActorError.__init__(self, message)
            self.message = message
            self.exceptions = tuple(exceptions)
        else:
            super().__init__(message, list(exceptions))

    def derive(self, excs):
        """The same kind of error for a subset of the exceptions (``except*``, ``split``)."""
        keep = [i for i, e in zip(self.failed, self.exceptions) if e in excs]
        return ActorGroupError(self.message, excs, keep, self.results)

    def __reduce__(self):
        return (ActorGroupError, (self.message, list(self.exceptions), self.failed,
                                  self.results))

    def __str__(self) -> str:
        return self.message
