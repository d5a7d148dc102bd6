"""The fork server: a single-threaded process that forks actor processes on request.

``Runtime(start_method="forkserver")`` starts one, as a fresh interpreter that imports
numpy, cloudpickle and actorshm once. Each actor is then a ``fork`` of it: no interpreter
start and no imports per actor. Forking is safe here because the server never starts a
thread (a fork of a process with threads is what deadlocks). It reports each child's exit
status back to the driver, which watches (and signals) the child through a pidfd the
server sends it with the child's pid.

Requests (driver -> server) and reports (server -> driver) are pickled tuples in
``HEADER``-framed messages on a socket pair; the child's socket and its stdout/stderr pipe
ends travel as SCM_RIGHTS fds with the request.
"""

from __future__ import annotations

import array
import os
import pickle
import select
import signal
import socket
import struct
import sys

from ._util import off_stdio

_LEN = struct.Struct("<I")


def encode_msg(obj) -> bytes:
    data = pickle.dumps(obj, protocol=5)
    return _LEN.pack(len(data)) + data


def send_msg(sock: socket.socket, obj, fds=()) -> None:
    """Send one message on a blocking socket (the server's end)."""
    msg = encode_msg(obj)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([msg], anc)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def recv_msg(sock: socket.socket):
    """One message and its fds; None at EOF. Blocking."""
    fds = array.array("i")
    head, anc, _, _ = sock.recvmsg(_LEN.size, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
    if not head:
        return None
    while len(head) < _LEN.size:
        more = sock.recv(_LEN.size - len(head))
        if not more:
            return None
        head += more
    (n,) = _LEN.unpack(head)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return pickle.loads(data), [off_stdio(fd, keep=True) for fd in fds]


def main() -> None:
    from ._util import fill_closed_stdio, leave_ctrl_c_to_the_driver, set_parent_death_signal
    # A driver that closed its standard streams passed them on closed: a file of the
    # server's took their number (its children's stdout), and Python started without
    # sys.stdout/stderr, which its children need (they put pipes on fds 1 and 2).
    fill_closed_stdio()
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False,
                                    errors="backslashreplace"))
    set_parent_death_signal()
    leave_ctrl_c_to_the_driver()
    # Import once here what every actor needs, so that forks start warm.
    import asyncio  # noqa: F401

    import cloudpickle  # noqa: F401
    import numpy  # noqa: F401

    from . import _actor_process, _descendants  # (and all an actor process needs)
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    # Everything imported so far lives as long as the server: move it out of the
    # collector's reach, so that a child's first collections do not write to (and so
    # copy) every page holding those objects. Halves a forked actor's start-up CPU
    # (about 10.5 -> 5.5 ms on 2 cores; copy-on-write faults 1540 -> 1180).
    import gc
    gc.freeze()
    sock = socket.socket(fileno=int(sys.argv[1]))
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock, rfd], [], [])
        if rfd in ready:
            try:
                os.read(rfd, 512)
            except BlockingIOError:
                pass
        if rfd in ready or not ready:
            for pid in list(children):
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    children.discard(pid)
                    continue
                if done:
                    children.discard(pid)
                    _report(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if sock in ready:
            try:
                msg = recv_msg(sock)
            except ConnectionResetError:  # (it exited with our reports unread)
                msg = None
            if msg is None:  # the driver is gone: its actors die too (they watch it)
                os._exit(0)
            (kind, env, cwd, argv), fds = msg
            # (Actors may outlive this server: they watch the driver, named in env.)
            env = dict(env, ACTORSHM_PARENT_PID=str(os.getpid()))
            try:
                pid = os.fork()
            except OSError as exc:  # (a process limit): that spawn fails, the server lives
                for fd in fds:
                    os.close(fd)
                _report(sock, ("fork_failed", 0, exc.errno))
                continue
            if pid == 0:
                _actor_process.forked_child_main(sock, rfd, wfd, env, cwd, fds)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            # The driver signals the child through this pidfd, opened before this
            # process can reap it: never through its number, which is free for reuse
            # once it is reaped here.
            # Without pidfds (``_launch._poll_exit``), its start time, read here before
            # it can be reaped, tells the driver whether its number still names it.
            try:
                pidfd, start = [os.pidfd_open(pid)], None
            except (AttributeError, OSError):
                pidfd, start = [], _descendants.process_start(pid)
            try:
                _report(sock, ("forked", pid, start), pidfd)
            finally:
                for fd in pidfd:
                    os.close(fd)


def _report(sock: socket.socket, msg: tuple, fds=()) -> None:
    """Tell the driver; if it is gone (its runtime closed), end quietly, as on EOF."""
    try:
        send_msg(sock, msg, fds)
    except OSError:
        os._exit(0)


if __name__ == "__main__":
    main()
