"""Small process helpers shared by the driver and the actor processes."""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import inspect
import os
import signal
import socket
import sys
import threading

PR_SET_PDEATHSIG = 1


def require_linux(what: str) -> None:
    """Raise a ``RuntimeError`` that says what to do where this is not Linux: the local
    backend and its shared memory are built on Linux's ``memfd_create``, pidfds and
    ``/proc``."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            f"actorshm: {what} needs Linux (it is built on memfd_create, pidfds and "
            f"/proc), and this is {sys.platform!r}: run your program on a Linux machine, "
            "or in a Linux container or virtual machine (Docker, WSL 2)")


def off_stdio(fd: int, keep: bool = False) -> int:
    """``fd``, or a copy of it numbered 3 or above (close-on-exec) in its place when it
    is 0, 1 or 2: where a program closed those (as daemon-style code does), a file the
    library opens takes their number, and the program's prints (a ``print``, a warning,
    a library's log) went into it: into a shared array's memory, or a connection's
    stream of frames. A file of the library's never takes their number. Where no other
    number is free, ``fd`` itself if ``keep``, else it is closed and the error raised."""
    if fd > 2:
        return fd
    try:
        new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError:
        if keep:
            return fd
        os.close(fd)
        raise
    os.close(fd)
    return new


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix stream sockets, numbered off the standard streams
    (``off_stdio``)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if a.fileno() > 2 and b.fileno() > 2:
        return a, b
    try:
        fa = off_stdio(a.detach())
    except BaseException:
        b.close()
        raise
    try:
        fb = off_stdio(b.detach())
    except BaseException:
        os.close(fa)
        raise
    return socket.socket(fileno=fa), socket.socket(fileno=fb)


def pipe() -> tuple[int, int]:
    """``os.pipe()``, numbered off the standard streams (``off_stdio``; close-on-exec,
    as ``os.pipe``'s are)."""
    r, w = os.pipe()
    if r > 2 and w > 2:
        return r, w
    try:
        r = off_stdio(r)
    except BaseException:
        os.close(w)
        raise
    try:
        return r, off_stdio(w)
    except BaseException:
        os.close(r)
        raise


def _no_op_signal(signum, frame) -> None:
    pass


def leave_ctrl_c_to_the_driver() -> None:
    """In the fork server (in the driver's process group, so a terminal's Ctrl-C reaches
    it) and in actor processes (in sessions of their own, out of a terminal's reach, but
    a stray SIGINT may still come): the driver alone handles a Ctrl-C (its runtime stops
    the actors), instead of every process printing the KeyboardInterrupt it got wherever
    it was, as torch's DataLoader workers leave it to their main process. A handler that
    does nothing, not SIG_IGN: an ignored signal stays ignored across exec, and programs
    an actor starts should still stop on a SIGINT; no EINTR for blocking calls in C."""
    signal.signal(signal.SIGINT, _no_op_signal)
    signal.siginterrupt(signal.SIGINT, False)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except Exception:  # pragma: no cover - not Linux
        pass


_forked = False  # this process is a child that a method of its actor forked


def _note_fork() -> None:
    global _forked
    _forked = True


def watch_forks() -> None:
    """In an actor process: a child its methods fork (``os.fork``) and that returns into
    actorshm (rather than exec or exit) exits there (``leave_if_forked``), instead of
    running a copy of the actor on the same socket, answering its calls and outliving it."""
    os.register_at_fork(after_in_child=_note_fork)


def leave_if_forked(code: int = 0) -> None:
    if _forked:
        os._exit(code)


def pipe_end(obj) -> str:
    """The class name of ``obj`` if it is a ``multiprocessing`` pipe end or listener
    (``Connection``, ``PipeConnection``, ``Listener``), else "". Pickled, one is its
    fd's number, which in another process names some other file of that process (and
    closes it when dropped): it must not travel."""
    t = type(obj)
    if getattr(t, "__module__", None) == "multiprocessing.connection" and \
            t.__name__ in ("Connection", "PipeConnection", "Listener"):
        return t.__name__
    return ""


def exit_code(exc: SystemExit) -> int:
    """The process exit code ``sys.exit(exc.code)`` gives: an int as it is, None 0,
    anything else (a message) 1."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "its connection closed"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"it was killed by {name} ({code})"
    return f"it exited with code {code}"


def fill_closed_stdio() -> None:
    """Open ``/dev/null`` on whichever of fds 0, 1 and 2 this process closed, before a
    uvloop loop starts: libuv aborts the process (SIGABRT) when it closes a file of its
    own numbered 0-2, which it gets where those are closed. (Daemon-style code closes
    them; ``/dev/null`` there is what it means: output goes nowhere.)"""
    for fd in (0, 1, 2):
        try:
            fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # (a lower one was closed meanwhile, by another thread)
                os.close(null)


def install_event_loop_policy() -> bool:
    """Use uvloop where it is installed; say whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    fill_closed_stdio()
    import asyncio
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def new_event_loop():
    try:
        import uvloop
    except ImportError:
        import asyncio
        return asyncio.new_event_loop()
    fill_closed_stdio()
    return uvloop.new_event_loop()


def fmt_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def first_line(text: str, limit: int = 300) -> str:
    """A death's cause, short: restart messages must not nest earlier ones whole."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def check_run_args(main) -> None:
    """Raise what ``actorshm.run(main)`` should say when it cannot run ``main``."""
    if not inspect.isawaitable(main):
        if callable(main):
            name = getattr(main, "__name__", "main")
            raise TypeError(f"actorshm.run() takes a coroutine: call the function, "
                            f"actorshm.run({name}()), not actorshm.run({name})")
        raise TypeError(f"actorshm.run() takes a coroutine, such as actorshm.run(main()), "
                        f"not {type(main).__name__}")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    if inspect.iscoroutine(main):
        main.close()  # it will never run: no "never awaited" warning on top
    name = getattr(main, "__name__", "main")
    raise RuntimeError(
        "actorshm.run() cannot be called from a running event loop (a Jupyter notebook, "
        f"IPython, or async code). Await the coroutine instead: `await {name}()` inside "
        "`async with actorshm.Runtime():`, or keep a runtime open across notebook cells "
        "with `rt = await actorshm.Runtime().start()` and end it with `await rt.close()`.")


def coalesced_call(loop, fn):
    """A callable that schedules ``fn()`` on ``loop`` at most once per loop iteration,
    however often and from whichever thread it is called (e.g. once per batch of dying
    blocks, to hand their releases to their connections)."""
    state = {"scheduled": False}
    loop_thread = threading.get_ident()

    def run() -> None:
        state["scheduled"] = False
        fn()

    def hook() -> None:
        if state["scheduled"]:
            return
        state["scheduled"] = True
        try:
            if threading.get_ident() == loop_thread:
                loop.call_soon(run)
            else:
                loop.call_soon_threadsafe(run)
        except RuntimeError:  # loop closed: the process is ending
            state["scheduled"] = False  # (nothing will run: a later call tries again)

    return hook


# Thread-count variables set from an actor's ``num_cpus``, as Ray sets them for its actors.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_PICKLING = ("cloudpickle", "pickle", "copyreg", "copy")


def warn_at_caller(message: str, category: type) -> None:
    """``warnings.warn``, attributed to the first frame outside actorshm and the
    pickling it runs (the user's line that made the call whose arguments gave rise to
    it), however deep in the encoding it is raised: a ``stacklevel`` cannot say."""
    import warnings
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_PACKAGE_DIR) or
                             str(f.f_globals.get("__name__", "")).split(".")[0]
                             in _PICKLING):
        f = f.f_back
    if f is None:
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(message, category, f.f_code.co_filename, f.f_lineno,
                           module=f.f_globals.get("__name__"),
                           registry=f.f_globals.setdefault("__warningregistry__", {}),
                           module_globals=f.f_globals)
