"""The GPU path. Runs where CuPy sees a GPU; skipped with a reason elsewhere."""

import asyncio

import pytest

import actorshm

pytestmark = pytest.mark.cuda

if not actorshm.cuda.available():
    pytest.skip("CuPy is not installed or sees no GPU: GPU tests skipped",
                allow_module_level=True)

import cupy  # noqa: E402

from gpu_actors import GpuArrays  # noqa: E402


async def test_write_through_across_processes(rt):
    a = await GpuArrays.options(num_gpus=0).spawn()
    x = actorshm.cuda.zeros(1 << 20, cupy.float32)
    await a.fill(x, 3.0)
    assert float(x.sum()) == 3.0 * (1 << 20)
    y = await a.make(1000, 2.0)
    assert actorshm.cuda.is_shared(y)
    y += 1
    assert await a.sum(y) == 3000.0


async def test_ordering_after_sender_kernel(rt):
    a = await GpuArrays.spawn()
    x = actorshm.cuda.zeros(1 << 24, cupy.float32)
    for _ in range(20):
        x += 1  # queued kernels on the current stream
    assert await a.sum(x) == 20.0 * (1 << 24)


async def test_recycling_no_new_slab(rt):
    a = await GpuArrays.spawn()
    for _ in range(3):
        y = await a.make(1 << 20, 1.0)
        del y
    await asyncio.sleep(0.05)
    s0 = await a.stats()
    for _ in range(50):
        y = await a.make(1 << 20, 1.0)
        del y
    await asyncio.sleep(0.05)
    s1 = await a.stats()
    assert s1["cuda_pool_allocs"] - s0["cuda_pool_allocs"] <= 1


async def test_leases_returned_when_receiver_killed(rt):
    a = await GpuArrays.spawn()
    base = actorshm.stats().get("cuda_blocks_live", 0)
    x = actorshm.cuda.zeros(1000)
    await a.keep(x)
    del x
    await a.kill()
    await asyncio.sleep(0.1)
    import gc
    gc.collect()
    assert actorshm.stats()["cuda_blocks_live"] == base


async def test_two_gpu_actors(rt):
    n = cupy.cuda.runtime.getDeviceCount()
    if n < 2:
        pytest.skip("needs two GPUs")
    a = await GpuArrays.options(num_gpus=1).spawn()
    b = await GpuArrays.options(num_gpus=1).spawn()
    assert await a.device_bus_id() != await b.device_bus_id()
