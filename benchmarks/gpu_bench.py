"""GPU benchmark: CuPy arrays via CUDA IPC against staging them through host memory.

    python benchmarks/gpu_bench.py            # on a GPU machine (part of gpu_check.sh)
    python benchmarks/gpu_bench.py --quick    # small sizes: checks the script, not speed

Rows, each the median of interleaved samples:
- a trivial call (the floor every call pays);
- a call whose argument is a large CuPy array in an actorshm block, via CUDA IPC: dropped
  unread (what the transport and the lease cost), and written by a kernel the actor waits
  for, beside that kernel's own time in one process;
- the same bytes staged through host memory: device -> shared host array in the sender,
  host -> device in the receiver (what a CPU-only transport, or Ray's default object store
  path for GPU tensors, amounts to);
- the recycled steady state of a producer -> consumer GPU batch stream through the
  driver, with the slabs allocated and bytes copied per batch after warm-up;
- where torch sees the GPU: the same large argument as a torch CUDA tensor from
  ``actorshm.torch.empty(device="cuda")`` (CUDA IPC), and as an ordinary torch CUDA
  tensor (copied once on the device into the pool).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import actorshm  # noqa: E402
from actorshm import actor  # noqa: E402


@actor
class GpuSink:
    def noop(self):
        return None

    def take(self, x):
        return None  # the argument arrives and is dropped: transport and leases only

    def touch(self, x):
        x[:1] = 1  # a kernel on the received memory, then wait for it
        cupy.cuda.get_current_stream().synchronize()
        return x.shape

    def touch_torch(self, t):
        import torch
        t[:1] = 1
        torch.cuda.synchronize()
        return tuple(t.shape)

    def touch_host(self, h):
        d = cupy.asarray(h)  # host -> device in the receiver
        d[:1] = 1
        cupy.cuda.get_current_stream().synchronize()
        return d.shape


@actor
class GpuProducer:
    def __init__(self, n):
        self.n = n

    def batch(self, value):
        a = actorshm.cuda.empty(self.n, cupy.uint8)
        a.fill(value)
        return a

    def stats(self):
        return actorshm.stats()


def _ms(samples):
    return statistics.median(samples) * 1e3


def _kernel_floor(x, n: int) -> float:
    """Median ms of what ``GpuSink.touch`` does on the GPU, in one process: the floor
    under a call that runs a kernel on its argument and waits for it."""
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        x[:1] = 1
        cupy.cuda.get_current_stream().synchronize()
        samples.append(time.perf_counter() - t)
    return _ms(samples)


def _fmt_bytes(n):
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


async def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few samples")
    args = p.parse_args(argv)
    big = (16 << 20) if args.quick else (1 << 30)
    batch = (4 << 20) if args.quick else (64 << 20)
    rounds = 3 if args.quick else 10
    dev = cupy.cuda.runtime.getDevice()
    print(f"CuPy {cupy.__version__}, GPU {dev} at PCI bus "
          f"{cupy.cuda.runtime.deviceGetPCIBusId(dev)}")

    sink = await GpuSink.spawn()
    x = actorshm.cuda.zeros(big, cupy.uint8)
    h = actorshm.empty(big, np.uint8)
    await sink.touch(x)
    await sink.touch_host(h)  # warm up both paths (handles opened, arenas mapped)
    await sink.take(x)
    trivial, ipc, staged, taken = [], [], [], []
    for _ in range(rounds):
        for _ in range(5):
            t = time.perf_counter()
            await sink.noop()
            trivial.append(time.perf_counter() - t)
            t = time.perf_counter()
            await sink.take(x)
            taken.append(time.perf_counter() - t)
        t = time.perf_counter()
        await sink.touch(x)
        ipc.append(time.perf_counter() - t)
        t = time.perf_counter()
        x.get(out=h)  # device -> host in the sender
        await sink.touch_host(h)
        staged.append(time.perf_counter() - t)

    producer = await GpuProducer.spawn(batch)
    for i in range(3):  # warm-up: the pools grow to their steady size
        b = await producer.batch(i)
        await sink.touch(b)
        del b
    s0 = await producer.stats()
    n = 5 if args.quick else 50
    t = time.perf_counter()
    for i in range(n):
        b = await producer.batch(i % 256)
        await sink.touch(b)  # forwarded: the consumer leases the producer's block
        del b
    per_batch = (time.perf_counter() - t) / n
    s1 = await producer.stats()
    new_slabs = (s1["cuda_pool_allocs"] - s0["cuda_pool_allocs"]) / n
    copied = (s1["cuda_bytes_copied"] - s0["cuda_bytes_copied"]) / n

    torch_rows = await _torch_rows(sink, big, rounds, _ms(trivial))
    kernel = _kernel_floor(x, rounds * 5)
    rows = [
        ("trivial call", _ms(trivial), 1.0),
        (f"{_fmt_bytes(big)} CuPy argument, dropped unread (transport and lease)",
         _ms(taken), _ms(taken) / _ms(trivial)),
        ("one-element kernel + synchronize, in this process (no call)", kernel,
         kernel / _ms(trivial)),
        (f"{_fmt_bytes(big)} CuPy argument via CUDA IPC", _ms(ipc), _ms(ipc) / _ms(trivial)),
        (f"{_fmt_bytes(big)} staged through host memory", _ms(staged),
         _ms(staged) / _ms(trivial)),
        (f"{_fmt_bytes(batch)} GPU batch, producer -> consumer, recycled", per_batch * 1e3,
         per_batch * 1e3 / _ms(trivial)),
    ] + torch_rows
    print("| what | median ms | x trivial call |\n| --- | --- | --- |")
    for what, ms, ratio in rows:
        print(f"| {what} | {ms:.3f} | {ratio:.1f} |")
    print(f"IPC is {_ms(staged) / _ms(ipc):.0f}x faster than staging through host memory")
    print(f"steady state per batch: {new_slabs:.2f} new GPU blocks, {copied:.0f} GPU bytes "
          "copied")
    return {"ipc_ms": _ms(ipc), "staged_ms": _ms(staged), "new_slabs_per_batch": new_slabs,
            "bytes_copied_per_batch": copied}


async def _torch_rows(sink, big: int, rounds: int, trivial_ms: float) -> list:
    """Rows for torch CUDA tensor arguments, where torch sees a GPU (else none)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        print("torch sees no GPU: torch CUDA tensor rows skipped")
        return []
    import actorshm.torch as at
    shared = at.zeros(big, dtype=torch.uint8, device="cuda")
    ordinary = torch.zeros(big, dtype=torch.uint8, device="cuda")
    await sink.touch_torch(shared)
    await sink.touch_torch(ordinary)
    ipc, copied = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        await sink.touch_torch(shared)
        ipc.append(time.perf_counter() - t)
        t = time.perf_counter()
        await sink.touch_torch(ordinary)
        copied.append(time.perf_counter() - t)
    return [(f"{_fmt_bytes(big)} torch CUDA tensor (actorshm.torch) via CUDA IPC", _ms(ipc),
             _ms(ipc) / trivial_ms),
            (f"{_fmt_bytes(big)} ordinary torch CUDA tensor (copied once on the device)",
             _ms(copied), _ms(copied) / trivial_ms)]


if __name__ == "__main__":
    actorshm.run(main())
