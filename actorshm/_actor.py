"""The user-facing layer: the ``@actor`` decorator, spawn options and handles.

Nothing here knows how processes or sockets work: a handle asks the process's
*client* (the driver's runtime, or the worker inside an actor process) to make a call.
A second backend slots in as another client.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
from dataclasses import dataclass, replace
from typing import Any, Awaitable

from . import _habits
from ._errors import PendingCallsLimitError
from ._util import THREAD_VARS

__all__ = ["actor", "ActorHandle", "ActorOptions"]

_RESERVED = {"spawn", "options", "kill", "pid"}


@dataclass(frozen=True)
class ActorOptions:
    """Per-actor settings, given to ``@actor(...)`` or ``Cls.options(...)``.

    Attributes:
        name: makes the actor findable with ``actorshm.get_actor(name)``; unique per
            runtime while the actor lives.
        max_concurrency: how many calls may run at once (async methods interleave, sync
            methods use a thread pool when above 1). Default 1: one call at a time, in
            the order they were made.
        num_gpus: GPUs given to the actor (``CUDA_VISIBLE_DEVICES`` is set for it).
        num_cpus: the actor's thread count for OpenMP, MKL, OpenBLAS and torch (default
            1, as in Ray): sets ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
            ``OPENBLAS_NUM_THREADS`` and friends in its process.
        max_restarts: how often the actor is restarted after its process dies
            (-1: without limit).
        max_pending_calls: the most unanswered calls this process may have on the actor
            at once; one more raises ``PendingCallsLimitError``. -1 (default) or None:
            no limit.
        env: environment variables for the actor's process; they win over what
            ``num_cpus`` sets. Under ``start_method="forkserver"``, an actor whose
            ``env`` changes a variable that Python reads only as it starts
            (``PYTHONHASHSEED``, ``PYTHONIOENCODING``, ``PYTHONWARNINGS``...) is started
            as with ``"spawn"``, so that it applies (under ``-E`` or ``-I``, which
            actors share, no actor reads them).

    Raises:
        TypeError: an unknown option, or a value of the wrong type.
        ValueError: a value out of range.
    """

    name: str | None = None
    max_concurrency: int = 1
    num_gpus: int = 0
    num_cpus: float = 1
    max_restarts: int = 0
    max_pending_calls: int = -1
    env: dict | None = None

    def merged(self, **kw: Any) -> "ActorOptions":
        """A copy with ``kw`` applied (``Cls.options(**kw)``).

        Raises:
            TypeError: an unknown option, or a value of the wrong type.
            ValueError: a value out of range.
        """
        unknown = set(kw) - set(self.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown actor option(s) {sorted(unknown)}; known options: "
                            f"{sorted(self.__dataclass_fields__)}"
                            f"{_habits.advice(_habits.OPTIONS, unknown)}")
        if "max_pending_calls" in kw and kw["max_pending_calls"] is None:
            kw["max_pending_calls"] = -1  # (no limit, as by default)
        new = replace(self, **kw)
        # (a bool is an int to Python: max_restarts=True would mean one restart)
        _check_int("max_concurrency", new.max_concurrency, 1, "an int >= 1")
        _check_int("num_gpus", new.num_gpus, 0, "an int >= 0")
        _check_int("max_restarts", new.max_restarts, -1, "an int >= 0 (or -1 for unlimited)")
        if isinstance(new.num_cpus, bool) or not isinstance(new.num_cpus, (int, float)):
            raise TypeError(f"num_cpus must be a number (the thread count), not "
                            f"{new.num_cpus!r}")
        if not 0 < new.num_cpus < 1 << 16:
            raise ValueError("num_cpus must be a number > 0 and below 65536 (the thread "
                             f"count), not {new.num_cpus!r}" + (
                                 ": to reserve no CPU (Ray's num_cpus=0), leave it out; "
                                 "the default, 1, reserves none on the Ray backend"
                                 if new.num_cpus == 0 else ""))
        _check_int("max_pending_calls", new.max_pending_calls, -1,
                   "an int >= 1 (or -1 or None for no limit)", not_zero=True)
        if new.env is not None:
            if not isinstance(new.env, dict):
                raise TypeError(f"env must be a dict of str to str (environment variables), "
                                f"not {type(new.env).__name__}")
            for k, v in new.env.items():
                if not (isinstance(k, str) and isinstance(v, str)):
                    def text(x):  # (bytes decoded as os.environb's are)
                        return os.fsdecode(x) if isinstance(x, bytes) else str(x)
                    raise TypeError(f"env must be a dict of str to str (environment "
                                    f"variables): {k!r}: {v!r} is not; write it as "
                                    f"{text(k)!r}: {text(v)!r}")
        for k, v in (new.env or {}).items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise ValueError(f"env: {k!r} -> {v!r} is not an environment variable (a "
                                 "name must be non-empty, without '=' or NUL; a value "
                                 "without NUL)")
        if new.name is not None and not (isinstance(new.name, str) and new.name):
            raise TypeError(f"name must be a non-empty str, not {new.name!r}")
        return new

    def thread_env(self) -> dict[str, str]:
        """The thread-count variables an actor process gets: ``num_cpus``, or the
        ``OMP_NUM_THREADS`` given in ``env`` (torch reads ``MKL_NUM_THREADS`` before it,
        so one must not say otherwise); ``env`` itself is applied after these."""
        n = (self.env or {}).get("OMP_NUM_THREADS") or str(max(1, int(self.num_cpus)))
        return {var: n for var in THREAD_VARS}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, least: int, what: str, not_zero: bool = False) -> None:
    """Refuse option ``name``: a ``TypeError`` if ``value`` is not an int (a bool is
    not one here), a ``ValueError`` if it is below ``least`` (or 0, with ``not_zero``)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be {what}, not {value!r}")
    if value < least or not_zero and value == 0:
        raise ValueError(f"{name} must be {what}, not {value!r}")


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not built in

STREAM = "stream"  # the kind of a generator method: its calls stream (``_streams``)


def public_methods(cls: type) -> dict[str, bool | str]:
    """Public method names of ``cls`` -> whether each is a coroutine function, or
    ``STREAM`` for a generator (sync or async).

    A method that is a plain function is known by the function it wraps, if any: a
    ``functools.wraps`` decorator's ``__wrapped__``, a ``partialmethod``'s or
    ``singledispatchmethod``'s function, so that an ``async def`` under a sync decorator
    is awaited and a generator under one streams. A wrapper that is itself a coroutine
    or generator function is what it is. Classes and properties are not methods."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") or name in ("spawn", "options"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        elif isinstance(attr, (functools.partialmethod, functools.singledispatchmethod)):
            attr = attr.func
        if isinstance(attr, type) or not callable(attr):
            continue
        fn = attr if _kind_of_its_own(attr) else _innermost(attr)
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            out[name] = STREAM
        else:
            out[name] = inspect.iscoroutinefunction(fn)
    return out


def _kind_of_its_own(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or \
        inspect.isasyncgenfunction(fn)


def _innermost(fn: Any) -> Any:
    """The function that ``fn`` wraps (``__wrapped__``, ``functools.partial``), if any."""
    for _ in range(100):  # (a wrapper that wraps itself must not loop)
        if isinstance(fn, functools.partial):
            fn = fn.func
        else:
            inner = getattr(fn, "__wrapped__", None)
            if inner is None or not callable(inner):
                return fn
            fn = inner
    return fn


RAY_CALLS = ("remote", "bind")  # Ray's ways to call an actor method


def no_attribute(obj: Any, attr: str, ray_names: tuple, hint) -> None:
    """Raise the ``AttributeError`` of ``obj.attr``: for one of Ray's spellings
    (``ray_names``), the text ``hint()`` gives, which says how actorshm spells it (a
    handle's method, a group's, a spawner, a pool use this ``__getattr__``)."""
    if attr in ray_names:
        raise AttributeError(hint())
    raise AttributeError(f"{type(obj).__name__!r} object has no attribute {attr!r}")


class _Spawner:
    """What ``Cls.options(...)`` returns: ``await Cls.options(...).spawn(*args)``."""

    def __init__(self, cls: type, options: ActorOptions) -> None:
        self._cls = cls
        self._options = options

    async def spawn(self, *args: Any, **kwargs: Any) -> "ActorHandle":
        from ._client import client
        if kwargs:
            refuse_options_as_init_args(self._cls, kwargs, f"{self._cls.__qualname__}.spawn()")
        return await client().spawn(self._cls, self._options, args, kwargs)

    def options(self, **kw: Any) -> "_Spawner":
        return _Spawner(self._cls, self._options.merged(**kw))

    def __await__(self):
        name = self._cls.__qualname__
        raise TypeError(f"{name}.options(...) is not awaitable: start the actor with "
                        f"`await {name}.options(...).spawn(*args)`")

    def __call__(self, *args: Any, **kwargs: Any):
        # ``Cls.options(...)(...)`` reads as Ray's ``Cls.options(...).remote(...)``; say
        # how it is spelled here rather than "'_Spawner' object is not callable".
        name = self._cls.__qualname__
        raise TypeError(f"{name}.options(...) returns a spawner, not the class: start "
                        f"the actor with `await {name}.options(...).spawn(*args)`")

    def __getattr__(self, attr: str):
        no_attribute(self, attr, ("remote",), lambda: (  # Ray's ``.options(...).remote()``
            f"{self._cls.__qualname__}.options(...).remote: an actorshm actor is started "
            f"with `await {self._cls.__qualname__}.options(...).spawn(*args)`, on Ray too "
            "(see docs/ray.md)"))


def refuse_options_as_init_args(cls: type, kwargs: dict, what: str) -> None:
    """An actor option given to ``spawn`` (Ray's ``Cls.options(...).remote`` read as
    ``spawn(name=...)``) that ``__init__`` does not take: said before a process starts,
    rather than by ``__init__`` in the actor ("unexpected keyword argument")."""
    given = [k for k in kwargs if k in ActorOptions.__dataclass_fields__]
    if not given:
        return
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # (no signature to read: __init__ says)
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    taken = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY,
                                                      p.POSITIONAL_OR_KEYWORD)}
    wrong = [k for k in given if k not in taken]
    if wrong:
        name = cls.__qualname__
        opts = ", ".join(f"{k}=..." for k in wrong)
        fix = (f"ActorGroup.spawn({name}.options({opts}), n)" if what.startswith("ActorGroup")
               else f"{name}.options({opts}).spawn(...)")
        raise TypeError(f"{what} got {opts}: actor option(s), which {name}.__init__ does "
                        f"not take; options go before the spawn: `await {fix}`")


class _ClassBinder:
    """A descriptor giving the decorated class ``spawn`` and ``options``."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __get__(self, obj: Any, cls: type):
        opts = cls.__dict__.get("__actorshm_options__")
        if opts is None:  # a subclass of an actor class, not decorated itself
            _refuse_reserved(cls)
            opts = _options_of(cls)
        spawner = _Spawner(cls, opts)
        return spawner.spawn if self.what == "spawn" else spawner.options


def _options_of(cls: type) -> ActorOptions:
    for k in cls.__mro__:
        o = k.__dict__.get("__actorshm_options__")
        if o is not None:
            return o
    return ActorOptions()


def _refuse_reserved(cls: type) -> None:
    """Refuse a class that defines, or inherits, a name that handles reserve: its
    handle's ``kill``, say, would end the actor rather than call the method."""
    clash = sorted({n for k in cls.__mro__[:-1] for n in _RESERVED
                    if n in k.__dict__ and not isinstance(k.__dict__[n], _ClassBinder)})
    if clash:
        raise TypeError(f"actor class {cls.__qualname__} defines {clash}, names that "
                        "actorshm reserves for spawning and handles; rename them")


def actor(cls: type | None = None, /, **options: Any):
    """Make a class an actor class: ``await Cls.spawn(...)`` starts it in its own process.

    Use bare (``@actor``) or with options (``@actor(max_concurrency=4, num_gpus=1)``).
    The class gains ``Cls.spawn(*args, **kwargs)``, awaitable: it starts a process, runs
    ``__init__(*args, **kwargs)`` there and returns an ``ActorHandle``; and
    ``Cls.options(**options)``, other options for one spawn:
    ``await Cls.options(name="ps").spawn()``. The class itself is unchanged otherwise:
    ``Cls(...)`` still makes a local instance.

    Args:
        cls: the class, in the bare ``@actor`` form.
        **options: actor options: ``name``, ``max_concurrency``, ``num_gpus``,
            ``num_cpus``, ``max_restarts``, ``max_pending_calls``, ``env`` (see
            "Actor options" in the API reference).

    The class itself is made an actor class, not a copy of it: decorating it again
    merges the new options onto its current ones (``Slow = actor(env=a)(Cls)`` then
    ``Fast = actor(env=b)(Cls)`` are one class, with ``env=b``; for options that differ
    between spawns, use ``Cls.options``). A decorated subclass of an actor class starts
    from its base's options, as an undecorated one keeps them.

    Returns:
        The class itself (or, with options only, a decorator that returns it).

    Raises:
        TypeError: ``cls`` is not a class, it defines a name actorshm reserves
            (``spawn``, ``options``, ``kill``, ``pid``), or an option is unknown.
        ValueError: an option's value is out of range.
    """
    if cls is None:
        return lambda c: actor(c, **options)
    if not isinstance(cls, type):
        raise TypeError(f"@actor decorates classes, not {type(cls).__name__} {cls!r}: put "
                        "it above a `class` statement (a function's work goes in a method "
                        "of an actor class)")
    if "__actorshm_options__" in cls.__dict__:  # decorated already: new default options
        cls.__actorshm_options__ = cls.__actorshm_options__.merged(**options)
        return cls
    if not cls.__flags__ & _HEAPTYPE:
        raise TypeError(f"@actor decorates classes of your own; {cls.__qualname__} is "
                        "built in: subclass it (`class MyList(list): ...`) and decorate that")
    _refuse_reserved(cls)
    if inspect.iscoroutinefunction(getattr(cls, "__init__", None)):
        raise TypeError(f"actor class {cls.__qualname__} has an `async def __init__`, which "
                        "Python cannot run (a constructor returns None, not a coroutine): "
                        "make __init__ sync, and put the async set-up in an async method "
                        "called after the spawn (`h = await Cls.spawn(); await h.setup()`)")
    opts = _options_of(cls).merged(**options)
    cls.__actorshm_options__ = opts
    cls.spawn = _ClassBinder("spawn")
    cls.options = _ClassBinder("options")
    return cls


_NO_RUN_AHEAD: Any = object()  # (``ActorMethod.options`` called without it)


class ActorMethod:
    """One public method of an actor, bound to a handle: calling it sends the call.

    It keeps what a call needs, not the handle, which keeps it (each handle's methods
    are made once): the two would be a reference cycle, and a handle dropped would wait
    for the garbage collector, its runtime's record of a dead actor with it."""

    __slots__ = ("_client", "_actor_id", "_cls_name", "_methods", "_max_pending",
                 "_actor_name", "_pid", "_name", "_what", "_run_ahead", "_plain", "_family")

    def __init__(self, handle: "ActorHandle | ActorMethod", name: str,
                 run_ahead: int = 16) -> None:
        self._client = handle._client
        self._actor_id = handle._actor_id
        self._cls_name = handle._cls_name
        self._family = handle._family
        self._methods = handle._methods
        self._max_pending = handle._max_pending
        self._actor_name = handle._actor_name
        self._pid = handle._pid
        self._name = name
        self._what = f"{handle._cls_name}.{name}"
        self._run_ahead = run_ahead
        # The common call: not streamed, no pending-calls limit (decided once, here).
        self._plain = handle._methods.get(name) != STREAM and handle._max_pending <= 0

    def options(self, *, run_ahead: int = _NO_RUN_AHEAD, **ray_options: Any) -> "ActorMethod":
        """This method with call settings: ``handle.batches.options(run_ahead=4)(10)``.

        Args:
            run_ahead: for a streaming (generator) method, the most items the actor
                may produce beyond those the caller has taken (default 16).

        Raises:
            TypeError: the method does not stream (``run_ahead`` would do nothing).
            ValueError: ``run_ahead`` is below 1 (TypeError: not an int).
        """
        # (Every backend's handles come through here, Ray's too.)
        if ray_options or run_ahead is _NO_RUN_AHEAD:
            raise TypeError(
                f"{self._what}.options() takes run_ahead=... (for a streaming method), not "
                f"{sorted(ray_options) or 'nothing'}"
                f"{_habits.advice(_habits.METHOD_OPTIONS, ray_options)}")
        if self._methods.get(self._name) != STREAM:
            raise TypeError(
                f"{self._what}.options(run_ahead=...): run_ahead applies to streaming "
                f"methods (generators) only, and {self._what} is not one: it returns one "
                f"result, so there is nothing to run ahead of; call it without "
                f"options: `handle.{self._name}(...)`")
        _check_int("run_ahead", run_ahead, 1, "an int >= 1")
        return ActorMethod(self, self._name, run_ahead)

    def __call__(self, *args: Any, **kwargs: Any):
        """Send the call now; return an awaitable of its result.

        Raises:
            TypeError: an argument cannot be serialized (nothing is sent).
            PendingCallsLimitError: the actor's ``max_pending_calls`` calls from this
                process are all unanswered (nothing is sent).
            RuntimeError: this process is a fork (``os.fork``: a DataLoader's worker) of
                the one whose runtime or actor the handle belongs to (nothing is sent).
        """
        if self._plain:
            return self._client.call(self._actor_id, self._name, args, kwargs, self._what)
        if self._methods.get(self._name) == STREAM and hasattr(self._client, "stream"):
            # an async iterator of its items (a client without ``stream`` streams in call)
            return self._client.stream(self._actor_id, self._name, args, kwargs, self._what,
                                       self._run_ahead)
        if self._max_pending > 0:
            return _limited_call(self, self._name, args, kwargs, self._what)
        return self._client.call(self._actor_id, self._name, args, kwargs, self._what)

    def __await__(self):
        raise TypeError(f"{self._what} is a method, not a call: call it, "
                        f"`await handle.{self._name}(...)`")

    def __getattr__(self, name: str):
        no_attribute(self, name, RAY_CALLS, lambda: (
            f"{self._what}.{name}: an actorshm method is called directly, and the call is "
            f"sent at once: `await handle.{self._name}(...)`, on Ray too (see docs/ray.md)"))

    def __repr__(self) -> str:
        return f"<actor method {self._what}>"

    def __reduce__(self):
        # As its handle pickles, then this method of it.
        return (_rebuild_method, (_handle_args(self), self._name, self._run_ahead))


class ActorHandle:
    """A reference to a running actor. Its attributes are the actor's public methods.

    Calling one sends the call at once and returns an awaitable for the result.
    Handles pickle: pass them to other actors, whose calls then go straight to it.
    """

    def __init__(self, client: Any, actor_id: int, cls_name: str, methods: dict,
                 name: str | None, pid: int, max_pending: int = -1) -> None:
        self._client = client
        self._max_pending = max_pending
        self._actor_id = actor_id
        self._cls_name = cls_name
        self._methods = methods
        self._actor_name = name
        self._pid = pid
        self._bound: dict[str, ActorMethod] = {}
        self._family: str | None = None  # its id's token, if not its client's (``family``)

    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("_"):
            if name.startswith("__"):  # (asked by libraries: copy, numpy, pickle...)
                raise AttributeError(name)
            raise AttributeError(f"{name!r}: an actor's methods whose names start with '_' "
                                 "are private, not callable through its handle (rename "
                                 "the method without the '_' to call it)")
        try:
            return self._bound[name]
        except KeyError:
            pass
        if name not in self._methods:
            raise AttributeError(
                f"actor {self._cls_name} has no public method {name!r}; its methods are "
                f"{sorted(self._methods)} (a handle reaches methods only: for an "
                "attribute or property, add a method that returns it)")
        m = self._bound[name] = ActorMethod(self, name)
        # Found by ordinary attribute lookup from now on: ``__getattr__`` runs only after
        # that lookup failed, which costs an AttributeError per call.
        self.__dict__[name] = m
        return m

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._methods))

    @property
    def pid(self) -> int:
        """The process id of the actor (of its current process, after a restart)."""
        return self._client.actor_pid(self._actor_id, self._pid)

    @property
    def actor_id(self) -> int:
        """The actor's id in its runtime (a method of the actor named ``actor_id`` wins)."""
        if "actor_id" in self._methods:
            return self.__getattr__("actor_id")
        return self._actor_id

    @property
    def name(self) -> str | None:
        """The name given with ``options(name=...)``, else None.

        An actor class may define a method called ``name``: then ``handle.name`` is that
        method, as with every other method.
        """
        if "name" in self._methods:
            return self.__getattr__("name")
        return self._actor_name

    def kill(self, **ray_options: Any) -> Awaitable[None]:
        """End the actor's process now (SIGKILL); pending calls raise ActorDiedError.

        The kill is under way once this returns (it starts at the event loop's next
        turn), as a call is sent when made, and it returns what a call does: a future
        (not a coroutine: ``await`` it, or hand it to ``asyncio.wait_for``, ``gather``
        or ``wait``). Cancelling the wait (a time-out, even of 0 s) does not stop the
        kill. With no event loop running here (a driver thread, a sync method of an actor
        with max_concurrency > 1), a ``concurrent.futures.Future``, as a call made there
        returns: the kill is handed to the runtime's loop, in order with the calls made
        after it (on Ray it runs on a loop of its own)."""
        if ray_options:
            raise TypeError(
                f"kill() takes no options, not {sorted(ray_options)}: it ends the actor for "
                "good, restarts or not (Ray's no_restart=True); to have an actor with "
                "max_restarts restart, end its process: os.kill(handle.pid, "
                "signal.SIGKILL)")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return kill_from_thread(self._client, self.kill, self._kill)
        begins = getattr(self._client, "kill_begins", None)  # (the local backend's)
        if begins is not None:  # (on the client's loop: this may be another thread's)
            from ._client import on_loop
            on_loop(self._client.loop, begins, self._actor_id)
        return start_shielded(self._kill())

    async def _kill(self) -> None:
        await self._client.kill(self._actor_id)

    def __reduce__(self):
        return (_rebuild_handle, _handle_args(self))

    def __repr__(self) -> str:
        return f"<ActorHandle {self._cls_name} id={self._actor_id} pid={self.pid}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorHandle) and other._actor_id == self._actor_id

    def __hash__(self) -> int:
        return hash(("actorshm.ActorHandle", self._actor_id))


def start_shielded(work) -> Awaitable:
    """Start coroutine ``work`` on the running loop now, where waiting for it is up to
    the caller and cancelling that wait does not stop it: a future (``kill``). With no
    loop running here, or one whose task factory fails, ``work`` itself, to be awaited."""
    try:
        task = asyncio.get_running_loop().create_task(work)
    except Exception:  # no loop runs here, or it cannot make tasks
        return work
    task.add_done_callback(_seen)
    outer = asyncio.shield(task)
    outer.add_done_callback(_seen)  # (an error nobody awaits is no "never retrieved")
    return outer


def kill_from_thread(client, kill, work):
    """A kill asked where no event loop runs (a driver thread, a sync method of an actor
    with max_concurrency > 1), as a call made there goes: ``kill()`` handed to the
    event loop of ``client`` (a runtime's, an actor's), in order with the calls made
    after it; where the client has none (Ray's), coroutine ``work()`` run on a loop of
    its own, in a thread of its own, begun now. Returns a ``concurrent.futures.Future``
    (``.result()``, or ``await`` it from a loop of this thread's own)."""
    from ._client import call_from_thread, refuse_if_forked
    home = getattr(client, "loop", None)
    if home is not None:
        refuse_if_forked(home)
        return call_from_thread(home, kill)
    return _start_in_thread(work())


def _start_in_thread(work):
    import concurrent.futures

    from ._client import ThreadCallFuture
    out = ThreadCallFuture()

    def run() -> None:
        try:
            result = asyncio.run(work)
        except BaseException as exc:
            try:
                out.set_exception(exc)
            except concurrent.futures.InvalidStateError:  # the wait was cancelled
                pass
        else:
            try:
                out.set_result(result)
            except concurrent.futures.InvalidStateError:
                pass

    threading.Thread(target=run, name="actorshm-kill", daemon=True).start()
    return out


def _seen(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _rebuild_handle(actor_id, cls_name, methods, name, pid, max_pending=-1, family=None):
    from ._client import Foreign, client_for_decode, known_family
    own = getattr(actor_id, "actorshm_client", None)  # an id that names its client (Ray)
    if own is not None:
        client = own()
    else:
        client = client_for_decode(actor_id)
        if not getattr(client, "shares_memory", True):  # a Ray runtime's process
            # (its client would take the local actor's id for a Ray actor's, and fail
            # each call with an AttributeError about the id)
            client = Foreign(f"{cls_name} (id {actor_id})")
        elif family is not None and not known_family(family):
            # (another driver's id: here it would name whichever actor has that number)
            client = Foreign(f"{cls_name} (id {actor_id})", family)
    h = ActorHandle(client, actor_id, cls_name, methods, name, pid, max_pending)
    h._family = family
    return h


def _handle_args(h: "ActorHandle | ActorMethod") -> tuple:
    """What a handle (or a method of one) travels as: ``_rebuild_handle``'s arguments,
    with the actor's current pid, not the one the handle was made with (the process
    that unpickles it cannot follow restarts that happened before)."""
    return (h._actor_id, h._cls_name, h._methods, h._actor_name,
            h._client.actor_pid(h._actor_id, h._pid), h._max_pending,
            h._family or getattr(h._client, "family", None))


def _rebuild_method(handle: tuple, name: str, run_ahead: int) -> ActorMethod:
    return ActorMethod(_rebuild_handle(*handle), name, run_ahead)


# Unanswered calls per actor from this process, for actors with ``max_pending_calls``:
# (client, actor id) -> their futures. (Keyed by client too: runtimes open at once number
# their actors alike.) A call counts until its future is done, so one cancelled frees its
# place at once, not when its callbacks run.
_pending: dict[tuple, set] = {}
_pending_lock = threading.Lock()


def _forget_pending_after_fork() -> None:
    """A forked child made none of its parent's calls (and another thread of the parent
    may have held the lock at the fork): its calls are refused as the parent's client's
    (``_client``), not counted against the parent's limit."""
    global _pending_lock
    _pending.clear()
    _pending_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pending_after_fork)


class _Reserved:
    """A place taken while the call that holds it is being made."""

    def done(self) -> bool:
        return False


def _limited_call(h: "ActorMethod", method: str, args: tuple, kwargs: dict, what: str):
    aid = h._actor_id
    key = (h._client, aid)
    slot = _Reserved()
    with _pending_lock:
        futs = _pending.setdefault(key, set())
        if len(futs) >= h._max_pending:  # (done ones whose callbacks have yet to run)
            futs.difference_update([f for f in futs if f.done()])
            if len(futs) >= h._max_pending:
                raise PendingCallsLimitError(
                    f"{what}(): {len(futs)} calls to actor {h._cls_name} (id {aid}) from "
                    f"this process are unanswered, its max_pending_calls={h._max_pending}; "
                    "await some of them before calling again, or raise max_pending_calls")
        futs.add(slot)
    try:
        fut = h._client.call(aid, method, args, kwargs, what)
    except BaseException:
        _call_done(key, slot)
        raise
    with _pending_lock:
        futs = _pending.setdefault(key, set())
        futs.discard(slot)
        futs.add(fut)
    fut.add_done_callback(lambda f: _call_done(key, f))
    return fut


def _call_done(key: tuple, fut) -> None:
    with _pending_lock:
        futs = _pending.get(key)
        if futs is not None:
            futs.discard(fut)
            if not futs:
                del _pending[key]
