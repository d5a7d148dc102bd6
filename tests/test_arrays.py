"""Zero-copy numpy arrays: write-through, layouts, recycling, leases, fds, budgets."""

import asyncio
import gc
import os
import time
import warnings

import numpy as np
import pytest

import actorshm
from actors import Arrays


async def test_write_through_both_directions(rt):
    a = await Arrays.spawn()
    x = actorshm.zeros(1000)
    await a.fill(x, 5.0)  # the actor writes; we see it
    assert (x == 5.0).all()
    y = await a.make(100, 1.0)  # the actor's array; we write, it sees
    y[:] = 2.0
    assert await a.sum(y) == 200.0
    assert actorshm.is_shared(y) and y.flags.writeable


def test_an_array_from_empty_knows_its_place_before_it_is_sent():
    # (a fresh batch each step is sent once: it must not pay for finding its block)
    from actorshm import _arena
    a = actorshm.empty((3, 4), np.float32, order="F")
    entry = _arena.offsets[id(a)]
    assert entry() is a and entry.offset == 0 and entry.block is _arena.find_block(a)
    key = id(a)
    del a, entry
    gc.collect()
    assert key not in _arena.offsets or _arena.offsets[key]() is not None


async def test_result_is_same_memory(rt):
    a = await Arrays.spawn()
    x = actorshm.zeros((4, 5), dtype=np.int32)
    back = await a.add_one(x)
    assert np.shares_memory(back, x)
    assert (x == 1).all() and back.dtype == np.int32 and back.shape == (4, 5)


LAYOUTS = [
    ("float64 C", lambda: actorshm.zeros((3, 4))),
    ("float32 F", lambda: actorshm.zeros((3, 4), np.float32, order="F")),
    ("int8", lambda: actorshm.zeros(17, np.int8)),
    ("complex128", lambda: actorshm.zeros((2, 3), np.complex128)),
    ("bool", lambda: actorshm.zeros(5, bool)),
    ("big-endian", lambda: actorshm.zeros(6, ">i4")),
    ("structured", lambda: actorshm.zeros(4, [("x", "<f4"), ("id", ">i8"), ("s", "S3")])),
    ("datetime64", lambda: actorshm.zeros(3, "datetime64[ns]")),
    ("0-d", lambda: actorshm.zeros((), np.float64)),
    ("strided view", lambda: actorshm.zeros((10, 10))[::2, 1::3]),
    ("transposed", lambda: actorshm.zeros((3, 5, 7)).transpose(2, 0, 1)),
    ("negative strides", lambda: actorshm.zeros(20)[::-3]),
]


@pytest.mark.parametrize("name,make", LAYOUTS, ids=[n for n, _ in LAYOUTS])
async def test_layouts_round_trip_zero_copy(rt, name, make):
    a = await Arrays.spawn()
    x = make()
    x[...] = np.arange(x.size).reshape(x.shape).astype(x.dtype) if x.dtype.names is None \
        else x
    before = actorshm.stats()["bytes_copied"]
    shape, dtype, strides, c, f, shared, writeable = await a.info(x)
    assert (shape, dtype, strides, c, f) == (x.shape, str(x.dtype), x.strides,
                                            x.flags.c_contiguous, x.flags.f_contiguous)
    assert shared and writeable
    back = await a.echo(x)
    assert back.dtype == x.dtype and back.strides == x.strides
    assert np.shares_memory(back, x) and np.array_equal(back, x)
    assert actorshm.stats()["bytes_copied"] == before


async def test_ordinary_arrays_copied_once_and_counted(rt):
    a = await Arrays.spawn()
    x = np.arange(4096, dtype=np.float64)  # over INLINE_MAX: copied into shared memory
    before = actorshm.stats()
    back = await a.echo(x)
    after = actorshm.stats()
    assert np.array_equal(back, x) and actorshm.is_shared(back) and not actorshm.is_shared(x)
    assert after["bytes_copied"] - before["bytes_copied"] == x.nbytes
    # a permuted, non-contiguous ordinary array keeps its axis order when copied
    t = np.arange(24.0).reshape(2, 3, 4).transpose(2, 0, 1)[:, :, ::2]
    bt = await a.echo(t)
    assert np.array_equal(bt, t)


async def test_small_ordinary_arrays_travel_in_band(rt):
    from actorshm._inband import INLINE_BUDGET, INLINE_MAX
    a = await Arrays.spawn()
    small = [np.arange(10.0) + i for i in range(200)]
    before, s0 = actorshm.stats(), await a.stats()
    back = await a.echo(small)
    after, s1 = actorshm.stats(), await a.stats()
    assert all(np.array_equal(b, x) for b, x in zip(back, small))
    # a copy, as before, and counted as one; but no shared block is used for it
    assert after["bytes_copied"] - before["bytes_copied"] == 200 * 80
    assert after["arrays_copied"] - before["arrays_copied"] == 200
    assert after["pool_allocs"] == before["pool_allocs"]
    assert s1["pool_allocs"] == s0["pool_allocs"]
    assert not any(actorshm.is_shared(b) for b in back)
    # the actor gets a writable copy, with the layout it was sent with, in call order
    for make in (lambda: np.arange(12.0).reshape(3, 4),
                 lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)),
                 lambda: np.arange(24.0).reshape(2, 3, 4).transpose(2, 0, 1)[:, :, ::2],
                 lambda: np.arange(20, dtype=">i4")[::-3],
                 lambda: np.zeros(3, [("x", "<f4"), ("s", "S3")]),
                 lambda: np.arange(4).astype("datetime64[ms]"),  # no buffer of its own
                 lambda: np.arange(6).astype("timedelta64[s]")[::2],
                 lambda: np.zeros(2, [("t", "datetime64[s]"), ("v", "<f8")]),
                 lambda: np.array(["ab", "cde"], dtype="<U3"),
                 lambda: np.zeros(2, "V8"),
                 lambda: np.zeros((2, 2), np.dtype(("<i2", (3,))))):  # a sub-array dtype
        x = make()
        echoed = await a.echo(x)  # the dtype travels as its string where that is exact
        assert echoed.dtype == x.dtype and np.array_equal(echoed, x)
        shape, dtype, strides, c, f, shared, writeable = await a.info(x)
        assert (shape, dtype) == (x.shape, str(x.dtype)) and writeable and not shared
        assert strides == x.strides  # memory order, gaps and negative strides kept
    # in band (small) or in a shared block, a view keeps its strides; a small view of a
    # much larger array is copied compactly (in its axis order), not with the rest
    big = np.arange(40000.0).reshape(200, 200)
    for x in (big[:, ::2], big[::-1, 3:], big.T[::2], big[5:6, ::7], big[::2, ::2],
              big[::-2, 1::2].T):  # (every other row and column: four times its bytes)
        assert (await a.info(x))[2] == x.strides and np.array_equal(await a.echo(x), x)
    # an axis of length 1 keeps its own stride (``[:, None]``: 0), in band or not: numpy's
    # own layout for the copy gave (8, 8)
    for x in (np.arange(10.0)[:, None], np.arange(20.0)[::2][:, None], np.arange(10.0)[None, :],
              np.asfortranarray(big)[:, None, :5]):
        assert (await a.info(x))[2] == x.strides and np.array_equal(await a.echo(x), x)
        copy = actorshm.share(x)
        assert actorshm.is_shared(copy) and copy.strides == x.strides
        assert (await a.info(copy))[2] == x.strides  # and by reference
    # an empty array keeps its strides too (numpy's pickling gave its own: (24, 8))
    for x in (np.zeros((0, 3)), np.zeros((3, 0), order="F"), big[:, :0:2],
              np.zeros((0, 2), dtype=[("a", "i4"), ("b", "f8")])):
        assert (await a.info(x))[2] == x.strides
        echoed = await a.echo([x])
        assert echoed[0].strides == x.strides and echoed[0].dtype == x.dtype
    x = big.T[::20, ::20]
    strides = (await a.info(x))[2]
    assert strides == (8, 80) and np.array_equal(await a.echo(x), x)
    ro = np.arange(5.0)
    ro.flags.writeable = False
    assert (await a.info(ro))[6]  # a read-only array arrives writable, as a copy does
    y = np.zeros(10)
    assert await a.write_slice(y, 0, 10, 1.0) and not y.any()  # the actor wrote a copy
    # calls carrying in-band arrays stay in call order with those carrying shared ones
    futs = []
    for i in range(20):
        arr = np.full(10, float(i)) if i % 2 else actorshm.empty(10)
        arr[...] = i
        futs += [a.keep(arr), a.sum_kept()]
    assert (await asyncio.gather(*futs))[1::2] == [10.0 * i for i in range(20)]
    # over the per-array size, or past the per-message budget: shared memory as before
    big = np.ones(INLINE_MAX // 8 + 1)
    assert (await a.info(big))[5]
    many = [np.ones(INLINE_MAX // 8) for _ in range(INLINE_BUDGET // INLINE_MAX + 2)]
    out = await a.echo(many)
    assert sum(actorshm.is_shared(b) for b in out) == 2
    # ... but tiny ones never: a shared block costs more than a pickled copy of them
    # (200,000 arrays of 16 bytes took 5 s, 134,000 of them in blocks; a pickle 1 s)
    from actorshm._inband import ALWAYS_IN_BAND
    tiny = [np.full(ALWAYS_IN_BAND // 8, float(i)) for i in range(
        2 * INLINE_BUDGET // ALWAYS_IN_BAND)]
    before = actorshm.stats()["pool_allocs"]
    out = await a.echo(tiny)
    assert not any(actorshm.is_shared(b) for b in out)
    assert actorshm.stats()["pool_allocs"] - before <= 1  # (the message, spilled)
    assert [b[0] for b in out] == [float(i) for i in range(len(tiny))]


async def test_a_copy_shows_nothing_between_its_elements_and_no_two_share_memory(rt):
    a = await Arrays.spawn()
    junk = actorshm.empty((1 << 17) - 1)
    junk[:] = 7.0  # its block goes back to the pool, to be reused by the copy below
    del junk
    gc.collect()
    for n in (100, 1 << 16):  # in band; in a shared block
        x = np.full(2 * n, 5.0)[::2]
        assert await a.between(x) == [0.0] * (n - 1)
    # a broadcast or sliding-window view arrives as independent elements (numpy makes
    # such views read-only; the copy the receiver gets is writable)
    for x in (np.broadcast_to(np.arange(3.0), (2, 3)),
              np.lib.stride_tricks.sliding_window_view(np.arange(5.0), 3)):
        back = await a.echo(x)
        back[0, 1] = -1.0
        assert np.array_equal(back[1:], x[1:]) and back[0, 1] == -1.0
    # a broadcast arrives C-ordered, as its real axes are (it came Fortran-ordered:
    # np.copy's order "K" puts the repeated axis, of stride 0, innermost), in band and
    # in a shared block; one whose real axes are in Fortran order stays so
    for n in (5, 5000):
        for x in (np.broadcast_to(np.arange(float(n)), (4, n)),
                  np.broadcast_to(np.arange(4.0)[:, None], (4, n))):
            back = await a.echo(x)
            assert back.flags.c_contiguous and np.array_equal(back, x), (n, back.strides)
    x = np.broadcast_to(np.asfortranarray(np.arange(12.0).reshape(3, 4))[None], (5, 3, 4))
    back = await a.echo(x)
    assert back.strides[1:] == (40, 120) and np.array_equal(back, x)
    # a new axis (length 1, stride 0) is no broadcast: a strided view keeps its axis order
    x = np.arange(120000.0).reshape(40, 50, 60)[::3, ::3, ::3].transpose(1, 2, 0)[:, None]
    back = await a.echo(x)
    assert back.strides == np.copy(x, order="K").strides and np.array_equal(back, x)


async def test_ml_dtypes_arrays_keep_their_dtype(rt):
    # ml_dtypes (numpy's bfloat16 and float8 kinds, as JAX uses) name themselves '<V2',
    # '<V1': a dtype sent as its string would arrive as raw void bytes.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = await Arrays.spawn()
    for dt in map(np.dtype, (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4)):
        assert np.dtype(dt.str) != dt
        for n in (12, 1 << 16):  # in band, and copied into shared memory
            x = (np.arange(n) % 7).astype(dt)
            for v in (x, x[::3], x.reshape(-1, 2).T):
                e = await a.echo(v)
                assert e.dtype == dt, (dt, n, e.dtype)
                assert np.array_equal(e.astype(np.float32), v.astype(np.float32))
        s = actorshm.empty(1 << 16, dt)
        s[...] = 3
        assert (await a.info(s))[1] == dt.name
        e = await a.echo(s)
        assert e.dtype == dt and actorshm.is_shared(e) and e.astype(np.float32).sum() == 3 << 16
        made = await a.make(100, 2, dt)
        assert made.dtype == dt and actorshm.is_shared(made)


async def test_object_arrays_and_nested_containers(rt):
    a = await Arrays.spawn()
    obj = np.array([1, "two", None, {"k": 3}], dtype=object)
    back = await a.echo(obj)
    assert back.dtype == object and list(back) == list(obj)
    x = actorshm.zeros(8)
    nested = {"list": [x, (x[2:], {"deep": x.reshape(2, 4)})], "n": 3}
    out = await a.echo(nested)
    assert np.shares_memory(out["list"][0], x)
    assert np.shares_memory(out["list"][1][1]["deep"], x)
    assert out["list"][1][1]["deep"].shape == (2, 4)
    assert actorshm.is_shared(out["list"][1][0])
    from actors import Batch, Holder
    b = Batch(x=actorshm.zeros(4), y=np.arange(3), step=7)
    ob = await a.echo(b)
    assert type(ob) is Batch and ob.step == 7
    assert np.shares_memory(ob.x, b.x) and np.array_equal(ob.y, b.y)  # y: a copy
    h = await a.echo(Holder(x))
    assert np.shares_memory(h.arr, x)


async def test_recycling_steady_state(rt):
    a = await Arrays.spawn()
    x = actorshm.zeros(1 << 16)
    for _ in range(5):  # warm-up
        y = await a.make(1 << 16, 1.0)
        await a.add_one(x)
    del y
    await asyncio.sleep(0.05)
    s0 = await a.stats()
    d0 = actorshm.stats()
    for _ in range(100):
        y = await a.make(1 << 16, 1.0)  # a buffer produced by the actor...
        await a.add_one(x)
        del y  # ...comes home when we drop it
    await asyncio.sleep(0.05)
    s1 = await a.stats()
    d1 = actorshm.stats()
    assert d1["bytes_copied"] == d0["bytes_copied"]
    assert s1["bytes_copied"] == s0["bytes_copied"]
    assert s1["pool_allocs"] - s0["pool_allocs"] <= 1
    assert s1["pool_reuses"] - s0["pool_reuses"] >= 99
    assert d1["bytes_zero_copy"] - d0["bytes_zero_copy"] == 100 * x.nbytes
    assert s1["blocks_live"] <= s0["blocks_live"] + 1


async def test_driver_buffers_recycle(rt):
    a = await Arrays.spawn()
    for _ in range(3):
        x = actorshm.empty(1 << 20)
        await a.fill(x, 1.0)
        del x
    await asyncio.sleep(0.05)
    s0 = actorshm.stats()
    for _ in range(50):
        x = actorshm.empty(1 << 20)
        await a.fill(x, 1.0)
        del x
    await asyncio.sleep(0.05)
    s1 = actorshm.stats()
    assert s1["pool_allocs"] == s0["pool_allocs"]
    assert s1["pool_reuses"] - s0["pool_reuses"] == 50


async def test_views_made_and_dropped_in_turn_each_arrive_as_themselves(rt):
    # A view dropped and the next one made often get the same id() in CPython: what is
    # remembered of an array sent (where its data lies in its block) must die with it.
    a = await Arrays.spawn()
    w = actorshm.share(np.arange(64.0))
    for i in range(40):  # (here CPython gives every view the same id)
        v = w[i:i + 8] if i % 2 else w[i::3]
        assert await a.sum(v) == float(v.sum())
        del v
    for i in range(4):
        v = w[i::2]
        back = await a.echo(v)
        assert np.shares_memory(back, v) and np.array_equal(back, v)
        del v, back
    # reshaped in place after it was sent: the next send has the new shape
    m = w[:16]
    assert await a.sum(m) == float(m.sum())
    with warnings.catch_warnings():  # (numpy 2.5 deprecates it; the same object still
        warnings.simplefilter("ignore", DeprecationWarning)  # changes shape in place)
        m.shape = (4, 4)
    assert (await a.info(m))[0] == (4, 4)
    back = await a.echo(m)
    assert back.shape == (4, 4) and np.array_equal(back, m)


async def test_held_block_is_not_recycled(rt):
    a = await Arrays.spawn()
    x = actorshm.empty(1000)
    x[:] = 1
    await a.keep(x)
    del x
    gc.collect()
    await asyncio.sleep(0.05)
    y = actorshm.empty(1000)  # must not be the block the actor still holds
    y[:] = 9
    assert await a.sum_kept() == 1000.0  # the actor's kept array still reads 1s
    assert await a.drop()


async def test_a_result_that_cannot_be_sent_gives_its_arrays_back_at_once(rt):
    # The failed reply must not leave the result in a reference cycle: an idle actor
    # collects cycles late, and the caller's block would stay out of its pool till then.
    a = await Arrays.spawn()
    await a.pause_gc()
    x = actorshm.empty(100_000)
    with pytest.raises(TypeError, match="cannot be sent back"):
        await a.unsendable_with(x)
    del x
    await a.stats()  # (the release rides ahead of this reply)
    await asyncio.sleep(0.05)
    before = actorshm.stats()
    y = actorshm.empty(100_000)
    after = actorshm.stats()
    assert (after["pool_reuses"] - before["pool_reuses"],
            after["pool_allocs"] - before["pool_allocs"]) == (1, 0)
    del y


async def test_disjoint_slices_from_many_actors(rt):
    actors = [await Arrays.spawn() for _ in range(4)]
    x = actorshm.zeros(4000)
    await asyncio.gather(*(a.write_slice(x, i * 1000, (i + 1) * 1000, i + 1)
                           for i, a in enumerate(actors)))
    for i in range(4):
        assert (x[i * 1000:(i + 1) * 1000] == i + 1).all()


async def test_leases_return_when_consumer_killed(rt):
    a = await Arrays.spawn()
    s0 = actorshm.stats()["blocks_live"]
    for _ in range(5):
        x = actorshm.empty(1 << 20)
        await a.keep(x)
        del x
    await asyncio.sleep(0.05)
    assert actorshm.stats()["blocks_live"] >= s0 + 1
    await a.kill()
    await asyncio.sleep(0.05)
    gc.collect()
    assert actorshm.stats()["blocks_live"] == s0


async def test_owner_death_keeps_memory_valid(rt):
    a = await Arrays.spawn()
    y = await a.make(1000, 3.0)
    await a.kill()
    y[:] += 1  # mapped memory outlives its owner: no SIGBUS, no crash
    assert (y == 4.0).all()


def _fd_count():
    return len(os.listdir("/proc/self/fd"))


async def test_no_dev_shm_entries_and_no_fd_growth(rt):
    shm_before = set(os.listdir("/dev/shm"))
    a = await Arrays.spawn()
    for _ in range(10):
        await a.echo(actorshm.empty(1000))
    fd0, afd0 = _fd_count(), await a.fd_count()
    for i in range(1000):
        x = actorshm.empty(100 + (i % 7) * 1000)
        y = await a.echo(x)
        del x, y
    await asyncio.sleep(0.05)
    assert _fd_count() <= fd0 + 1
    assert await a.fd_count() <= afd0 + 1
    assert set(os.listdir("/dev/shm")) == shm_before


async def test_out_of_budget_is_clear_memory_error():
    async with actorshm.Runtime():
        pool = __import__("actorshm._shm", fromlist=["pool"]).pool()
        old = pool.budget
        pool.budget = pool.reserved + (64 << 20)
        try:
            with pytest.raises(MemoryError, match="shm_budget"):
                actorshm.empty(1 << 30, np.uint8)
            with pytest.raises(actorshm.SharedMemoryError):
                actorshm.empty(1 << 30, np.uint8)
        finally:
            pool.budget = old


async def test_large_array_zero_copy(rt):
    a = await Arrays.spawn()
    x = actorshm.empty(64 << 20, np.uint8)
    x[::4096] = 7
    b0 = actorshm.stats()["bytes_copied"]
    back = await a.echo(x)
    assert np.shares_memory(back, x)
    assert actorshm.stats()["bytes_copied"] == b0


@pytest.mark.parametrize("shape", [(2.5,), 2.5, "abc", (2, None)])
def test_empty_refuses_a_shape_numpy_refuses(shape):
    with pytest.raises(TypeError):
        np.empty(shape)
    with pytest.raises(TypeError):
        actorshm.empty(shape)


@pytest.mark.parametrize("dtype", ["U3", "S5", "M8[s]", [("a", "i4"), ("b", "U2")], "c16"])
def test_zeros_are_numpys_zeros_of_every_dtype(dtype):
    z = actorshm.zeros((2, 3), dtype)
    assert z.dtype == np.dtype(dtype) and (z == np.zeros((2, 3), dtype)).all()
    assert actorshm.empty(np.int64(3)).shape == (3,)


async def test_share_and_is_shared():
    x = np.arange(5.0)
    assert not actorshm.is_shared(x)
    s = actorshm.share(x)
    assert actorshm.is_shared(s) and actorshm.is_shared(s[1:]) and np.array_equal(s, x)
    assert actorshm.share(s) is s
    assert not actorshm.is_shared([1, 2])


class _MaskedSub(np.ma.MaskedArray):
    """A masked array subclass of one's own (no construction of its own)."""


async def test_share_keeps_the_class_and_a_masked_arrays_mask(rt, tmp_path):
    # as sending keeps them: a masked array's copy must not come back without its mask
    m = np.ma.array(np.arange(5000.0), mask=np.arange(5000) % 3 == 0, fill_value=-1.0)
    s = actorshm.share(m)
    assert type(s) is np.ma.MaskedArray and s.fill_value == -1.0
    assert np.array_equal(s.mask, m.mask) and np.array_equal(s.data, m.data)
    assert actorshm.is_shared(s.data) and actorshm.is_shared(s.mask)
    assert actorshm.share(s) is s
    a = await Arrays.spawn()
    before = actorshm.stats()["bytes_copied"]
    await a.write_slice(s, 0, 3, 7.0)  # data and mask both by reference
    assert actorshm.stats()["bytes_copied"] == before and (s.data[:3] == 7.0).all()
    rec = np.rec.array(np.zeros(3000, [("a", "i4"), ("b", "f8")]))
    assert type(actorshm.share(rec)) is np.recarray and actorshm.share(rec).b.shape == (3000,)
    mm = np.memmap(tmp_path / "mm", dtype="f8", mode="w+", shape=(3000,))
    assert type(actorshm.share(mm)) is np.ndarray  # its file stays its own
    # a structured dtype's mask (which MaskedArray(...) copies into private memory)
    st = np.ma.array(np.zeros(3000, [("x", "i4"), ("y", "f8")]),
                     mask=[(i % 2, i % 3 == 0) for i in range(3000)], hard_mask=True)
    ss = actorshm.share(st)
    assert actorshm.is_shared(ss.mask) and actorshm.share(ss) is ss and ss.hardmask
    assert np.array_equal(ss.mask, st.mask)
    # a subclass that builds itself as MaskedArray does: shared as sending goes
    sub = m.view(_MaskedSub)
    shared = actorshm.share(sub)
    assert type(shared) is _MaskedSub and np.array_equal(shared.mask, m.mask)
    assert actorshm.is_shared(shared.data) and actorshm.is_shared(shared.mask)


async def test_forwarded_block_flows_home(rt):
    producer, consumer = await Arrays.spawn(), await Arrays.spawn()
    for _ in range(3):
        b = await producer.make(1 << 16, 1.0)
        await consumer.add_one(b)
        del b
    await asyncio.sleep(0.05)
    p0 = await producer.stats()
    for _ in range(30):
        b = await producer.make(1 << 16, 1.0)
        await consumer.add_one(b)  # forwarded: the consumer leases it through us
        assert b[0] == 2.0
        del b
    await asyncio.sleep(0.1)
    p1 = await producer.stats()
    assert p1["pool_allocs"] - p0["pool_allocs"] <= 1
    assert p1["bytes_copied"] == p0["bytes_copied"]


async def test_retired_arena_is_unmapped_in_peers():
    # A free dedicated arena is retired when the budget is short; a peer that mapped it
    # is told, and closes its fd and mapping.
    async with actorshm.Runtime(shutdown_grace=1.0):
        from actorshm import _shm
        pool = _shm.pool()
        gc.collect()
        pool.drain()
        pool._retire_free(1 << 62)  # start with no free dedicated arenas (earlier tests')
        old = pool.budget
        pool.budget = pool.reserved + (12 << 20)
        try:
            a = await Arrays.spawn()
            x = actorshm.zeros(8 << 20, np.uint8)
            assert await a.sum(x) == 0.0  # the actor maps x's arena
            mapped = await a.fd_count()
            del x
            gc.collect()
            await asyncio.sleep(0.05)
            y = actorshm.zeros(10 << 20, np.uint8)  # needs the room: x's arena goes
            assert await a.sum(y) == 0.0
            assert await a.fd_count() == mapped  # one arena closed, one mapped
            assert (await a.stats())["arenas_mapped"] >= 2
            del y
        finally:
            pool.budget = old


async def test_argument_failing_to_unpickle_gives_leases_back(rt):
    from actors import BreaksOnArrival
    a = await Arrays.spawn()
    base = actorshm.stats()["blocks_live"]
    x = actorshm.zeros(1000)
    with pytest.raises(TypeError, match="could not deserialize"):
        await a.echo((x, BreaksOnArrival()))  # x is leased, then the tuple fails
    # x in the state of the object that fails (its __setstate__'s frame holds it, and
    # the error's traceback that frame): back with the reply, not at the actor's next
    # garbage collection
    with pytest.raises(TypeError, match="could not deserialize"):
        await a.echo(BreaksOnArrival(payload=x))
    del x
    gc.collect()
    await asyncio.sleep(0.1)
    assert actorshm.stats()["blocks_live"] == base  # the actor gave x's lease back
    y = actorshm.zeros(1000)  # same arena as x: the connection still knows it
    assert np.shares_memory(await a.echo(y), y)


async def test_result_failing_to_unpickle_gives_leases_back(rt):
    # The error the caller gets (and keeps, here) held the frames of the failed
    # unpickling, and with them the actor's array: leased until it let go of the error
    a = await Arrays.spawn()
    base = (await a.stats())["blocks_live"]
    kept = []
    for kind in ("error", "chained"):  # (chained: a frame in the error's context)
        with pytest.raises(TypeError, match="could not be deserialized here") as caught:
            await a.breaking_with_array(1000, kind)
        assert "cannot be rebuilt" in str(caught.value)
        kept.append(caught.value)
        for _ in range(50):
            if (await a.stats())["blocks_live"] == base:
                break
            await asyncio.sleep(0.02)
        assert (await a.stats())["blocks_live"] == base, kind


async def test_dead_peers_memory_is_let_go(rt):
    from actorshm import _leases
    a = await Arrays.spawn()
    n0 = len(_leases._regions)
    kept = await a.make(10, 1.0)  # maps the actor's chunk arena here
    dropped = await a.make(1 << 20, 1.0)  # and one dedicated arena
    assert len(_leases._regions) == n0 + 2
    del dropped
    await a.kill()
    await asyncio.sleep(0.05)
    gc.collect()
    # The arena still in use stays mapped (its memory stays valid); the other is closed.
    assert len(_leases._regions) == n0 + 1 and kept.sum() == 10.0
    del kept  # and the last one goes with its last array
    gc.collect()
    await asyncio.sleep(0.05)
    assert len(_leases._regions) == n0


async def test_dead_owners_arena_travels_again_after_peers_let_go(rt):
    # A lends x to C and returns it to us; we pass it on to B. A dies: we and B let go of
    # A's arena, C still holds x. C sends x back and we pass it to B again: the arena is
    # introduced afresh on each hop (nobody may assume the other still has it).
    from actorshm import _leases
    owner, b, c = await Arrays.spawn(), await Arrays.spawn(), await Arrays.spawn()
    x = await owner.make_and_lend([c], 1 << 20, 1.0)
    assert await b.sum(x) == float(1 << 20)
    n0 = await b.regions()
    del x
    gc.collect()
    await asyncio.sleep(0.05)
    await owner.kill()
    await asyncio.sleep(0.1)
    assert await b.regions() == n0 - 1
    y = await c.get_kept()
    assert await b.sum(y) == float(1 << 20)
    assert await b.regions() == n0 and _leases._regions


async def test_one_relay_letting_go_does_not_close_a_region_another_still_sends(rt):
    owner, x, y, b = [await Arrays.spawn() for _ in range(4)]
    await owner.make_and_lend([x, y], 1 << 20, 1.0)
    assert await x.sum_kept_at(b) == await y.sum_kept_at(b) == float(1 << 20)
    await x.drop()
    await owner.kill()  # x lets go of the arena and tells b; y still holds it
    await asyncio.sleep(0.1)
    assert await y.sum_kept_at(b) == float(1 << 20)


def test_block_dropped_in_a_thread_cannot_be_picked_up_again():
    # A block dies in one thread while the loop thread adopts a new grant of it: the
    # new grant must get a new lease, never the dying block (whose lease is going back).
    import threading
    import time
    from actorshm import _leases, _shm

    class Conn:
        closed = False

        def __init__(self):
            self.released = 0
            self.received_regions = set()

        def queue_release(self, key, n):
            self.released += n

    owner = _shm.HostPool()
    arena = owner._make_region((owner.token, 0), 1 << 20, False)
    key = (12345, 0)  # the same memory, seen as a peer's arena
    peer = _shm.Arena(key, -1, arena.size, arena.addr, owned=False, dedicated=False)

    def opener(ctx, rkey, rsize, intro):
        return peer

    conn, hook = Conn(), _leases._release_hook
    _leases.set_release_hook(lambda: time.sleep(0.2))  # the dying block's thread lets go of the GIL
    try:
        box = [_leases.adopt(conn, opener, key, arena.size, 0, 0, 256)]
        t = threading.Thread(target=box.clear)  # drops the last reference
        t.start()
        time.sleep(0.05)
        again = _leases.adopt(conn, opener, key, arena.size, None, 0, 256)
        t.join()
        assert conn.released == 0  # not treated as a second grant of a live block
        assert again.lease.upstream == {conn: 1}
        assert [r[1] for r in _leases.pending_releases] == [(12345, 0, 0)]  # the old lease goes back
    finally:
        _leases.set_release_hook(hook)
        _leases.pending_releases.clear()
        _leases._regions.pop(key, None)
        _leases._own_tokens.discard(owner.token)
        _shm._pools.remove(owner)
        arena.close()


def test_releases_go_out_after_another_threads_runtime_closed():
    # A thread opens and closes a runtime on a loop of its own: the driver's releases
    # were then scheduled on that ended loop, so an actor's block the driver dropped went
    # home only if another frame to that actor happened to carry its release.
    import threading
    got = []

    async def main():
        a = await Arrays.spawn()

        def thread():
            async def inner():
                async with actorshm.Runtime():
                    await (await Arrays.spawn()).stats()
            asyncio.run(inner())
        t = threading.Thread(target=thread)
        t.start()
        await asyncio.get_running_loop().run_in_executor(None, t.join)
        for _ in range(3):
            x = await a.make(1000, 1.0)
            home = a.wait_blocks_home(20)  # running while we drop x: no frame follows
            await asyncio.sleep(0.05)
            del x
            got.append(await home)
            if not got[-1]:
                break
    actorshm.run(main())
    assert got == [True] * 3


async def test_handed_back_array_does_not_pin_a_dead_owners_arena(rt):
    # We pass the owner's array to b, b hands it back: we and b each introduced the
    # arena to the other. After the owner dies, both must still let it go.
    from actorshm import _leases
    owner, b = await Arrays.spawn(), await Arrays.spawn()
    n0, b0 = len(_leases._regions), await b.regions()
    x = await owner.make(1 << 20, 1.0)
    y = await b.echo(x)
    assert np.shares_memory(x, y)
    del x, y
    gc.collect()
    await asyncio.sleep(0.05)
    await owner.kill()
    for _ in range(50):
        await asyncio.sleep(0.02)
        if len(_leases._regions) == n0 and await b.regions() == b0:
            break
    assert len(_leases._regions) == n0 and await b.regions() == b0


async def test_losing_one_relay_does_not_make_round_trips_reintroduce_the_arena(rt):
    # a got x from us and through b, and has sent it back to us. b dies: a must keep
    # x's arena (we, its owner, still send it), not let go and remap it every call.
    a, b = await Arrays.spawn(), await Arrays.spawn()
    x = actorshm.zeros(1 << 20)
    await a.keep(x)
    await b.keep(x)
    await b.sum_kept_at(a)  # b introduces x's arena to a as well
    await a.drop()
    y = await a.echo(x)
    del y
    await b.kill()
    await asyncio.sleep(0.1)
    from actorshm import _shm
    key = _shm.find_block(x).region.key
    conn = rt._actors[a.actor_id].conn
    for _ in range(5):
        y = await a.echo(x)
        del y
        gc.collect()
        await asyncio.sleep(0.02)
        assert key in conn.sent_regions  # a never told us it let go


async def test_owner_keeps_a_block_a_dead_relay_passed_to_the_driver(rt):
    # owner lends x to relay, relay passes it to us, then dies: the owner must not
    # recycle x's block while we still hold x.
    owner, relay = await Arrays.spawn(), await Arrays.spawn()
    await owner.make_and_lend([relay], 1000, 1.0)
    x = await relay.get_kept()
    await owner.drop()  # only the relay's lease (and our x, through it) remain
    await relay.kill()
    await asyncio.sleep(0.1)
    assert await owner.quarantined() == 1
    for _ in range(5):  # new blocks of the same size: none may be x's
        y = await owner.make(1000, 2.0)
        assert not np.shares_memory(x, y)
    assert (x == 1.0).all()
    assert await owner.sum(x) == 1000.0  # and it can go home
    assert actorshm.stats()["forward_notices_sent"] == 0  # the driver sends none


async def test_owner_keeps_a_block_a_dead_relay_passed_to_an_actor(rt):
    owner, relay, d = [await Arrays.spawn() for _ in range(3)]
    await owner.make_and_lend([relay], 1 << 16, 1.0)
    await relay.lend_kept(d)  # relay -> d, actor to actor
    await owner.drop()
    await relay.drop()
    await relay.kill()
    await asyncio.sleep(0.1)
    for _ in range(5):
        await owner.make(1 << 16, 2.0)
    assert await d.sum_kept() == float(1 << 16)


async def test_a_middle_relay_keeps_what_it_passed_to_a_dead_one(rt):
    # owner -> r1 -> r2 -> d; r2 dies. r1 must keep its lease, so the owner keeps x;
    # then r1 dies too, and the owner keeps it itself.
    owner, r1, r2, d = [await Arrays.spawn() for _ in range(4)]
    await owner.make_and_lend([r1], 1 << 16, 1.0)
    await r1.lend_kept(r2)
    await r2.lend_kept(d)
    await owner.drop()
    await r1.drop()
    await r2.kill()
    await asyncio.sleep(0.1)
    assert await r1.quarantined() == 1 and await owner.quarantined() == 0
    for _ in range(5):
        await owner.make(1 << 16, 2.0)
    assert await d.sum_kept() == float(1 << 16)
    await r1.kill()
    await asyncio.sleep(0.1)
    assert await owner.quarantined() == 1
    for _ in range(5):
        await owner.make(1 << 16, 3.0)
    assert await d.sum_kept() == float(1 << 16)


async def test_a_forward_notice_stuck_behind_a_full_socket_holds_the_block_back(rt):
    # The relay's socket to us (its upstream) is full, so its notice cannot be written
    # at once: the frame passing our block on must wait for it, or the relay could die
    # with the block passed on and the notice unsent.
    relay, d = await Arrays.spawn(), await Arrays.spawn()
    await relay.keep(np.zeros(1))
    await relay.lend_kept(d)  # relay and d are connected
    n = 1 << 16
    a = actorshm.empty(n)
    a[:] = 1.0
    await relay.keep(a)
    del a
    gc.collect()
    task = asyncio.ensure_future(relay.lend_kept_behind_a_full_socket_then_die(d, 8 << 20))
    time.sleep(1.0)  # (the call is sent) our loop is busy: we read nothing meanwhile
    with pytest.raises(actorshm.ActorDiedError):
        await task
    await asyncio.sleep(0.1)
    assert actorshm.stats()["blocks_quarantined"] >= 1
    ys = [actorshm.empty(n) for _ in range(5)]
    for y in ys:
        y[:] = 2.0
    assert await d.sum_kept() == float(n)


async def test_a_relay_that_exits_leaves_what_it_passed_on_in_place(rt, caplog):
    # A relay that stops on its own (sys.exit) closes its connections while the
    # process it passed our block to lives on: its notice must stand.
    relay, d = await Arrays.spawn(), await Arrays.spawn()
    n = 1 << 16
    a = actorshm.empty(n)
    a[:] = 1.0
    await relay.keep(a)
    await relay.lend_kept(d)
    await relay.drop()
    del a
    gc.collect()
    with pytest.raises(actorshm.ActorDiedError, match="code 0"):
        await relay.exit(0)
    for _ in range(250):  # (the warning waits 0.5 s, in case everything stops)
        if "ended while processes it passed 1 shared block" in caplog.text:
            break
        await asyncio.sleep(0.02)
    assert actorshm.stats()["blocks_quarantined"] == 1
    assert "ended while processes it passed 1 shared block" in caplog.text
    # (the driver keeps them only while a process that could hold them lives: it said
    # "for as long as it runs", what an actor does)
    assert "until every process that could hold them has exited" in caplog.text
    ys = [actorshm.empty(n) for _ in range(5)]
    for y in ys:
        y[:] = 2.0
    assert await d.sum_kept() == float(n)


async def test_killing_an_actor_right_after_it_got_a_block_back_keeps_nothing(rt, caplog):
    # a passes our x to b, which hands it back: a withdraws its notice only after one
    # more exchange with b. kill() lets that finish first.
    b = await Arrays.spawn()
    for _ in range(3):
        a = await Arrays.spawn()
        x = actorshm.zeros(1000)
        assert await a.bounce(x, b) == 0.0
        del x
        await a.kill()
    await asyncio.sleep(0.6)
    assert actorshm.stats()["blocks_quarantined"] == 0
    assert "ended while" not in caplog.text


async def test_a_clean_close_keeps_nothing_back(caplog):
    for _ in range(3):
        async with actorshm.Runtime():
            owner, relay, d = [await Arrays.spawn() for _ in range(3)]
            await owner.make_and_lend([relay], 1 << 10, 1.0)
            await relay.lend_kept(d)
            a = actorshm.zeros(100)
            await relay.keep(a)
            await relay.lend_kept(d)
    assert "ended while" not in caplog.text
    assert actorshm.stats()["blocks_quarantined"] == 0


async def test_results_shaped_like_calls_keep_their_arrays_shared(rt):
    a = await Arrays.spawn()
    for value in (0, 1):
        label, v, x = await a.labelled(value)
        assert (label, v) == ("label", value)
        assert actorshm.is_shared(x) and (x == value).all()


async def test_a_relay_that_got_its_block_back_leaves_nothing_quarantined(rt):
    owner, relay, d = [await Arrays.spawn() for _ in range(3)]
    x = await owner.make_and_lend([relay], 1 << 16, 1.0)
    await relay.lend_kept(d)
    await d.drop()  # the block comes back to relay, which withdraws its notice
    y = await relay.get_kept()  # relay -> driver
    del x, y
    gc.collect()
    await asyncio.sleep(0.05)
    await owner.drop()
    await relay.kill()
    await asyncio.sleep(0.1)
    assert await owner.quarantined() == 0  # nobody downstream held it: it went home
    for _ in range(100):
        if (await owner.stats())["blocks_live"] == 0:
            break
        await asyncio.sleep(0.02)
    assert (await owner.stats())["blocks_live"] == 0


async def test_arena_passed_round_a_loop_is_let_go_after_its_owner_dies(rt):
    owner, a, b, c = [await Arrays.spawn() for _ in range(4)]
    base = [await p.regions() for p in (a, b, c)]
    await owner.make_and_lend([a], 1 << 20, 1.0)
    await a.sum_kept_at(b)  # a -> b (b sums and drops it)
    x = await a.get_kept()
    await b.keep(x)
    await b.sum_kept_at(c)
    await c.keep(await b.get_kept())
    await c.sum_kept_at(a)  # c -> a closes the loop a -> b -> c -> a
    del x
    for p in (a, b, c):
        await p.drop()
    gc.collect()
    await owner.kill()
    for _ in range(50):
        await asyncio.sleep(0.02)
        if [await p.regions() for p in (a, b, c)] == base:
            break
    assert [await p.regions() for p in (a, b, c)] == base


async def test_numpy_subclasses_arrive_as_themselves(rt):
    a = await Arrays.spawn()
    small = np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0], fill_value=-1.0)
    big = np.ma.array(np.arange(5000.0), mask=np.arange(5000) % 3 == 0)
    for x in (small, big):
        y = await a.echo(x)
        assert type(y) is np.ma.MaskedArray  # not a bare ndarray with the mask dropped
        assert np.array_equal(y.mask, x.mask) and np.array_equal(y.data, x.data)
        assert y.fill_value == x.fill_value and y.sum() == x.sum()
    # a masked array over shared memory: its data goes by reference, writes come back
    shared = np.ma.array(actorshm.zeros(10), mask=[0, 1] * 5)
    before = actorshm.stats()["bytes_copied"]
    await a.write_slice(shared, 0, 10, 7.0)
    assert (shared.data == 7.0).all() and np.array_equal(shared.mask, [0, 1] * 5)
    assert actorshm.stats()["bytes_copied"] - before == shared.mask.nbytes  # the mask only
    rec = np.rec.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")])
    back = await a.echo(rec)
    assert type(back) is np.recarray and back.a.tolist() == [1, 3]
    # numpy's masked-element constant (what m[i] gives for a masked i), and a masked
    # array subclass made its own way: they failed (in the sender, and in the actor)
    element = np.ma.array([1, 2], mask=[1, 0])[0]
    assert (await a.echo([element]))[0] is np.ma.masked
    import numpy.ma.mrecords
    mr = np.ma.mrecords.fromarrays([np.arange(3), np.ones(3)], names="a,b")
    mr.mask[1] = (True, False)
    back = await a.echo(mr)
    assert type(back) is np.ma.mrecords.MaskedRecords and back.a.tolist() == [0, None, 2]
    for x in (np.ma.masked, mr):  # (not a shared copy without its mask)
        with pytest.raises(TypeError, match="send it as it is"):
            actorshm.share(x)
