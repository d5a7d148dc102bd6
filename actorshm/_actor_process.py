"""An actor process's life: started, run until told to stop, and exited.

``main`` runs on the socket fd the driver passed (the ``spawn`` start method runs it
through ``python -c``); ``forked_child_main`` turns a fork server's child into an actor
process and calls ``main``. An actor that is asked to stop (its runtime closes, a method
calls ``sys.exit``) ends as a Python program does, while its connections are still open
(``_end_like_a_program``); then both end with ``os._exit``, since the interpreter's own
teardown could only run more of the user's code against closed sockets. Between start
and exit the process belongs to its ``_worker.Worker``.
"""

from __future__ import annotations

import asyncio
import atexit
import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import weakref

from . import _client, _descendants, _leases
from ._introspect import STACK_SIGNAL
from ._util import (coalesced_call, exit_code, leave_ctrl_c_to_the_driver, new_event_loop,
                    watch_forks)
from ._worker import Worker


async def _amain(fd: int) -> int:
    loop = asyncio.get_running_loop()
    worker = Worker(loop, fd)
    watch_forks()
    _client.set_worker(worker)
    worker.release_hook = coalesced_call(loop, _leases.dispatch_releases)
    _leases.set_release_hook(worker.release_hook)  # (a runtime opened here gives it back)
    _leases.set_forward_notices(True)  # an actor that dies must not strand its relays' blocks
    try:
        await worker.stopped
        limit = _exit_when_overdue(worker)
        if limit is not None:
            # Its connections close before its atexit functions run: the driver, told
            # this, waits for its exit (it kills a process that closed one by mistake),
            # and it and the peers send the calls made from now on to its restart.
            worker.leaving = limit  # (and on the links it gets from now on: ``_worker``)
            for c in worker.connections():
                c.say_leaving(limit)
        await _end_like_a_program(worker, worker.shutdown_grace / 8)
        await _wait_for_gpu_leases(worker, worker.shutdown_grace / 4)
    finally:
        worker._closing = True
        worker.exited = True  # (no queued call starts while the last writes go out)
        # What came back goes out before we do. Peers may live on, holding blocks we
        # passed them: closing keeps those, and our forward notices for them stand, so
        # their owners keep them too. (Closing the peers may let go of more: the
        # driver's connection goes last.)
        # One time limit for them all, within what is left of the driver's grace (it
        # asked us to stop, and sends SIGTERM once that has passed: the waits above
        # take at most 3/8 of it, with the user's own clean-up besides); peers that do
        # not read take at most half of it, so the driver's last frames get the rest.
        now = loop.time()
        end = now + worker.shutdown_grace / 2
        peers_end = now + worker.shutdown_grace / 4
        for c in [*worker.peers.values(), *worker.peers_leaving, worker.driver]:
            _leases.dispatch_releases()
            c.send_owed()
            await _written(c, (end if c is worker.driver else peers_end) - loop.time())
            c.close(peer_gone=False)
        if worker.executor is not None:
            worker.executor.shutdown(wait=False, cancel_futures=True)
    return worker.exit_code


async def _end_like_a_program(worker: "Worker", timeout: float) -> None:
    """What a Python program does as it ends, done by a stopping actor while its
    connections are open: its tasks (running async calls, streams, tasks its methods
    started) are cancelled and given up to ``timeout`` seconds for their ``finally``
    blocks, as ``asyncio.run`` does with the tasks left at the end; then the instance is
    dropped (its ``__del__`` runs, and files only it holds are flushed and closed). The
    ``atexit`` functions run once the event loop has stopped (``main``), and then, if a
    reference cycle kept the instance, a garbage collection. A sync call
    still running in a thread keeps the instance; non-daemon threads are not waited for.
    All of it has the runtime's ``shutdown_grace``: the process then exits regardless
    (``_exit_when_overdue``, started before), so that calls on it end with its death."""
    # The cycles made before are collected at the end, after the atexit functions
    # (``main``), as a program's are: not by a collection that allocations here happen
    # to start. (Frozen, not disabled: what the clean-up makes is collected as usual.)
    gc.freeze()
    # No call starts now (``Worker.stop``): those queued are dropped (their callers hear
    # of the actor's end); streams that are stopped still take slots in turn, to run
    # their finally blocks.
    streams = [entry for entry in worker.queue if entry[0] is None]
    worker.queue.clear()
    worker.queue.extend(streams)
    for conn, cid in list(worker.running_calls):
        worker.cancel_call(conn, cid)
    await _cancel_tasks(timeout)
    worker.exited = True
    # What is owed goes out first, in case the user's clean-up never ends.
    _leases.dispatch_releases()
    for c in worker.connections():
        c.send_owed()
    if worker.instance is None:  # (its __init__ failed)
        return
    try:
        alive = weakref.ref(worker.instance)
    except TypeError:  # (a class with __slots__ and no __weakref__)
        alive = None
    worker.instance = None
    # Kept by a cycle (a full collection: tens of milliseconds where numpy and torch are
    # loaded), it is collected after the ``atexit`` functions, as a program's cycles
    # are at its end: libraries count on that order (a DataLoader iterator that a
    # method's exception keeps in a cycle joins its workers for 5 s unless torch's exit
    # function ran first).
    worker.collect_at_exit = alive is None or alive() is not None


async def _cancel_tasks(timeout: float) -> None:
    """Cancel every task but this one; wait up to ``timeout`` for them to end. (A
    function of its own: no variable of the caller's keeps one, and the instance
    its frames refer to, alive.)"""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


_LEAST_CLEAN_UP = 0.5  # seconds a clean-up gets after sys.exit even with shutdown_grace=0


def _exit_when_overdue(worker: "Worker") -> float | None:
    """Exit (``os._exit``) should this stopping actor still run ``shutdown_grace`` from
    now: its clean-up hangs (an ``atexit`` function joining a process that never ends).
    A thread's timer, as the clean-up may hold the event loop. (A runtime that closes
    sends SIGTERM at that time too; a method's ``sys.exit`` has no one else to.)

    Returns:
        The seconds it gives the clean-up, or None if no timer could be started.
    """
    limit = max(worker.shutdown_grace, _LEAST_CLEAN_UP)

    def overdue() -> None:
        try:  # (straight to fd 2: a method may have closed sys.stderr, or a hung
            # clean-up may hold its lock)
            os.write(2, f"actorshm: actor {worker.cls_name}'s clean-up (finally, "
                        f"__del__, atexit) did not end within {limit:g} s (its runtime's "
                        "shutdown_grace): it exits now\n".encode())
        except Exception:
            pass
        finally:
            os._exit(worker.exit_code)
    timer = threading.Timer(limit, overdue)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # at its limit of threads (ulimit -u): the clean-up goes untimed
        return None  # (the driver kills it 0.3 s after its connection closes)
    return limit


async def _written(conn, timeout: float) -> None:
    """Wait, at most ``timeout`` seconds, until what ``conn`` has queued is written: the
    last reply (a big ``__init__`` error, say) is not cut off by the exit."""
    if conn.closed or not conn._out:
        return
    timeout = max(timeout, 0.0)
    done = asyncio.get_running_loop().create_future()
    conn.after_item(conn._out[-1], lambda ok: done.done() or done.set_result(ok))
    conn.flush_now()
    try:
        await asyncio.wait_for(done, timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass  # the peer does not read: it goes without


async def _wait_for_gpu_leases(worker: "Worker", timeout: float) -> None:
    """Before a stopping actor exits, let peers give back the GPU blocks it lent them.

    CUDA frees a process's device memory when the process exits, whoever still has it
    open (unlike host memory, which lives on while mapped): a peer still holding one of
    our GPU arrays would then read freed memory. So wait, a bounded time, and say so if
    some are still out.
    """
    held = await worker.grants_out(lambda g: g.block.region.device is not None, timeout, 0.01)
    if held:
        print(f"actorshm: actor {worker.cls_name} exits while peers still hold {held} "
              "of its GPU blocks; those arrays are invalid from now on (CUDA frees a "
              "process's device memory when it exits). Drop GPU arrays an actor sent "
              "you before stopping it.", file=sys.stderr, flush=True)


def main() -> None:
    """Run this actor process on the socket fd in ``sys.argv[1]``; exits the process."""
    # Before anything else: a session of its own, and the watchdog that ends it (what
    # it starts goes with it) when it exits or its driver does (even one killed by a
    # signal; its parent may be a fork server, which may die first).
    _descendants.start_watchdog()  # (a spawned actor's bootstrap did it already)
    faulthandler.enable()
    faulthandler.register(STACK_SIGNAL, all_threads=True)  # rt.dump_stacks's fallback
    leave_ctrl_c_to_the_driver()
    # Its output reaches the driver a line (or a progress bar's "\r") at a time: a fork
    # server's child, and a spawned actor under -E or -I (which ignore PYTHONUNBUFFERED),
    # would hold it until 8 KiB had gathered.
    for f in (sys.stdout, sys.stderr):
        if hasattr(f, "reconfigure"):  # (a sitecustomize may have replaced them)
            f.reconfigure(line_buffering=True)
    os.set_inheritable(fd := int(sys.argv[1]), False)  # (not for programs it starts)
    extra = os.environ.pop("ACTORSHM_SYS_PATH", None)
    if extra:
        path = json.loads(extra)
        sys.path[:] = path + [p for p in sys.path if p not in path]
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        task = loop.create_task(_amain(fd))
        while True:
            try:
                code = loop.run_until_complete(task)
                break
            except SystemExit as exc:  # raised in a task a method started (or a
                # callback): it ends the loop, not the stop, which goes on as after a
                # method's sys.exit
                worker = _client.current_worker()
                if worker is None:
                    code = exit_code(exc)
                    break
                worker._exit(exc, "a task of the actor")
                _quiet_about(loop, exc)
        # As at a program's end, once its event loop has stopped (an exit function may
        # run one of its own: ``asyncio.run(client.aclose())``).
        atexit._run_exitfuncs()
        worker = _client.current_worker()
        if worker is not None and worker.collect_at_exit:
            gc.unfreeze()
            gc.collect()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (ValueError, OSError):  # a method closed it, or the pipe is gone
                pass
    # Skip interpreter teardown: it can only run user __del__s against closed sockets.
    os._exit(code)


def _quiet_about(loop, exc: SystemExit) -> None:
    """The task that raised ``exc`` holds it, never retrieved: when that task is
    collected, asyncio would log it with its traceback, after the actor said what
    happened. Drop that report (any other goes to the handler set before)."""
    before = loop.get_exception_handler()

    def handler(loop, context) -> None:
        if context.get("exception") is exc and \
                "never retrieved" in context.get("message", ""):
            return
        if before is not None:
            before(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def forked_child_main(server_sock, rfd, wfd, env, cwd, fds) -> None:
    """Become an actor process: the fork server's child, right after ``fork``.

    Drops the server's sockets and signal set-up, takes the driver's environment and
    working directory, puts the pipes it was given on stdout and stderr, and runs
    ``main`` on the actor's socket. Never returns.

    Args:
        server_sock: the fork server's socket to the driver (closed here).
        rfd, wfd: the server's signal wake-up pipe (closed here).
        env, cwd: the environment and working directory the driver asked for.
        fds: the actor's socket, and its stdout and stderr pipe ends.
    """
    ready = False
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        server_sock.close()
        os.close(rfd)
        os.close(wfd)
        conn_fd, out_fd, err_fd = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(env)
        _blas_threads(env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["actorshm-worker", str(conn_fd)]
        ready = True
        main()
    except BaseException as exc:
        if not ready:  # (the driver quotes its stderr: say why, as a spawn's error does)
            os.write(2, f"actorshm: the forked actor process could not start: "
                        f"{type(exc).__name__}: {exc}\n".encode(errors="replace"))
    finally:
        os._exit(1)


def _blas_threads(env: dict) -> None:
    """Give the BLAS that the fork server loaded (with one thread) the count this actor's
    environment asks for, when it is not one: numpy read it before the fork. Needs
    threadpoolctl (scikit-learn brings it); without it such an actor keeps one thread."""
    n = env.get("OPENBLAS_NUM_THREADS") or env.get("OMP_NUM_THREADS")
    if n is None or n.strip() == "1":
        return
    try:
        import threadpoolctl
        threadpoolctl.threadpool_limits(int(n), user_api="blas")
    except Exception:  # (no threadpoolctl, a count that is no number): as it was
        pass


if __name__ == "__main__":
    main()
