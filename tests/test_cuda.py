"""The GPU path. Runs where CuPy sees a GPU; skipped with a reason elsewhere.

On CPU machines tests/test_cuda_simulated.py runs this file against a simulated GPU
(tests/simgpu), which checks actorshm's bookkeeping; on a GPU machine it checks CUDA.
"""

import asyncio
import gc

import pytest

import actorshm

pytestmark = pytest.mark.cuda

if not actorshm.cuda.available():
    pytest.skip("CuPy is not installed or sees no GPU: GPU tests skipped",
                allow_module_level=True)

import cupy  # noqa: E402

from gpu_actors import GpuArrays  # noqa: E402


def _cuda_stats():
    return {k: v for k, v in actorshm.stats().items() if k.startswith("cuda_")}


async def _settle():
    await asyncio.sleep(0.05)
    gc.collect()
    await asyncio.sleep(0.05)


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


async def test_reply_waits_for_the_actors_work_on_its_gpu_arguments(rt):
    # the method queues kernels writing into its argument and returns None without
    # synchronizing: the caller still sees their result once the call returns
    a = await GpuArrays.spawn()
    x = actorshm.cuda.zeros(1 << 24, cupy.float32)
    assert await a.add_queued(x, 1.0, 20) is None
    assert float(x.sum()) == 20.0 * (1 << 24)
    if cupy.__version__ == "0.0-simulated":  # no real kernels: count the waits instead
        before = await a.stream_syncs()
        await a.add_queued(x, 1.0, 1)
        assert await a.stream_syncs() == before + 1
        await a.stream_syncs()  # a call without GPU arguments waits for nothing
        assert await a.stream_syncs() == before + 1
    # a sync method run in an executor thread (max_concurrency > 1) is covered as well
    b = await GpuArrays.options(max_concurrency=2).spawn()
    base = float(x[0])
    assert await asyncio.gather(b.add_queued(x[:8], 1.0, 10),
                                b.add_queued(x[8:16], 2.0, 10)) == [None, None]
    assert float(x[:8].sum()) == 8 * (base + 10) and float(x[8:16].sum()) == 8 * (base + 20)


async def test_a_cancelled_gpu_call_leaves_no_reply_wait_behind(rt):
    a = await GpuArrays.spawn()
    x = actorshm.cuda.zeros(1000, cupy.float32)
    busy = a.sleep(1.0)  # (a blocked loop reads the cancel before the next call starts)
    queued = a.add_queued(x, 1.0, 1)  # decoded in the actor, waiting behind `busy`
    await asyncio.sleep(0.2)
    queued.cancel()
    await busy
    assert await a.reply_waits_held() == 0
    assert float(x.sum()) == 0.0  # it never ran


async def test_views_keep_shape_strides_and_offset(rt):
    a = await GpuArrays.spawn()
    x = actorshm.cuda.zeros((64, 48), cupy.float32)
    for v in (x, x[3:, ::2], x.T, x[10]):
        shape, strides, dtype, shared, _ = await a.info(v)
        assert (tuple(shape), tuple(strides), dtype) == (v.shape, v.strides, str(v.dtype))
        assert shared
    await a.fill(x[5:7, 1:3], 9.0)
    assert float(x.sum()) == 36.0 and float(x[5, 1]) == 9.0


async def test_ml_dtypes_arrays_keep_their_dtype(rt):
    # bfloat16 names itself '<V2': sent as that string it would arrive as raw void
    ml_dtypes = pytest.importorskip("ml_dtypes")
    try:
        x = actorshm.cuda.zeros(4096, ml_dtypes.bfloat16)
    except (TypeError, ValueError) as exc:
        pytest.skip(f"this CuPy has no bfloat16 arrays: {exc}")
    a = await GpuArrays.spawn()
    for v in (x, x[::2]):
        shape, strides, dtype, shared, _ = await a.info(v)
        assert (tuple(shape), tuple(strides), dtype) == (v.shape, v.strides, "bfloat16")
        assert shared
        back = await a.echo(v)
        assert back.dtype == v.dtype and back.shape == v.shape


async def test_same_process_round_trip_needs_no_ipc(rt):
    a = await GpuArrays.spawn()
    x = actorshm.cuda.zeros(1000, cupy.float32)
    before = _cuda_stats()
    back = await a.add_one(x)  # our own block comes home: the same memory, no handle
    assert back.data.ptr == x.data.ptr and float(x.sum()) == 1000.0
    assert _cuda_stats()["cuda_handles_opened"] == before["cuda_handles_opened"]


async def test_cupy_pool_array_is_copied_once_and_counted(rt):
    a = await GpuArrays.spawn()
    x = cupy.zeros(1000, cupy.float32)  # CuPy's own pool: its handle would name more
    assert not actorshm.cuda.is_shared(x) and not actorshm.is_shared(x)
    before = _cuda_stats()
    assert await a.sum(x) == 0.0
    after = _cuda_stats()
    assert after["cuda_bytes_copied"] - before["cuda_bytes_copied"] == 4000
    assert after["cuda_bytes_zero_copy"] == before["cuda_bytes_zero_copy"]
    s = actorshm.cuda.share(x)
    assert actorshm.cuda.is_shared(s) and actorshm.cuda.share(s) is s
    assert actorshm.is_shared(s) and actorshm.is_shared(s[10:])  # (asks the GPU plug-in)


async def test_handle_opened_once_per_slab(rt):
    a = await GpuArrays.spawn()
    xs = [actorshm.cuda.zeros(1000 + i, cupy.float32) for i in range(20)]  # one chunk slab
    for x in xs:
        await a.sum(x)
    assert (await a.stats())["cuda_handles_opened"] == 1


async def test_group_call_sends_one_gpu_block_to_every_member(rt):
    g = await actorshm.ActorGroup.spawn(GpuArrays, 3)
    x = actorshm.cuda.zeros(1000, cupy.float32)
    x += 2
    await g[0].sum(x)  # member 0 has the slab's handle already; the others get it now
    assert await g.sum(x) == [2000.0] * 3  # the call encoded once for all three
    assert await g.sum(x) == [2000.0] * 3
    assert [s["cuda_handles_opened"] for s in await g.stats()] == [1, 1, 1]
    assert await g.fill(x, 5.0) == [None] * 3  # every member writes the same memory
    assert float(x.sum()) == 5000.0


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
    assert s1["cuda_pool_reuses"] - s0["cuda_pool_reuses"] >= 49


async def test_forwarded_block_flows_home(rt):
    producer, consumer = await GpuArrays.spawn(), await GpuArrays.spawn()
    for _ in range(3):
        b = await producer.make(1 << 16, 1.0)
        await consumer.add_one(b)  # the producer's block, leased to the consumer by us
        del b
    await _settle()
    p0, c0 = await producer.stats(), await consumer.stats()
    for _ in range(30):
        b = await producer.make(1 << 16, 1.0)
        assert float((await consumer.add_one(b)).sum()) == 2.0 * (1 << 16)
        del b
    await _settle()
    p1, c1 = await producer.stats(), await consumer.stats()
    assert p1["cuda_pool_allocs"] - p0["cuda_pool_allocs"] <= 1
    assert c1["cuda_handles_opened"] == c0["cuda_handles_opened"]
    assert p1["cuda_bytes_copied"] == p0["cuda_bytes_copied"]


async def test_owner_keeps_a_block_a_dead_relay_passed_on(rt):
    relay, d = await GpuArrays.spawn(), await GpuArrays.spawn()
    n = 1 << 16
    x = actorshm.cuda.empty(n, cupy.float32)
    x[...] = 1.0
    await relay.keep(x)
    await relay.lend_kept(d)  # our block, passed on by the relay
    await relay.drop()
    del x
    await _settle()
    await relay.kill()
    await _settle()
    assert actorshm.stats()["blocks_quarantined"] == 1
    ys = [actorshm.cuda.empty(n, cupy.float32) for _ in range(5)]
    for y in ys:
        y[...] = 2.0
    cupy.cuda.get_current_stream().synchronize()
    assert await d.sum_kept() == float(n)


async def test_leases_returned_when_receiver_killed(rt):
    a = await GpuArrays.spawn()
    base = actorshm.stats().get("cuda_blocks_live", 0)
    x = actorshm.cuda.zeros(1000)
    await a.keep(x)
    del x
    await _settle()
    assert actorshm.stats()["cuda_blocks_live"] == base + 1  # the actor still holds it
    await a.kill()
    await _settle()
    assert actorshm.stats()["cuda_blocks_live"] == base


async def test_owner_killed_while_the_driver_holds_its_block(rt):
    # The owner's memory goes with its process; the driver drops its lease on a dead
    # owner's slab without an error, and the GPU path keeps working for everyone else.
    owner, other = await GpuArrays.spawn(), await GpuArrays.spawn()
    y = await owner.make(1 << 16, 1.0)
    assert float(y.sum()) == float(1 << 16)
    label = rt.record(owner.actor_id).label
    gpu = [r for r in (await rt.memory()).rows if r["device"].startswith("gpu:")]
    assert len(gpu) == 1 and gpu[0]["owner"] == label and "driver" in gpu[0]["held_by"]
    await owner.kill()
    await _settle()
    del y
    await _settle()
    assert not [r for r in (await rt.memory()).rows if r["device"].startswith("gpu:")]
    x = actorshm.cuda.zeros(1 << 16, cupy.float32)
    await other.fill(x, 2.0)
    assert float(x.sum()) == 2.0 * (1 << 16)
    assert float((await other.make(10, 3.0)).sum()) == 30.0


async def test_out_of_gpu_memory_is_clear_error():
    with pytest.raises(actorshm.SharedMemoryError, match="has no room"):
        actorshm.cuda.empty(1 << 50, cupy.uint8)


async def test_an_actor_with_a_gpu_of_its_own_shares_arrays_both_ways(rt):
    # num_gpus=1 sets CUDA_VISIBLE_DEVICES in the actor, whose ordinals then differ from
    # the driver's: arrays still meet on the same physical GPU, by reference.
    a = await GpuArrays.options(num_gpus=1).spawn()
    assert await a.env("CUDA_VISIBLE_DEVICES") is not None
    mine = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.runtime.getDevice())
    assert await a.device_bus_id() == mine
    before = actorshm.stats()["cuda_bytes_zero_copy"]
    x = actorshm.cuda.zeros(1 << 20, cupy.float32)
    await a.fill(x, 4.0)
    assert float(x.sum()) == 4.0 * (1 << 20)
    assert actorshm.stats()["cuda_bytes_zero_copy"] == before + x.nbytes
    info = await a.info(x[::2])
    assert info[3] and info[4] == mine and info[1] == (8,)
    y = await a.make(1000, 5.0)  # the actor's own block, on the same GPU
    assert y.data.device_id == cupy.cuda.runtime.getDevice()
    y += 1
    assert await a.sum(y) == 6000.0


async def test_two_gpu_actors(rt):
    n = cupy.cuda.runtime.getDeviceCount()
    if n < 2:
        pytest.skip("needs two GPUs")
    a = await GpuArrays.options(num_gpus=1).spawn()
    b = await GpuArrays.options(num_gpus=1).spawn()
    assert await a.device_bus_id() != await b.device_bus_id()


async def test_array_on_a_gpu_the_actor_cannot_see(rt):
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    a = await GpuArrays.options(num_gpus=1).spawn()  # sees the first GPU only
    mine = cupy.cuda.runtime.deviceGetPCIBusId(1)
    assert await a.device_bus_id() != mine
    base = actorshm.stats()["cuda_blocks_live"] if "cuda_blocks_live" in actorshm.stats() \
        else 0
    with cupy.cuda.Device(1):
        x = actorshm.cuda.zeros(1000)
    with pytest.raises(TypeError, match="not visible in this process"):
        await a.sum(x)
    del x
    await _settle()
    assert actorshm.stats()["cuda_blocks_live"] == base  # the failed lease came back
    assert await a.device_bus_id()  # the actor is fine


async def test_stopping_producer_warns_about_gpu_blocks_still_held(capfd):
    async with actorshm.Runtime(shutdown_grace=0.5):
        a = await GpuArrays.spawn()
        kept = await a.make(100, 1.0)
        dropped = await a.make(100, 1.0)
        del dropped
        await asyncio.sleep(0.05)
    err = capfd.readouterr().err
    assert "exits while peers still hold 1 of its GPU blocks" in err, err
    del kept


async def test_release_from_a_busy_device_goes_back_from_a_helper_thread(rt):
    if cupy.__version__ != "0.0-simulated":
        pytest.skip("needs the simulation's knob that keeps a device busy")
    a = await GpuArrays.spawn()
    y = await a.make(1000, 1.0)
    assert (await a.stats())["cuda_blocks_live"] == 1
    cupy.cuda.Event.busy = True  # our work on the device "has not finished" yet
    try:
        del y
        gc.collect()
        for _ in range(100):  # the helper thread waits, then the lease goes back
            await asyncio.sleep(0.01)
            if (await a.stats())["cuda_blocks_live"] == 0:
                break
        assert (await a.stats())["cuda_blocks_live"] == 0
        # the helper slept in the wait: a spinning one would keep a core busy meanwhile
        assert cupy.cuda.Event.spinning_waits == 0
    finally:
        cupy.cuda.Event.busy = False


def test_bad_input_to_the_cuda_api_is_a_clear_error():
    import numpy as np
    with pytest.raises(TypeError, match="actorshm.share for numpy"):
        actorshm.cuda.share(np.zeros(3))
    with pytest.raises(ValueError, match="order must be"):
        actorshm.cuda.empty(3, order="K")
    with pytest.raises(ValueError, match="negative"):
        actorshm.cuda.zeros((2, -1))
    with pytest.raises(TypeError, match="object arrays"):
        actorshm.cuda.empty(3, object)


async def test_memory_lists_gpu_blocks_with_their_holders(rt):
    a = await GpuArrays.spawn()
    x = actorshm.cuda.zeros(1 << 16, cupy.float32)
    await a.keep(x)
    report = await rt.memory()
    gpu = [r for r in report.rows if r["device"].startswith("gpu:")]
    label = rt.record(a.actor_id).label
    assert len(gpu) == 1 and gpu[0]["owner"] == "driver"
    assert gpu[0]["held_by"] == ["driver", label] and gpu[0]["size"] >= x.nbytes
    assert report.processes["driver"]["cuda_slab_bytes_owned"] > 0
    assert "GPU" in str(report)
    await a.drop()
    del x
    await _settle()
    assert not [r for r in (await rt.memory()).rows if r["device"].startswith("gpu:")]
