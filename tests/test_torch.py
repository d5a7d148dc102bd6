"""PyTorch tensors travel like numpy arrays: by reference, writable, recycled."""

import gc
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                            "'actorshm[torch]'); the tensor path is untested here")

import actorshm  # noqa: E402
import actorshm.torch as at  # noqa: E402
from torch_actors import Tensors  # noqa: E402


def _dtypes():
    names = ["float32", "float64", "float16", "bfloat16", "complex64", "complex128",
             "complex32", "bool", "uint8", "int8", "int16", "int32", "int64", "uint16",
             "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
             "float8_e5m2fnuz", "float8_e8m0fnu"]
    return [n for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


def _bytes(t):
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def test_importing_actorshm_does_not_import_torch():
    code = ("import sys, actorshm, numpy; actorshm.zeros(3); "
            "assert 'torch' not in sys.modules; assert not actorshm.torch.is_shared(1); "
            "assert 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


async def test_write_through_both_ways(rt):
    a = await Tensors.spawn()
    x = at.zeros(1000)
    assert at.is_shared(x) and x.dtype == torch.float32
    await a.fill(x, 5.0)  # the actor writes; we see it
    assert bool((x == 5.0).all())
    y = await a.make(100, 1.0)  # the actor's tensor; we write, it sees
    assert isinstance(y, torch.Tensor) and at.is_shared(y)
    y[:] = 2.0
    assert await a.total(y) == 200.0
    back = await a.add_one(x)
    assert back.data_ptr() == x.data_ptr() and bool((x == 6.0).all())


async def test_every_dtype_travels_by_reference(rt):
    a = await Tensors.spawn()
    for dtype in _dtypes():
        dt = getattr(torch, dtype)
        x = at.empty(3, 4, dtype=dt)
        b = _bytes(x)
        b.copy_(torch.arange(b.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
        if dt == torch.bool:
            b.clamp_(max=1)
        before = actorshm.stats()["bytes_copied"]
        info = await a.info(x)
        assert info == ("Tensor", str(dt), (3, 4), (4, 1), 0, "cpu", False, True), dtype
        assert await a.first_bytes(x, b.numel()) == bytes(b.tolist()), dtype
        back = await a.echo(x)
        assert back.dtype == dt and back.data_ptr() == x.data_ptr(), dtype
        assert actorshm.stats()["bytes_copied"] == before, dtype


async def test_ordinary_tensor_is_copied_once(rt):
    a = await Tensors.spawn()
    for dtype in ["bfloat16", "float16", "complex64", "bool", "int64", "float8_e5m2"]:
        dt = getattr(torch, dtype)
        x = torch.ones(64, 8).to(dt)
        before = actorshm.stats()
        back = await a.echo(x)
        after = actorshm.stats()
        assert after["bytes_copied"] - before["bytes_copied"] == x.numel() * x.element_size()
        assert after["arrays_copied"] - before["arrays_copied"] == 1
        assert back.dtype == dt and at.is_shared(back), dtype
        assert torch.equal(_bytes(back), _bytes(x)), dtype
        assert not at.is_shared(x) and back.data_ptr() != x.data_ptr()


VIEWS = [
    ("slice", lambda t: t[2:5]),
    ("strided", lambda t: t[::2, 1::3]),
    ("transposed", lambda t: t.t()),
    ("permuted 3-d", lambda t: t.reshape(10, 6, 10).permute(2, 0, 1)),
    ("expanded", lambda t: t[0:1].expand(7, 30)),
    ("0-d", lambda t: t[3, 4]),
    ("column", lambda t: t[:, 7]),
]


async def test_views_keep_strides_and_offset(rt):
    a = await Tensors.spawn()
    base = at.zeros(20, 30)
    base.copy_(torch.arange(600, dtype=torch.float32).reshape(20, 30))
    for name, make in VIEWS:
        v = make(base)
        before = actorshm.stats()["bytes_copied"]
        info = await a.info(v)
        assert info[2:5] == (tuple(v.shape), v.stride(), v.storage_offset()), name
        back = await a.echo(v)
        assert back.stride() == v.stride() and back.storage_offset() == v.storage_offset()
        assert back.data_ptr() == v.data_ptr() and torch.equal(back, v), name
        assert actorshm.stats()["bytes_copied"] == before, name


async def test_copied_view_keeps_layout(rt):
    a = await Tensors.spawn()
    t = torch.arange(600, dtype=torch.float64).reshape(20, 30)
    for v in (t.t(), t[::2], t[5]):
        back = await a.echo(v)
        assert torch.equal(back, v) and at.is_shared(back)
        if v is not t[5]:
            assert back.stride() == v.stride()


async def test_containers_at_any_depth(rt):
    a = await Tensors.spawn()
    x, y = at.zeros(10) + 0, at.zeros(5)  # x: an ordinary tensor (the sum is new)
    y += 2
    x += 1
    before = actorshm.stats()
    got = await a.nested({"a": [x, y], "b": (y[1:],)})
    assert got == {"a": [10.0, 10.0], "b": [8.0]}
    after = actorshm.stats()
    assert after["arrays_copied"] - before["arrays_copied"] == 1
    assert after["arrays_zero_copy"] - before["arrays_zero_copy"] == 2


async def test_parameter_and_requires_grad(rt):
    a = await Tensors.spawn()
    p = torch.nn.Parameter(at.zeros(3, 3))
    back = await a.echo(p)
    assert type(back) is torch.nn.Parameter and back.requires_grad
    assert back.data_ptr() == p.data_ptr()
    frozen = torch.nn.Parameter(at.zeros(2), requires_grad=False)
    back = await a.echo(frozen)
    assert type(back) is torch.nn.Parameter and not back.requires_grad
    leaf = at.zeros(4, requires_grad=True)
    info = await a.info(leaf)
    assert info[0] == "Tensor" and info[6] is True
    back = await a.echo(leaf)
    assert back.requires_grad and back.is_leaf


async def test_non_leaf_requiring_grad_is_refused_before_sending(rt):
    a = await Tensors.spawn()
    leaf = at.zeros(4, requires_grad=True)
    before = actorshm.stats()["calls_sent"]
    with pytest.raises(TypeError, match=r"\.detach\(\)"):
        await a.echo({"x": [leaf * 2]})
    assert actorshm.stats()["calls_sent"] == before
    assert await a.total((leaf * 2).detach()) == 0.0  # the actor is fine


async def test_share_and_is_shared():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not at.is_shared(t) and not at.is_shared("x") and not at.is_shared(np.zeros(2))
    s = at.share(t)
    assert at.is_shared(s) and torch.equal(s, t) and s.stride() == t.stride()
    assert at.share(s) is s
    assert at.is_shared(s[1:, ::2])
    p = at.share(torch.nn.Parameter(torch.ones(2)))
    assert type(p) is torch.nn.Parameter and p.requires_grad and at.is_shared(p)
    with pytest.raises(TypeError, match="torch.Tensor"):
        at.share(np.zeros(3))
    with pytest.raises(ValueError, match="device"):
        at.empty(3, device="meta")
    assert at.zeros([2, 3], dtype=torch.int16).shape == (2, 3)
    assert actorshm.torch is at


async def test_share_module_hogwild(rt):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    model.register_buffer("seen", torch.zeros(3))
    assert at.share_module(model) is model
    assert all(at.is_shared(t) for t in [*model.parameters(), *model.buffers()])
    assert type(model.weight) is torch.nn.Parameter
    w0 = model.weight.detach().clone()
    trainers = [await Tensors.spawn() for _ in range(2)]
    before = actorshm.stats()["bytes_copied"]
    import asyncio
    shared = await asyncio.gather(*(t.train(model, 30, i) for i, t in enumerate(trainers)))
    assert shared == [[True, True]] * 2
    assert actorshm.stats()["bytes_copied"] == before
    assert not torch.equal(model.weight.detach(), w0)  # their SGD steps reached us
    x = torch.randn(64, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).item()
    assert loss < 1.0


async def test_recycling_pool_allocs_flat(rt):
    a = await Tensors.spawn()
    t = torch.zeros(1 << 16)  # ordinary: copied into the pool every round
    allocs = []
    for i in range(50):
        await a.total(t)
        r = await a.echo(at.zeros(1 << 14))
        del r
        gc.collect()
        allocs.append(actorshm.stats()["pool_allocs"])
    assert allocs[-1] == allocs[10], allocs


async def test_numpy_recognised_by_address(rt):
    a = await Tensors.spawn()
    w = actorshm.zeros(100)
    via_torch = torch.from_numpy(w).numpy()
    via_buffer = np.frombuffer(w.data, dtype=np.float64)
    assert actorshm.is_shared(via_torch) and actorshm.is_shared(via_buffer)
    before = actorshm.stats()["bytes_copied"]
    await a.write_numpy(via_torch, 3.0)
    assert (w == 3.0).all()
    await a.write_numpy(via_buffer[10:20], 4.0)
    assert (w[10:20] == 4.0).all()
    t = torch.from_numpy(w)  # a tensor over a shared numpy array
    assert at.is_shared(t)
    await a.fill(t[50:], 7.0)
    assert (w[50:] == 7.0).all() and (w[:10] == 3.0).all()
    assert actorshm.stats()["bytes_copied"] == before
    assert not actorshm.is_shared(np.frombuffer(bytearray(80)))


async def test_torch_threads_follow_num_cpus(rt):
    one = await Tensors.spawn()
    two = await Tensors.options(num_cpus=2).spawn()
    # The user's OpenMP count wins, for torch too (which reads MKL_NUM_THREADS first).
    env = await Tensors.options(num_cpus=2, env={"OMP_NUM_THREADS": "1"}).spawn()
    assert await one.threads() == (1, "1")
    assert await two.threads() == (2, "2")
    assert await env.threads() == (1, "1")
