"""Seeing inside a running runtime: every process's counters, who holds which shared
block, every actor's stack, and why the kernel killed an actor.

Each actor gets a second socket at start-up, its *probe*, answered by a daemon thread
in the actor (``serve_probe``), not by its event loop: an actor stuck in a sync method
still answers, as long as the Python code it runs lets go of the GIL now and then
(sleeping, waiting on a lock or a queue, I/O, or plain Python bytecode: the interpreter
switches threads every few milliseconds). Requests and answers are length-framed
pickles tagged with a request id, so an answer that comes after its request timed out
is recognised and dropped.

``Inspectable`` is mixed into ``Runtime``: ``rt.stats()``, ``rt.memory()`` and
``rt.dump_stacks()``. ``oom_note`` tells why a SIGKILLed actor died when the system
shows it: the kernel log (``/dev/kmsg``, when readable) names the OOM killer's victim;
otherwise the actor's memory cgroup counts its ``oom_kill`` events.
"""

from __future__ import annotations

import asyncio
import numbers
import inspect
import itertools
import pickle
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any, TextIO

from . import _leases, _shm
from ._descendants import is_stopped
from ._oom import oom_kill_count
from ._serialization import PassFd
from ._util import socket_pair

__all__ = ["Inspectable", "MemoryReport", "call_init", "serve_probe"]

# Registered with ``faulthandler`` in every actor process: its stacks, written by the
# signal handler itself, on its stderr (which the driver forwards, prefixed). The
# fallback for an actor whose probe thread cannot run (C code holding the GIL).
STACK_SIGNAL = signal.SIGRTMIN + 3
_HEADER = struct.Struct("!QI")  # request id, payload length
_ids = itertools.count(1)


# -- in the actor ----------------------------------------------------------------------
def serve_probe(fd: int, worker) -> None:
    """Answer the driver's probe on socket ``fd`` from a daemon thread (in an actor).

    Args:
        fd: the actor's end of the probe socket.
        worker: the actor process's ``_worker.Worker`` (its loop and connections).
    """
    answers = {"stats": _shm.stats,
               "stacks": lambda: format_stacks(worker.loop),
               "memory": lambda: held_blocks(worker.connections())}
    threading.Thread(target=_probe_loop, args=(socket.socket(fileno=fd), answers),
                     daemon=True, name="actorshm-probe").start()


def _probe_loop(sock: socket.socket, answers: dict) -> None:
    with sock:
        while True:
            try:
                head = _recv_exact(sock, _HEADER.size)
                if head is None:
                    return  # the driver closed it: the actor is ending
                rid, n = _HEADER.unpack(head)
                what = pickle.loads(_recv_exact(sock, n) or b"")
                try:
                    answer = (True, answers[what]())
                except Exception as exc:  # say what failed rather than go quiet
                    answer = (False, f"{type(exc).__name__}: {exc}")
                body = pickle.dumps(answer, protocol=5)
                sock.sendall(_HEADER.pack(rid, len(body)) + body)
            except OSError:
                return


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def format_stacks(loop: asyncio.AbstractEventLoop | None = None, skip: tuple = (),
                  calls: list = ()) -> str:
    """Every thread's Python stack in this process, and every pending asyncio task's
    of ``loop`` (an ``async def`` method waits in a task, not on a thread), as text;
    tasks with a frame of a function named in ``skip`` (plumbing) are left out.
    ``calls``: ``(name, coroutine)`` of pending calls whose tasks cannot be walked
    (Ray's, whose outer coroutines are compiled and have no frames)."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        out.append(f"Thread {names.get(ident, ident)} (most recent call last):\n")
        out.extend(traceback.format_stack(frame))
    del frame
    for task in _tasks(loop):
        stack = _await_chain(task.get_coro())
        if not stack or stack[0].f_code.co_name == "_amain" or any(  # (our own)
                f.f_code.co_name in skip for f in stack):
            continue
        out.append(f"Task {task.get_name()} (most recent call last):\n")
        out.extend(traceback.StackSummary.extract(
            (f, f.f_lineno) for f in stack).format())
    for name, coro in calls:
        stack = _await_chain(coro)
        if stack:  # (none: it has not started, or has just ended)
            out.append(f"Call {name} (most recent call last):\n")
            out.extend(traceback.StackSummary.extract(
                (f, f.f_lineno) for f in stack).format())
    return "".join(out)


def _await_chain(coro) -> list:
    """The frames of a suspended coroutine and of what it awaits, outermost first
    (``Task.get_stack`` gives the outermost only)."""
    frames = []
    while coro is not None and len(frames) < 200:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or \
            getattr(coro, "ag_frame", None)  # (an async generator: a streaming method)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or \
            getattr(coro, "ag_await", None)
        if coro is not None and type(coro).__name__ in _ASEND:
            # ``await agen.__anext__()``: the step object does not name its generator;
            # the awaiting frame holds it (a stream's runner: ``gen``).
            coro = next((v for v in list(frame.f_locals.values())
                         if inspect.isasyncgen(v) and v.ag_await is not None), None)
    return frames


_ASEND = ("async_generator_asend", "async_generator_athrow")


def _tasks(loop) -> list:
    if loop is None:
        return []
    try:
        return list(asyncio.all_tasks(loop))
    except RuntimeError:  # the loop's task set changed meanwhile: no tasks this time
        return []


def held_blocks(connections) -> dict:
    """The shared blocks alive in this process: ``{"tokens": the pools' tokens, "blocks":
    [(key, size, device, in_use)], "stats": stats()}``; ``in_use`` is false where only
    our grants to peers on ``connections`` keep the block (we lent it and hold no
    array on it ourselves)."""
    granted: dict[tuple, int] = {}
    for conn in connections:
        for key in list(conn.ledger.grants):
            granted[key] = granted.get(key, 0) + 1
    live, tokens = _leases.live_blocks()
    blocks = []
    for block in live:
        # References: ``live``, ``block`` here, getrefcount's argument, one per grant;
        # any more are arrays (or their buffers) in this process.
        in_use = sys.getrefcount(block) - 3 > granted.get(block.key, 0)
        device = block.region.device
        blocks.append((block.key, block.size,
                       "host" if device is None else f"gpu:{device}", in_use))
    live = block = None  # (no reference of ours outlives the scan)
    return {"tokens": sorted(tokens), "blocks": blocks, "stats": _shm.stats()}


# -- in the driver ---------------------------------------------------------------------
class _Probe:
    """The driver's end of one actor's probe socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()  # survives a timed-out request: the stream stays framed
        self.lock: asyncio.Lock | None = None
        self.ready = False  # its actor is initialized (its STACK_SIGNAL handler too)
        self.closed = False

    async def ask(self, what: str, timeout: float) -> Any:
        """Ask the actor ``what``; ``timeout`` counts the wait for a request made before
        (one at a time on the socket) too, so each caller waits at most its own."""
        if self.lock is None:
            self.lock = asyncio.Lock()

        async def in_turn() -> Any:
            async with self.lock:
                try:
                    if self.closed:
                        raise ConnectionError("the actor's probe is closed (it died)")
                    return await self._ask(what)
                finally:
                    if self.closed:  # closed while we asked: the socket goes now
                        self.sock.close()
        return await asyncio.wait_for(in_turn(), timeout)

    async def _ask(self, what: str) -> Any:
        loop = asyncio.get_running_loop()
        rid = next(_ids)
        body = pickle.dumps(what)
        await loop.sock_sendall(self.sock, _HEADER.pack(rid, len(body)) + body)
        while True:
            while True:
                if len(self.buf) >= _HEADER.size:
                    got, n = _HEADER.unpack_from(self.buf)
                    if len(self.buf) >= _HEADER.size + n:
                        payload = bytes(self.buf[_HEADER.size:_HEADER.size + n])
                        del self.buf[:_HEADER.size + n]
                        break
                chunk = await loop.sock_recv(self.sock, 1 << 16)
                if not chunk:
                    raise ConnectionError("the actor closed its probe")
                self.buf += chunk
            if got == rid:  # (older ones answer requests that timed out)
                ok, value = pickle.loads(payload)
                if not ok:
                    raise RuntimeError(value)
                return value

    def close(self) -> None:
        """Close the driver's end (its actor died); a request under way closes it when
        it ends, so no socket is closed under the loop's watch."""
        self.closed = True
        if self.lock is None or not self.lock.locked():
            self.sock.close()


def call_init(rec, config: dict, args: tuple, kwargs: dict) -> asyncio.Future:
    """Send a new actor process its ``__init_actor__`` call, with a fresh probe socket
    (replacing the one of an earlier process of the same actor); its future.

    Args:
        rec: the actor's ``_launch.ActorRecord`` (its ``conn`` is open or buffering).
        config: the actor's configuration (``probe`` is added here).
        args, kwargs: for the actor class's ``__init__``.
    """
    if rec.probe is not None:
        rec.probe.close()
    ours, theirs = socket_pair()
    ours.setblocking(False)
    rec.probe = _Probe(ours)
    config["probe"] = PassFd(theirs.fileno())
    rec.oom_baseline = oom_kill_count(rec.pid)
    try:
        fut = rec.conn.call("__init_actor__", (rec.cls, args, kwargs, config), {},
                            f"{rec.cls_name}.__init__")
    except TypeError as exc:
        rec.probe.close()
        theirs.close()
        raise _class_unsendable(rec.cls) or exc
    rec.conn.close_after_call(fut, [theirs.detach()])
    probe = rec.probe
    fut.add_done_callback(lambda f: setattr(probe, "ready", not f.cancelled()
                                            and f.exception() is None))
    return fut


def _class_unsendable(cls: type) -> TypeError | None:
    """Why actor class ``cls`` itself cannot travel to its process (a class of
    ``__main__`` or a notebook goes by value, and some members cannot), or None."""
    import cloudpickle
    try:
        cloudpickle.dumps(cls)
    except Exception as exc:
        return TypeError(
            f"actor class {cls.__qualname__} cannot be sent to its process: it is defined "
            f"in {cls.__module__!r}, so it travels by value (cloudpickle), and that fails: "
            f"{exc}. Move the class into a module the actor can import (a .py file next to "
            "your script), so that it travels by name")
    return None


class MemoryReport:
    """Who holds which shared block: ``Runtime.memory()``'s answer.

    ``str(report)`` is a table; the data is in the attributes.

    Attributes:
        rows: one dict per live block: ``block`` (an id), ``device`` (``"host"`` or
            ``"gpu:N"``), ``size`` (bytes), ``owner`` (the process whose pool it comes
            from, or ``"?"`` when that process is gone), ``held_by`` (the processes
            holding arrays on it: where it stays alive; an owner or relay that only
            keeps it for a peer is not listed), largest first.
        processes: per process (``"driver"`` or an actor's label): its pools' memory
            (``arena_bytes_owned``, ``cuda_slab_bytes_owned``: free blocks included)
            and live blocks (``blocks_live``).
        unresponsive: labels of actors that did not answer in time.
    """

    def __init__(self, rows: list[dict], processes: dict[str, dict],
                 unresponsive: list[str]) -> None:
        self.rows = rows
        self.processes = processes
        self.unresponsive = unresponsive

    @property
    def total_bytes(self) -> int:
        """Bytes in live blocks, all processes together."""
        return sum(r["size"] for r in self.rows)

    def __repr__(self) -> str:
        return f"<MemoryReport: {len(self.rows)} live blocks, {self.total_bytes} bytes>"

    def __str__(self) -> str:
        head = ("block", "device", "size", "owner", "held by")
        table = [head] + [(r["block"], r["device"], _human(r["size"]), r["owner"],
                           ", ".join(r["held_by"]) or "-") for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                 for row in table]
        lines.append(f"{_count(len(self.rows), 'live block')}, {_human(self.total_bytes)}")
        lines.append("pools (free blocks included):")
        for label, p in self.processes.items():
            gpu = p.get("cuda_slab_bytes_owned", 0)
            lines.append(f"  {label}: {_human(p.get('arena_bytes_owned', 0))} host"
                         + (f", {_human(gpu)} GPU" if gpu else "")
                         + f", {_count(p.get('blocks_live', 0), 'block')} live")
        for label in self.unresponsive:
            lines.append(f"  {label}: did not answer")
        return "\n".join(lines)


def check_timeout(what: str, timeout: Any) -> None:
    """``rt.stats``/``memory``/``dump_stacks``'s ``timeout`` (``what``: what they ask)
    is a number of seconds above 0, or None: else every actor would be reported
    unresponsive."""
    if timeout is None:  # no limit
        return
    method = "dump_stacks" if what == "stacks" else what
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"rt.{method}(timeout=...) must be a number of seconds (or None: "
                        f"no limit), not {timeout!r}")
    if not 0 < timeout:  # (NaN too)
        raise ValueError(f"rt.{method}(timeout=...) must be more than 0 seconds (how long "
                         f"to wait for each actor's answer), not {timeout!r}")


def check_file(file: Any) -> None:
    """``rt.dump_stacks``'s ``file`` is a stream to print to, or None (``sys.stderr``)."""
    if file is not None and not callable(getattr(file, "write", None)):
        path = isinstance(file, (str, bytes)) or hasattr(file, "__fspath__")
        raise TypeError(
            f"rt.dump_stacks(file=...) takes a stream to print to (sys.stderr, an open "
            f"text file, io.StringIO()), not {type(file).__name__} {file!r}"
            + ("; to write them to a file, open it: `with open(path, 'w') as f: await "
               "rt.dump_stacks(file=f)`" if path else ""))


def memory_report(views: list, unresponsive: list) -> MemoryReport:
    """A ``MemoryReport`` from each answering process's ``(label, held_blocks())``."""
    owners = {t: label for label, v in views for t in v["tokens"]}
    rows: dict[tuple, dict] = {}
    for label, view in views:
        for key, size, device, in_use in view["blocks"]:
            row = rows.get(key)
            if row is None:
                row = rows[key] = {
                    "block": f"{key[0] & 0xFFFFFF:06x}:{key[1]}+{key[2]}",
                    "device": device, "size": size,
                    "owner": owners.get(key[0], "?"), "held_by": []}
            if in_use:
                row["held_by"].append(label)
    keys = ("arena_bytes_owned", "cuda_slab_bytes_owned", "blocks_live")
    procs = {label: {k: v["stats"].get(k, 0) for k in keys} for label, v in views}
    return MemoryReport(sorted(rows.values(), key=lambda r: (-r["size"], r["block"])),
                        procs, unresponsive)


# Keys that are limits, not counters: the total keeps the driver's (the runtime's
# budget is one for all its processes; summing it would count it once per process).
_LIMITS = frozenset({"shm_budget"})


def stats_report(answers: list, unresponsive: list) -> dict:
    """``rt.stats()``'s answer: this process's counters, each ``(actor_id, counters)``
    answer, their key-by-key sum, and the actors that did not answer."""
    driver = _shm.stats()
    total = dict(driver)
    for _, counters in answers:
        for k, v in counters.items():
            if k not in _LIMITS:
                total[k] = total.get(k, 0) + v
    return {"driver": driver, "actors": dict(answers), "total": total,
            "unresponsive": unresponsive}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


class Inspectable:
    """Mixed into ``Runtime``: counters, memory and stacks of every live actor."""

    def _live(self) -> list:
        return [r for r in self._actors.values()
                if r.alive and getattr(r, "probe", None) is not None]

    async def _ask_all(self, what: str, timeout: float) -> tuple[list, list]:
        check_timeout(what, timeout)
        self._check_open()
        recs = self._live()
        answers = await asyncio.gather(*(r.probe.ask(what, timeout) for r in recs),
                                       return_exceptions=True)
        got = [(r, a) for r, a in zip(recs, answers) if not isinstance(a, BaseException)]
        missed = [(r, a) for r, a in zip(recs, answers) if isinstance(a, BaseException)]
        return got, missed

    async def stats(self, timeout: float = 5.0) -> dict:
        """The counters of the driver and of every live actor, and their sums.

        ``actorshm.stats()`` gives the calling process's own counters; this asks every
        actor too, through a thread of its own, so an actor busy in a sync method
        answers as well.

        Args:
            timeout: seconds to wait for each actor's answer.

        Returns:
            ``{"driver": {...}, "actors": {actor_id: {...}}, "total": {...},
            "unresponsive": [actor_id, ...]}``: each ``{...}`` is an ``actorshm.stats()``
            dict, ``total`` sums the driver's and the actors' key by key (but for
            ``shm_budget``, the runtime's, which is the driver's); actors that
            did not answer within ``timeout`` are listed in ``unresponsive``.

        Raises:
            RuntimeError: the runtime is not open.
        """
        got, missed = await self._ask_all("stats", timeout)
        return stats_report([(rec.actor_id, c) for rec, c in got],
                            [r.actor_id for r, _ in missed])

    async def memory(self, timeout: float = 5.0) -> MemoryReport:
        """Every live shared block: its owner, size, and the processes holding it.

        The answer to "who is keeping my memory": ``print(await rt.memory())`` shows a
        table; its ``rows`` hold the same as dicts (see ``MemoryReport``).

        Args:
            timeout: seconds to wait for each actor's answer.

        Returns:
            A ``MemoryReport``.

        Raises:
            RuntimeError: the runtime is not open.
        """
        got, missed = await self._ask_all("memory", timeout)
        conns = [c for r in self._actors.values() for c in (r.conn, r.ended_conn)
                 if c is not None]
        views = [("driver", held_blocks(conns))] + [(r.label, a) for r, a in got]
        return memory_report(views, [r.label for r, _ in missed])

    async def dump_stacks(self, timeout: float = 5.0, file: TextIO | None = None) -> str:
        """Every live actor's Python stacks: its threads', and its pending async calls'.

        Answered by a thread of each actor's own, so an actor stuck in a sync method
        (a deadlock, an endless loop, a wait that never ends) shows where it is stuck.
        One that holds the GIL in C code the whole time cannot answer in time: it is
        listed as not answering, and ``faulthandler`` in it writes its threads' stacks
        to its stderr (forwarded to the driver's, prefixed with the actor).

        Args:
            timeout: seconds to wait for each actor's answer.
            file: where to print them, each line prefixed with its actor as its output
                is (default ``sys.stderr``).

        Returns:
            The text printed.

        Raises:
            RuntimeError: the runtime is not open.
        """
        check_file(file)
        got, missed = await self._ask_all("stacks", timeout)
        parts = []
        for rec, text in got:
            prefix = f"({rec.cls_name} pid={rec.pid}) "
            parts.append("".join(prefix + ln + "\n" for ln in
                                 [f"{rec.label}:"] + text.rstrip("\n").split("\n")))
        for rec, exc in missed:
            why = f"{exc!r}: see its stderr"
            if isinstance(exc, asyncio.TimeoutError):
                why = (f"no answer within {timeout} s (busy in C code holding the GIL?); "
                       "its faulthandler dump follows on stderr")
                if rec.probe is None or not rec.probe.ready:
                    why = f"no answer within {timeout} s (still starting?)"
                elif is_stopped(rec.pid):
                    # No dump: it would run once the process goes on, while its threads
                    # run again (faulthandler then crashed it, on Python 3.13).
                    why = (f"no answer within {timeout} s: its process is stopped "
                           "(SIGSTOP, Ctrl-Z or a debugger)")
                elif threading.get_ident() == self._loop_thread:
                    rec.send_signal(STACK_SIGNAL)  # (nothing, if it died meanwhile)
                else:  # (the loop's thread owns its pidfd, which closes when it dies)
                    self.loop.call_soon_threadsafe(rec.send_signal, STACK_SIGNAL)
            parts.append(f"({rec.cls_name} pid={rec.pid}) {rec.label}: {why}\n")
        text = "".join(parts)
        print(text, end="", file=file if file is not None else sys.stderr, flush=True)
        return text
