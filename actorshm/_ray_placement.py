"""Whether Ray can place an actor at all, and saying so instead of waiting in silence.

Ray holds an actor whose resource request no node can meet (``num_gpus=1`` on a cluster
without GPUs, ``num_cpus=64`` on a 16-core box) pending until a node that can appears,
and one whose request the nodes could meet but is taken now until enough is freed;
and it keeps trying to start a worker process for an actor whose process fails as it
starts (an ``env=`` that breaks Python: ``PYTHONHOME``), saying so only in the raylet's
log. A ``spawn`` that awaits such an actor waits forever with nothing said in the
program. So, before asking Ray for the actor, a request larger than every node of a
cluster that cannot grow (the local Ray a runtime started itself) is a ``ValueError``
that names what is missing and the fix; and a spawn still waiting after a while logs a
warning once: while its request is more than is free, with what is free; while Ray has
no process running it, with what may keep one from starting.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["requested", "check_feasible", "await_ready"]

logger = logging.getLogger("actorshm")

WARN_AFTER = 10.0  # seconds a spawn waits before it says what it is waiting for


def requested(num_cpus: float, num_gpus: float) -> dict[str, float] | None:
    """What Ray needs free on one node to place the actor (as Ray counts it); ``None``
    for Ray's default of one CPU, which any node places and nothing checks."""
    if num_cpus == 1 and not num_gpus:
        return None
    req = {"CPU": float(num_cpus)}
    if num_gpus:
        req["GPU"] = float(num_gpus)
    return req


def _fmt(res: dict) -> str:
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in ("CPU", "GPU"))


def check_feasible(ray: Any, what: str, req: dict[str, float] | None,
                   fixed: bool) -> None:
    """Raise ``ValueError`` when no alive node of the cluster has ``req`` in total and the
    cluster cannot grow (``fixed``); on a cluster that may (an autoscaler), warn."""
    if req is None:
        return
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not nodes or any(all(n.get(k, 0) >= v for k, v in req.items()) for n in nodes):
        return
    largest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)))
    asked = " and ".join(f"num_{k.lower()}s={v:g}" for k, v in req.items()
                         if k == "GPU" or v != 1)
    msg = (f"cannot spawn {what} with {asked} on Ray: no node of this Ray cluster has that "
           f"much (the largest has {_fmt(largest)}), so Ray would keep the actor waiting "
           "for one")
    if fixed:
        raise ValueError(
            f"{msg} forever. Spawn it with less (num_gpus=0, or num_cpus up to the "
            "node's count), or use a cluster that has such a node: "
            "Runtime(backend='ray', address=...)")
    logger.warning("actorshm: %s, unless the cluster adds such a node (an autoscaler).", msg)


async def await_ready(ready: Any, ray: Any, what: str, req: dict[str, float] | None,
                      actor_hex: str = "") -> Any:
    """Await the actor's ``ready`` reference; if it takes over ``WARN_AFTER`` seconds
    while its request is more than the cluster has free, or while Ray has no process
    running actor ``actor_hex``, log once what it waits for."""
    fut = asyncio.ensure_future(_wait(ready))
    try:
        return await asyncio.wait_for(asyncio.shield(fut), WARN_AFTER)
    except asyncio.TimeoutError:
        pass
    except BaseException:  # the spawn was cancelled: so is the wait (its error, once the
        fut.cancel()  # actor is killed, was "never retrieved")
        raise
    try:
        free = ray.available_resources() if req is not None else None
    except Exception:  # a warning is not worth failing the spawn for
        free = None
    if free is not None and any(free.get(k, 0) < v for k, v in req.items()):
        logger.warning(
            "actorshm: %s has waited %g s for Ray to start it: it needs %s free on one "
            "node, and the cluster has %s free now. Ray starts it once enough is freed: "
            "kill an actor that holds them, or spawn with less.",
            what, WARN_AFTER, _fmt(req), _fmt(free))
    elif _no_process(actor_hex):
        logger.warning(
            "actorshm: %s has waited %g s for Ray to start it, and no process runs it yet: "
            "Ray may be failing to start one (an env= or runtime_env that breaks Python, "
            "such as PYTHONHOME or PYTHONPATH; Ray's output on stderr, or the raylet's "
            "log, says why). Ray keeps trying: to give up, time the spawn out "
            "(asyncio.wait_for).", what, WARN_AFTER)
    return await fut


def _no_process(actor_hex: str) -> bool:
    """Whether Ray's actor table shows actor ``actor_hex`` waiting to be created with no
    worker process given to it (Ray's own record; False where it cannot be read)."""
    if not actor_hex:
        return False
    try:
        from ray._private.state import state  # (no public API reads it without the
        info = state.actor_table(actor_hex)  # dashboard, which a runtime does not start)
        return info.get("State") == "PENDING_CREATION" and not info.get("Pid")
    except Exception:
        return False


async def _wait(ready: Any) -> Any:
    return await ready
