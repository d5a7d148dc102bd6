"""torch.Tensor arguments and results: by reference, writable, every dtype, recycled."""

import asyncio
import gc
import importlib.util
import subprocess
import sys
import time
import warnings
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

import actorshm  # noqa: E402
import actorshm.torch as at  # noqa: E402
from recorder import trip  # noqa: E402
from torch_actors import Tagged, TorchWorker  # noqa: E402

_TORCH = tuple(int(x) for x in torch.__version__.split(".")[:2])  # (major, minor)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool,
          torch.complex64, torch.complex128, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64] + [getattr(torch, n) for n in (
              "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def test_importing_actorshm_does_not_import_torch():
    code = "import sys, actorshm; actorshm.zeros(3); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr


async def test_shared_tensor_is_written_through_both_ways(rt):
    w = await TorchWorker.spawn()
    t = at.zeros(1000)
    s0 = actorshm.stats()
    await w.fill(t, 3.0)
    assert float(t.sum()) == 3000.0  # the actor wrote our memory
    r = await w.make(10, 1.0)
    assert at.is_shared(r)
    r += 1  # we write the actor's memory
    assert await w.kept_sum() == 20.0
    s1 = actorshm.stats()
    assert s1["bytes_copied"] == s0["bytes_copied"]
    assert s1["bytes_zero_copy"] - s0["bytes_zero_copy"] == t.numel() * 4


async def test_an_empty_tensor_of_every_dtype_round_trips(rt):
    # Before: an ordinary tensor with an empty storage went to torch's own pickling,
    # which cannot rebuild uint16/32/64, complex32 or the float8 kinds: the call failed
    # in the actor ("could not deserialize the call's arguments: AttributeError:
    # type object 'torch.storage.UntypedStorage' has no attribute 'dtype'")
    w = await TorchWorker.spawn()
    names = ("uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2",
             "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    dtypes = DTYPES + [getattr(torch, n) for n in names if hasattr(torch, n)]
    for dtype in dtypes:
        with warnings.catch_warnings():  # (complex32: "experimental")
            warnings.simplefilter("ignore", UserWarning)
            t = torch.empty(0, 3, dtype=dtype).t()
        info = await w.info(t)
        assert (info["dtype"], info["shape"], info["stride"]) == (dtype, (3, 0), t.stride())
        back = await w.echo(t)
        assert back.dtype == dtype and back.shape == (3, 0), dtype
    leaf = torch.empty(0, requires_grad=True)
    assert (await w.info(leaf))["requires_grad"]
    param = await w.echo(torch.nn.Parameter(torch.empty(0, 2)))
    assert isinstance(param, torch.nn.Parameter) and param.shape == (0, 2)


async def test_every_dtype_round_trips_by_reference(rt):
    w = await TorchWorker.spawn()
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for dtype in DTYPES:
        t = at.empty(4, 6, dtype=dtype)
        t.copy_(src.to(dtype) if dtype is not torch.bool else src > 5)
        back = await w.echo(t)
        assert back.dtype == dtype and back.shape == t.shape, dtype
        assert back.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), dtype
        info = await w.info(t)
        assert info["dtype"] == dtype and info["shared"], dtype
        ordinary = src.to(dtype)  # copied once, and equal bit for bit
        back = await w.echo(ordinary)
        assert back.dtype == dtype
        assert torch.equal(back.view(torch.uint8), ordinary.view(torch.uint8)), dtype


async def test_share_copies_the_bit_packed_dtypes_bit_for_bit(rt):
    # torch has no copy kernel for uint1-7 / int1-7 (one byte per element): share()
    # raised torch's NotImplementedError ("copy_kernel" not implemented for 'UInt4'),
    # though empty() and sending such a tensor worked.
    names = [n for n in ("uint1", "uint2", "uint4", "uint7", "int1", "int4", "int7")
             if hasattr(torch, n)]
    if not names:
        pytest.skip("this torch has no bit-packed dtypes")
    w = await TorchWorker.spawn()
    raw = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    for name in names:
        dtype = getattr(torch, name)
        for t in (raw.view(dtype), raw.view(dtype).t(), raw.view(dtype)[:, ::2]):
            s = at.share(t)
            assert at.is_shared(s) and s.dtype == dtype and s.shape == t.shape, name
            assert torch.equal(s.view(torch.uint8), t.view(torch.uint8)), name
            info = await w.info(s)
            assert info["shared"] and info["dtype"] == dtype, name


async def test_views_keep_strides_and_storage_offset(rt):
    w = await TorchWorker.spawn()
    base = at.zeros(6, 8)
    v = base[1:5, ::2].t()
    info = await w.info(v)
    assert (info["shape"], info["stride"], info["offset"]) == (
        tuple(v.shape), v.stride(), v.storage_offset())
    await w.fill(v, 7.0)
    expect = torch.zeros(6, 8)
    expect[1:5, ::2] = 7.0
    assert torch.equal(base, expect)


async def test_views_of_ordinary_tensors_keep_strides_and_storage_offset(rt):
    # copied with the storage up to the view's end; a small view of a much larger
    # storage is copied compactly, not with the rest
    w = await TorchWorker.spawn()
    big = torch.randn(300, 300)
    for v in (big[10:20, 5:], big[5], big[:, ::2], big.t()[:, ::2], torch.arange(3.).expand(4, 3),
              torch.arange(10.)[3:3], big[::2, ::2], big[1::2, 1::2].t()):
        info = await w.info(v)
        assert (info["shape"], info["stride"], info["offset"]) == (
            tuple(v.shape), v.stride(), v.storage_offset())
        assert torch.equal(await w.echo(v), v)
    v = big[:, ::150]
    info = await w.info(v)
    assert (info["shape"], info["stride"], info["offset"]) == ((300, 2), (2, 1), 0)
    assert torch.equal(await w.echo(v), v)


async def test_conjugate_and_negative_views_keep_their_values(rt):
    w = await TorchWorker.spawn()
    z = at.share(torch.tensor([1 + 2j, 3 - 1j]))
    for x in (z.conj(), z.conj().imag, torch.tensor([1 + 2j, 0.5j]).conj()):
        assert x.is_conj() or x.is_neg()  # torch keeps these as bits, not in memory
        y = await w.echo(x)
        assert y.dtype == x.dtype and torch.equal(y.resolve_conj().resolve_neg(),
                                                  x.resolve_conj().resolve_neg())
    # a small view of a large ordinary storage is copied compactly (a clone, which
    # resolved the bits: it arrived with the right values but as no view)
    big = torch.arange(40000.0) * (1 + 1j)
    for x in (big[30000:30003].conj(), torch._neg_view(big.real[30000:30003])):
        y = await w.echo(x)
        assert (y.is_conj(), y.is_neg()) == (x.is_conj(), x.is_neg())
        assert torch.equal(y.resolve_conj().resolve_neg(), x.resolve_conj().resolve_neg())
    back = await w.echo(z.conj())
    assert back.is_conj() and back.data_ptr() == z.data_ptr()  # still a view of z
    await w.fill(z.conj(), 1j)  # written through the conjugate view: z holds -1j
    assert torch.equal(z, torch.tensor([-1j, -1j]))


async def test_nested_and_sparse_tensors_travel(rt):
    w = await TorchWorker.spawn()
    # (torch pickles nested tensors from 2.2 on; the jagged layout came later still)
    layouts = [torch.strided, getattr(torch, "jagged", None)] if _TORCH >= (2, 2) else []
    for layout in filter(None, layouts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype API
            nt = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)],
                                            layout=layout)
        back = await w.echo(nt)
        assert back.is_nested and [t.tolist() for t in back.unbind()] == [
            [1.0, 1.0], [0.0, 1.0, 2.0]]
    sp = await w.echo(torch.eye(3).to_sparse())
    assert sp.is_sparse and torch.equal(sp.to_dense(), torch.eye(3))


async def test_received_sparse_tensors_are_not_kept_alive(pair):
    # torch's unpickling queues each sparse tensor for torch.load to check, and only
    # torch.load empties that queue; the parts of a sparse tensor travel as actorshm
    # tensors, never through torch.load: every sparse tensor received would stay alive,
    # its parts' shared memory leased with it.
    queue = torch._utils._sparse_tensors_to_validate
    queued, live = len(queue), actorshm.stats()["blocks_live"]
    dense = torch.tensor([[0, 0, 1.0, 0], [2, 0, 0, 0], [0, 3, 0, 4], [0, 0, 0, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR is a beta API
        noted = dense.to_sparse()
        noted.note = "kept"
        for sent in (dense.to_sparse(), dense.to_sparse_csr(), dense.to_sparse_csc(),
                     dense.to_sparse_bsr((2, 2)), dense.to_sparse_csc().requires_grad_(True),
                     dense.to_sparse().requires_grad_(True),
                     torch.nn.Parameter(dense.to_sparse()), noted):
            for _ in range(3):
                (_, (got,), _), _, _ = trip(("f", (sent,), {}), *pair)
                assert type(got) is type(sent) and got.layout == sent.layout
                assert got.requires_grad == sent.requires_grad  # (a leaf's flag is kept)
                assert torch.equal(got.detach().to_dense(), sent.detach().to_dense())
                assert getattr(got, "note", None) == getattr(sent, "note", None)
                del got
    assert len(queue) == queued
    gc.collect()
    for _ in range(100):  # (the leases come back over the socket pair)
        if actorshm.stats()["blocks_live"] == live:
            break
        await asyncio.sleep(0.01)
    assert actorshm.stats()["blocks_live"] == live


async def test_tensors_in_containers_at_any_depth(rt):
    w = await TorchWorker.spawn()
    a, b = at.zeros(3), at.zeros(2, dtype=torch.int64)
    back = await w.echo({"x": [a, (b, {"deep": a[1:]})]})
    assert back["x"][0].untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    back["x"][1][1]["deep"][0] = 5.0  # a view of a, rebuilt over the same memory
    assert a[1] == 5.0


def _same_tensors(got, sent):
    """``got`` is ``sent`` rebuilt: each shared tensor (or array) over the same memory,
    with the same dtype, shape, strides, storage offset, type and autograd and view
    bits; an ordinary one an equal copy; scalars equal."""
    if isinstance(sent, torch.Tensor):
        assert type(got) is type(sent) and got.dtype == sent.dtype
        assert (got.shape, got.stride(), got.storage_offset()) == (
            sent.shape, sent.stride(), sent.storage_offset())
        assert (got.requires_grad, got.is_conj(), got.is_neg()) == (
            sent.requires_grad, sent.is_conj(), sent.is_neg())
        if at.is_shared(sent):
            assert got.untyped_storage().data_ptr() == sent.untyped_storage().data_ptr()
        got, sent = (t.detach().resolve_conj().resolve_neg() for t in (got, sent))
        if sent.dtype.itemsize == 1:  # (torch 2.1 cannot compare float8 tensors)
            got, sent = got.view(torch.uint8), sent.view(torch.uint8)
        assert torch.equal(got, sent)
    elif isinstance(sent, np.ndarray):
        assert type(got) is np.ndarray and np.shares_memory(got, sent)
    elif isinstance(sent, (tuple, list, dict)):
        assert type(got) is type(sent) and len(got) == len(sent)
        for k in (sent if isinstance(sent, dict) else range(len(sent))):
            _same_tensors(got[k], sent[k])
    else:
        assert got == sent


async def test_shared_tensors_travel_flat_and_the_rest_by_the_full_encoder(pair):
    from actorshm import _wire as W
    base = at.zeros(6, 8)
    z = at.share(torch.tensor([1 + 2j, 3 - 1j]))
    p = torch.nn.Parameter(at.zeros(4))
    leaf = at.zeros(3).requires_grad_(True)
    bf = at.zeros(10, dtype=torch.bfloat16)[3:9:2]
    cases = [
        (("f", (base,), {}), True),
        (("f", (base[1:5, ::2].t(), 2.5), {"z": z.conj(), "n": z.conj().imag}), True),
        (("f", (p, leaf, bf, actorshm.zeros(5)), {}), True),
        ([base, 1, "x"], True),
        (bf, True),
        (("f", (torch.ones(3),), {}), False),  # ordinary: copied into shared memory
        (("f", ([base],), {}), False),  # nested
        (("f", (torch.nn.Parameter(torch.ones(2)),), {}), False),
        (("f", (base, torch.ones(3)), {}), False),  # one shared, one to copy
    ]
    assert cases[1][0][2]["n"].is_neg() and cases[1][0][2]["z"].is_conj()
    for msg, flat in cases:
        got, flags, _ = trip(msg, *pair)
        assert bool(flags & W.FLAT) == flat, msg
        _same_tensors(got, msg)
    # a shared tensor leased before the message fell back is counted once, not twice
    s0 = actorshm.stats()
    trip(("f", (base, torch.ones(3)), {}), *pair)
    s1 = actorshm.stats()
    assert s1["bytes_zero_copy"] - s0["bytes_zero_copy"] == 6 * 8 * 4
    assert s1["bytes_copied"] - s0["bytes_copied"] == 3 * 4
    # a message with a tensor that is not flat goes through cloudpickle, as any message
    sp = torch.eye(2).to_sparse()
    sp.note = lambda: 5  # (plain pickle cannot send a lambda)
    (_, (got,), _), flags, _ = trip(("f", (sp,), {}), *pair)
    assert not flags & W.FLAT and torch.equal(got.to_dense(), torch.eye(2))
    assert got.note() == 5
    # a tensor that recurs arrives once, and a flat message counts what it shares
    s0 = actorshm.stats()
    (_, (x, y, q), kw), flags, enc = trip(("f", (bf, bf, p), {"k": bf}), *pair)
    assert flags & W.FLAT and x is y is kw["k"] and type(q) is torch.nn.Parameter
    s1 = actorshm.stats()
    assert s1["bytes_zero_copy"] - s0["bytes_zero_copy"] == 3 * 2 + 4 * 4
    assert s1["bytes_copied"] == s0["bytes_copied"]
    # a tensor in an autograd graph is still refused, before anything is sent, and the
    # shared tensor before it is not counted as sent
    with pytest.raises(TypeError, match=r"detach\(\)"):
        trip(("f", (base, leaf * 2), {}), *pair)
    assert actorshm.stats()["bytes_zero_copy"] == s1["bytes_zero_copy"]


async def test_a_receiver_without_torch_fails_that_call_and_carries_on(rt):
    from actors import WithoutTorch
    w = await WithoutTorch.spawn()
    t = at.zeros(4)
    for _ in range(2):  # flat (the maker cannot be imported there): the call fails
        with pytest.raises(TypeError, match="could not deserialize"):
            await w.kind(t)
    assert await w.ping() == "alive"
    assert await w.kind(actorshm.zeros(3)) == "ndarray"


async def test_ordinary_tensor_is_copied_once_and_counted(rt):
    w = await TorchWorker.spawn()
    t = torch.ones(8192)  # 32 KiB: over the in-band limit
    s0 = actorshm.stats()
    info = await w.info(t)
    s1 = actorshm.stats()
    assert info["shared"]  # the actor got it in shared memory
    assert s1["bytes_copied"] - s0["bytes_copied"] == 8192 * 4
    assert s1["arrays_copied"] - s0["arrays_copied"] == 1
    assert not at.is_shared(t)


async def test_views_of_one_ordinary_tensor_in_one_call_view_one_copy(rt):
    # as torch.multiprocessing keeps them: a write through one is seen through the other
    w = await TorchWorker.spawn()
    for n in (10, 100_000):  # in band, and in a shared block
        base = torch.zeros(n)
        assert await w.write_first_read_second(base, base[:5]) == (1000.0, True)
        # the view first: on a small storage it is copied whole, and base views that copy;
        # a few bytes of a large one are copied alone (base's copy must not wait for them)
        assert await w.write_first_read_second(base[:5], base) == (
            (1000.0, True) if n == 10 else (0.0, False))
        flat = torch.zeros(n)
        model = torch.nn.Linear(n - 2, 1)
        model.weight.data, model.bias.data = flat[:-2].view(1, -1), flat[-2:-1]
        assert await w.write_first_read_second(model.weight, flat) == (1000.0, True)
        assert float(base.sum()) == 0.0  # copies: ours untouched
    s0 = actorshm.stats()
    assert await w.write_first_read_second(base[:5], base[10:20]) == (0.0, False)
    # (a view met before a copy that covers it keeps its own: each up to its last element)
    assert actorshm.stats()["bytes_copied"] - s0["bytes_copied"] == (5 + 20) * 4


async def test_storages_travel_as_storages_by_reference_when_shared(rt):
    # torch's own pickling of a storage failed in the actor with an AttributeError
    w = await TorchWorker.spawn()
    t = at.zeros(10)
    assert await w.poke_storage(t.untyped_storage()) == ("UntypedStorage", 40, None)
    assert t.view(torch.uint8)[0] == 7
    t = at.zeros(10, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (TypedStorage is deprecated)
        typed = t.storage()
    assert await w.poke_storage(typed) == ("TypedStorage", 80, torch.float64)
    assert t.view(torch.uint8)[0] == 7
    ordinary = torch.zeros(10)
    s0 = actorshm.stats()
    assert await w.poke_storage(ordinary.untyped_storage()) == ("UntypedStorage", 40, None)
    assert ordinary.view(torch.uint8)[0] == 0  # a copy, counted
    assert actorshm.stats()["bytes_copied"] - s0["bytes_copied"] == 40


async def test_the_rows_of_an_ordinary_batch_copy_its_storage_about_once(rt):
    # Each row copied up to itself (so that its storage offset stays) made 5,000 rows of
    # 16 B copy ~134 MB, and failed past the shared-memory budget
    w = await TorchWorker.spawn()
    batch = torch.arange(20_000, dtype=torch.float32).reshape(5_000, 4)
    rows = list(batch)
    s0 = actorshm.stats()
    back = await w.echo(rows)
    copied = actorshm.stats()["bytes_copied"] - s0["bytes_copied"]
    assert batch.nbytes <= copied <= 2 * batch.nbytes + 65536
    for got, sent in zip(back[::499], rows[::499]):
        _same_tensors(got, sent)
    # rows over 64 KiB from the storage's start are copied alone (compactly) until the
    # rows met add up to a quarter of it: then the storage, which the rest view
    wide = list(torch.zeros(400, 2048))  # 8 KiB rows
    s0 = actorshm.stats()
    assert await w.storages(wide) == 98  # (rows 0-96 alone, the rest over one copy)
    copied = actorshm.stats()["bytes_copied"] - s0["bytes_copied"]
    assert 400 * 8192 <= copied <= 1.5 * 400 * 8192  # (the first rows: up to themselves)


async def test_the_rows_of_an_ordinary_batch_arrive_mostly_as_views_of_one_copy(rt):
    # Rows copied compactly were never counted as pieces of their storage: no copy of it
    # was made, and the 64 rows of a batch of images arrived over 64 storages, 1.56x its
    # bytes copied; 8 parameters over one flat buffer arrived over 4
    w = await TorchWorker.spawn()
    batch = torch.randn(64, 3072)  # 12 KiB rows
    s0 = actorshm.stats()
    rows = list(batch)
    assert await w.storages(rows) == 15  # (rows 0-13 alone, the rest over one copy)
    copied = actorshm.stats()["bytes_copied"] - s0["bytes_copied"]
    assert copied <= 2 * batch.nbytes
    flat = torch.zeros(8 * 256 * 256)
    params = [torch.nn.Parameter(flat[i * 65536:(i + 1) * 65536].view(256, 256))
              for i in range(8)]
    assert await w.storages(params) == 2  # (the first alone, up to itself)
    back = await w.echo(rows)
    assert all(torch.equal(got, sent) for got, sent in zip(back, rows))
    assert [t.storage_offset() for t in back[14:]] == [i * 3072 for i in range(14, 64)]


async def test_a_tensor_shared_by_torch_itself_is_copied_with_a_warning_once(rt,
                                                                             monkeypatch):
    # torch.multiprocessing's idiom (model.share_memory()) does not share with actors:
    # say so once, naming what does, instead of training a copy in silence
    from actorshm import _torch
    monkeypatch.setattr(_torch, "_warned", [False])
    w = await TorchWorker.spawn()
    model = torch.nn.Linear(4, 2)
    model.share_memory()
    with pytest.warns(RuntimeWarning, match=r"share_module\(model\)") as caught:
        await w.sgd_step(model, 0.5)
    assert caught[0].filename == __file__  # (the line that sent it: not actorshm's)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second send says nothing
        await w.sgd_step(model, 0.5)
        await w.echo(torch.ones(3))  # (an ordinary tensor: no warning)
    shared = at.share_module(model)
    before = [p.detach().clone() for p in shared.parameters()]
    await w.sgd_step(shared, 0.5)
    for p, p0 in zip(shared.parameters(), before):
        assert torch.allclose(p.detach(), p0 - 0.5)
    # share_memory() after share_module moves the tensors back out: the warning says so
    monkeypatch.setattr(_torch, "_warned", [False])
    shared.share_memory()
    assert not any(at.is_shared(p) for p in shared.parameters())
    with pytest.warns(RuntimeWarning, match=r"not call share_memory\(\) after"):
        await w.sgd_step(shared, 0.5)


async def test_a_dataloaders_batches_from_its_workers_are_copied_without_a_warning(rt):
    # A DataLoader's workers hand their batches over in torch's shared memory: that is
    # data (copied as any other tensor), not a model shared with share_memory() that an
    # actor is expected to write, so the warning above must not fire for it. Run where
    # users run it: in an actor (its workers forked from it) that sends the batches on.
    loader, other = await asyncio.gather(TorchWorker.spawn(), TorchWorker.spawn())
    got = await loader.send_loader_batches(other, 20, 5)
    assert got["in_torch_shared_memory"] and got["same"]
    assert got["warnings"] == []
    assert got["bytes_copied"] >= 20 * 2 * 4
    # one shared here with share_memory_() still warns
    assert len(got["then"]) == 1 and "share(t)" in got["then"][0]


async def test_a_model_sent_through_torch_multiprocessing_still_warns(rt, monkeypatch):
    # torch keeps the storages it sent in its cache too: a model shared with
    # share_memory() and once given to a torch.multiprocessing process looked like a
    # DataLoader's batch, and its copy in an actor went unsaid
    from multiprocessing.reduction import ForkingPickler

    from actorshm import _torch
    monkeypatch.setattr(_torch, "_warned", [False])
    w = await TorchWorker.spawn()
    model = torch.nn.Linear(4, 2).share_memory()
    try:
        ForkingPickler.dumps(model)  # (what a torch queue's put does with it)
    finally:
        import multiprocessing.resource_sharer
        multiprocessing.resource_sharer.stop()  # (the thread and fds that dumps made)
    with pytest.warns(RuntimeWarning, match=r"share_module\(model\)"):
        await w.sgd_step(model, 0.5)


async def test_an_actor_whose_dataloader_raised_stops_at_once():
    # The method's exception keeps the DataLoader's iterator in a reference cycle with
    # the instance. Collected before torch's exit function ran, the iterator joined its
    # worker for 5 s (cut short at the shutdown grace); after it, as at a program's end,
    # torch leaves its workers to the process's end.
    async with actorshm.Runtime(shutdown_grace=8.0):
        w = await TorchWorker.spawn()
        with pytest.raises(ValueError, match="no item"):
            await w.load_failing()
        start = time.monotonic()
    assert time.monotonic() - start < 4.0  # (5 s or more before; ~0.1 s here)


async def test_small_ordinary_tensors_travel_in_band_as_writable_copies(rt):
    from actorshm._inband import INLINE_BUDGET, INLINE_MAX
    w = await TorchWorker.spawn()
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    z = torch.tensor([1 + 2j, 3 - 1j])
    small = [torch.ones(10), torch.nn.Parameter(torch.zeros(3)),
             torch.zeros(5).requires_grad_(True), base[1:, ::2].t(),
             torch.arange(7, dtype=torch.bfloat16), torch.tensor([True, False]), z.conj(),
             torch.zeros(4, dtype=torch.float8_e4m3fn)]
    a0, s0 = await w.stats(), actorshm.stats()
    back = await w.echo(small)
    a1, s1 = await w.stats(), actorshm.stats()
    for got, sent in zip(back, small):
        _same_tensors(got, sent)
        assert got.untyped_storage().data_ptr() != sent.untyped_storage().data_ptr()
    # in band both ways: copies counted, no shared block made or leased on either side
    # (each storage up to the view's last element: the same bytes back as out)
    copied = s1["bytes_copied"] - s0["bytes_copied"]
    assert copied >= sum(x.numel() * x.element_size() for x in small)
    assert a1["bytes_copied"] - a0["bytes_copied"] == copied
    assert s1["arrays_copied"] - s0["arrays_copied"] == len(small)
    for d in (s0, a0):
        d1 = s1 if d is s0 else a1
        assert d1["pool_allocs"] == d["pool_allocs"] and d1["pool_reuses"] == d["pool_reuses"]
    info = await w.info(small[0])
    assert not info["shared"] and info["type"] == "Tensor"
    assert await w.add_one(small[0]) == 20.0  # writable there; ours is untouched
    assert float(small[0].sum()) == 10.0
    # past the per-message budget, the rest are copied into shared memory
    n = INLINE_BUDGET // INLINE_MAX + 2
    many = [torch.ones(INLINE_MAX // 4) for _ in range(n)]
    shared = await w.count_shared(many)
    assert 1 <= shared <= 3 and shared + INLINE_BUDGET // INLINE_MAX >= n


async def test_a_quantized_dtype_view_of_raw_memory_is_refused_before_sending(rt):
    # Not quantized (no scale, no zero point), it arrived quantized with no quantizer,
    # and the actor died of SIGSEGV returning it; shared, it took the flat path alike.
    w = await TorchWorker.spawn()
    for raw in (torch.zeros(16, dtype=torch.uint8), at.zeros(16, dtype=torch.uint8)):
        with pytest.raises(TypeError, match=r"torch\.qint32 that is not quantized.*"
                                            r"t\.view\(torch\.int32\)"):
            w.info(raw.view(torch.qint32))
    assert (await w.info(torch.ones(2)))["shape"] == (2,)  # the actor lives on


async def test_a_model_shared_only_in_part_warns_that_the_rest_does_not_train(
        rt, monkeypatch):
    # A layer replaced after share_module was copied at each send in silence: the
    # actor's steps never reached it, while the rest of the model trained
    from actorshm import _torch
    monkeypatch.setattr(_torch, "_warned_mixed", [False])
    w = await TorchWorker.spawn()
    model = at.share_module(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                torch.nn.Linear(4, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await w.sgd_step(model, 0.5)  # (all shared: nothing said)
        await w.sgd_step(torch.nn.Linear(4, 2), 0.5)  # (all copied: an evaluation's)
    model[1] = torch.nn.Linear(4, 2)
    with pytest.warns(RuntimeWarning, match=r"parameters of a model are sent partly by "
                                            r"reference .*share_module\(model\) again") \
            as caught:
        await w.sgd_step(model, 0.5)
    assert caught[0].filename == __file__
    at.share_module(model)
    before = model[1].bias.detach().clone()
    await w.sgd_step(model, 0.5)  # (shared again: the new layer trains)
    assert torch.allclose(model[1].bias.detach(), before - 0.5)


async def test_a_torchscript_module_is_refused_saying_what_to_send(rt):
    # torch's own error, "Tried to serialize object ... which does not have a
    # __getstate__ method defined", came with advice about open files and locks
    w = await TorchWorker.spawn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (torch 2.13 deprecates them)
        scripted = [torch.jit.script(torch.nn.Linear(2, 2)),
                    torch.jit.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))]
    for m in scripted:
        with pytest.raises(TypeError, match=r"a TorchScript module \(\w+, from "
                                            r"torch\.jit\.script or torch\.jit\.trace\) "
                                            r"cannot be pickled.*script it in the actor"):
            w.echo([m])
    assert (await w.info(torch.ones(2)))["shape"] == (2,)


async def test_an_mkldnn_tensor_is_refused_and_a_meta_tensor_travels(rt):
    # An MKL-DNN tensor has no storage: the error was torch's "Cannot access storage of
    # OpaqueTensorImpl", with advice about open files and locks
    w = await TorchWorker.spawn()
    if getattr(torch, "_mkldnn", None) is not None and torch.backends.mkldnn.is_available():
        with pytest.raises(TypeError, match=r"MKL-DNN tensor.*t\.to_dense\(\)"):
            w.info([torch.ones(3).to_mkldnn()])
        with pytest.raises(TypeError, match=r"share: an MKL-DNN tensor.*t\.to_dense\(\)"):
            at.share(torch.ones(3).to_mkldnn())  # (was torch's "copy_mkldnn_: ...")
    meta = torch.nn.Parameter(torch.empty(2, 3, device="meta"))
    info = await w.info(meta)
    assert info["shape"] == (2, 3) and info["parameter"] and info["requires_grad"]


async def test_parameter_and_requires_grad_travel_and_non_leaf_is_refused(rt):
    w = await TorchWorker.spawn()
    p = torch.nn.Parameter(at.zeros(4))
    info = await w.info(p)
    assert info["parameter"] and info["requires_grad"]
    leaf = at.zeros(3).requires_grad_(True)
    info = await w.info(leaf)
    assert info["requires_grad"] and not info["parameter"]
    non_leaf = leaf * 2
    with pytest.raises(TypeError, match=r"detach\(\)"):
        w.info(non_leaf)
    assert (await w.info(non_leaf.detach()))["requires_grad"] is False
    # leaves over a small part of a large ordinary storage (copied: only their part)
    big = torch.zeros(1 << 20)
    for t, parameter in ((torch.nn.Parameter(big[:4]), True),
                         (big[8:11].requires_grad_(True), False)):
        info = await w.info(t)
        assert info["requires_grad"] and info["parameter"] is parameter


async def test_attributes_set_on_a_tensor_travel_with_it(rt):
    # As torch's pickling (and so the Ray backend) keeps them: shared or copied, small or
    # large, a Parameter or not, alone (the flat path) or in a container, both ways.
    w = await TorchWorker.spawn()
    cases = [at.zeros(4), torch.zeros(4), torch.zeros(1 << 16), torch.zeros(0),
             torch.nn.Parameter(at.zeros(3)), torch.nn.Parameter(torch.ones(1 << 16))]
    for t in cases:
        t.tag, t.no_decay = "w", True
        for sent in (t, [t, 1]):
            got = await w.echo(sent)
            got = got if isinstance(got, torch.Tensor) else got[0]
            assert (got.tag, got.no_decay) == ("w", True), t.shape
            assert type(got) is type(t) and torch.equal(got, t)
    plain = await w.echo(at.zeros(2))
    assert not hasattr(plain, "tag")
    shared = cases[0]
    await w.fill(shared, 5.0)  # still by reference
    assert shared.tolist() == [5.0] * 4


async def test_an_attribute_may_refer_to_its_tensor(rt):
    # Sent as arguments of the tensor's rebuild, such attributes recursed without end
    # ("excessively deep recursion", a TypeError), where before they were dropped.
    w = await TorchWorker.spawn()
    for t in (at.zeros(4), torch.ones(1 << 16), torch.nn.Parameter(at.zeros(3)),
              torch.eye(3).to_sparse()):
        t.me, t.pair = t, (t, 1)
        got = await w.echo(t)
        assert got.me is got and got.pair[0] is got and type(got) is type(t)
        assert torch.equal(got.to_dense(), t.to_dense())


async def test_tensor_subclasses_travel_by_reference_as_themselves(rt):
    # torch pickled them by value: a shared one was copied, uncounted, and writes were lost
    w = await TorchWorker.spawn()
    t = at.zeros(4096).as_subclass(Tagged)
    t.tag = "img"
    before = actorshm.stats()
    info = await w.info(t)
    assert (info["type"], info["shared"]) == ("Tagged", True)
    await w.fill(t, 3.0)
    assert t.tolist() == [3.0] * 4096
    after = actorshm.stats()
    assert after["bytes_copied"] == before["bytes_copied"]
    back = await w.echo([t[2:], t])
    assert type(back[1]) is Tagged and back[1].tag == "img"
    assert back[1].data_ptr() == t.data_ptr() and back[0].storage_offset() == 2
    # an ordinary one is copied once (counted), a leaf keeps requires_grad
    g = torch.Tensor._make_subclass(Tagged, torch.zeros(8192), True)
    info = await w.info(g)
    assert (info["type"], info["requires_grad"], info["shared"]) == ("Tagged", True, True)
    assert actorshm.stats()["bytes_copied"] - after["bytes_copied"] == 8192 * 4
    s = at.share(torch.ones(8).as_subclass(Tagged))
    assert type(s) is Tagged and at.is_shared(s) and actorshm.is_shared(s)


async def test_a_shared_parameter_subclass_travels_by_reference_and_says_so(rt):
    # torch's Parameter.__reduce_ex__ sends its .data, a plain tensor that actorshm
    # sends by reference: the actor's writes come back and nothing is copied, while
    # is_shared said False. It arrives as an nn.Parameter, as torch's pickling makes it.
    class MyParam(torch.nn.Parameter):
        pass

    w = await TorchWorker.spawn()
    p = MyParam(at.zeros(4096))
    assert at.is_shared(p) and actorshm.is_shared(p) and at.share(p) is p
    before = actorshm.stats()["bytes_copied"]
    info = await w.info(p)
    assert (info["type"], info["shared"], info["requires_grad"]) == ("Parameter", True, True)
    await w.fill(p, 3.0)
    assert p.tolist() == [3.0] * 4096 and actorshm.stats()["bytes_copied"] == before
    assert not at.is_shared(MyParam(torch.zeros(3)))


def test_is_shared_is_false_for_tensor_subclasses_torch_pickles_by_value():
    # a subclass that pickles itself its own way, and a wrapper subclass has no
    # storage (asking for its data pointer raises)
    class OwnReduce(torch.Tensor):
        def __reduce_ex__(self, proto):
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor).clone(), proto)

    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    o = at.zeros(3).as_subclass(OwnReduce)
    assert not at.is_shared(o) and not actorshm.is_shared(o)
    assert not at.is_shared(Wrapper(at.zeros(3)))
    assert not actorshm.is_shared(Wrapper(at.zeros(3)))
    assert at.is_shared(torch.nn.Parameter(at.zeros(3)))


async def test_share_module_hogwild_updates_the_shared_weights(rt):
    torch.manual_seed(0)
    model = at.share_module(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                                                torch.nn.Linear(3, 2)))
    before = [p.detach().clone() for p in model.parameters()]
    workers = [await TorchWorker.spawn() for _ in range(2)]
    s0 = actorshm.stats()
    for wk in workers:  # one after the other: concurrent `p -= lr` may lose an update
        await wk.sgd_step(model, 0.5)
    s1 = actorshm.stats()
    for p, p0 in zip(model.parameters(), before):
        assert torch.allclose(p.detach(), p0 - 1.0)  # both actors' steps reached us
    assert s1["bytes_copied"] == s0["bytes_copied"]


class _Tied(torch.nn.Module):
    """Tensors that view one storage: tied weights, one buffer registered in two
    submodules, parameters that are views of one flat vector, a transposed parameter."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.out = torch.nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight  # tied
        stats = torch.arange(4.0)
        self.a, self.b = torch.nn.Module(), torch.nn.Module()
        self.a.register_buffer("stats", stats)
        self.b.register_buffer("stats", stats)  # the same tensor, twice
        flat = torch.arange(10.0)
        self.head = torch.nn.Parameter(flat[:6].view(2, 3))
        self.tail = torch.nn.Parameter(flat[6:])
        self.t = torch.nn.Parameter(torch.arange(6.0).view(2, 3).t())


async def test_share_module_keeps_tensors_that_view_one_storage_aliased(rt):
    model = _Tied()
    before = {k: (v.detach().clone(), v.stride(), v.storage_offset())
              for k, v in model.state_dict(keep_vars=True).items()}
    assert at.share_module(model) is model
    for k, v in model.state_dict(keep_vars=True).items():
        assert at.is_shared(v), k
        assert torch.equal(v.detach(), before[k][0]) and v.stride() == before[k][1], k
        assert v.storage_offset() == before[k][2], k
    assert model.out.weight is model.emb.weight
    assert model.a.stats is model.b.stats
    assert model.head.untyped_storage().data_ptr() == model.tail.untyped_storage().data_ptr()
    with torch.no_grad():
        model.tail[0] = -1.0  # a write through one view is seen through the other
    whole = torch.empty(0).set_(model.head.untyped_storage())
    assert whole.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0, 7.0, 8.0, 9.0]
    ptrs = [v.data_ptr() for v in model.state_dict().values()]
    at.share_module(model)  # already shared: nothing moves
    assert [v.data_ptr() for v in model.state_dict().values()] == ptrs

    w = await TorchWorker.spawn()
    s0 = actorshm.stats()
    await w.fill_path(model, "a.stats", 7.0)  # the actor's write reaches both holders
    await w.fill_path(model, "out.weight", 2.0)
    await w.fill_path(model, "tail", 3.0)
    assert model.b.stats.tolist() == [7.0] * 4
    assert model.emb.weight.detach().sum().item() == 30.0
    assert model.head.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert model.tail.tolist() == [3.0] * 4
    assert actorshm.stats()["bytes_copied"] == s0["bytes_copied"]


def test_share_module_frees_each_old_storage_as_it_goes(monkeypatch):
    # Peak memory is the module plus one storage, not twice the module: by the time the
    # third storage is copied, the first two (held by nothing but the module) are gone.
    # (The buffers keep their objects, their .data moves: the numpy arrays under the old
    # storages tell when those are freed.)
    m = torch.nn.Module()
    arrays = [np.full(4, float(i), np.float32) for i in range(3)]
    for i, a in enumerate(arrays):
        m.register_buffer(f"b{i}", torch.from_numpy(a))
    old = [weakref.ref(a) for a in arrays]
    del arrays, a
    alive_at_copy = []
    real_empty = at.empty

    def counting_empty(*args, **kw):
        gc.collect()
        alive_at_copy.append(sum(r() is not None for r in old))
        return real_empty(*args, **kw)

    monkeypatch.setattr(at, "empty", counting_empty)
    at.share_module(m)
    assert alive_at_copy == [3, 2, 1]
    assert [b.tolist() for b in m.buffers()] == [[float(i)] * 4 for i in range(3)]
    assert all(at.is_shared(b) for b in m.buffers())


def test_share_module_moves_nothing_when_one_tensor_is_refused():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m[1].register_buffer("q", torch.quantize_per_tensor(torch.ones(3), 0.1, 0,
                                                            torch.quint8))
    with pytest.raises(TypeError, match=r"dequantize\(\)"):
        at.share_module(m)
    assert not any(at.is_shared(p) for p in m.parameters())


def test_share_module_refuses_a_lazy_module_until_its_first_forward():
    # It returned as if done, the lazy parameters left private (empty, then given
    # private memory at the first forward): actors trained copies. torch's own
    # share_memory() refuses them too.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("lazy modules are a new feature": torch 2.1)
        m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LazyLinear(4))
    with pytest.raises(ValueError, match=r"LazyLinear\.weight is uninitialized.*forward"):
        at.share_module(m)
    assert not any(at.is_shared(p) for p in m[0].parameters())  # (nothing moved)
    m(torch.ones(2, 3))
    assert all(at.is_shared(p) for p in at.share_module(m).parameters())


def test_share_module_keeps_conjugate_and_negative_views_and_buffer_objects():
    # A conjugate or negative view lost its bit when moved (its values changed: 1-1j
    # became 1+1j, -1 became 1); a buffer was replaced by a plain tensor (its class,
    # attributes and requires_grad gone, which Module.share_memory() keeps).
    m = torch.nn.Module()
    z = torch.tensor([1 - 1j, 2 + 2j])
    m.w = torch.nn.Parameter(z.clone().conj())
    m.register_buffer("kernel", z.clone().conj())
    m.register_buffer("neg", torch._neg_view(torch.tensor([1.0, 2.0])))
    b = torch.ones(3).as_subclass(Tagged)
    b.tag = "keep"
    m.register_buffer("b", b)
    m.register_buffer("g", torch.ones(2, requires_grad=True))
    before = {k: v.detach().resolve_conj().resolve_neg().clone()
              for k, v in m.state_dict(keep_vars=True).items()}
    bits = {k: (v.is_conj(), v.is_neg()) for k, v in m.state_dict(keep_vars=True).items()}
    at.share_module(m)
    for k, v in m.state_dict(keep_vars=True).items():
        assert at.is_shared(v), k
        assert (v.is_conj(), v.is_neg()) == bits[k], k
        assert torch.equal(v.detach().resolve_conj().resolve_neg(), before[k]), k
    assert type(m.b) is Tagged and m.b.tag == "keep"  # (a new object, as sent ones)
    # one registered in two modules stays one object (it became two)
    twice = torch.nn.Module()
    twice.a, twice.b = torch.nn.Module(), torch.nn.Module()
    shared_b = torch.ones(2).as_subclass(Tagged)
    twice.a.register_buffer("s", shared_b)
    twice.b.register_buffer("s", shared_b)
    at.share_module(twice)
    assert twice.a.s is twice.b.s and type(twice.a.s) is Tagged and at.is_shared(twice.a.s)
    assert m.g.requires_grad


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_share_module_frees_view_buffers_old_memory_and_shares_every_kind():
    # A buffer is replaced by its shared copy: a view buffer (nanoGPT's causal mask,
    # tril(ones(n, n)).view(1, 1, n, n)) moved in place through .data kept its old base
    # alive; a sparse compressed tensor moved so kept its old parts (not shared); an
    # inference tensor moved so broke (repr, state_dict: "Inference tensors do not track
    # version counter"); a quantized-dtype view of raw bytes failed part-way.
    base = np.tril(np.ones((64, 64), np.float32))
    old = weakref.ref(base)
    m = torch.nn.Module()
    m.register_buffer("mask", torch.from_numpy(base).view(1, 1, 64, 64))
    del base
    m.register_buffer("csr", torch.eye(3).to_sparse_csr())
    m.csr_p = torch.nn.Parameter(torch.eye(3).to_sparse_csr(), requires_grad=False)
    with torch.inference_mode():
        m.register_buffer("inf", torch.arange(4.0))
    at.share_module(m)
    gc.collect()
    assert old() is None  # (the old mask's memory went)
    assert all(at.is_shared(t) for t in (m.mask, m.csr, m.csr_p, m.inf))
    assert torch.equal(m.mask[0, 0], torch.tril(torch.ones(64, 64)))
    assert torch.equal(m.csr.to_dense(), torch.eye(3))
    assert torch.equal(m.csr_p.to_dense(), torch.eye(3))
    assert m.state_dict()["inf"].tolist() == [0.0, 1.0, 2.0, 3.0]
    m.inf.add_(1)  # (an ordinary tensor now, as Module.share_memory() leaves it)
    m2 = torch.nn.Sequential(torch.nn.Linear(2, 2))
    m2.register_buffer("raw", torch.zeros(8, dtype=torch.uint8).view(torch.qint32))
    with pytest.raises(TypeError, match=r"not quantized.*t\.view\(torch\.int32\)"):
        at.share_module(m2)
    assert not any(at.is_shared(p) for p in m2.parameters())  # (nothing moved)


def test_share_module_moves_tensors_from_one_address_over_storages_of_two_sizes():
    # Two tensors made from one array (from_numpy of a slice and of the whole) start at
    # one address on storages of two sizes: the copy was sized by the first one met, and
    # the second failed part-way ("Trying to resize storage that is not resizable").
    arr = np.arange(100, dtype=np.float32)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.from_numpy(arr[:10]))
    m.b = torch.nn.Parameter(torch.from_numpy(arr))
    at.share_module(m)
    assert at.is_shared(m.a) and at.is_shared(m.b)
    assert m.a.tolist() == list(range(10)) and m.b.tolist() == list(range(100))
    with torch.no_grad():
        m.b[3] = -1.0  # still one memory, as before
    assert m.a[3].item() == -1.0


def test_share_keeps_what_sending_keeps():
    p = torch.nn.Parameter(torch.ones(2, 3))
    sp = at.share(p)
    assert type(sp) is torch.nn.Parameter and sp.requires_grad and at.is_shared(sp)
    # attributes set on a tensor or a Parameter (they were dropped; sending keeps them)
    p.no_decay = True
    t = torch.ones(3)
    t.tag = ["a"]
    assert at.share(p).no_decay is True and at.share(t).tag is t.tag
    t.me = t  # one that refers to the tensor itself refers to the copy, as sent
    st = at.share(t)
    assert st.me is st
    leaf = at.share(torch.ones(3, requires_grad=True))
    assert leaf.requires_grad and leaf.is_leaf and at.is_shared(leaf)
    with pytest.raises(TypeError, match=r"not a leaf.*t\.detach\(\)"):
        at.share(torch.ones(3, requires_grad=True) * 2)
    # strides that cover the elements densely stay (channels_last, a transpose)
    cl = torch.arange(120.0).view(2, 3, 4, 5).to(memory_format=torch.channels_last)
    t = torch.arange(6.0).view(2, 3).t()
    for x in (cl, t):
        y = at.share(x)
        assert y.stride() == x.stride() and torch.equal(y, x) and at.is_shared(y)
    assert at.share(cl).is_contiguous(memory_format=torch.channels_last)
    # a conjugate or negative view stays one, over a copy of the memory as it was
    z = torch.tensor([1 + 2j, 3 - 1j])
    for x in (z.conj(), z.conj().imag, torch._neg_view(z)):
        y = at.share(x)
        assert (y.is_conj(), y.is_neg()) == (x.is_conj(), x.is_neg()) and at.is_shared(y)
        assert torch.equal(y.resolve_conj().resolve_neg(), x.resolve_conj().resolve_neg())
    with pytest.raises(TypeError, match=r"actorshm\.torch\.share"):
        actorshm.share(torch.ones(3))  # (numpy's would give an ndarray)
    with pytest.raises(TypeError, match=r"actorshm\.torch\.empty"):
        actorshm.empty(3, dtype=torch.float32)
    # any other view's copy is contiguous
    for x in (torch.arange(10.0)[::2], torch.ones(2, 1, 3).expand(2, 4, 3)):
        y = at.share(x)
        assert y.is_contiguous() and torch.equal(y, x) and at.is_shared(y)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_share_their_parts_and_nested_ones_are_refused():
    dense = torch.eye(4)
    for s in (dense.to_sparse(), dense.to_sparse_csr(), dense.to_sparse_bsc((2, 2))):
        assert not at.is_shared(s)
        shared = at.share(s)
        assert shared.layout is s.layout and at.is_shared(shared)
        assert torch.equal(shared.to_dense(), dense) and at.share(shared) is shared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: a prototype and a deprecated kind)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)
    for t, fix in ((nested, r"unbind\(\)"), (quantized, r"dequantize\(\)")):
        assert not at.is_shared(t)
        with pytest.raises(TypeError, match=fix):
            at.share(t)
        m = torch.nn.Module()
        m.register_buffer("x", t)
        with pytest.raises(TypeError, match="share_module.*" + fix):
            at.share_module(m)


async def test_shared_tensors_recycle(rt):
    w = await TorchWorker.spawn()
    for _ in range(3):
        t = at.empty(1 << 18)
        await w.fill(t, 1.0)
        del t
    await asyncio.sleep(0.05)
    s0 = actorshm.stats()
    for _ in range(50):
        t = at.empty(1 << 18)
        await w.fill(t, 1.0)
        del t
    await asyncio.sleep(0.05)
    gc.collect()
    s1 = actorshm.stats()
    assert s1["pool_allocs"] == s0["pool_allocs"]
    assert s1["pool_reuses"] - s0["pool_reuses"] == 50


async def test_numpy_views_of_shared_memory_found_by_address(rt):
    w = await TorchWorker.spawn()
    base = actorshm.zeros(100)
    s0 = actorshm.stats()
    via_torch = torch.from_numpy(base).numpy()
    via_buffer = np.frombuffer(base.data)
    await w.fill_numpy(via_torch, 1.0)
    assert base.sum() == 100.0
    await w.fill_numpy(via_buffer[10:20], 2.0)
    assert base.sum() == 110.0
    assert actorshm.stats()["bytes_copied"] == s0["bytes_copied"]
    assert actorshm.is_shared(via_torch) and actorshm.is_shared(via_buffer)
    assert not actorshm.is_shared(np.frombuffer(bytearray(16)))


async def test_tensor_from_numpy_of_shared_array_travels_by_reference(rt):
    w = await TorchWorker.spawn()
    a = actorshm.zeros(50, dtype=np.float32)
    t = torch.from_numpy(a)
    assert at.is_shared(t)
    # actorshm.is_shared answers for tensors too, rather than a silent False
    assert actorshm.is_shared(t) and actorshm.is_shared(at.zeros(3)[1:])
    assert not actorshm.is_shared(torch.zeros(3))
    await w.fill(t, 4.0)
    assert a.sum() == 200.0


async def test_num_cpus_sets_torch_threads(rt):
    one = await TorchWorker.spawn()
    two = await TorchWorker.options(num_cpus=2).spawn()
    # (torch caps its count at the machine's cores: 2 is the most a 2-core CI shows)
    three = await TorchWorker.options(num_cpus=1, env={"OMP_NUM_THREADS": "2"}).spawn()
    assert await one.threads() == 1
    assert await two.threads() == 2
    assert await three.threads() == 2  # env wins over num_cpus, for torch too


def test_bad_input_errors():
    with pytest.raises(ValueError, match="must be 'cpu' or 'cuda'"):
        at.empty(3, device="meta")
    with pytest.raises(ValueError, match="CPU or CUDA tensors"):
        at.share(torch.zeros(3, device="meta"))
    if importlib.util.find_spec("cupy") is None:  # the GPU pool is CuPy's
        with pytest.raises(ImportError, match=r"needs CuPy.*actorshm\[cuda\]"):
            at.empty(3, device="cuda")
    with pytest.raises(ValueError, match="ints >= 0"):
        at.empty(-1)
    for bad in (2.5, True, "3", (2, 3)):  # as torch.empty: not truncated, not read as 1
        with pytest.raises(TypeError, match=r"ints >= 0.* not an integer"):
            at.empty(bad, 2)
    # sizes computed with numpy or torch are integers too, as torch.empty takes them
    assert at.empty(np.int64(2), 3).shape == (2, 3)
    assert at.zeros((np.int32(4),)).shape == (4,) and at.empty(torch.tensor(3)).shape == (3,)
    with pytest.raises(TypeError, match="nn.Module"):
        at.share_module(torch.zeros(3))
    # each names itself, and the way in for a numpy array or a module
    with pytest.raises(TypeError, match=r"torch\.is_shared takes a torch\.Tensor, not "
                                        r"ndarray; for a numpy array, use actorshm\.is_shared"):
        at.is_shared(np.zeros(3))
    with pytest.raises(TypeError, match=r"torch\.share takes a torch\.Tensor, not ndarray; "
                                        r"for a numpy array, use actorshm\.share"):
        at.share(np.zeros(3))
    with pytest.raises(TypeError, match=r"not Linear; a module's parameters are shared with "
                                        r"actorshm\.torch\.share_module"):
        at.share(torch.nn.Linear(2, 2))
    # what torch takes as a dtype works as in torch.empty
    assert [at.zeros(2, dtype=t).dtype for t in (float, int, bool)] == \
        [torch.float64, torch.int64, torch.bool]
    for dtype in (np.float32, "float32"):  # numpy's spelling: the way to each
        with pytest.raises(TypeError, match=r"takes a torch dtype \(torch\.float32\), not "
                                            r".*actorshm\.empty\(\.\.\., dtype='float32'\)"):
            at.zeros(3, dtype=dtype)
    for make in (at.empty, at.zeros):  # quantized: by value, so never in shared memory
        with pytest.raises(TypeError, match=r"torch\.qint8 is a quantized dtype"):
            make(3, dtype=torch.qint8)
    s = at.share(torch.arange(4.0))
    assert at.is_shared(s) and at.share(s) is s and s.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_shared_tensor_lookup_does_not_scan_every_live_block():
    # A tensor is recognised by its storage's address. Scanning every live block for it
    # cost milliseconds per tensor once thousands of blocks were live (a module's
    # parameters, a data set held as small shared arrays): the lookup must stay O(1).
    from actorshm import _torch
    keep = [actorshm.empty(8) for _ in range(20000)]
    made = at.zeros(16)
    viewed = torch.from_numpy(actorshm.zeros(16))  # found by address once, then known
    sliced = made[4:]  # a view: the same storage
    for t in (made, viewed, sliced):
        assert _torch.storage_block(t) is not None
    t0 = time.perf_counter()
    for _ in range(100):
        for t in (made, viewed, sliced):
            assert at.is_shared(t)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"300 lookups with 20000 live blocks took {elapsed:.2f} s"
    del keep


def test_storage_address_map_drops_dead_blocks():
    # The address -> block map must not keep an entry for every storage ever seen.
    from actorshm import _shm, _torch
    known: dict = {}
    for i in range(5000):
        a = actorshm.empty(8)
        _torch.remember(known, (1 << 40) + 64 * i, _shm.find_block(a))
        del a  # the block dies here
    assert len(known) < 2100
