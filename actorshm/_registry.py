"""Plug-in registries: how a plug-in's objects travel and how its regions open.

The base layers know numpy and host memory only; ``_serialization`` asks these
registries for everything else (re-exported there, where plug-ins find them).
"""

from __future__ import annotations

import sys
from typing import Any

# -- plug-in registries ---------------------------------------------------------------
# The base layers know numpy and host memory only. A plug-in (CuPy: ``_cuda``; torch)
# registers, when it is imported, how its objects travel (a reducer per type) and how
# the receiver opens its kind of region (an opener per region kind). A plug-in that
# should load as soon as its library is in use registers a loader by module name
# (``register_lazy_plugin``), from a layer above this one.


# Exact type -> reducer; a subclass of a registered type is found through its MRO and
# remembered.
_reducers: dict[type, Any] = {}
_not_reduced: set[type] = set()  # types seen with no registered base
# Module name -> loader, called once when that module is first seen imported.
_lazy_plugins: dict[str, Any] = {}
_OPENERS: dict[int, Any] = {}
# Flat messages (``_flat``): exact type -> ``hole(enc, obj)``, for plug-in objects that may
# travel in a flat message; and the makers that their holes name.
_flat_holes: dict[type, Any] = {}
_flat_makers: set = set()
# Type -> ``check(obj)``: whether a plug-in's object lies in shared memory (``is_shared``).
_shared_checks: dict[type, Any] = {}
# Type -> ``check(obj)``: raises as its reducer refuses ``obj``, doing nothing else
# (``register_reducer``'s ``check``; the search for where a part that cannot be sent lies).
_sendable_checks: dict[type, Any] = {}


def register_reducer(cls: type, reducer, check=None) -> None:
    """Send instances of ``cls`` (and its subclasses) with ``reducer``.

    ``reducer(enc, obj)`` returns a pickle reduce value ``(callable, args)``, or
    ``NotImplemented`` to let cloudpickle pickle ``obj`` by value. To send memory out of
    band, it calls ``enc.lease(block, kind, intro)``, which returns the block's row in the
    message's block table, and returns a rebuild function (importable by name) whose
    arguments include that row; on the receiving side the rebuild function gets the block
    with ``leased_block(row)``. Work the receiver must see before it reads the memory
    (a GPU stream) is waited for with ``enc.before_send(fn, item)``. What it sends is
    counted with ``enc.count(key, n)`` (``"bytes_zero_copy"``, ``"bytes_copied"``, ...),
    which ``stats()`` shows once the whole message is made.

    Args:
        cls: the type, exactly as the plug-in's library defines it.
        reducer: called as ``reducer(enc, obj)`` for every such object in a message.
        check: optional, ``check(obj)`` raises as ``reducer`` refuses ``obj`` (an
            ``Unsendable`` that says what to send instead) and does nothing else: where
            a message could not be sent, it says which such object was refused, without
            copying any (``_culprit``).

    Raises:
        TypeError: ``cls`` is not a type, or ``reducer`` is not callable.
    """
    if not isinstance(cls, type) or not callable(reducer):
        raise TypeError("register_reducer(cls, reducer) needs a type and a callable")
    _reducers[cls] = reducer
    if check is not None:
        _sendable_checks[cls] = check
    _not_reduced.clear()


def plugin_check(t: type):
    """The ``check`` registered with the reducer of ``t`` or a base class of it, or None."""
    for base in t.__mro__:
        check = _sendable_checks.get(base)
        if check is not None:
            return check
    return None


def register_flat(cls: type, hole, maker) -> None:
    """Let instances of exactly ``cls`` travel in flat messages (``_flat``) when they lie
    in shared memory, with no pickler. In every other message they go through
    cloudpickle, with the reducer registered for ``cls`` (``register_reducer``), if any.

    Args:
        cls: the exact type (a subclass is not flat unless registered too).
        hole: called as ``hole(enc, obj)``; returns None when ``obj`` cannot go flat
            (the whole message then goes through cloudpickle), else a tuple
            ``(maker, *args)`` of builtin scalars and tuples of them after ``maker``,
            having leased ``obj``'s block with ``enc.lease`` (which gives the row in
            ``args``) and counted it (``enc.count("bytes_zero_copy", nbytes)``,
            ``enc.count("arrays_zero_copy", 1)``); what it asks with ``enc.before_send``
            runs before the message leaves.
        maker: a module-level function (it travels by name), called on the receiving
            side as ``maker(blocks, *args)`` with the message's adopted blocks. What it
            raises fails that message only (the call), as an unpickling error would; a
            hole that names no registered maker is a malformed frame.
    """
    if not isinstance(cls, type) or not callable(hole) or not callable(maker):
        raise TypeError("register_flat(cls, hole, maker) needs a type and two callables")
    _flat_holes[cls] = hole
    _flat_makers.add(maker)


def register_region_kind(kind: int, opener) -> None:
    """Open regions of ``kind`` with ``opener`` when a peer introduces one.

    Args:
        kind: the region kind, as written in block tables (``ARENA``, ``GPU_SLAB``, ...).
        opener: called as ``opener(ctx, region key, size, intro)`` with what the peer sent
            to open it (``intro``: an fd index, an IPC handle); returns an
            ``actorshm._leases.Region``. It raises ``ProtocolError`` for a malformed
            introduction (the connection closes), anything else when the region cannot
            be opened here (that block's call fails).
    """
    _OPENERS[kind] = opener


def register_shared_check(cls: type, check) -> None:
    """Let ``actorshm.is_shared`` answer for instances of ``cls`` (and its subclasses):
    ``check(obj)`` says whether ``obj`` lies in shared memory (travels by reference)."""
    if not isinstance(cls, type) or not callable(check):
        raise TypeError("register_shared_check(cls, check) needs a type and a callable")
    _shared_checks[cls] = check


def plugin_is_shared(obj: Any) -> bool:
    """What the plug-in registered for ``obj``'s type (or a base of it) says of it
    (``register_shared_check``); False for an object no plug-in knows."""
    if _lazy_plugins:
        _load_plugins()
    for base in type(obj).__mro__:
        check = _shared_checks.get(base)
        if check is not None:
            return bool(check(obj))
    return False


def register_lazy_plugin(module: str, loader) -> None:
    """Call ``loader()`` once, the first time a message is encoded while ``module`` is
    imported (the loader imports the plug-in, which registers its reducers).

    Args:
        module: a top-level module name, e.g. ``"cupy"``.
        loader: a callable with no arguments.
    """
    _lazy_plugins[module] = loader


def _load_plugins() -> None:
    mods = sys.modules
    for name in [n for n in _lazy_plugins if n in mods]:
        _lazy_plugins[name]()
        del _lazy_plugins[name]  # (a loader that failed is tried again next time)


def _plugin_reducer(t: type):
    """The reducer registered for ``t`` or a base class of it, or None."""
    if _lazy_plugins:
        _load_plugins()
    r = _reducers.get(t)
    if r is not None or t in _not_reduced:
        return r
    for base in t.__mro__[1:]:
        r = _reducers.get(base)
        if r is not None:
            _reducers[t] = r
            return r
    if len(_not_reduced) < 4096:
        _not_reduced.add(t)
    return None
