"""actorshm against its floors and peers, side by side, in one interleaved run.

    python -m benchmarks                 # everything installed (ray, torch via '.[bench]')
    python -m benchmarks --quick         # actorshm and the floors, small sizes, < 1 minute
    python -m benchmarks --out docs/benchmarks.md --plots docs   # report and its charts
                                                   # (the file's ## sections are kept)

Every measurement runs in rounds; each round takes a few samples from every contender in
turn, so that this noisy machine's swings hit all of them alike. Only ratios measured in
the same run mean anything; absolute numbers move by 2-10x from one run to the next here.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds 127.0.0.1

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import actorshm  # noqa: E402
from benchmarks import _peers, plots  # noqa: E402
from benchmarks._timing import FAILED, sample as _sample  # noqa: E402
from benchmarks._bench_actors import PipeProducer, Producer, Sink  # noqa: E402

HEADER = _peers.HEADER
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _pct(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


class Table:
    def __init__(self) -> None:
        self.sections: list[tuple[str, list[str], list[list[str]]]] = []
        self.notes: list[str] = []

    def add(self, title, header, rows):
        self.sections.append((title, header, rows))

    def markdown(self) -> str:
        out = []
        for title, header, rows in self.sections:
            out.append(f"### {title}\n")
            out.append("| " + " | ".join(header) + " |")
            out.append("|" + "---|" * len(header))
            for r in rows:
                out.append("| " + " | ".join(r) + " |")
            out.append("")
        return "\n".join(out)


# -- floors ------------------------------------------------------------------------
class _UvloopClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiters: list = []

    def connection_made(self, t) -> None:
        self.t = t

    def data_received(self, data) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while len(buf) - pos >= 8:
            (n,) = HEADER.unpack_from(buf, pos)
            if len(buf) - pos < 8 + n:
                break
            pos += 8 + n
            self.waiters.pop(0).set_result(None)
        del buf[:pos]

    def call(self, payload: bytes):
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.t.write(HEADER.pack(len(payload)) + payload)
        return fut


def _spawn_peer(kind: str):
    a, b = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-m", "benchmarks._peers", kind, str(b.fileno())],
                         pass_fds=[b.fileno()], cwd=ROOT)
    b.close()
    return a, p


class Contenders:
    """Everything a round trip is measured on, started once."""

    async def start(self, quick: bool) -> None:
        self.sink = await Sink.spawn()
        s, self.uv_proc = _spawn_peer("uvloop")
        loop = asyncio.get_running_loop()
        _, self.uv = await loop.connect_accepted_socket(_UvloopClient, s)
        self.raw, self.raw_proc = _spawn_peer("blocking")
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.pipe_proc = ctx.Process(target=_peers.pipe_echo, args=(child,), daemon=True)
        self.pipe_proc.start()
        child.close()
        self.skipped = []
        self.ray = None
        if not quick:
            try:
                import ray  # noqa: F401
                self.ray = await _start_ray()
            except ImportError:
                self.skipped.append("ray not installed: Ray contenders skipped "
                                    "(pip install -e '.[bench]')")
        else:
            self.skipped.append("--quick: Ray not measured")
        try:  # (in --quick too: the goals compare with it)
            import torch  # noqa: F401
            self.torch = _start_torch()
        except ImportError:
            self.torch = None
            self.skipped.append("torch not installed: torch.multiprocessing "
                                "contenders skipped (pip install -e '.[bench]')")

    def close(self) -> None:
        self.uv_proc.kill()
        self.raw.close()
        self.raw_proc.kill()
        self.uv_proc.wait()
        self.raw_proc.wait()
        self.pipe.send(None)
        self.pipe_proc.join(5)
        if self.torch is not None:
            self.torch["q_in"].put(None)
            self.torch["proc"].join(5)


async def _start_ray():  # pragma: no cover - needs ray
    import ray
    from ray.job_config import JobConfig
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             object_store_memory=1 << 30,  # actors import benchmarks/ as this process does
             job_config=JobConfig(code_search_path=[str(ROOT)]))

    @ray.remote
    class RaySink:
        def noop(self, x=None):
            return None

        def touch(self, a):
            return None

    h = RaySink.remote()
    ray.get(h.noop.remote())
    return {"ray": ray, "h": h, "cls": RaySink}


def _torch_echo(q_in, q_out):  # pragma: no cover - needs torch
    while True:
        x = q_in.get()
        if x is None:
            return
        q_out.put(0)


def _start_torch():  # pragma: no cover - needs torch
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_torch_echo, args=(q_in, q_out), daemon=True)
    p.start()
    q_in.put(1)
    q_out.get()
    return {"q_in": q_in, "q_out": q_out, "proc": p}


# -- measurements ------------------------------------------------------------------------
async def round_trips(c: Contenders, rounds: int, per: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    pc = time.perf_counter
    payload = b"x" * 24

    async def actorshm_rt():
        t = pc()
        await c.sink.noop()
        return pc() - t

    async def uvloop_rt():
        t = pc()
        await c.uv.call(payload)
        return pc() - t

    async def raw_rt():
        t = pc()
        c.raw.sendall(HEADER.pack(len(payload)) + payload)
        c.raw.recv(64)
        return pc() - t

    async def pipe_rt():
        t = pc()
        c.pipe.send(1)
        c.pipe.recv()
        return pc() - t

    fns = {"actorshm": actorshm_rt, "asyncio+uvloop socket pair (floor)": uvloop_rt,
           "raw blocking socket pair (floor)": raw_rt, "multiprocessing.Pipe": pipe_rt}
    if c.ray is not None:  # pragma: no cover
        ray, h = c.ray["ray"], c.ray["h"]

        async def ray_get():
            t = pc()
            ray.get(h.noop.remote())
            return pc() - t

        async def ray_await():
            t = pc()
            await h.noop.remote()
            return pc() - t
        fns["Ray actor (ray.get)"] = ray_get
        fns["Ray actor (await)"] = ray_await
    if c.torch is not None:  # pragma: no cover
        async def torch_rt():
            t = pc()
            c.torch["q_in"].put(1)
            c.torch["q_out"].get()
            return pc() - t
        fns["torch.multiprocessing SimpleQueue"] = torch_rt
    for name, fn in fns.items():  # warm-up
        for _ in range(50):
            await fn()
        samples[name] = []
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per):
                samples[name].append(await fn())
    return samples


async def pipelined(c: Contenders, rounds: int, n: int = 100, batches: int = 20):
    rates: dict[str, list[float]] = {"actorshm": [], "asyncio+uvloop socket pair (floor)": []}
    if c.ray is not None:  # pragma: no cover
        rates["Ray actor (await)"] = []
    payload = b"x" * 24
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(batches):
            await asyncio.gather(*[c.sink.noop() for _ in range(n)])
        rates["actorshm"].append(n * batches / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(batches):
            await asyncio.gather(*[c.uv.call(payload) for _ in range(n)])
        rates["asyncio+uvloop socket pair (floor)"].append(
            n * batches / (time.perf_counter() - t))
        if c.ray is not None:  # pragma: no cover
            h = c.ray["h"]
            t = time.perf_counter()
            for _ in range(max(1, batches // 4)):
                await asyncio.gather(*[h.noop.remote() for _ in range(n)])
            rates["Ray actor (await)"].append(n * max(1, batches // 4) /
                                              (time.perf_counter() - t))
    return rates


def _call_and_pipe(c: Contenders, obj, pipe_label: str) -> dict:
    """Timed functions: an actorshm call with ``obj`` as its argument (the sink does
    nothing), and ``obj`` pickled through a ``multiprocessing.Pipe`` (its peer answers
    with a tiny object)."""
    pc = time.perf_counter

    async def actorshm_call():
        t = pc()
        await c.sink.noop(obj)
        return pc() - t

    async def pipe_call():
        t = pc()
        c.pipe.send(obj)
        c.pipe.recv()
        return pc() - t
    return {"actorshm call": actorshm_call, pipe_label: pipe_call}


async def small_arrays(c: Contenders, rounds: int, n: int = 1000) -> dict[str, list[float]]:
    """Seconds per round trip of a list of ``n`` small ordinary arrays (``np.ones(10)``):
    as an actorshm call's argument, and pickled through a ``multiprocessing.Pipe``."""
    small = [np.ones(10) for _ in range(n)]
    return await _sample(_call_and_pipe(c, small, "pickle round trip (multiprocessing.Pipe)"),
                         rounds, reps=5)


async def big_bytes(c: Contenders, sizes: list[int], rounds: int) -> dict[str, dict]:
    """Seconds per call with one ``bytes`` argument of each size (``bytes`` is no
    array: it is pickled, and a pickle this big travels through the sender's shared-memory
    pool, not the socket), against the same object pickled through a
    ``multiprocessing.Pipe`` and, where installed, a Ray actor call."""
    out: dict[str, dict] = {}
    for size in sizes:
        blob = os.urandom(size)
        fns = _call_and_pipe(c, blob, "multiprocessing.Pipe, pickled")
        if c.ray is not None:  # pragma: no cover - needs ray
            async def ray_call():
                t = time.perf_counter()
                c.ray["ray"].get(c.ray["h"].noop.remote(blob))
                return time.perf_counter() - t
            fns["Ray actor call (ray.get)"] = ray_call
        for k, v in (await _sample(fns, rounds)).items():
            out.setdefault(k, {})[size] = statistics.median(v)
    return out


def goals(rt: dict, pl: dict, arr: dict, small: dict, recycle: tuple,
          pipe: tuple) -> list[list[str]]:
    """The targets of the call path, each as a ratio measured in this run, and whether
    it is met. ``recycle``: (actorshm transport, torch transport or None) in seconds;
    ``pipe``: (actorshm actor pipeline, torch pattern or None) in seconds per batch."""
    med = statistics.median
    trivial, floor = med(rt["actorshm"]), med(rt["asyncio+uvloop socket pair (floor)"])
    rows = [["trivial call vs the uvloop socket-pair floor", "<= 1.20x", trivial / floor,
             trivial / floor <= 1.2]]
    tq = rt.get("torch.multiprocessing SimpleQueue")
    rows.append(["trivial call vs torch.multiprocessing SimpleQueue round trip", "< 1.00x",
                 trivial / med(tq) if tq else None, tq is not None and trivial < med(tq)])
    prate = med(pl["actorshm"]) / med(pl["asyncio+uvloop socket pair (floor)"])
    rows.append(["pipelined calls (100 in flight), rate vs the floor's", ">= 0.70x", prate,
                 prate >= 0.7])
    shared = arr["actorshm, shared argument"]
    worst = max(shared, key=lambda size: shared[size])
    rows.append([f"call with a shared array (worst size: {_size(worst)}) vs a trivial call",
                 "<= 1.30x", shared[worst] / trivial, shared[worst] / trivial <= 1.3])
    r = med(small["actorshm call"]) / med(small["pickle round trip (multiprocessing.Pipe)"])
    rows.append(["call carrying 1,000 `np.ones(10)` vs a pickle round trip of the list",
                 "<= 1.20x", r, r <= 1.2])
    ours, torch_t = recycle
    rows.append(["64 MiB recycling loop, transport vs torch's buffer-return pattern",
                 "<= 0.10x", ours / torch_t if torch_t else None,
                 bool(torch_t) and ours / torch_t <= 0.1])
    ours, torch_t = pipe
    rows.append(["64 MiB producer → consumer actors (no driver) vs torch's two-process "
                 "pattern", "<= 1.00x", ours / torch_t if torch_t else None,
                 bool(torch_t) and ours <= torch_t])
    return [[g, target, "not measured" if v is None else f"{v:.2f}x",
             "not measured" if v is None else ("met" if ok else "**not met**")]
            for g, target, v, ok in rows]


async def array_sizes(c: Contenders, sizes: list[int], rounds: int):
    """Median seconds per call with an argument of each size, per contender."""
    out: dict[str, dict[int, float]] = {}
    for size in sizes:
        shared = actorshm.empty(size, np.uint8)
        shared[::4096] = 1
        ordinary = np.ones(size, np.uint8)
        dst = np.empty(size, np.uint8)
        reps = 2 if size >= 512 * MiB else (5 if size >= 64 * MiB else 30)
        fns = {}

        async def shm_shared():
            t = time.perf_counter()
            await c.sink.touch(shared)
            return time.perf_counter() - t

        async def shm_ordinary():
            t = time.perf_counter()
            await c.sink.touch(ordinary)
            return time.perf_counter() - t

        async def pipe_pickled():
            t = time.perf_counter()
            c.pipe.send(ordinary)
            c.pipe.recv()
            return time.perf_counter() - t

        async def memcpy():
            t = time.perf_counter()
            np.copyto(dst, ordinary)
            return time.perf_counter() - t

        fns["actorshm, shared argument"] = shm_shared
        fns["actorshm, ordinary argument (copied once)"] = shm_ordinary
        fns["multiprocessing.Pipe, pickled"] = pipe_pickled
        fns["numpy memcpy (floor)"] = memcpy
        if c.ray is not None and size <= 512 * MiB:  # pragma: no cover
            ray, h = c.ray["ray"], c.ray["h"]
            ref = ray.put(ordinary)

            async def ray_arg():
                t = time.perf_counter()
                ray.get(h.touch.remote(ordinary))
                return time.perf_counter() - t

            async def ray_ref():
                t = time.perf_counter()
                ray.get(h.touch.remote(ref))
                return time.perf_counter() - t
            fns["Ray, argument"] = ray_arg
            fns["Ray, put once, pass ref"] = ray_ref
        # The zero-copy call is cheap at every size: sample it as often as a small
        # call, so that one slow wake-up does not make its median.
        samples = await _sample(fns, rounds, {k: 30 if k == "actorshm, shared argument"
                                              else reps for k in fns})
        for k, v in samples.items():
            out.setdefault(k, {})[size] = statistics.median(v)
        del shared, ordinary, dst
    return out


async def recycling(batch: int, n: int, warm: int = 5):
    prod = await Producer.spawn(batch)
    cons = await Sink.spawn()
    for i in range(warm):
        b = await prod.batch(i)
        await cons.touch(b)
        del b
    await asyncio.sleep(0.05)
    p0, c0, d0 = await prod.stats(), await cons.stats(), actorshm.stats()
    t = time.perf_counter()
    for i in range(n):
        b = await prod.batch(i)
        await cons.touch(b)
        del b
    per = (time.perf_counter() - t) / n
    await asyncio.sleep(0.05)
    p1, c1, d1 = await prod.stats(), await cons.stats(), actorshm.stats()
    copied = sum(b["bytes_copied"] - a["bytes_copied"] for a, b in ((p0, p1), (c0, c1), (d0, d1)))
    allocs = sum(b["pool_allocs"] - a["pool_allocs"] for a, b in ((p0, p1), (c0, c1), (d0, d1)))
    # the refill alone, in-process, for the transport share of a round
    buf = np.empty(batch, np.uint8)
    buf[:] = 0  # pages faulted in, as a recycled buffer's are
    t = time.perf_counter()
    for i in range(n):
        buf[::4096] = i
    refill = (time.perf_counter() - t) / n
    await prod.kill()
    await cons.kill()
    return per, refill, copied / n, allocs / n


async def actor_pipeline(batch: int, n: int) -> tuple[float, float]:
    """(seconds per batch, new pool blocks per batch) of a producer actor feeding a
    consumer actor directly, two batches in flight (``PipeProducer``)."""
    prod, cons = await asyncio.gather(PipeProducer.spawn(batch), Sink.spawn())
    try:
        per, allocs = await prod.run(cons, n)
    finally:
        await asyncio.gather(prod.kill(), cons.kill())
    return per, allocs / n


def torch_recycling(batch: int, n: int):  # pragma: no cover - needs torch
    """ms per batch of torch.multiprocessing's buffer-return pattern (2 buffers)."""
    import torch
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    bufs = [torch.zeros(batch, dtype=torch.uint8).share_memory_() for _ in range(2)]
    q_full, q_free, q_result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    for i in range(2):
        q_free.put(i)
    cons = ctx.Process(target=_peers.torch_consumer, args=(q_full, q_free, bufs, q_result))
    prod = ctx.Process(target=_peers.torch_producer, args=(q_full, q_free, bufs, n + 5))
    cons.start()
    prod.start()
    per = q_result.get()
    prod.join()
    cons.join()
    del torch
    return per


def ray_startup(count: int):  # pragma: no cover - needs ray
    import ray

    @ray.remote
    class Empty:
        def noop(self):
            return None

    t = time.perf_counter()
    hs = [Empty.remote() for _ in range(count)]
    ray.get([h.noop.remote() for h in hs])
    el = time.perf_counter() - t
    for h in hs:
        ray.kill(h)
    return el


async def startup(method: str, count: int) -> float:
    """Seconds until ``count`` actors started at once (``ActorGroup.spawn``) all run."""
    async with actorshm.Runtime(start_method=method):
        t = time.perf_counter()
        await actorshm.ActorGroup.spawn(Sink, count)
        return time.perf_counter() - t


async def broadcast(size: int, n: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per call with one shared array: to one actor, to a group of ``n`` (one
    call encoded once for all), and to the same ``n`` one call each (``asyncio.gather``);
    with the driver's CPU seconds per call (``time.process_time``), which the other
    processes' noise moves less than the wall clock."""
    group = await actorshm.ActorGroup.spawn(Sink, n)
    one = group[0]
    a = actorshm.empty(size, np.uint8)
    a[::4096] = 1
    fns = {"one actor": lambda: one.touch(a), f"group of {n}": lambda: group.touch(a),
           f"{n} calls, one each (asyncio.gather)":
               lambda: asyncio.gather(*(h.touch(a) for h in group))}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        await fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            c = time.process_time()
            for _ in range(10):
                t = time.perf_counter()
                await fn()
                samples[k].append(time.perf_counter() - t)
            cpu[k].append((time.process_time() - c) / 10)
    del a
    await group.kill()
    return {"wall": samples, "cpu": cpu}


# -- report ------------------------------------------------------------------------
def _us(x):
    return f"{x * 1e6:.0f}"


def _ms(x):
    return f"{x * 1e3:.3f}" if x < 0.01 else f"{x * 1e3:.1f}"


def _size(n):
    return f"{n // GiB} GiB" if n >= GiB else (f"{n // MiB} MiB" if n >= MiB else
                                               f"{n // KiB} KiB")


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    try:
        import uvloop
        uv = uvloop.__version__
    except ImportError:  # pragma: no cover
        uv = "not installed"
    return (f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
            f"Linux {platform.release()}, Python {platform.python_version()}, numpy "
            f"{np.__version__}, uvloop {uv}, actorshm {actorshm.__version__}")


async def run(args, data: dict | None = None) -> str:
    """Measure everything; return the Markdown report. ``data`` gets the raw numbers
    the charts are drawn from (see ``benchmarks.plots.write``)."""
    data = {} if data is None else data
    quick = args.quick
    table = Table()
    c = Contenders()
    await c.start(quick)
    try:
        ray_rows: list = []
        rt = await round_trips(c, rounds=5 if quick else 20, per=100 if quick else 200)
        floor = statistics.median(rt["asyncio+uvloop socket pair (floor)"])
        rows = []
        for k, v in rt.items():
            m = statistics.median(v)
            rows.append([k, _us(m), _us(_pct(v, 0.99)), f"{m / floor:.2f}x"])
        data["latency"] = {k: (statistics.median(v), _pct(v, 0.99)) for k, v in rt.items()}
        table.add("Trivial call round trip", ["contender", "median µs", "p99 µs",
                                              "vs uvloop floor"], rows)
        pl = await pipelined(c, rounds=3 if quick else 8)
        pfloor = statistics.median(pl["asyncio+uvloop socket pair (floor)"])
        data["throughput"] = {k: statistics.median(v) for k, v in pl.items()}
        table.add("Pipelined calls, 100 in flight", ["contender", "calls/s",
                                                     "vs uvloop floor"],
                  [[k, f"{statistics.median(v):,.0f}", f"{statistics.median(v) / pfloor:.2f}x"]
                   for k, v in pl.items()])
        sizes = [KiB, MiB, 64 * MiB] if quick else [KiB, MiB, 64 * MiB, 512 * MiB, GiB]
        arr = await array_sizes(c, sizes, rounds=2 if quick else 3)
        data["arrays"] = arr
        trivial = statistics.median(rt["actorshm"])
        rows = []
        for k, per_size in arr.items():
            rows.append([k] + [f"{_ms(per_size[s])} ms ({s / per_size[s] / 1e9:.1f} GB/s)"
                               if s in per_size else "not measured" for s in sizes])
        table.add("A call with a numpy argument (median; effective GB/s)",
                  ["contender"] + [_size(s) for s in sizes], rows)
        for size in sizes[2:]:
            shared_big = arr["actorshm, shared argument"][size]
            table.notes.append(f"A {_size(size)} shared argument costs "
                               f"{shared_big / trivial:.2f}x a trivial call "
                               f"({_ms(shared_big)} ms vs {_us(trivial)} µs).")
        ray_512 = [(what, arr[k][512 * MiB] / arr["actorshm, shared argument"][512 * MiB])
                   for k, what in (("Ray, argument", "passing it as an argument"),
                                   ("Ray, put once, pass ref", "its put-once reference"))
                   if 512 * MiB in arr.get(k, {})]
        if ray_512:  # pragma: no cover - needs ray
            table.notes.append("512 MiB: Ray " + "; ".join(
                f"{what} takes {r:.1f}x" for what, r in ray_512) + " actorshm's time.")
        if "Ray actor (ray.get)" in rt:  # pragma: no cover
            table.notes.append(
                f"Trivial call: Ray (ray.get) takes "
                f"{statistics.median(rt['Ray actor (ray.get)']) / trivial:.0f}x actorshm's time.")
        sm = await small_arrays(c, rounds=3 if quick else 8)
        data["small_arrays"] = {k: statistics.median(v) for k, v in sm.items()}
        small_ref = statistics.median(sm["pickle round trip (multiprocessing.Pipe)"])
        table.add("A call carrying a list of 1,000 small ordinary arrays (`np.ones(10)`)",
                  ["contender", "median ms", "vs pickle round trip"],
                  [[k, _ms(statistics.median(v)), f"{statistics.median(v) / small_ref:.2f}x"]
                   for k, v in sm.items()])
        bsizes = [MiB, 16 * MiB] if quick else [MiB, 16 * MiB, 64 * MiB]
        bb = await big_bytes(c, bsizes, rounds=3 if quick else 7)
        data["big_bytes"] = bb
        table.add("A call with one big `bytes` argument (median ms)",
                  ["contender"] + [_size(s) for s in bsizes],
                  [[k] + [_ms(v[s]) if s in v else "not measured" for s in bsizes]
                   for k, v in bb.items()])
        per, refill, copied, allocs = await recycling(64 * MiB, 10 if quick else 40)
        rows = [["actorshm", _ms(per), _ms(refill), _ms(max(per - refill, 0)), f"{copied:.0f}",
                 f"{allocs:.2f}"]]
        torch_transport = None
        if c.torch is not None:  # pragma: no cover
            tper = torch_recycling(64 * MiB, 10 if quick else 40)
            torch_transport = max(tper - refill, 0)
            rows.append(["torch.multiprocessing queues, buffer-return pattern", _ms(tper),
                         _ms(refill), _ms(torch_transport), "0", "0"])
        table.add("Recycling loop, 64 MiB batches (producer fills, consumer touches, "
                  "buffer goes home)",
                  ["contender", "ms per batch", "refill alone ms", "transport ms",
                   "bytes copied/batch", "new blocks/batch"], rows)
        # The same batches between two actors, no driver in between, against the same
        # torch pattern, alternated round by round.
        ours_pipe, torch_pipe, pipe_allocs = [], [], []
        for r in range(2 if quick else 3):
            p, a = await actor_pipeline(64 * MiB, 10 if quick else 40)
            ours_pipe.append(p)
            pipe_allocs.append(a)
            if c.torch is not None:  # pragma: no cover
                torch_pipe.append(tper if r == 0 else
                                  torch_recycling(64 * MiB, 10 if quick else 40))
        pipe = (statistics.median(ours_pipe),
                statistics.median(torch_pipe) if torch_pipe else None)
        rows = [["actorshm: producer actor calls consumer actor, 2 in flight", _ms(pipe[0]),
                 f"{max(pipe_allocs):.2f}"]]
        if pipe[1] is not None:  # pragma: no cover
            rows.append(["torch.multiprocessing queues, buffer-return pattern (2 buffers)",
                         _ms(pipe[1]), "0"])
        data["pipeline"] = {"actorshm": pipe[0], "torch": pipe[1]}
        table.add("Producer → consumer pipeline of actors, 64 MiB batches, no driver in "
                  "between (median of rounds)", ["contender", "ms per batch (refill included)",
                                                  "new blocks/batch"], rows)
        table.add("Goals of the call path (ratios from this run)",
                  ["goal", "target", "measured", ""],
                  goals(rt, pl, arr, sm, (max(per - refill, 0), torch_transport), pipe))
        if c.ray is not None:  # pragma: no cover
            from benchmarks import ray_backend
            res = await ray_backend.measure(quick)
            data["ray_backend"] = res
            table.add("The Ray backend: actorshm on Ray next to raw Ray",
                      ray_backend.HEADER, ray_backend.rows(res))
        size, n = (64 * MiB, 4) if quick else (512 * MiB, 8)
        bc = await broadcast(size, n, rounds=3 if quick else 10)
        one = statistics.median(bc["wall"]["one actor"])
        table.add(f"Broadcast: one shared {_size(size)} array to a group of {n} actors "
                  "(`await group.touch(a)`)",
                  ["call", "median ms", "p99 ms", "vs one actor", "driver CPU µs/call"],
                  [[k, _ms(statistics.median(v)), _ms(_pct(v, 0.99)),
                    f"{statistics.median(v) / one:.2f}x",
                    _us(statistics.mean(bc["cpu"][k]))] for k, v in bc["wall"].items()])
        from benchmarks.group_send import send_cost
        sc = await send_cost(n, rounds=50 if quick else 200)
        table.add(f"Broadcast: the driver's own work to send a group call, per member "
                  f"({n} connections, no process woken)",
                  ["call", "median µs per member"], [[k, f"{v:.1f}"] for k, v in sc.items()])
        from benchmarks.streaming import rows as stream_rows, streaming
        st = await streaming(quick)
        data["streaming"] = st
        table.add("Streaming method vs the same items by individual calls (one awaited "
                  "at a time)", ["items", "streamed items/s", "individual calls items/s",
                                 "streaming speed-up"], stream_rows(st))

        from benchmarks import torch_tensors
        await torch_tensors.section(c, table, data, quick, trivial, _ms, _size)
        ray_rows = []
        many_label = f"{4 if quick else 16} actors at once"
        data["startup"] = {}
        if c.ray is not None:  # pragma: no cover
            one, many = ray_startup(1), ray_startup(16)
            ray_rows = [["Ray actors", _ms(one), _ms(many)]]
            data["startup"]["Ray actors"] = {"1 actor": one, many_label: many}
    finally:
        c.close()
    rows = []
    ours: dict = {}
    for method in ("spawn", "forkserver"):
        one = await startup(method, 1)
        many = await startup(method, 4 if quick else 16)
        rows.append([f"actorshm ({method})", _ms(one), _ms(many)])
        ours[f"actorshm ({method})"] = {"1 actor": one, many_label: many}
    data["startup"] = {**ours, **data["startup"]}
    rows += ray_rows
    table.add("Actor start-up", ["contender", "1 actor ms",
                                 f"{4 if quick else 16} actors at once "
                                 "(`ActorGroup.spawn`) ms"], rows)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    notes = "\n".join(f"- {n}" for n in table.notes + c.skipped + FAILED +
                      [f"Peak RSS of the driver: {rss:.0f} MiB."])
    data["title"] = f"{_command(args)}, {machine()}"
    return (f"# Benchmarks\n\nMachine: {machine()}.\n"
            f"Command: `{_command(args)}`.\n\n"
            f"{_READING}\n{_pinned() if args.pin_cpu is not None else ''}"
            f"{table.markdown()}\n{notes}\n")


def _command(args) -> str:
    return (f"python -m benchmarks{' --quick' if args.quick else ''}"
            f"{'' if args.pin_cpu is None else f' --pin-cpu {args.pin_cpu}'}")


def _with_charts(report: str, section: str) -> str:
    """The report with its charts before the first table."""
    head, sep, tables = report.partition("\n### ")
    return f"{head}\n{section}{sep.lstrip()}{tables}" if sep else report + section


def _pinned() -> str:
    cpus = ", ".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return _PINNED.format(cpus=cpus)


_PINNED = """\
This run pins every process to CPU {cpus} (`--pin-cpu`). A round trip then costs the
software on both sides, one after the other, and no cross-CPU wake-up: on a virtual
machine such a wake-up can cost more than the call itself, and where the scheduler puts
two processes decides it, so unpinned latencies vary several-fold from run to run.
Throughput and start-up are lower than unpinned (one CPU does all the work).

"""

_READING = """\
All contenders are measured in one run, interleaved round by round, so the machine's
noise (this 2-core box's wake-up latency swings between 5 and 80 µs from run to run)
hits every one alike: read the ratios, not the absolute numbers. The floors are what no
design can beat: a raw blocking socket-pair ping-pong, an asyncio + uvloop socket-pair
ping-pong with length-prefixed frames (the floor for any asyncio design), and numpy's
memcpy bandwidth. Array calls pass the array and touch one element; nothing is summed.
Peers that are not installed are skipped with a line below (`pip install -e '.[bench]'`
brings Ray and PyTorch). On a virtual machine, where a wake-up on another CPU can cost
more than the call itself, `--pin-cpu 0` runs every process on one CPU and shows the
software's own cost (docs/benchmarks-pinned.md).
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="actorshm, its floors and the local peers (no Ray), sizes up to 64 MiB, a few "
                        "minutes at most")
    p.add_argument("--out", help="also write the Markdown report to this file")
    p.add_argument("--pin-cpu", type=int, metavar="N",
                   help="run every process (this one and all it starts) on CPU N: "
                        "measures software cost without cross-CPU wake-ups")
    p.add_argument("--plots", metavar="DIR",
                   help="also draw the results as PNG charts (matplotlib) into DIR; the "
                        "report embeds them")
    args = p.parse_args(argv)
    if args.plots is not None:
        try:
            import matplotlib  # noqa: F401  (checked before measuring, not after)
        except ImportError:
            p.error("--plots needs matplotlib: pip install -e '.[bench]'")
    if args.pin_cpu is not None:
        try:
            os.sched_setaffinity(0, {args.pin_cpu})  # inherited by every process started
        except (OSError, ValueError, OverflowError):
            p.error(f"--pin-cpu {args.pin_cpu}: this process may run on CPUs "
                    f"{sorted(os.sched_getaffinity(0))}; pick one of those")
    data: dict = {}
    report = actorshm.run(run(args, data))
    if args.plots is not None:
        paths = plots.write(data, args.plots)
        base = Path(args.out).parent if args.out else Path.cwd()
        report = _with_charts(report, plots.markdown(paths, base, _command(args)))
    print(report)
    if args.out:
        out = Path(args.out)
        kept = _analysis(out.read_text()) if out.exists() else ""
        out.write_text(f"{report.rstrip()}\n\n{kept}" if kept else report)


def _analysis(text: str) -> str:
    """The hand-written part of a report file: everything from its first ``## ``
    heading on (the measured report has only ``###`` headings), kept when ``--out``
    rewrites the file, so a new run updates the tables without erasing the analysis."""
    at = text.find("\n## ")
    return text[at + 1:] if at >= 0 else ""


if __name__ == "__main__":
    main()
