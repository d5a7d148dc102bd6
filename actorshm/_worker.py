"""The actor process: its event loop, its one actor instance, and its connections.

The process starts in ``_actor_process`` (spawned or forked), which runs a ``Worker``
on the socket the driver gave it. The first call on it is ``__init_actor__``; then calls
run one at a time in arrival order (``max_concurrency=1``), or up to ``max_concurrency`` at once, sync
methods then running in a thread pool so the event loop never stalls. Calls to other
actors go over direct connections that the driver brokers once per pair.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import os
import queue
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter as _clock
from typing import Any

from . import _client, _leases, _plugins, _shm  # noqa: F401  (_plugins: lazy GPU plug-in)
from . import _multicast
from ._errors import ActorDiedError, init_exit_error
from ._framing import close_fd
from ._introspect import serve_probe
from ._protocol import Connection
from ._remote_errors import call_in_thread
from ._serialization import PassFd
from ._streams import (CANCELLED_BY_CALLER, NO_META, Outflow, StreamingClient, StreamSlot,
                       chain, reentrant_error, run_stream)
from ._util import describe_exit, exit_code, leave_if_forked, socket_pair

# Replies made while a connection's frames are read go out together once they are all
# handled, unless a sync call that may take long is about to run (``Worker._start``).
FAST_CALL = 0.0005  # a sync method whose last run took less is taken to be fast again
FLUSH_AFTER = 0.001  # replies wait at most this long behind fast calls
BURST = 0.002  # sync calls run back to back this long at most before a read (cancels)
REHOLDS = 8  # turns a hold may be made to last, for reads cut short (``read_cut_short``)


class CallQueue(collections.OrderedDict):
    """The calls waiting for a slot, in order; each found at once by its key,
    ``(conn, cid)`` (a stream waiting for a slot again: ``(None, slot)``), so that a
    burst of cancels of queued calls costs each a lookup, not a scan of the queue (30k
    calls cancelled in reverse order took 14 s). Entries are ``(conn, cid, call)`` and
    ``(None, slot, None)``. Used as a deque of them (iterating gives the entries), plus
    ``discard``; an ``OrderedDict`` underneath, so that its truth and length, asked on
    every call, cost what a deque's do."""

    __slots__ = ()

    def __iter__(self):
        return iter(self.values())

    def append(self, entry: tuple) -> None:
        self[entry[0], entry[1]] = entry

    def appendleft(self, entry: tuple) -> None:
        key = entry[0], entry[1]
        self[key] = entry
        self.move_to_end(key, last=False)

    def extend(self, entries) -> None:
        for entry in entries:
            self.append(entry)

    def popleft(self) -> tuple:
        return self.popitem(last=False)[1]

    def remove(self, entry: tuple) -> None:
        del self[entry[0], entry[1]]

    def discard(self, key: tuple) -> None:
        self.pop(key, None)


class Worker(StreamingClient):
    """The host of every connection in an actor process, and its call client."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()
        # The token of its driver's actor ids, which the handles it makes carry
        # (``_client.family``; not for the programs it starts).
        self.family = os.environ.pop("ACTORSHM_FAMILY", None)
        self.stopped = loop.create_future()
        self._closing = False
        self.exit_code = 0
        self.shutdown_grace = 2.0  # the runtime's, once __init_actor__ arrives
        self.instance: Any = None
        self.actor_id = -1
        self.cls_name = "actor"
        self.methods: dict[str, bool] = {}
        self.max_concurrency = 1
        self.running = 0
        self.queue = CallQueue()
        self.read_at = _clock()  # when a connection last read (a burst's start)
        self.executor = None
        self.exited = False  # the process is leaving: no queued call starts any more
        self.stopping = False  # ... and no call starts from now on (``stop``)
        self.seq = 0  # calls started
        self.holding: dict[tuple, int] = {}  # (conn, cid) of calls in a slot -> their seq
        self.held = False  # a sync call just held the loop: calls wait a moment (_finished)
        self.rehold = False  # a read was cut short while held: the hold lasts a turn more
        self.reholds = 0  # turns the hold under way was made to last (``REHOLDS`` at most)
        self.draining = False  # ``_finished`` is starting queued calls
        self.reading: Connection | None = None  # whose frames handle_call was last given
        self.fast: set[str] = set()  # sync methods whose last run took under FAST_CALL
        self.unflushed = 0.0  # seconds of sync calls run since replies were last flushed
        self.running_calls: dict[tuple, Any] = {}  # (conn, cid) -> its task, or None: sync
        self.dropped: set[tuple] = set()  # sync calls cancelled while they ran
        self.outflows: dict[tuple, Outflow] = {}  # (conn, cid) of streams -> their credit
        self.peers: dict[int, Connection] = {}
        self.kill_begun: dict[int, int] = {}  # actors this one is killing -> kill() calls
        self.peers_leaving: set[Connection] = set()  # links to peers that are stopping
        # Links the driver has not answered for yet (``_connect``; they are read once it
        # has) -> whether writing to them broke meanwhile (seen once the answer says why).
        self.brokering: dict[Connection, bool] = {}
        self.leaving: float | None = None  # this actor said LEAVING (``_actor_process``)
        self.release_hook = None  # (set by ``_actor_process``: dispatches on this loop)
        self.collect_at_exit = False  # a cycle keeps the instance: collect after atexit
        self.driver = Connection(loop, self, socket.socket(fileno=fd), label="the driver")

    closing = property(lambda self: self._closing, doc="Whether the actor is stopping.")

    # -- client side (handles inside this actor) -------------------------------
    def call(self, actor_id: int, method: str, args, kwargs, what: str = "",
             meta: dict | None = None, stream: Any = None):
        """Call ``method`` on actor ``actor_id`` over a direct connection (brokered by the
        driver on first use); as ``Runtime.call``. The call carries the chain of calls
        it was made from (``_streams.chain``).

        Raises:
            TypeError: an argument cannot be pickled (nothing is sent).
        """
        if threading.get_ident() != self.loop_thread:
            _client.refuse_if_forked(self.loop)
            ctx = contextvars.copy_context()
            return _client.call_from_thread(self.loop, lambda: ctx.run(
                self.call, actor_id, method, args, kwargs, what, meta, stream))
        if actor_id in self.kill_begun:  # (made after kill(): it would race the SIGKILL)
            return _client.failed_call(ActorDiedError(self._killed(actor_id)))
        conn = self.peers.get(actor_id)
        if conn is None:
            conn = self._connect(actor_id)
        link = chain.get()
        if link:  # (outer chain, actor id, "Cls.method", seq): the call this one is made in
            meta = {**(meta or {}), "chain": (*link[0], link[1:])}
        return conn.call(method, args, kwargs, what, meta, stream)

    def call_group(self, actor_ids: list, method: str, args: tuple, kwargs: dict,
                   what: list):
        """As ``Runtime.call_group``: one call to every actor, encoded once for all."""
        if threading.get_ident() != self.loop_thread:
            return None
        conns = []
        for actor_id in actor_ids:
            if actor_id in self.kill_begun:
                return None  # (each call then fails as a single call would)
            conn = self.peers.get(actor_id)
            conns.append(conn if conn is not None else self._connect(actor_id))
        link = chain.get()
        meta = {"chain": (*link[0], link[1:])} if link else None
        return _multicast.call_many(conns, method, args, kwargs, what, meta)

    def _connect(self, actor_id: int) -> Connection:
        """A link to actor ``actor_id``: a socket pair made here, whose one end the
        driver hands to that actor (``_services._connect``). Calls are written into
        ours at once, as the driver's are, even if this actor's loop then blocks
        (the target reads them once it has its end); what the target sends back is read
        once the driver has answered (the target's pid, whether it is its last process),
        or the link closes with the driver's word on the target."""
        conn = Connection(self.loop, self, label=f"actor {actor_id}")
        conn.peer_id = actor_id
        self.peers[actor_id] = conn
        try:
            ours, theirs = socket_pair()
        except OSError as exc:  # out of fds: the calls on it fail with the error
            conn.close(exc)
            return conn
        fd = theirs.detach()
        self.brokering[conn] = False
        conn.attach(ours, read=False)  # (what comes back is read once the driver answers)
        if self.leaving is not None:
            conn.say_leaving(self.leaving)
        try:
            # (ahead of calls held on the driver connection: what the target sends
            # back is read once this is answered)
            fut = self.driver.call_ahead("__connect__", (actor_id, PassFd(fd)), {})
        except BaseException as exc:  # (out of memory, an interrupt): no link is made,
            close_fd(fd)  # the next call asks afresh
            self.brokering.pop(conn, None)
            conn.close(exc if isinstance(exc, Exception) else None)
            raise
        self.driver.close_after_call(fut, [fd])

        def done(f: asyncio.Future) -> None:
            broke = self.brokering.pop(conn, False)
            if f.cancelled():
                conn.close()
            elif f.exception() is not None:
                exc = f.exception()
                if isinstance(exc, ActorDiedError):  # the driver's word on the actor's
                    exc = ActorDiedError(str(exc))  # death, not an error its method raised
                conn.close(exc)
            else:
                conn.label, conn.peer_pid, conn.last_process = f.result()
                conn.start_reading()
                if broke:
                    self.connection_eof(conn)

        fut.add_done_callback(done)
        return conn

    def actor_pid(self, actor_id: int, pid: int) -> int:
        """The pid of the process this actor's link to ``actor_id`` reaches, while that
        link is open; else the pid the handle was made with. (The driver follows
        restarts as they happen; an actor, when a call through its link reaches the
        restarted process.)"""
        conn = self.peers.get(actor_id)
        if conn is not None and not conn.closed and conn.peer_pid is not None:
            return conn.peer_pid
        return pid

    def kill_begins(self, actor_id: int) -> None:
        """``handle.kill()`` was called here: as in the driver (``Runtime.kill_begins``),
        the calls this actor made on ``actor_id`` and has not heard back fail now, and
        those it makes until the kill is done fail at once. (On this worker's loop.)"""
        self.kill_begun[actor_id] = self.kill_begun.get(actor_id, 0) + 1
        why = ActorDiedError(self._killed(actor_id))
        for conn in (self.peers.get(actor_id), *self.peers_leaving):
            if conn is not None and conn.peer_id == actor_id and not conn.closed:
                conn.fail_pending(why)

    def _killed(self, actor_id: int) -> str:
        conn = self.peers.get(actor_id)
        return f"{conn.label if conn is not None else f'actor {actor_id}'} was killed by " \
            "actorshm kill()"

    async def kill(self, actor_id: int) -> None:
        """Ask the driver to kill actor ``actor_id`` (``Runtime.kill``)."""
        try:
            await self._ask_driver("__kill__", (actor_id,))
        finally:  # (gone: its link's end, or the driver, says so from now on; on this
            # worker's loop, where kill_begins counted it)
            _client.on_loop(self.loop, self._kill_done, actor_id)

    def _kill_done(self, actor_id: int) -> None:
        n = self.kill_begun.pop(actor_id, 0) - 1
        if n > 0:  # (another kill of it is under way)
            self.kill_begun[actor_id] = n

    async def spawn(self, cls, options, args, kwargs):
        """Ask the driver to spawn an actor (``Runtime.spawn``, whose errors it raises)."""
        return await self._ask_driver("__spawn__", (cls, options, args, kwargs),
                                      f"{cls.__qualname__}.spawn")

    async def get_actor(self, name: str):
        """Ask the driver for the named actor's handle.

        Raises:
            ValueError: no live actor has that name.
        """
        return await self._ask_driver("__get_actor__", (name,))

    async def _ask_driver(self, service: str, args: tuple, what: str = ""):
        """A service call to the driver, awaited from any event loop of this process:
        the connection is this worker's loop's, so a thread's own loop (``asyncio.run``
        in a sync method of an actor with max_concurrency > 1) waits for it there."""
        _client.refuse_if_forked(self.loop)
        if asyncio.get_running_loop() is self.loop:
            return await self.driver.call(service, args, {}, what)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self._ask_driver(service, args, what), self.loop))

    # -- host side -------------------------------------------------------------
    def handle_call(self, conn: Connection, cid: int, call: list) -> None:
        """Run a call on the actor instance, or a service call (``Host``)."""
        self.reading = conn
        method = call[0]
        if method.startswith("__"):
            args = call[1]
            call.clear()
            self._service(conn, cid, method, args)
            return
        if self.stopping:  # it never starts: its caller hears of the actor's end
            call.clear()
            return
        if self.instance is None:  # not initialized yet: calls wait for __init__
            self.queue.append((conn, cid, call))
            return
        if len(call) == 4 and (self.running >= self.max_concurrency or self.queue) \
                and "chain" in call[3]:
            err = reentrant_error(call[3]["chain"], self, f"{self.cls_name}.{method}")
            if err is not None:
                call.clear()
                conn.reply_error(cid, err)
                return
        if self.running < self.max_concurrency and not self.queue and not self.held:
            if conn.frame_spanned:
                # A call too large for one read: its caller could write nothing after
                # it (a cancel of it) until it was read. Read on before it starts, as
                # after a call that held the loop.
                self.queue.append((conn, cid, call))
                self.running += 1
                self._finished(None, blocked=True)
                return
            if self.methods.get(method) is False and conn.cancel_behind():
                # A sync method runs at once, to its end: the frames read behind it go
                # first (a cancel of it among them, written when the caller cancelled
                # it right after making it), then it starts (``read_ended``).
                self.queue.append((conn, cid, call))
                conn.deferred = True
                return
            self._start(conn, cid, call)
        else:  # (held: the frames read meanwhile, cancels among them, go first)
            self.queue.append((conn, cid, call))

    def _start(self, conn: Connection, cid: int, call: list) -> None:
        if len(call) == 3:
            (method, args, kwargs), meta = call, NO_META
        else:
            method, args, kwargs, meta = call
        call.clear()
        if method not in self.methods:
            self.running += 1
            conn.reply_error(cid, AttributeError(
                f"actor {self.cls_name} has no public method {method!r}"))
            self._finished(None)
            return
        what = f"{self.cls_name}.{method}"
        try:
            fn = getattr(self.instance, method)
        except Exception as exc:  # (a __getattr__ or property of the class's own)
            self.running += 1
            conn.reply_error(cid, exc)
            self._finished(None)
            return
        self.seq += 1
        # Calls it makes carry the chain, this one last (tasks copy the context now).
        token = chain.set((meta.get("chain", ()), self.actor_id, what, self.seq))
        key = (conn, cid)
        kind = self.methods[method]
        self.running += 1
        self.holding[key] = self.seq
        if kind == "stream" or "run_ahead" in meta:
            slot = StreamSlot(self, key, self.seq)
            task = self._task(self._run_stream(conn, cid, fn, args, kwargs, what, meta, slot),
                              conn, cid, what)
            chain.reset(token)
            if task is None:
                slot.done()
                return
            self.running_calls[key] = task
            task.add_done_callback(lambda t: slot.done())
        elif kind:
            task = self._task(self._run_async(conn, cid, fn, args, kwargs, what),
                              conn, cid, what)
            chain.reset(token)
            if task is None:
                self._finished(key)
                return
            self.running_calls[key] = task
            task.add_done_callback(lambda t: self._finished(key))
        elif self.max_concurrency > 1:
            self.running_calls[key] = None
            ctx = contextvars.copy_context()
            chain.reset(token)
            try:
                fut = self.loop.run_in_executor(
                    self.executor, lambda: ctx.run(call_in_thread, fn, args, kwargs, what))
            except RuntimeError as exc:  # "can't start new thread", with none running
                conn.reply_error(cid, RuntimeError(
                    f"{what} could not run: the actor could not start a thread for it "
                    f"({exc}). With max_concurrency > 1 sync methods run in threads, and "
                    "this process is at its limit of threads (ulimit -u, a container's "
                    "pids limit): raise the limit, or lower max_concurrency"
                    if "thread" in str(exc) else f"{what} could not run: {exc}"))
                self._finished(key)
                return
            fut.add_done_callback(lambda f: self._sync_done(conn, cid, f, what))
        else:
            # Replies made while reading a connection's frames wait to go out together,
            # after them. Before a call that may take long (its method's last run did,
            # or it never ran), or once they waited a millisecond, they go now: a quick
            # call's reply does not wait for a slow call behind it (unless that method
            # was quick on its last run).
            if method not in self.fast or self.unflushed > FLUSH_AFTER:
                self.unflushed = 0.0
                if self.reading is not None:
                    self.reading.flush_now()
            t0 = _clock()
            try:
                result = fn(*args, **kwargs)
            except SystemExit as exc:
                leave_if_forked(exit_code(exc))
                self._exit(exc, what)
                return
            except BaseException as exc:
                leave_if_forked()
                conn.reply_error(cid, exc)
            else:
                leave_if_forked()
                del args, kwargs
                conn.reply(cid, result, what)
                del result
            finally:
                chain.reset(token)
            now = _clock()
            took = now - t0
            self.unflushed += took
            if took < FAST_CALL:
                self.fast.add(method)
            else:
                self.fast.discard(method)
            # Sync calls have run back to back for over ``BURST`` since this process
            # last read its sockets (this one alone, or a burst of short ones read at
            # once): the next waits for a read, so that the cancels written meanwhile
            # are seen before it starts (cancelled 50 ms in, a burst of 400 calls of
            # 1 ms ran whole, each too short to hold the loop alone).
            self._finished(key, blocked=now - self.read_at > BURST)

    def _task(self, coro, conn, cid, what) -> asyncio.Task | None:
        """A task running ``coro`` for call ``cid``; None, the call answered with the
        error, where the loop cannot make one (a task factory set on it that fails:
        ``asyncio.eager_task_factory`` under uvloop on Python 3.13 does). The call was
        left unanswered, and its slot taken for good: the actor answered nothing more."""
        try:
            return self.loop.create_task(coro)
        except Exception as exc:
            if inspect.getcoroutinestate(coro) != inspect.CORO_CREATED:
                raise  # (a factory that ran it, then failed: the call is the task's)
            coro.close()
            conn.reply_error(cid, RuntimeError(
                f"{what}: the actor's event loop could not start a task for this call "
                f"({type(exc).__name__}: {exc}); a task factory set on that loop "
                "(loop.set_task_factory) fails there"))
            return None

    async def _run_async(self, conn, cid, fn, args, kwargs, what) -> None:
        try:
            result = fn(*args, **kwargs)
            del args, kwargs
            if inspect.isawaitable(result):
                result = await result
        except SystemExit as exc:
            leave_if_forked(exit_code(exc))
            self._exit(exc, what)
            return
        except asyncio.CancelledError as exc:
            if not getattr(asyncio.current_task(), CANCELLED_BY_CALLER, False):
                # Not its caller's doing (it awaited a task cancelled in the actor, or
                # raised it): the caller waits for an answer, as for any other error.
                conn.reply_error(cid, exc)
            return
        except BaseException as exc:
            leave_if_forked()
            conn.reply_error(cid, exc)
            return
        leave_if_forked()
        conn.reply(cid, result, what)

    async def _run_stream(self, conn, cid, fn, args, kwargs, what, meta, slot) -> None:
        if conn.closed:
            # Its caller is gone (an actor that died while the stream waited for a slot,
            # or before its task ran): nobody would take an item, give credit or cancel
            # it, and the generator would wait at its ``run_ahead``-th yield for good.
            return
        out = self.outflows[(conn, cid)] = Outflow(meta.get("run_ahead", 16))
        out.slot = slot
        try:
            try:
                gen = fn(*args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, SystemExit):
                    self._exit(exc, what)
                else:
                    conn.reply_error(cid, exc)
                return
            del args, kwargs
            if inspect.isawaitable(gen):
                gen = await gen
            if not (inspect.isgenerator(gen) or inspect.isasyncgen(gen)):
                conn.reply(cid, gen, what)  # not a generator: its result ends the stream
                return
            try:
                await run_stream(conn, cid, gen, out, what,
                                 self.executor if self.max_concurrency > 1 else None, slot)
            except SystemExit as exc:
                self._exit(exc, what)
        finally:
            self.outflows.pop((conn, cid), None)

    def stream_credit(self, conn: Connection, cid: int, n: int) -> None:
        """The caller of streaming call ``cid`` took ``n`` more items (``Host``)."""
        if (conn, cid) in self.outflows:
            self.outflows[(conn, cid)].add(n)

    def cancel_call(self, conn: Connection, cid: int) -> None:
        """The caller cancelled call ``cid`` (``Host``): a queued call never runs, a running
        async one (or stream) is cancelled, a running sync one's result is dropped."""
        key = (conn, cid)
        conn.reply_waits.pop(cid, None)  # nobody waits for its reply now
        if key in self.running_calls:
            task = self.running_calls[key]
            if task is None:
                self.dropped.add(key)
                return
            out = self.outflows.get(key)
            if out is not None:  # a stream: it closes its generator ahead of queued calls
                out.slot.reclaim()
            setattr(task, CANCELLED_BY_CALLER, True)  # (no reply owed: nobody waits)
            task.cancel()
            return
        self.queue.discard(key)

    def _sync_done(self, conn, cid, fut, what) -> None:
        key = (conn, cid)
        if key in self.dropped or fut.cancelled():  # (cancelled: the pool shut down)
            self.dropped.discard(key)
            self._finished(key)
            return
        exc = fut.exception()
        if isinstance(exc, SystemExit):
            self._exit(exc, what)
        elif exc is not None:
            conn.reply_error(cid, exc)
        else:
            conn.reply(cid, fut.result(), what)
        self._finished(key)

    def _finished(self, key, blocked: bool = False) -> None:
        """A call left its slot (``key``: ``(conn, cid)``, or None): start the next."""
        if key is not None:
            self.running_calls.pop(key, None)
            self.holding.pop(key, None)
        self.running -= 1
        if blocked:
            # Sync calls held the loop over ``BURST``: it reads cancels before the next
            # starts.
            self.running += 1
            if not self.held:
                self.held = True
                self.loop.call_soon(self.loop.call_soon, self._release_hold)
            return
        self._drain()

    def read_cut_short(self) -> None:
        """A connection stopped reading with frames maybe left in its socket (64 reads
        in a row carried fds): the queued calls wait for the loop to read it again, as
        after a call that held the loop, since a cancel of one may be among them."""
        if self.held:
            # (the hold under way ends a turn later than planned; a few times at most,
            # so that a peer that keeps sending fds cannot hold the queue for good)
            self.rehold = self.reholds < REHOLDS
        else:
            self.running += 1
            self._finished(None, blocked=True)

    def read_ended(self) -> None:
        """A connection handled every frame of a read, after queueing a call until then
        (``handle_call``): the queue goes on, unless the loop is held."""
        if not self.held:
            self._drain()

    def _drain(self) -> None:
        """Start queued calls while slots are free (not while the queue is held: a call
        in another slot that ends meanwhile, max_concurrency > 1, starts none)."""
        if not self.queue or self.draining or self.held:  # (draining: a sync call that
            return  # the loop below started ended here; the loop goes on with the next)
        # A loop, not a recursion: a sync call run here ends in ``_finished`` again, and
        # a long queue (a burst read while calls were held) would exceed Python's
        # recursion limit, its calls then never answered.
        self.draining = True
        try:
            while self.queue and self.running < self.max_concurrency and not self.exited \
                    and not self.held:
                entry = self.queue.popleft()
                if entry[0] is None:  # a stream waiting to take its next item
                    entry[1].grant()
                elif not self.stopping:  # (stopping: it never starts)
                    self._start(*entry)
        finally:
            self.draining = False

    def _release_hold(self) -> None:
        if self.rehold:  # (a read cut short meanwhile: the loop reads its socket first)
            self.rehold = False
            self.reholds += 1
            self.loop.call_soon(self.loop.call_soon, self._release_hold)
            return
        self.held = False
        self.reholds = 0
        self.read_at = _clock()  # (the loop polled its sockets since the hold began)
        self._finished(None)

    def _exit(self, exc: SystemExit, what: str) -> None:
        """Method ``what`` raised SystemExit: this process exits, saying so (its stderr
        reaches the driver's, where the call's ActorDiedError shows)."""
        self.exit_code = exit_code(exc)
        try:
            print(f"actorshm: {what} raised SystemExit({exc.code!r}) (sys.exit): this "
                  "actor's process exits, and calls on it fail with ActorDiedError",
                  file=sys.stderr, flush=True)
        except (ValueError, OSError):  # (a method closed stderr)
            pass
        self.stop()

    def stop(self) -> None:
        """The actor stops: no call starts from now on (those queued or that arrive
        are never run: their callers hear of its end), and ``_actor_process`` ends it."""
        self.stopping = True
        if not self.stopped.done():
            self.stopped.set_result(None)

    def _service(self, conn: Connection, cid: int, method: str, args) -> None:
        try:
            if method == "__init_actor__":
                self._init_actor(conn, cid, *args)
                return
            if method == "__accept_peer__":
                fd, peer_id, peer_pid = args
                peer = Connection(self.loop, self, socket.socket(fileno=fd),
                                  label=f"actor {peer_id}")
                peer.peer_id, peer.peer_pid = peer_id, peer_pid
                self.peers.setdefault(peer_id, peer)
                if self.leaving is not None:  # a link made after it said LEAVING
                    peer.say_leaving(self.leaving)
                conn.reply(cid, None)
            elif method == "__peer_moved__":  # (``_services._hand_over``)
                peer_id, pid = args
                link = self.peers.get(peer_id)
                if link is not None and not link.closed:
                    link.peer_pid = pid
                conn.reply(cid, None)
            elif method == "__stop__":
                self._closing = True  # the runtime closes: every actor is stopping
                conn.reply(cid, None)
                self.stop()
            elif method == "__settle__":
                self._task(self._settle(conn, cid, *args), conn, cid, "settling")
            elif method == "__stats__":
                conn.reply(cid, _shm.stats())
            elif method == "__ping__":
                conn.reply(cid, os.getpid())
            else:
                conn.reply_error(cid, AttributeError(f"unknown service {method!r}"))
        except BaseException as exc:
            conn.reply_error(cid, exc)

    async def _settle(self, conn: Connection, cid: int, timeout: float) -> None:
        """Before a kill: wait (bounded) for blocks we passed on to come back, and send
        the withdrawals of their forward notices, so their owners need not keep them."""
        await self.grants_out(lambda g: g.told, timeout, 0.002)
        _leases.dispatch_releases()
        for c in self.connections():
            c.send_owed()
        conn.reply(cid, None)

    def connections(self) -> list[Connection]:
        """The open connections: the driver's, then the peers'."""
        return [c for c in (self.driver, *self.peers.values(), *self.peers_leaving)
                if not c.closed]

    async def grants_out(self, which, timeout: float, step: float) -> int:
        """Wait up to ``timeout`` until no grant (``_ledger.Grant``) that ``which(grant)``
        picks is left on any connection; how many are left."""
        deadline = self.loop.time() + timeout
        while True:
            left = sum(c.ledger.count(which) for c in self.connections())
            if not left or self.loop.time() >= deadline:
                return left
            await asyncio.sleep(step)

    def _init_actor(self, conn, cid, cls, args, kwargs, config) -> None:
        self.actor_id = config["actor_id"]
        self.cls_name = cls.__qualname__
        self.max_concurrency = config["max_concurrency"]
        self.shutdown_grace = config.get("shutdown_grace", 2.0)
        _shm.set_budget(config.get("shm_budget"))
        # (the budget shared with the runtime)
        _shm.join_budget(config.get("shm_ledger"), self.loop)
        if config.get("probe") is not None:
            serve_probe(config["probe"], self)
        from ._actor import public_methods
        self.methods = public_methods(cls)
        if self.max_concurrency > 1:
            self.executor = _Threads(self.max_concurrency,
                                     thread_name_prefix=f"actorshm-{self.cls_name}")
        try:
            self.instance = cls(*args, **kwargs)
        except BaseException as exc:
            code = exit_code(exc) if isinstance(exc, SystemExit) else 1
            exc = init_exit_error(self.cls_name, exc)
            conn.reply_error(cid, exc)
            while self.queue:
                qconn, qcid, _ = self.queue.popleft()
                qconn.reply_error(qcid, ActorDiedError(
                    f"actor {self.cls_name} failed in __init__: {exc!r}"))
            self.exit_code = code
            self.loop.call_soon(self.stop)
            return
        conn.reply(cid, os.getpid())
        self.running += 1
        # Start the calls that arrived before __init__ finished, once the frames that
        # came meanwhile are read: a cancel among them (a call made while the actor
        # restarted, then cancelled) stops its call before it starts.
        self._finished(None, blocked=True)

    def connection_eof(self, conn: Connection) -> None:
        """A connection broke (``Host``)."""
        if conn is self.driver:
            conn.close(ActorDiedError("the driver is gone"))
        elif conn in self.brokering:  # (the driver's answer says why: ``_connect``)
            self.brokering[conn] = True
        else:
            conn.close(ActorDiedError(f"{conn.label} is gone: "
                                      f"{describe_exit(None)}"))

    def connection_leaving(self, conn: Connection) -> None:
        """The actor on ``conn`` began to stop (``Host``; ``LEAVING``): it starts no call
        from now on, so the calls made from now on go through a new link, which the
        driver connects to its restart, if one comes (``_services._connect``). Those
        under way end on this one."""
        if conn.peer_id is not None and self.peers.get(conn.peer_id) is conn \
                and not conn.last_process:
            del self.peers[conn.peer_id]
            self.peers_leaving.add(conn)

    def connection_closed(self, conn: Connection) -> None:
        """A connection closed (``Host``): the driver's ends the actor; a peer's stops
        the streams it was taking (nobody is left to give them credit)."""
        for key in [k for k in self.outflows if k[0] is conn]:
            self.cancel_call(conn, key[1])
        if conn is self.driver:
            self.stop()
        elif conn.peer_id is not None and self.peers.get(conn.peer_id) is conn:
            del self.peers[conn.peer_id]
        self.peers_leaving.discard(conn)


class _Threads(ThreadPoolExecutor):
    """The threads sync methods run in when ``max_concurrency > 1``.

    At the process's limit of threads (``ulimit -u``, a container's pids limit) a call
    waits for one of the threads already running; with none running, ``submit`` raises
    and leaves nothing queued (a plain pool keeps the call queued though it raised, so
    that it would run later, on the next thread that starts, after its caller was told
    it failed; or never, its caller left waiting).
    """

    def _adjust_thread_count(self) -> None:
        try:
            super()._adjust_thread_count()
        except RuntimeError:
            if self._threads:
                return  # those running take it in turn
            while True:
                try:
                    self._work_queue.get_nowait()
                except queue.Empty:
                    break
            raise
