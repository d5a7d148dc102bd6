"""What the driver does for actor processes: their calls to the runtime.

An actor that calls another actor asks the driver to connect them (``__connect__``):
the asker makes a socket pair and the driver hands its other end to the target, so the
two then talk directly. Actors also spawn, kill and find actors through the driver,
and ask for its counters (``actorshm.stats`` of the driver).
"""

from __future__ import annotations

import asyncio

from . import _client, _shm
from ._errors import ActorDiedError
from ._framing import close_fd
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
            _connect(runtime, conn, cid, *args)
        elif method == "__get_actor__":
            task = runtime.loop.create_task(runtime.get_actor(*args))
            task.add_done_callback(lambda t: _reply_task(conn, cid, t))
        elif method == "__kill__":
            owner = _client.runtime_of(runtime, args[0])
            task = runtime.loop.create_task(owner.kill(*args))
            task.add_done_callback(lambda t: _reply_task(conn, cid, t))
        elif method == "__spawn__":
            cls, options, a, k = args
            task = runtime.loop.create_task(runtime.spawn(cls, options, a, k))
            task.add_done_callback(lambda t: _reply_task(conn, cid, t))
            _follow_spawn(runtime, conn, cid, task)
        elif method == "__stats__":
            conn.reply(cid, _shm.stats())
        else:
            raise AttributeError(f"the driver has no service {method!r}")
    except BaseException as exc:
        conn.reply_error(cid, exc)


def _connect(runtime, conn, cid: int, target: int, fb: int) -> None:
    """Connect the actor on ``conn`` to actor ``target``: hand the target ``fb``, the
    end of a socket pair the asker made (it writes its calls into its own end at once).
    A target that is restarting gets it once its new process runs (the calls wait in
    the socket, as the driver's own calls wait in its fresh connection), and the asker
    is answered once that one took it: calls made after a death wait for the new
    process, from an actor as from the driver (they failed at once, one after another,
    until it ran). The target may be another runtime's (``_client.runtime_of``).
    The answer: the target's label, its pid, and whether it is its last process."""
    try:
        caller = runtime.record(conn.peer_id)
        runtime = _client.runtime_of(runtime, target)
        rec = runtime.record(target)
        if rec is None or rec.conn is None or rec.conn.closed:
            raise ActorDiedError(runtime.death_of(target))
    except BaseException:
        close_fd(fb)  # (the asker's calls end with this error, not at the socket's end)
        raise
    peer = (conn.peer_id, caller.pid if caller else None)
    accepted = rec.conn.call("__accept_peer__", (PassFd(fb), *peer), {})
    if rec.alive and rec.conn.sock is not None:
        # It runs: no need to wait for its answer, unless it is dying, its death not yet
        # seen here (the asker saw its own link break first): then its new process takes
        # the asker's end, with the calls written into it meanwhile (it never read them:
        # it answers before it reads). (A connection not attached holds calls for a
        # restart: one that a process ending on its own will have, below.)
        accepted.add_done_callback(
            lambda f: _hand_over(runtime, rec, target, fb, peer, conn, f))
        # (a target that said it is stopping, and that no restart follows: its LEAVING
        # on this link is no reason for a new one)
        last = rec.conn.leaving is not None and not runtime.may_restart(rec)
        conn.reply(cid, (rec.label, rec.pid, last))
        return
    rec.conn.close_after_call(accepted, [fb])

    def answered(f: asyncio.Future) -> None:
        if f.cancelled() or f.exception() is not None:
            conn.reply_error(cid, ActorDiedError(runtime.death_of(target)) if
                             f.cancelled() else f.exception())
        else:
            conn.reply(cid, (rec.label, rec.pid, False))
    accepted.add_done_callback(answered)


def _hand_over(runtime, rec, target: int, fb: int, peer: tuple, asker,
               f: asyncio.Future) -> None:
    """The running target answered the asker's socket end ``fb``: done with it here.
    If it died first, the process that replaces it gets it (``_after_death`` made the
    record's fresh connection before this runs), and the asker (on connection
    ``asker``) is told that process's pid once it took it; else ``fb`` is closed, and
    the asker's calls fail as the target is gone."""
    if not f.cancelled() and f.exception() is None:
        close_fd(fb)
        return
    if runtime.record(target) is rec and not rec.alive and rec.conn is not None \
            and not rec.conn.closed:
        taken = rec.conn.call("__accept_peer__", (PassFd(fb), *peer), {})
        rec.conn.close_after_call(taken, [fb])

        def tell(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is None and not asker.closed:
                asker.call("__peer_moved__", (target, rec.pid), {}).add_done_callback(
                    _ignore)
        taken.add_done_callback(tell)
    else:
        close_fd(fb)


# The latest spawns made for actors, by (connection, call id): the task while it runs,
# then the id of the actor it started (None if it failed), so that a cancel that comes
# after the reply still finds it (``cancel_spawn``). Bounded: such a cancel comes at once.
SPAWNS_KEPT = 1000


def _follow_spawn(runtime, conn, cid: int, task: asyncio.Task) -> None:
    spawns = runtime.spawns_for_actors
    key = (conn, cid)
    spawns[key] = task

    def done(t: asyncio.Task) -> None:
        if spawns.get(key) is t:  # (the id alone: a handle would keep the record)
            spawns[key] = _made(t)
    task.add_done_callback(done)
    while len(spawns) > SPAWNS_KEPT:
        spawns.popitem(last=False)


def _made(task: asyncio.Task) -> int | None:
    """The id of the actor a finished spawn task started, or None (it failed)."""
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result().actor_id


def cancel_spawn(runtime, conn, cid: int) -> None:
    """The actor on ``conn`` cancelled its call ``cid`` (a time-out, a cancel): if that
    was a spawn, nothing it started may be left running, as for a spawn cancelled in the
    driver. A start under way is cancelled (``Runtime.spawn`` stops what it started);
    one that ended has had its reply sent (or is about to), which the actor drops, a
    call it cancelled: nobody would hold a handle on that actor, so it is killed."""
    found = runtime.spawns_for_actors.pop((conn, cid), None)
    if isinstance(found, asyncio.Task):
        # Under way, it is cancelled; what it still made (ended already, its callbacks
        # not yet run; or, before Python 3.12, a ``wait_for`` in it that returned a
        # result coming in the same step as the cancel) is killed once it ends.
        found.cancel()
        found.add_done_callback(lambda t: _kill(runtime, _made(t)))
    else:
        _kill(runtime, found)


def _kill(runtime, actor_id: int | None) -> None:
    if actor_id is not None:
        runtime.loop.create_task(runtime.kill(actor_id)).add_done_callback(_ignore)


def forget_spawns(runtime, conn) -> None:
    """``conn`` closed: no cancel comes on it any more (``cancel_spawn``), and no reply
    reaches its actor. A spawn still under way for it (or ended, its reply not yet sent)
    is stopped as a cancelled one is: the actor that asked is gone (killed, crashed,
    restarted), so nobody would ever hold a handle on what it started."""
    spawns = runtime.spawns_for_actors
    for key in [k for k in spawns if k[0] is conn]:
        if isinstance(spawns[key], asyncio.Task):
            cancel_spawn(runtime, conn, key[1])
        else:
            del spawns[key]


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
