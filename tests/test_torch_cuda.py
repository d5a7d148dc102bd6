"""torch CUDA tensors through actorshm's GPU pool, by CUDA IPC reference.

Runs where torch and CuPy see a GPU (``benchmarks/gpu_check.sh``). On CPU machines
tests/test_cuda_simulated.py runs it against the simulated GPU (tests/simgpu), where a
stand-in tensor type (``simtorchcuda.SimCudaTensor``) replaces torch's CUDA tensors,
which a CPU build of torch lacks: the address lookup, the reducer's choice, the copy into
the pool, the leases and the receiver's rebuild all run; CUDA itself does not. The few
tests that need real torch CUDA semantics (autograd, ``nn.Parameter``) skip there.
"""

import asyncio
import gc

import pytest

import actorshm

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

pytestmark = pytest.mark.cuda

if not actorshm.cuda.available():
    pytest.skip("CuPy is not installed or sees no GPU: torch CUDA tests skipped",
                allow_module_level=True)

import cupy  # noqa: E402

import actorshm.torch as at  # noqa: E402
from actorshm import _cuda  # noqa: E402
from torch_cuda_actors import SIMULATED, TorchGpu  # noqa: E402

if SIMULATED:
    import simtorchcuda
    simtorchcuda.install()
elif not torch.cuda.is_available():
    pytest.skip("torch sees no GPU (a CPU build?): torch CUDA tests skipped",
                allow_module_level=True)

real_gpu_only = pytest.mark.skipif(SIMULATED, reason="needs torch's real CUDA tensors")


def _cuda_stats():
    return {k: v for k, v in actorshm.stats().items() if k.startswith("cuda_")}


def from_cupy(arr):
    """A torch CUDA tensor viewing CuPy array ``arr``."""
    return simtorchcuda.from_cupy(arr) if SIMULATED else torch.from_dlpack(arr)


def ordinary(n):
    """A CUDA tensor that is not in actorshm's pool (torch's, or CuPy's, allocator)."""
    return from_cupy(cupy.zeros(n, cupy.float32)) if SIMULATED else \
        torch.zeros(n, device="cuda")


def total(t) -> float:
    return float(t.sum())


async def _settle():
    await asyncio.sleep(0.05)
    gc.collect()
    await asyncio.sleep(0.05)


def test_empty_and_zeros_lie_in_the_gpu_pool():
    t = at.zeros(4, 6, dtype=torch.float32, device="cuda")
    assert t.device.type == "cuda" and t.shape == (4, 6) and t.stride() == (6, 1)
    assert t.dtype == torch.float32 and total(t) == 0.0
    assert at.is_shared(t)
    st = t.untyped_storage()
    block = _cuda.block_at(st.data_ptr(), st.data_ptr() + st.nbytes(), t.device.index)
    assert block is not None and block.region.owned
    b = at.empty(3, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    assert b.dtype == torch.bfloat16 and b.device.index == 0 and at.is_shared(b)
    assert actorshm.is_shared(b)  # (asks the torch plug-in, which asks the GPU one)
    assert not at.is_shared(ordinary(8)) and not actorshm.is_shared(ordinary(8))


def test_tensor_inside_a_block_is_found_by_address():
    arr = actorshm.cuda.zeros(100, cupy.float32)
    t = from_cupy(arr[10:])  # its storage starts 40 bytes into the block
    assert at.is_shared(t)
    st = t.untyped_storage()
    assert _cuda.block_at(st.data_ptr(), st.data_ptr() + st.nbytes(),
                          t.device.index) is _cuda.find_block(arr)
    # past the block's end, on another device, or outside any block: not found
    lo = st.data_ptr()
    assert _cuda.block_at(lo, lo + (1 << 30), t.device.index) is None
    assert _cuda.block_at(lo, lo + 4, t.device.index + 1) is None


async def test_pool_tensor_travels_by_reference_and_is_written_through(rt):
    a = await TorchGpu.spawn()
    t = at.zeros(1000, device="cuda")
    before = _cuda_stats()
    await a.fill(t, 3.0)
    assert total(t) == 3000.0  # the actor wrote our GPU memory
    after = _cuda_stats()
    assert after["cuda_bytes_zero_copy"] - before["cuda_bytes_zero_copy"] == 4000
    assert after["cuda_bytes_copied"] == before["cuda_bytes_copied"]
    r = await a.make(10, 1.0)  # the actor's pool tensor, to us by reference
    assert r.device.type == "cuda" and at.is_shared(r) and total(r) == 10.0
    assert (await a.info(r))[5]


async def test_an_actor_with_a_gpu_of_its_own_shares_tensors_both_ways(rt):
    # num_gpus=1: the actor's CUDA_VISIBLE_DEVICES names our GPU; tensors meet on it
    a = await TorchGpu.options(num_gpus=1).spawn()
    t = at.zeros(1000, device="cuda")
    await a.fill(t, 2.0)
    assert total(t) == 2000.0
    assert (await a.info(t[::4]))[1:] == ((250,), (4,), 0, "cuda", True)
    r = await a.make(10, 1.0)
    assert r.device == t.device and at.is_shared(r) and total(r) == 10.0


async def test_receiver_gets_dtype_shape_strides_offset_and_device(rt):
    a = await TorchGpu.spawn()
    t = at.zeros(8, 6, device="cuda")
    for v in (t, t[2:, ::2], t.T, t[3], t[1:3, 1:3]):
        assert await a.info(v) == (str(v.dtype), tuple(v.shape), tuple(v.stride()),
                                   v.storage_offset(), "cuda", True)
    await a.fill(t[1:3, 1:3], 9.0)
    assert total(t) == 36.0


DTYPES = ["float32", "float16", "bfloat16", "int64", "bool", "complex64", "float8_e4m3fn"]


async def test_every_dtype_comes_home_to_the_same_memory(rt):
    a = await TorchGpu.spawn()
    for dt in [getattr(torch, d) for d in DTYPES if hasattr(torch, d)]:
        t = at.empty(4, 6, dtype=dt, device="cuda")
        t.view(torch.uint8).fill_(1)
        before = _cuda_stats()
        back = await a.echo(t)
        assert back.dtype == dt and tuple(back.shape) == (4, 6), dt
        assert back.device == t.device, dt
        # our own block came home: the same memory, no IPC handle opened here
        assert back.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), dt
        assert _cuda_stats()["cuda_handles_opened"] == before["cuda_handles_opened"]
        assert (await a.info(t))[0] == str(dt)
        assert int(back.view(torch.uint8).sum()) == t.numel() * t.element_size(), dt


async def test_ordinary_cuda_tensor_is_copied_once_on_the_device(rt):
    a = await TorchGpu.spawn()
    x = ordinary(1000)
    assert not at.is_shared(x)
    before = _cuda_stats()
    await a.fill(x, 5.0)  # the actor writes the copy, not our tensor
    assert total(x) == 0.0
    after = _cuda_stats()
    assert after["cuda_bytes_copied"] - before["cuda_bytes_copied"] == 4000
    assert after["cuda_arrays_copied"] - before["cuda_arrays_copied"] == 1
    assert after["cuda_bytes_zero_copy"] == before["cuda_bytes_zero_copy"]
    assert (await a.info(x))[4:] == ("cuda", True)  # it arrives in the pool


async def test_share_makes_a_pool_copy(rt):
    x = ordinary(16)
    s = at.share(x)
    assert at.is_shared(s) and s.device == x.device and at.share(s) is s
    a = await TorchGpu.spawn()
    await a.fill(s, 2.0)
    assert total(s) == 32.0


async def test_cuda_tensors_recycle(rt):
    a = await TorchGpu.spawn()
    for _ in range(3):
        y = await a.make(1 << 18, 1.0)
        del y
    await _settle()
    s0 = await a.stats()
    for _ in range(30):
        y = await a.make(1 << 18, 1.0)
        del y
    await _settle()
    s1 = await a.stats()
    assert s1["cuda_pool_allocs"] - s0["cuda_pool_allocs"] <= 1
    assert s1["cuda_pool_reuses"] - s0["cuda_pool_reuses"] >= 29


@real_gpu_only
async def test_parameter_and_requires_grad_on_the_gpu(rt):
    a = await TorchGpu.spawn()
    p = torch.nn.Parameter(at.zeros(3, device="cuda"))
    assert await a.kind(p) == ("Parameter", True, "cuda")
    leaf = at.zeros(3, device="cuda").requires_grad_(True)
    assert await a.kind(leaf) == ("Tensor", True, "cuda")
    big = torch.zeros(1 << 20, device="cuda")  # copied: only the small part each views
    assert await a.kind(torch.nn.Parameter(big[:4])) == ("Parameter", True, "cuda")
    assert await a.kind(big[8:11].requires_grad_(True)) == ("Tensor", True, "cuda")
    with pytest.raises(TypeError, match="detach"):
        await a.kind(leaf * 2)


@real_gpu_only
async def test_ordering_after_the_senders_stream(rt):
    # the receiver sees every write the sender queued before the call, on torch's
    # current stream: the default one, or a side stream the sender made current
    a = await TorchGpu.spawn()
    t = at.zeros(1 << 24, dtype=torch.float64, device="cuda")
    for _ in range(20):
        t += 1
    assert await a.total(t) == 20.0 * (1 << 24)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        u = at.zeros(1 << 24, dtype=torch.float64, device="cuda")
        u += 7
        assert await a.total(u) == 7.0 * (1 << 24)
    x = torch.ones(1 << 24, dtype=torch.float64, device="cuda")  # copied on the device
    x *= 3
    assert await a.total(x) == 3.0 * (1 << 24)
