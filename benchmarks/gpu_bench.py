"""GPU benchmark: a 1 GiB CuPy argument via CUDA IPC vs staged through host memory."""

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
    def touch(self, x):
        return x.shape

    def touch_host(self, h):
        d = cupy.asarray(h)  # host -> device in the receiver
        cupy.cuda.get_current_stream().synchronize()
        return d.shape

    def make(self, n):
        a = actorshm.cuda.empty(n, cupy.uint8)
        a[:1] = 1
        return a

    def stats(self):
        return actorshm.stats()


def _median_ms(samples):
    return statistics.median(samples) * 1e3


async def main():
    sink = await GpuSink.spawn()
    n = 1 << 30
    x = actorshm.cuda.zeros(n, cupy.uint8)
    rows = []
    ipc = []
    for _ in range(10):
        t = time.perf_counter()
        await sink.touch(x)
        ipc.append(time.perf_counter() - t)
    host = []
    for _ in range(3):
        t = time.perf_counter()
        h = actorshm.empty(n, np.uint8)
        x.get(out=h)  # device -> host in the sender
        await sink.touch_host(h)
        host.append(time.perf_counter() - t)
        del h
    rows.append(("1 GiB argument via CUDA IPC", _median_ms(ipc)))
    rows.append(("1 GiB argument staged through host memory", _median_ms(host)))
    for _ in range(3):
        y = await sink.make(64 << 20)
        del y
    s0 = await sink.stats()
    t = time.perf_counter()
    for _ in range(50):
        y = await sink.make(64 << 20)
        del y
    per = (time.perf_counter() - t) / 50
    s1 = await sink.stats()
    rows.append(("64 MiB GPU batch, recycled steady state", per * 1e3))
    print("| what | median ms |\n| --- | --- |")
    for what, ms in rows:
        print(f"| {what} | {ms:.3f} |")
    print(f"new GPU slabs per batch after warm-up: "
          f"{(s1['cuda_pool_allocs'] - s0['cuda_pool_allocs']) / 50:.2f}; "
          f"GPU bytes copied per batch: "
          f"{(s1['cuda_bytes_copied'] - s0['cuda_bytes_copied']) / 50:.0f}")


if __name__ == "__main__":
    actorshm.run(main())
