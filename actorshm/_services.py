"""What the driver does for actor processes: their calls to the runtime.

An actor that calls another actor asks the driver to connect them (``__connect__``):
the driver makes a socket pair and hands one end to each, so the two then talk
directly. Actors also spawn, kill and find actors through the driver, and ask for its
counters (``actorshm.stats`` of the driver).
"""

from __future__ import annotations

import asyncio
import socket

from . import _shm
from ._errors import ActorDiedError
from ._serialization import PassFd


def serve(runtime, conn, cid: int, call: list) -> None:
    """Answer service call ``cid`` that an actor made on ``conn``.

    Args:
        runtime: the driver's ``Runtime``.
        conn: the actor's connection to the driver.
        cid: the call's id (the answer goes back with ``conn.reply``).
        call: ``[method, args, kwargs]`` (cleared here: the arguments go when done).
    """
    method, args, _ = call
    call.clear()
    try:
        if method == "__connect__":
            (target,) = args
            rec = runtime.record(target)
            if rec is None or not rec.alive or rec.conn is None or rec.conn.closed:
                raise ActorDiedError(runtime.death_of(target))
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fa, fb = a.detach(), b.detach()
            rec.conn.call("__accept_peer__", (PassFd(fb), conn.peer_id), {}) \
                .add_done_callback(_ignore)
            rec.conn.close_after_send([fb])
            conn.reply(cid, (PassFd(fa), rec.label))
            conn.close_after_send([fa])
        elif method == "__get_actor__":
            task = runtime.loop.create_task(runtime.get_actor(*args))
            task.add_done_callback(lambda t: _reply_task(conn, cid, t))
        elif method == "__kill__":
            task = runtime.loop.create_task(runtime.kill(*args))
            task.add_done_callback(lambda t: _reply_task(conn, cid, t))
        elif method == "__spawn__":
            cls, options, a, k = args
            task = runtime.loop.create_task(runtime.spawn(cls, options, a, k))
            task.add_done_callback(lambda t: _reply_task(conn, cid, t))
        elif method == "__stats__":
            conn.reply(cid, _shm.stats())
        else:
            raise AttributeError(f"the driver has no service {method!r}")
    except BaseException as exc:
        conn.reply_error(cid, exc)


def _ignore(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _reply_task(conn, cid: int, task: asyncio.Task) -> None:
    if task.cancelled():
        conn.reply_error(cid, asyncio.CancelledError())
    elif task.exception() is not None:
        conn.reply_error(cid, task.exception())
    else:
        conn.reply(cid, task.result())
