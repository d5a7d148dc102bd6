"""``Runtime(backend="ray")``: the runtime of the Ray backend.

It starts (or connects to) Ray, is the innermost runtime while open, spawns through
``_ray.CLIENT`` and kills what it spawned on close.
"""

from __future__ import annotations

import asyncio
import collections
import os
import warnings
from typing import Any

from . import _client, _events, _ray_events, _serialization, _shm
from ._actor import ActorHandle, ActorOptions
from ._errors import ActorDiedError
from ._ray import CLIENT, RayActorId, import_ray, ray_env
from ._ray_introspect import RayInspectable
from ._launch import check_start_options
from ._util import fill_closed_stdio

__all__ = ["RayRuntime"]


_connected_by: list = [None]  # the runtime whose ray.init made this process's connection


def _user_paths() -> list[str]:
    """The driver's import path minus the interpreter's own (as local actors get it)."""
    import sys
    skip = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    return [os.path.abspath(p or os.getcwd()) for p in sys.path
            if os.path.isdir(p or ".") and not os.path.abspath(p or ".").startswith(skip)]


_LOCAL_ONLY = {"shutdown_grace", "start_timeout", "gpus"}


def _warn_address_unused(stacklevel: int) -> None:
    warnings.warn(
        f"RAY_ADDRESS is set ({os.environ.get('RAY_ADDRESS')}), but Runtime(backend='ray') "
        "without an address starts a Ray of its own, as it does wherever it runs; to join "
        "that cluster (a `ray job submit` entrypoint, say), pass "
        "address=os.environ['RAY_ADDRESS'] or address='auto' (to actorshm.run too)",
        RuntimeWarning, stacklevel=stacklevel)


class RayRuntime(_events.EventSource, RayInspectable):
    """``Runtime(backend="ray")``: actors run as Ray actors, locally or on a cluster.

    With no ``address``, starts a local Ray (on 127.0.0.1, no dashboard) and shuts it
    down on close; with one, connects to that cluster and only disconnects on close. If
    this process is already connected to Ray, that connection is used and kept.

    Args:
        address: a Ray cluster's address (``"auto"``, ``"ray://host:10001"``, ...), or
            None for a local Ray.
        **ray_init_options: passed to ``ray.init`` (for example ``num_cpus``,
            ``object_store_memory``, ``runtime_env``).

        start_method, shm_budget: the local backend's options, checked as there and
            then left to Ray, so that code written for either backend runs on both: Ray
            starts its own worker processes, and its object store (``ray.init``'s
            ``object_store_memory``) is its shared memory.

    Raises:
        TypeError: another option of the local backend only (``shutdown_grace``,
            ``start_timeout``, ``gpus``), which has no meaning on Ray; an ``address``
            that is not a str.
        ValueError: a ``start_method`` or ``shm_budget`` the local backend refuses.
    """

    backend = "ray"
    shares_memory = False

    def __init__(self, address: str | None = None, *, start_method: str = "spawn",
                 shm_budget: int | None = None, **ray_init_options: Any) -> None:
        check_start_options(start_method, shm_budget)  # (as the local backend does)
        if address is not None and not isinstance(address, str):
            raise TypeError(f"Runtime(backend='ray', address=...) takes a Ray cluster's "
                            f"address as a str ('auto', 'ray://host:10001'), or None for "
                            f"a local Ray; not {type(address).__name__}")
        local_only = sorted(set(ray_init_options) & _LOCAL_ONLY)
        if local_only:
            raise TypeError(f"{local_only}: options of the local backend; with "
                            "backend='ray', other keywords go to ray.init()")
        self.address = address
        self.ray_init_options = ray_init_options
        self._owns_ray = False
        # Set by ``actorshm.run`` on the runtime it opens around ``main``: a runtime that
        # ``main`` opens itself with options of its own takes Ray over from it while it
        # has no actors (``_take_over``); it then connects again on its next spawn.
        self.opened_by_run = False
        self._address_unused = False  # RAY_ADDRESS is set, and is to be warned of
        self.connect_on_first_use = False
        self._open = False
        self._closing = False
        self.loop_guard = None  # (made by start(): ``_client.close_with_loop``)
        self.closed_with_loop = False  # (closed by it)
        self._spawned: list[ActorHandle] = []
        self._watchers: list[asyncio.Task] = []  # one per spawned actor (events)
        # Spawned actors that died for good, by key: their summary rows for ``actors()``
        # (the latest ``DEAD_KEPT``); their handles leave ``_spawned``.
        self._gone: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._given_up: dict[str, str] = {}  # key -> why: listed dead, may yet come back
        self.loop: asyncio.AbstractEventLoop | None = None

    closing = property(lambda self: self._closing, doc="Whether it is closing or closed.")

    async def start(self) -> "RayRuntime":
        """Connect to (or start) Ray and open the runtime; see ``Runtime.start``.

        Raises:
            RuntimeError: it is already open, or was closed.
            ImportError: Ray is not installed.
        """
        if self._open:
            raise RuntimeError("this Runtime is already open")
        if self._closing:
            raise RuntimeError("this Runtime was closed; open a new one")
        ray_env(self.address)  # (read when Ray is imported, and when it connects)
        fill_closed_stdio()  # (Ray's own files took fds 1 and 2: prints failed, EINVAL)
        import_ray()
        _serialization.send_mp_main_by_value()
        self._take_over()
        self._connect()
        self.loop = asyncio.get_running_loop()
        self._open = True
        _shm.set_budget(None, id(self))  # (no budget of its own: idle memory kept for reuse)
        _client.runtime_opened(self)
        await _client.close_with_loop(self)
        return self

    def _given(self) -> list:
        return sorted(self.ray_init_options) + (["address"] if self.address else [])

    def _take_over(self) -> None:
        """Opened inside ``actorshm.run`` with options of its own: if the runtime that
        ``run`` opened started Ray and has spawned nothing yet, that Ray goes, and this
        one starts Ray (or joins its cluster) with these options. (One process holds one
        connection to Ray.)"""
        owner = _connected_by[0]
        ray = import_ray()
        if owner is None or owner is self or not owner.opened_by_run or owner._spawned \
                or not self._given() or not ray.is_initialized() or CLIENT.busy():
            return
        ray.shutdown()
        owner._owns_ray = False
        owner.connect_on_first_use = True
        CLIENT.fixed_cluster = False
        _connected_by[0] = None

    def _connect(self) -> None:
        """Start Ray, or join the cluster at ``address``, unless this process is
        connected already: then the options given here cannot apply, and say so."""
        self.connect_on_first_use = False
        ray = import_ray()
        if ray.is_initialized():
            given = self._given()
            if given and not self._owns_ray:
                warnings.warn(
                    f"Runtime(backend='ray', {', '.join(f'{k}=...' for k in given)}): this "
                    "process is connected to Ray already, so these options do not apply; "
                    "open this runtime first (outside any other), or pass them to the "
                    "runtime that starts Ray", RuntimeWarning, stacklevel=4)
            return
        opts = dict(self.ray_init_options)
        address = self.address
        if address is None:
            if os.environ.get("RAY_ADDRESS"):
                if self.opened_by_run:  # (``main`` may yet open one with that address,
                    self._address_unused = True  # which takes over: said at first use)
                else:
                    _warn_address_unused(5)
            opts.setdefault("include_dashboard", False)
            opts.setdefault("object_store_memory", 1 << 30)
        opts.setdefault("log_to_driver", True)
        if "job_config" not in opts:  # actors import user modules as the driver does
            from ray.job_config import JobConfig
            opts["job_config"] = JobConfig(code_search_path=_user_paths())
        # No address: a Ray of its own ("local"), even where a `ray start` cluster
        # runs or RAY_ADDRESS is set (``None`` would join that one).
        try:
            ray.init(address=address or "local", **opts)
        except AssertionError as exc:  # how Ray refuses a bad value (num_cpus="x")
            if not self.ray_init_options:  # (none of the user's: not theirs to fix)
                raise
            raise ValueError(f"ray.init refused a value among the options of Runtime("
                             f"backend='ray', {', '.join(self.ray_init_options)}): "
                             f"{exc or 'an assertion failed'}") from exc
        except RuntimeError as exc:
            if "Unknown keyword argument" not in str(exc):
                raise
            raise TypeError(f"Runtime(backend='ray'): {exc}; besides address, start_method "
                            "and shm_budget, its keywords go to ray.init (see its "
                            "documentation for what it takes)") from None
        self._owns_ray = True
        _connected_by[0] = self
        CLIENT.fixed_cluster = address is None  # a local Ray: no autoscaler

    __reduce__ = _client.refuse_runtime
    __enter__ = __exit__ = _client.refuse_sync_with

    async def __aenter__(self) -> "RayRuntime":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill every actor this runtime spawned; shut down (or disconnect from) Ray.
        While another task or thread closes it, return once that close has ended."""
        if not self._open:
            return
        if self._closing:
            if await _client.close_under_way(self, 30):
                return
        elif await _client.closed_on_own_loop(self, 30):  # (from another thread's loop)
            return
        self._closing = True
        try:
            _events.close(self)
            for t in self._watchers:
                if t.get_loop().is_closed():  # (its loop ended with the runtime open, by
                    # ``loop.close()`` alone: nothing can run it now, and cancelling it
                    # would schedule on that loop, which raises)
                    t._log_destroy_pending = False
                else:
                    t.cancel()
            self._watchers.clear()
            ray = import_ray()
            why = "was stopped because its runtime closed" + (
                f" {_client.WITH_LOOP}" if self.closed_with_loop else "")
            for h in self._spawned:
                CLIENT.killed(h._actor_id.key, why)
                try:
                    ray.kill(h._actor_id.handle, no_restart=True)
                except Exception:
                    pass
            # Calls still pending end now, saying why (a Ray it started ends them all)
            CLIENT.close_calls(None if self._owns_ray else
                               {h._actor_id.key for h in self._spawned},
                               "the actor's runtime closed")
            self._spawned.clear()
            if self._owns_ray:
                # Streams read and spawns waiting on Ray end now, while Ray still runs:
                # an await on Ray that resumes after its shutdown ends the process.
                CLIENT.abort_waits(ActorDiedError("the actor's runtime closed"))
                for _ in range(3):  # let them unwind (a half-spawned actor is killed)
                    await asyncio.sleep(0)
                CLIENT.forget_all_where()  # (Ray's references: they go with it)
                ray.shutdown()
                CLIENT.fixed_cluster = False
                self._owns_ray = False
                if _connected_by[0] is self:
                    _connected_by[0] = None
        finally:
            self._open = False
            if not _client.runtime_closed(self):
                _shm.release_budget(id(self), trim=True)  # idle shared memory, as locally
            _client.end_loop_guard(self)

    def _check_open(self) -> None:
        if self.closed_with_loop:
            raise RuntimeError(f"this actorshm Runtime closed {_client.WITH_LOOP}")
        if not self._open:
            raise RuntimeError("this Runtime is closed")

    async def spawn(self, cls: type, options: ActorOptions, args: tuple,
                    kwargs: dict) -> ActorHandle:
        self._check_open()
        if self.connect_on_first_use:
            self._connect()
        self._say_address_unused()
        h = await CLIENT.spawn(cls, options, args, kwargs)
        if not self._open or self._closing:  # closed meanwhile (on a Ray it did not start)
            await h.kill()
            raise ActorDiedError(f"{h._cls_name}.spawn: the actor's runtime closed while "
                                 "it started")
        self.adopt(h, options)
        return h

    def adopt(self, h: ActorHandle, options: ActorOptions) -> None:
        """Own ``h``'s actor (spawned here, or inside one of this runtime's actors):
        watch it for lifecycle events, list it, kill it on close."""
        self._spawned.append(h)
        self._watchers = [t for t in self._watchers if not t.done()]
        self._watchers.append(_ray_events.watch(self, h, options, CLIENT))

    def forget(self, actor_id: RayActorId, death: str) -> None:
        """Actor ``actor_id`` died for good (``death``: why): its handle leaves the list,
        a summary row stays for ``actors()``, and the client forgets its call numbers.
        (Kept, they grew by Ray's actor handle, ~64 KB, per actor spawned and killed.)"""
        key = actor_id.key
        self._given_up.pop(key, None)
        for h in [h for h in self._spawned if h._actor_id.key == key]:
            self._spawned.remove(h)
            self._gone[key] = {"id": h._actor_id.detached(), "class": h._cls_name,
                               "pid": h.pid, "alive": False, "name": h._actor_name,
                               "death": death}
        while len(self._gone) > _client.DEAD_KEPT:
            self._gone.popitem(last=False)
        if key not in CLIENT._dead:
            # Its calls fail at once from now on, and it reads as unreachable: forgetting
            # its call numbers forgot the death a call had seen, and an ActorPool whose
            # member's call failed just then kept the dead member (reachable: True).
            CLIENT.killed(key, f"died: {death}")
        CLIENT.forget(key)

    def given_up(self, actor_id: RayActorId, death: str) -> None:
        """Actor ``actor_id``'s restart did not come in time: listed as dead, but kept
        (it may yet come back, and is killed when the runtime closes)."""
        self._given_up[actor_id.key] = death

    def call(self, actor_id: RayActorId, method: str, args: tuple, kwargs: dict,
             what: str = ""):
        return CLIENT.call(actor_id, method, args, kwargs, what)

    def actor_pid(self, actor_id: RayActorId, pid: int) -> int:
        return CLIENT.actor_pid(actor_id, pid)

    async def kill(self, actor_id: RayActorId) -> None:
        await CLIENT.kill(actor_id)

    async def get_actor(self, name: str) -> ActorHandle:
        self._check_open()
        if self.connect_on_first_use:
            self._connect()
        self._say_address_unused()  # (a named actor of that cluster is not found here)
        return await CLIENT.get_actor(name)

    def _say_address_unused(self) -> None:
        """``actorshm.run``'s runtime is first used on a Ray of its own while RAY_ADDRESS
        names a cluster: say so (``_connect`` could not: ``main`` might have opened a
        runtime with that address, taking over)."""
        if self._address_unused:
            self._address_unused = False
            if self._owns_ray:
                _warn_address_unused(5)

    def actors(self) -> list[dict]:
        """A snapshot of the actors this runtime spawned: the live ones, and the latest
        dead ones (a thousand). Each row's ``"id"`` is its handle's ``actor_id``, which
        keys ``rt.stats()["actors"]`` too, as locally."""
        rows = [dict(g) for g in self._gone.values()]
        for h in self._spawned:
            key = h._actor_id.key
            death = "kill()" if key in CLIENT._dead else self._given_up.get(key)
            rows.append({"id": h._actor_id, "class": h._cls_name, "pid": h.pid,
                         "alive": death is None, "name": h._actor_name, "death": death})
        return rows
