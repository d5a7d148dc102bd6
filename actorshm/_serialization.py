"""Serialization: pickle protocol 5, with arrays and fds travelling out of band.

Messages are pickled with a cloudpickle-based pickler, so that classes and functions
defined in ``__main__``, a notebook cell or a closure travel by value. Every numpy (or
CuPy) array at any depth is replaced by a reference into the message's *block table*:
the shared blocks the message leases to the receiver, each as ``(region, offset, size)``
plus what opens the region the first time it crosses this connection (an arena's fd,
riding along as SCM_RIGHTS; a GPU slab's IPC handle). The array itself keeps its shape,
dtype, strides and offset inside the block, so views travel as views and nothing is
copied. An array that is not yet in shared memory is first copied into this process's
pool (once per send; counted in ``bytes_copied``), except a small one: an ordinary array
of up to ``INLINE_MAX`` bytes travels inside the pickle itself (pickle protocol 5,
in band), up to ``INLINE_BUDGET`` bytes of them per message (one of up to
``ALWAYS_IN_BAND`` bytes always: ``_inband.in_band``). It is a copy either way, and
a shared block would cost more than the bytes it carries; the receiver gets a writable
copy all the same, and the copy still counts in ``bytes_copied``.

The table is pickled ahead of the user's objects (frame flag ``HAS_BLOCKS``), and the
receiver adopts every block in it before it unpickles anything of the user's. So a user
object that fails to unpickle fails the call, but every lease still comes back and every
region is still opened: the connection and the peer carry on.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import io
import os
from asyncio import Future as _Future
from concurrent.futures import Future as _ThreadFuture
import pickle
import sys
import threading
import types
from typing import Any

import cloudpickle
import numpy as np

from . import _encoding, _leases, _results, _shm
from ._encoding import (SCALARS, Encoding, MessageTooBig, add_fd, add_wait, arena_fd,
                        check_size)
from ._flat import decode_flat, encode_flat
from ._inband import dtype_token, in_band, inline_array, rebuild_inline
from ._errors import ProtocolError, SharedMemoryError, Unsendable
from ._util import pipe_end
from ._wire import ARENA, FLAT, GPU_SLAB, HAS_BLOCKS, LEN, PLAIN, RECV_SIZE  # noqa: F401

__all__ = ["encode", "encode_plain_call", "decode", "Unsendable", "MessageTooBig", "PassFd",
           "register_reducer", "register_region_kind", "register_lazy_plugin",
           "register_shared_check",
           "register_flat", "leased_block", "lease_host_block", "ARENA", "GPU_SLAB",
           "FILE_TYPES", "refuse_file", "refuse_process_bound", "PROCESS_BOUND"]

from ._registry import (_OPENERS, _flat_holes, _lazy_plugins,  # noqa: F401
                        _not_reduced, _plugin_reducer, _reducers, plugin_check, register_flat,
                        register_lazy_plugin, register_reducer, register_region_kind,
                        register_shared_check)

_ndarray = np.ndarray
_memmap = np.memmap


# Open files: cloudpickle would send a text file as a snapshot of its contents (a copy
# that no longer follows the file), and a binary one fails with a bare "cannot pickle".
FILE_TYPES = frozenset({io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom,
                         io.TextIOWrapper})


def send_mp_main_by_value() -> None:
    """In a ``multiprocessing`` child started by spawn or forkserver, the parent's script
    is module ``__mp_main__``: its classes and functions go by value, as ``__main__``'s
    do (cloudpickle named them by reference, and no actor can import ``__mp_main__``).
    A runtime calls this as it opens; Ray's own copy of cloudpickle, which pickles an
    actor class for Ray, is told too once Ray is imported."""
    mod = sys.modules.get("__mp_main__")
    if mod is None or getattr(mod, "__name__", None) != "__mp_main__":
        return  # (not such a child: importing multiprocessing may alias __main__)
    for pickler in (cloudpickle, sys.modules.get("ray.cloudpickle")):
        if pickler is not None:
            pickler.register_pickle_by_value(mod)


LruCache = functools._lru_cache_wrapper  # what functools.lru_cache and cache make


def _sent_by_value(obj: Any) -> bool:
    """Whether cloudpickle (actorshm's, or Ray's copy) sends function ``obj`` by value: it
    was defined in the script, a notebook or a function, or in a module registered to
    go by value with either."""
    module = getattr(obj, "__module__", None)
    if module is None or module in ("__main__", "__mp_main__") or \
            "<locals>" in getattr(obj, "__qualname__", "<locals>"):
        return True
    by_value = set()
    for pickler in (cloudpickle, sys.modules.get("ray.cloudpickle")):
        if pickler is not None:
            by_value.update(pickler.list_registry_pickle_by_value())
    parts = module.split(".")
    return any(".".join(parts[:i]) in by_value for i in range(1, len(parts) + 1))


def _named(module: str, qualname: str, load=importlib.import_module) -> Any:
    obj = load(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def reduce_lru_cache(obj: Any) -> Any:
    """``functools.lru_cache`` (or ``cache``) around a function sent by value: rebuilt
    around that function, sent by value too, with an empty cache. pickle names the
    wrapper by its module and name, which the actor's process cannot look up: an actor
    class of the script with a cached method could not be spawned. One that its name
    finds (in an importable module): named, as pickle does (``obj.__reduce__()``)."""
    func = getattr(obj, "__wrapped__", None)
    if func is None:
        return obj.__reduce__()
    if not _sent_by_value(obj):
        try:
            if _named(obj.__module__, obj.__qualname__, sys.modules.__getitem__) is obj:
                return obj.__reduce__()
        except Exception:
            pass  # (``fast = lru_cache()(slow)``: its name finds another object)
    params = obj.cache_parameters()
    extra = {k: v for k, v in vars(obj).items() if k != "__wrapped__"}
    return _rebuild_lru_cache, (func, params["maxsize"], params["typed"], extra)


def _rebuild_lru_cache(func, maxsize, typed, extra=None):
    wrapper = functools.lru_cache(maxsize=maxsize, typed=typed)(func)
    if extra:  # (set on the wrapper itself: ``__isabstractmethod__``, say)
        vars(wrapper).update(extra)
    return wrapper


def lru_cache_state(obj: Any) -> tuple:
    """``reduce_lru_cache`` as Ray's custom serializers take it (the Ray backend
    registers it; ``from_lru_cache_state`` undoes it): ``(module, name)`` or ``(function,
    maxsize, typed, attributes)``."""
    r = reduce_lru_cache(obj)
    return (obj.__module__, r) if isinstance(r, str) else r[1]


def from_lru_cache_state(state: tuple) -> Any:
    if len(state) == 2:  # named: look it up, as pickle does
        return _named(*state)
    return _rebuild_lru_cache(*state)


def refuse_file(f) -> None:
    name = getattr(f, "name", None)
    what = f"the open file {name!r}" if isinstance(name, str) else "an open file"
    raise Unsendable(
        f"{what} cannot be sent to another process: pass its path and open it there, "
        "or its contents (f.read())")


def refuse_connection(c) -> None:
    """Refuse ``c`` if it is a ``multiprocessing`` pipe end or listener (``pipe_end``):
    it would arrive as its fd's number (in the driver, an actor's socket's, which the
    copy closed when dropped)."""
    kind = pipe_end(c)
    if kind:
        what = "an end of multiprocessing.Pipe()" if kind != "Listener" else "listening"
        raise Unsendable(
            f"a multiprocessing {kind} ({what}) cannot be sent to another process this "
            "way: its file descriptor does not travel. Pass the data through calls (a "
            "streaming method for a flow of items), or create it where it is used")


_INHERITED = ("a multiprocessing {name} reaches only the processes that inherit it as they "
              "start, and actors are started by actorshm: ")
# Objects that work only within the process that made them, by the module of their class:
# why each is refused, and what to use instead. Pickling raised for each already, with
# advice that leads nowhere with actors ("through inheritance"). (An asyncio Event or
# Lock is not refused: it pickles as a copy, as any object does, and an object may hold
# an unlocked one for its own use.)
PROCESS_BOUND = {
    "multiprocessing.connection": refuse_connection,
    "multiprocessing.queues": _INHERITED + (
        "send the items through calls, stream them from a generator method, or make an "
        "actor the queue (its methods put and get)"),
    "torch.multiprocessing.queue": _INHERITED + (
        "send the items through calls (tensors travel by reference), stream them from a "
        "generator method, or make an actor the queue (its methods put and get)"),
    "multiprocessing.synchronize": _INHERITED + (
        "an actor runs one call at a time (max_concurrency=1: a lock around its state), "
        "and an async method of an actor can wait for an event there"),
    "multiprocessing.sharedctypes": (
        "a multiprocessing Value or Array ({name}) reaches only the processes that "
        "inherit it as they start, and actors are started by actorshm: share an array "
        "instead: actorshm.zeros(1) travels by reference, and the actor's writes to it "
        "are seen by the caller"),
}


def refuse_process_bound(obj, module: str) -> None:
    """Refuse ``obj``, whose class's module is ``module``, if ``PROCESS_BOUND`` names it."""
    why = PROCESS_BOUND.get(module)
    if why is None or isinstance(obj, BaseException):  # (an error is data)
        return
    if callable(why):
        why(obj)
        return
    raise Unsendable(why.format(name=type(obj).__name__))


class PassFd:
    """Wraps a file descriptor so that it travels with a message (SCM_RIGHTS)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd


class _Encoding(Encoding):
    """An encoding made by a pickler, which asks how each array travels (``array``)."""

    def array(self, obj):
        """How ndarray ``obj`` travels: in band when small and an ordinary array of its
        own (a copy either way), else as a lease on its shared block (``_reduce_array``);
        None: pickle it as numpy does."""
        if type(obj) is _ndarray and obj.base is None and not obj.dtype.hasobject:
            n = obj.nbytes
            if n and in_band(n, self.inlined):
                self.inlined += n
                self.n_inlined += 1
                return inline_array(obj)
        return _reduce_array(self, obj)


THREAD_FUTURE = ("it holds the future of a call made from a thread (a sync method of an "
                 "actor with max_concurrency > 1): block on it with .result() first, and "
                 "send what that returns")


def result_mistake(value: Any) -> str | None:
    """Why a method's result ``value`` that did not pickle cannot be sent, in words that
    say what to change, when it is a common mistake: a generator or coroutine object the
    method made instead of streaming or awaiting; None otherwise."""
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        return ("it is a generator object; to stream, make the method itself a generator "
                "(a `def` or `async def` with `yield`)")
    if inspect.iscoroutine(value):
        return ("it is a coroutine object: the method returned a coroutine without "
                "awaiting it (write `return await ...`)")
    return None


# cloudpickle (3.1 on) names the file of every code object it sends by value
# "<dynamic-code>", so that a remote traceback through an actor class of the driver's
# script showed no file and no source line. Its file is kept here: on this one machine
# the receiver's ``linecache`` reads the line from it, as in the driver's own tracebacks.
_DYNAMIC_CODE = "<dynamic-code>"
_cloudpickle_code = cloudpickle.Pickler.dispatch_table.get(types.CodeType)
_CodeType = types.CodeType


def _reduce_code(code: types.CodeType):
    rebuild, args = _cloudpickle_code(code)
    # (its file is the first str of ``CodeType``'s arguments: the name comes after it)
    i = next((i for i, a in enumerate(args) if type(a) is str), None)
    if i is not None and args[i] == _DYNAMIC_CODE:
        args = (*args[:i], code.co_filename, *args[i + 1:])
    return rebuild, args


class _Encoder(_Encoding, cloudpickle.Pickler):
    """Any message: cloudpickle (classes and functions of ``__main__`` travel by value,
    keeping their file for tracebacks), with arrays, fds and plug-in types reduced here."""

    def __init__(self, file, conn) -> None:
        cloudpickle.Pickler.__init__(self, file, protocol=5)
        self._start(conn)

    def reducer_override(self, obj):
        t = type(obj)
        if obj is _rebuild_array or obj is rebuild_inline or obj is _rebuild_masked:  # ours
            return NotImplemented
        if t is _ndarray or (isinstance(obj, _ndarray)):
            r = self.array(obj)
            return NotImplemented if r is None else r
        if t is PassFd:
            return _rebuild_fd, (add_fd(self, obj.fd),)
        if isinstance(obj, _Future):  # a call's result as an argument (``_results``)
            return _results.reduce_future(obj)
        if isinstance(obj, _ThreadFuture):
            raise Unsendable(THREAD_FUTURE)
        if t is _CodeType and _cloudpickle_code is not None:
            return _reduce_code(obj)
        if t in FILE_TYPES and obj is not sys.stdout and obj is not sys.stderr:
            refuse_file(obj)
        if t is LruCache:
            return reduce_lru_cache(obj)
        module = getattr(t, "__module__", None)  # (a class may have none)
        if module in PROCESS_BOUND:  # (cheap: asked of every object)
            refuse_process_bound(obj, module)
        if _reducers or _lazy_plugins:
            r = _plugin_reducer(t)
            if r is not None:
                return r(self, obj)
        return super().reducer_override(obj)


class _Discard:
    """A file that keeps nothing (``_Probe``)."""

    @staticmethod
    def write(data) -> int:
        return len(data)


_DISCARD = _Discard()


def _placeholder() -> None:
    return None


class _Probe(_Encoder):
    """Pickles a part of a message that could not be sent, to learn whether that part
    fails too (``encode_part``), doing nothing but pickling it: arrays and plug-in types
    (tensors) go as placeholders, not copied anywhere (a plug-in's ``check``, where it
    registered one, still refuses what its reducer refuses); nothing is leased, counted,
    spilled or waited for, and what it pickles is not kept."""

    def array(self, obj):
        return None if obj.dtype.hasobject else (_placeholder, ())  # (None: its items)

    def reducer_override(self, obj):
        if (_reducers or _lazy_plugins) and not isinstance(obj, _ndarray):
            t = type(obj)
            if _plugin_reducer(t) is not None:
                check = plugin_check(t)
                if check is not None:
                    check(obj)
                return _placeholder, ()
        return super().reducer_override(obj)


def encode_part(part: Any, conn=None) -> None:
    """Pickle one part of a message that could not be sent, as it would be sent (on
    ``conn``) but with nothing done (``_Probe``), for ``_culprit``, which asks where the
    failure lies; raises as that part fails."""
    try:
        _Probe(_DISCARD, conn).dump(part)
    except (_results.Unfinished, _results.DependencyFailed):
        pass  # (a call's result as an argument: not a part that cannot be sent)


class _ArrayEncoder(_Encoding, pickle.Pickler):
    """A message of builtin scalars and plain numpy arrays only (``_scalars_and_arrays``
    is 1): the C pickler does it all but the arrays, with no cloudpickle work per
    message."""

    def __init__(self, file, conn) -> None:
        pickle.Pickler.__init__(self, file, 5)
        self._start(conn)

    def reducer_override(self, obj):
        if type(obj) is _ndarray:
            r = self.array(obj)
            if r is not None:
                return r
        return NotImplemented


def _reduce_array(enc: _Encoder, a: np.ndarray):
    t = type(a)
    if t is not _ndarray and t is not _memmap:
        ma = sys.modules.get("numpy.ma")  # loaded wherever a masked array exists
        if ma is not None and isinstance(a, ma.MaskedArray):
            if t.__new__ is not ma.MaskedArray.__new__ or a is ma.masked:
                # A subclass made its own way (``np.ma.mrecords``), or ``np.ma.masked``
                # (a singleton): numpy's pickling, by value.
                return None
            # Its data and mask travel as arrays of their own (by reference when shared);
            # viewing the data as a MaskedArray would drop the mask.
            return _rebuild_masked, (t, a.data, ma.getmask(a), a.fill_value, a.hardmask)
    dtype = a.dtype
    if dtype.hasobject:
        return None  # by value, in band (object arrays hold Python objects, not bytes)
    if a.size == 0:  # by value too, with its strides (numpy's pickling takes its own)
        return (rebuild_inline, (bytearray(), dtype_token(dtype), a.shape, a.strides)) \
            if t is _ndarray else None
    view = _shm.find_block(a)
    if view is None:
        n = _shm.copy_nbytes(a)  # (bytes copied, in band or into a block: counted so)
        if in_band(n, enc.inlined) and \
                (type(a) is _ndarray or type(a) is _memmap):
            enc.inlined += n
            enc.n_inlined += 1
            return inline_array(a)
        a = _shm.copy_to_shared(a)
        view = _shm.find_block(a)
        enc.count("bytes_copied", n)
        enc.count("arrays_copied", 1)
    elif not (_shm.first_sends and _shm.first_send(enc, a)):  # (a group's fresh copy)
        enc.count("bytes_zero_copy", a.nbytes)
        enc.count("arrays_zero_copy", 1)
    row = enc.lease(view, ARENA, arena_fd)
    data = a.__array_interface__["data"][0]
    sub = None if (t is _ndarray or t is _memmap) else t
    return _rebuild_array, (row, data - view.region.addr - view.offset, a.shape,
                            dtype_token(dtype), a.strides, sub)


def _rebuild_masked(cls, data, mask, fill_value, hard_mask):
    return cls(data, mask=mask, fill_value=fill_value, hard_mask=hard_mask, copy=False)


def lease_host_block(enc: Encoding, block) -> int:
    """Lease a host block in the message ``enc`` is encoding (by a reducer, or flat);
    returns its table row (for plug-ins sending objects that live in host shared memory,
    e.g. torch tensors)."""
    return enc.lease(block, ARENA, arena_fd)


class _DecodeCtx:
    __slots__ = ("conn", "fds", "taken", "blocks", "waits")

    def __init__(self, conn, fds, waits) -> None:
        self.conn = conn
        self.fds = fds
        self.taken: set[int] = set()
        self.blocks: list = []  # the message's block table, adopted
        self.waits = waits  # ``reply_waits_for``: fn -> items; None: not a call

    def take_fd(self, index: int) -> int:
        if not 0 <= index < len(self.fds) or index in self.taken:
            raise ProtocolError(f"frame refers to fd #{index}, which it did not carry")
        self.taken.add(index)
        fd = self.fds[index]
        if fd < 0:  # dropped by the kernel as it came (``FrameReader``): no such fd here
            raise SharedMemoryError(
                "actorshm: shared memory sent to this process could not be opened: the "
                f"kernel dropped its file descriptor{getattr(self.conn, 'fds_why', '')}")
        return fd


_tls = threading.local()


def current_decode_conn():
    ctx = getattr(_tls, "ctx", None)
    return ctx.conn if ctx is not None else None


def _ctx() -> _DecodeCtx:
    ctx = getattr(_tls, "ctx", None)
    if ctx is None:
        raise ProtocolError("actorshm arrays can only be unpickled by actorshm itself")
    return ctx


def leased_block(row: int):
    """The block in row ``row`` of the block table of the message being decoded.

    Args:
        row: what ``enc.lease`` returned on the sending side.

    Raises:
        ProtocolError: called outside ``decode`` (an actorshm object unpickled by hand).
    """
    return _ctx().blocks[row]


def reply_waits_for(fn, item) -> None:
    """Call ``fn(items)`` once, before the reply to the call being decoded leaves, with
    every ``item`` given for it: e.g. the GPUs whose queued work the caller must see
    once the call returns, such as the actor's writes into a GPU argument. Nothing when
    the message is not a call."""
    waits = _ctx().waits
    if waits is not None:
        add_wait(waits, fn, item)


def _rebuild_fd(index: int) -> int:
    return _ctx().take_fd(index)


def _rebuild_array(row, aoff, shape, dtype, strides, sub):
    view = _ctx().blocks[row]
    arr = np.ndarray(shape, dtype, buffer=np.asarray(view), offset=aoff, strides=strides)
    if sub is not None:
        arr = arr.view(sub)
    return arr


def _open_arena(ctx: _DecodeCtx, key: tuple, size: int, fd_index) -> _shm.Arena:
    """Map an arena a peer introduced in this frame (its fd rode along)."""
    if fd_index is None:
        raise ProtocolError("peer referred to an arena it never sent")
    fd = ctx.take_fd(fd_index)
    try:
        if os.fstat(fd).st_size < size:
            raise ProtocolError("arena fd is smaller than the peer claims")
        addr = _shm.map_fd(fd, size)
    except BaseException:
        os.close(fd)
        raise
    _leases.counters["arenas_mapped"] += 1
    return _shm.Arena(key, fd, size, addr, owned=False, dedicated=size >= _shm.LARGE)


register_region_kind(ARENA, _open_arena)


def _adopt_table(ctx: _DecodeCtx, table) -> None:
    """Adopt every block of a message before any user object is unpickled.

    Each block is adopted even when an earlier one fails (a region that cannot be
    opened here), so that every lease is accounted for; then the first failure is
    raised, and the blocks already adopted are dropped, which gives their leases back.
    """
    if type(table) is not list:
        raise ProtocolError("malformed block table")
    conn = ctx.conn
    failed = None
    blocks = ctx.blocks
    for row in table:
        try:
            kind, rkey, rsize, intro, boff, bsize = row
            hash(rkey)
            hash(kind)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed block table row: {exc}") from None
        opener = _OPENERS.get(kind)
        if opener is None:
            raise ProtocolError(f"block table names an unknown region kind {kind!r}")
        try:
            blocks.append(_leases.adopt(conn, opener, rkey, rsize, intro, boff, bsize, ctx))
        except ProtocolError:
            raise
        except Exception as exc:
            blocks.append(None)
            failed = failed or exc
    if failed is not None:
        blocks.clear()
        raise failed


_SIMPLE = SCALARS
_dumps = pickle.dumps
_loads = pickle.loads
_NO_FDS: tuple = ()


def _simple(obj: Any) -> bool:
    """Builtin scalars, and builtin containers of them (tuples, lists, dicts with scalar
    keys), nested a few levels and not too big: plain pickle does them right."""
    t = type(obj)
    if t in _SIMPLE:
        return True
    if t is tuple or t is list:
        for x in obj:
            tx = type(x)
            if tx not in _SIMPLE:
                return (tx is tuple or tx is list or tx is dict) and \
                    _nested(obj, _NESTED_DEPTH, [_NESTED_ITEMS])
        return True
    if t is dict:
        for k, v in obj.items():
            tv = type(v)
            if tv not in _SIMPLE or type(k) is not str:
                return (tv is tuple or tv is list or tv is dict or tv in _SIMPLE) and \
                    _nested(obj, _NESTED_DEPTH, [_NESTED_ITEMS])
        return True
    return False


# How far ``_simple`` looks into nested containers: deeper or bigger ones (and cycles)
# go the general way, whose per-message cost is small beside their own.
_NESTED_DEPTH = 8
_NESTED_ITEMS = 1000


def _nested(obj: Any, depth: int, budget: list) -> bool:
    """Whether container ``obj`` holds only builtin scalars and such containers, within
    ``depth`` levels and ``budget[0]`` items in all (what is left is written back)."""
    if depth <= 0:
        return False
    t = type(obj)
    if t is dict:
        items = obj.values()
        for k in obj:
            if type(k) not in _SIMPLE:
                return False
    elif t is tuple or t is list:
        items = obj
    else:
        return False
    budget[0] -= len(obj)
    if budget[0] < 0:
        return False
    for x in items:
        tx = type(x)
        if tx not in _SIMPLE and not ((tx is tuple or tx is list or tx is dict)
                                      and _nested(x, depth - 1, budget)):
            return False
    return True


def _scalars_and_arrays(obj: Any) -> int:
    """Whether ``obj`` may be a flat message (``_flat``), and which encoder makes it when
    it is not: builtin scalars and numpy arrays of plain dtypes, alone or in a flat
    tuple, list or dict (str keys), are 1 (the C pickler and ``_ArrayEncoder`` do them
    right); with plug-in objects among them (``register_flat``: torch tensors), 2
    (cloudpickle: their library's own pickling may need it); anything else 0."""
    t = type(obj)
    if t in _SIMPLE or (t is _ndarray and not obj.dtype.hasobject):
        return 1
    if t in _flat_holes:
        return 2
    if t is tuple or t is list:
        items = obj
    elif t is dict:
        for k in obj:
            if type(k) is not str:
                return 0
        items = obj.values()
    else:
        return 0
    kinds = 1
    for x in items:
        tx = type(x)
        if tx not in _SIMPLE and (tx is not _ndarray or x.dtype.hasobject):
            if tx not in _flat_holes:
                return 0
            kinds = 2
    return kinds


def _plain_meta(meta: Any) -> bool:
    """Whether a call's ``meta`` (``_protocol.Connection.call``: the chain of calls it was
    made from, a stream's run-ahead) is builtins only: str keys, each value a scalar or
    a tuple of tuples of scalars (the chain's links)."""
    if type(meta) is not dict:
        return False
    for k, v in meta.items():
        if type(k) is not str:
            return False
        if type(v) is tuple:
            for link in v:
                if type(link) is not tuple:
                    return False
                for x in link:
                    if type(x) not in _SIMPLE:
                        return False
        elif type(v) not in _SIMPLE:
            return False
    return True


def encode_plain_call(method: str, args: tuple, kwargs: dict) -> bytes | None:
    """The payload of a call whose arguments are all builtin scalars (frame flag
    ``PLAIN``: no cloudpickle, no block table, no decoding context), or None for any
    other call (``encode`` makes that one)."""
    if _simple(args) and _simple(kwargs):
        if args and _big_text(args):
            return None  # ``encode`` pickles it straight for its spill
        data = _dumps((method, args, kwargs), 5)
        if len(data) <= _encoding.MAX_MESSAGE:
            return data
    return None


_TLEN = LEN


def encode(obj: Any, conn) -> tuple[Any, list[int], "_Encoder | None", int]:
    """Pickle ``obj`` for ``conn``: (payload, fds, encoder, frame flags).

    The payload is bytes, or a list of buffers to send back to back.
    Nothing is committed until the connection's ledger commits the encoder
    (``_ledger.Ledger.commit``), just before the frame is queued.
    """
    # Fast path (most calls): builtin scalars need neither cloudpickle nor our reducers,
    # and the receiver needs no decoding context for them (``PLAIN``).
    n = len(obj) if type(obj) is tuple else 0
    call = (n == 3 or (n == 4 and _plain_meta(obj[3]))) and type(obj[0]) is str
    if _simple(obj[1]) and _simple(obj[2]) if call else _simple(obj):
        if (type(obj[1]) is tuple and _big_text(obj[1])) if call else \
                (type(obj) in _TEXT and len(obj) > SPILL_MIN):
            return _spill_plain(obj, conn)
        data = _dumps(obj, 5)
        check_size(len(data))
        if len(data) > SPILL_MIN:
            return spill(data, _NO_FDS, None, PLAIN, conn)
        return data, _NO_FDS, None, PLAIN
    # Arrays too: when all of them are shared, no pickler is needed either. (A call's
    # arguments go straight to ``_flat``, which checks every item and gives up at the
    # first that is not flat; then ``flat`` says which pickler makes it.)
    if call:
        if type(obj[1]) is tuple and type(obj[2]) is dict:
            out = encode_flat(obj, conn)
            if out is not None:
                return out if len(out[0][2]) <= SPILL_MIN else spill(*out, conn)
        flat = _scalars_and_arrays(obj[1])
        if flat:
            kwargs = _scalars_and_arrays(obj[2])
            flat = kwargs and max(flat, kwargs)
    else:
        flat = _scalars_and_arrays(obj)
        if flat:
            out = encode_flat(obj, conn)
            if out is not None:
                return out if len(out[0][2]) <= SPILL_MIN else spill(*out, conn)
    f = io.BytesIO()
    enc = (_ArrayEncoder if flat == 1 else _Encoder)(f, conn)
    enc.dump(obj)
    check_size(f.tell())  # before anything is committed: no lease is taken
    if enc.n_inlined:
        enc.count("bytes_copied", enc.inlined)
        enc.count("arrays_copied", enc.n_inlined)
    for fn, items in enc.waits.items():
        fn(items)
    enc.settle_counts(_leases.counters)
    if f.tell() > SPILL_MIN:
        return spill(f.getbuffer(), enc.fds, enc, HAS_BLOCKS if enc.table else 0, conn)
    if not enc.table:
        return f.getvalue(), enc.fds, enc, 0
    table = _dumps(enc.table, 5)
    # Parts, not one bytes object: the frame writer joins them with the header in one copy.
    return [_TLEN.pack(len(table)), table, f.getbuffer()], enc.fds, enc, HAS_BLOCKS


# A message whose pickle is bigger than the receive buffer would come through the socket
# in many reads (each a wake-up of the receiver, a copy into its buffer and a wait for
# room on the sender's side: 64 MiB of bytes took ~200 ms): it goes through this
# process's pool instead, as an ordinary array does (``spill``).
SPILL_MIN = RECV_SIZE


def spill(payload, fds, enc: "Encoding | None", flags: int, conn):
    """The frame of a message whose pickle is over ``SPILL_MIN`` bytes: the pickle is
    copied into a block of this process's pool and leased to the receiver like an
    array's (one more row of the block table; counted in ``messages_spilled`` and
    ``bytes_spilled``, not in ``bytes_copied``, which is about arrays), and the
    frame carries only the table and a small pickle that, unpickled, unpickles the
    block's bytes (``_unspill``) in the same decoding context. The receiver's copy is
    made by unpickling, which leaves nothing viewing the block, so its lease comes home
    with the reply. The block comes only from memory to spare (``Pool.alloc(spare=
    True)``: a recycled block, or a new region that leaves half the budget free, with
    no waiting and nothing of the pool's given back): else the socket takes the
    message as before, and arrays keep the budget.

    Args: what ``encode`` would return (payload, fds, its encoder or None, flags), and
    the connection it is for.
    """
    if type(payload) is _Parts:
        parts, n = payload.parts, payload.n
    else:
        body = payload[2] if type(payload) is list else payload  # (table, then the pickle)
        parts, n = (body,), len(body)
    try:
        # Only memory to spare: the socket can take it, arrays cannot.
        block = _shm.pool().alloc(n, spare=True)
    except (MemoryError, OSError):  # (short of budget; no fd or memfd to be had)
        block = None
    if block is None:  # a frame of its own, then
        if type(payload) is _Parts:
            return b"".join(parts), fds, enc, flags
        if type(payload) is memoryview:  # (``encode``'s pickler's buffer)
            if not flags & HAS_BLOCKS:
                return bytes(payload), fds, enc, flags
            table = _dumps(enc.table, 5)
            payload = [_TLEN.pack(len(table)), table, payload]
        return payload, fds, enc, flags
    a = np.asarray(block)[:n]
    pos = 0
    for part in parts:
        k = len(part)
        if k:
            a[pos:pos + k] = np.frombuffer(part, np.uint8)
            pos += k
    del block, parts
    view = _shm.find_block(a)
    if enc is None:
        enc = Encoding()
        enc._start(conn)
    row = enc.lease(view, ARENA, arena_fd)
    aoff = a.__array_interface__["data"][0] - view.region.addr - view.offset
    counters = _leases.counters
    counters["messages_spilled"] += 1
    counters["bytes_spilled"] += n
    table = _dumps(enc.table, 5)
    outer = _dumps(_Spilled(row, aoff, n, flags), 5)
    return [_TLEN.pack(len(table)), table, outer], enc.fds, enc, HAS_BLOCKS


class _Parts:
    """A pickle as the pickler wrote it (its ``file``): the big payloads it hands over
    whole by reference (a ``bytes`` itself; a ``str``'s UTF-8, a fresh bytes made in one
    piece), so that a big plain message is copied once, into its spill block, not first
    into a growing new pickle."""

    __slots__ = ("parts", "n")

    def __init__(self) -> None:
        self.parts: list = []
        self.n = 0

    def write(self, data) -> int:
        self.parts.append(data)
        self.n += len(data)
        return len(data)


def _spill_plain(obj: Any, conn):
    """``encode``'s plain path for a message with a big ``bytes`` or ``str`` at its top
    (``_big_text``): pickled into ``_Parts`` and spilled."""
    out = _Parts()
    pickle.Pickler(out, 5).dump(obj)
    check_size(out.n)
    return spill(out, _NO_FDS, None, PLAIN, conn)


_TEXT = frozenset({bytes, str})


def _big_text(items) -> bool:
    """Whether ``items`` holds a ``bytes`` or ``str`` over ``SPILL_MIN``: its message
    is pickled straight for a spill (``_spill_plain``)."""
    for x in items:
        if type(x) in _TEXT and len(x) > SPILL_MIN:
            return True
    return False


class _Spilled:
    """What a spilled message's frame carries in place of its pickle."""

    __slots__ = ("args",)

    def __init__(self, *args) -> None:
        self.args = args

    def __reduce__(self):
        return _unspill, self.args


def _unspill(row: int, aoff: int, n: int, flags: int):
    """The message ``spill`` put in row ``row`` of the block table, unpickled."""
    ctx = _ctx()
    body = memoryview(np.asarray(ctx.blocks[row]))[aoff:aoff + n]  # (a block's bytes)
    try:
        if flags & FLAT:
            return decode_flat(body, ctx.blocks)
        return _loads(body)
    finally:
        del body  # (a failure's traceback keeps this frame: it must not keep the block)


def decode(payload, fds, conn, flags: int = 0, waits: dict | None = None) -> Any:
    """Unpickle a message received on ``conn`` with the fds its frame carried; for a
    call, ``waits`` collects what must be waited for before its reply leaves
    (``reply_waits_for``)."""
    if flags == PLAIN and not fds:
        return _loads(payload)
    ctx = _DecodeCtx(conn, fds, waits)
    prev = getattr(_tls, "ctx", None)
    _tls.ctx = ctx
    try:
        if flags & HAS_BLOCKS:
            mv = memoryview(payload)
            (n,) = _TLEN.unpack_from(mv)
            try:
                table = _loads(mv[4:4 + n])
            except Exception as exc:
                raise ProtocolError(f"undecodable block table: {exc!r}") from None
            _adopt_table(ctx, table)
            payload = mv[4 + n:]
            if flags & FLAT:
                return decode_flat(payload, ctx.blocks)
        return _loads(payload)
    finally:
        _tls.ctx = prev
        # An exception's traceback keeps this frame, and so ``ctx``, alive until the next
        # garbage collection: drop the blocks now, so failed calls give leases back now.
        ctx.blocks.clear()
        if fds:
            for i, fd in enumerate(fds):
                if i not in ctx.taken:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
