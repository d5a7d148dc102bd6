"""Pools and size classes (``_shm``), in this process: no actor, no event loop."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from actorshm import _leases, _shm
from actorshm._errors import SharedMemoryError


@pytest.fixture
def pool():
    p = _shm.HostPool(budget=256 << 20)
    yield p
    p.close()
    _shm._pools.remove(p)
    _leases._own_tokens.discard(p.token)


def test_size_classes_are_four_per_power_of_two():
    assert _shm.size_class(1) == _shm.MIN_BLOCK
    assert _shm.size_class(_shm.MIN_BLOCK) == _shm.MIN_BLOCK
    # 1024..2048 splits into 1024, 1280, 1536, 1792, 2048
    assert [_shm.size_class(n) for n in (1025, 1280, 1281, 1793)] == [1280, 1280, 1536, 2048]
    for n in (300, 5000, 123457, 3 << 20):
        c = _shm.size_class(n)
        assert n <= c < n * 1.25 + _shm.MIN_BLOCK


def test_large_size_classes_are_whole_pages():
    c = _shm.size_class(_shm.LARGE + 1)
    assert c % _shm.PAGE == 0 and c > _shm.LARGE


def test_a_dropped_block_is_recycled_by_its_pool(pool):
    block = pool.alloc(1000)
    where = (block.region.key, block.offset, block.size)
    reuses = _leases.counters["pool_reuses"]
    del block
    gc.collect()
    again = pool.alloc(900)  # the same size class
    assert (again.region.key, again.offset, again.size) == where
    assert _leases.counters["pool_reuses"] == reuses + 1
    assert pool.blocks_live == 1


def test_small_blocks_share_a_chunk_and_large_ones_get_their_own(pool):
    a, b = pool.alloc(1000), pool.alloc(1000)
    big = pool.alloc(_shm.LARGE)
    assert a.region is b.region and not a.region.dedicated
    assert big.region.dedicated and big.region is not a.region
    assert len(pool.regions) == 2


def test_the_budget_frees_unused_dedicated_regions_before_it_fails(pool):
    pool.budget = _shm.CHUNK_SIZE + 3 * _shm.LARGE
    small = pool.alloc(1)  # a chunk in use (an idle one would be given back too)
    big = pool.alloc(2 * _shm.LARGE)
    del big
    gc.collect()
    other = pool.alloc(3 * _shm.LARGE)  # fits only once the free 8 MiB region is gone
    assert other.region.dedicated and len(pool.regions) == 2
    with pytest.raises(SharedMemoryError, match="shm_budget"):
        pool.alloc(2 * _shm.LARGE)


def test_memory_to_spare_never_takes_the_last_half_of_the_budget(pool):
    # (a big pickle, ``spill``: the socket can take it instead, so it must neither wait
    # for room, nor give back idle regions kept for reuse, nor crowd arrays out)
    idle = pool.alloc(_shm.LARGE)
    del idle
    gc.collect()
    pool.drain()
    kept = set(pool.regions)
    held = [pool.alloc(_shm.LARGE * 2) for _ in range(15)]  # 40 MiB of 256 in use
    assert pool.alloc(100 << 20, spare=True) is None  # would leave less than half
    assert set(pool.regions) >= kept  # nothing idle given back
    pool.budget = pool.reserved + (1 << 20)
    assert pool.alloc(2 << 20, spare=True) is None  # short of budget: no wait, no error
    del held


def test_a_region_made_for_memory_to_spare_goes_back_but_the_last_small_one(pool):
    before = pool.reserved
    a = pool.alloc(3 << 20, spare=True)  # a region of its own, even under LARGE
    assert a.region.dedicated and pool.reserved > before
    ka = a.region.key
    del a
    gc.collect()
    pool.drain()
    assert ka[1] in pool.regions  # kept idle: the last one, small enough
    again = pool.alloc(3 << 20, spare=True)
    assert again.region.key == ka  # and reused
    b = pool.alloc(5 << 20, spare=True)
    del again, b
    gc.collect()
    pool.drain()
    assert ka[1] not in pool.regions and len(pool.regions) == 1  # only the last kept
    huge = pool.alloc(pool.budget // 8 + 1, spare=True)  # over an eighth of the budget
    kh = huge.region.key
    del huge
    gc.collect()
    pool.drain()
    assert kh[1] not in pool.regions  # given back at once
    # An array that takes the kept region makes it an ordinary region of the pool.
    kept = pool._kept_spare
    arr = pool.alloc(5 << 20)
    assert arr.region.key[1] == kept
    del arr
    gc.collect()
    pool.drain()
    assert kept in pool.regions and kept not in pool._transient
    assert pool.blocks_live == 0


def test_arrays_on_a_block_keep_it_alive(pool):
    block = pool.alloc(800)
    arr = _shm.array_from_block(block, (100,), np.float64)
    key = block.key
    del block
    gc.collect()
    assert _leases._blocks[key]() is not None
    assert _shm.find_block(arr[10:]).key == key
    del arr
    gc.collect()
    pool.drain()
    assert pool.blocks_live == 0


def test_stats_names_the_budget_before_the_first_block():
    # A fresh process that has made no shared block yet reports the budget its first
    # block will be held to, like every other counter (0 until used), not no key at all.
    code = "import actorshm; print(actorshm.stats()['shm_budget'])"
    env = {**os.environ, "ACTORSHM_SHM_BUDGET": str(64 << 20)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 64 << 20


def test_over_budget_names_the_array_and_the_arena_it_needs(pool):
    # A 1 MiB array over the budget said "cannot allocate 4.0 MiB": the size of the chunk
    # that small arrays share, not the array's
    pool.chunk_size = pool.budget = _shm.LARGE
    held = [pool.alloc(1 << 20) for _ in range(4)]  # the one chunk, full
    with pytest.raises(SharedMemoryError,
                       match=r"cannot allocate 1\.0 MiB \(a new 4\.0 MiB arena, which small "):
        pool.alloc(1 << 20)
    with pytest.raises(SharedMemoryError, match=r"cannot allocate 8\.0 MiB of shared"):
        pool.alloc(2 * _shm.LARGE)  # (an arena of its own: one size to name)
    # one rounded up to its size class said the rounded size ("112.0 MiB" for 100)
    want = 2 * _shm.LARGE + 1000
    with pytest.raises(SharedMemoryError, match=rf"cannot allocate {want / 2**20:.1f} MiB "
                                                rf"\({pool.size_class(want) / 2**20:.1f} MiB "
                                                r"as the pool rounds it"):
        pool.alloc(want)
    del held


FORKED_CHILD_ALLOCATES = r"""
import os, threading
import actorshm
from actorshm import _shm

dropped = actorshm.zeros(1000); del dropped  # a block on the free list
keep = actorshm.zeros(10)                    # an array the child inherits
held, go = threading.Event(), threading.Event()
def hold_the_lock():                         # another thread allocating as we fork
    with _shm.pool().lock:
        held.set(); go.wait()
threading.Thread(target=hold_the_lock, daemon=True).start()
held.wait()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    recycled, fresh = actorshm.empty(1000), actorshm.empty(1000)
    recycled[:] = fresh[:] = 7
    keep[0] = 5
    os.write(w, str(actorshm.stats()["blocks_live"]).encode())
    os._exit(0)
go.set()
os.waitpid(pid, 0)
child_live = int(os.read(r, 100))
mine = [actorshm.empty(1000), actorshm.empty(1000)]
print(child_live, any((a == 7).any() for a in mine), keep[0] == 5)
"""


def test_a_forked_child_allocates_from_a_pool_of_its_own():
    # A DataLoader's worker (forked) whose collate_fn allocates actorshm memory: from the
    # parent's free lists and chunk, it was handed the blocks the parent handed out next,
    # and the two processes wrote the same memory. And a pool lock another thread held
    # at the fork was held forever in the child.
    out = subprocess.run([sys.executable, "-c", FORKED_CHILD_ALLOCATES],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # the child's two blocks are its own, the parent's next two are not them, and an
    # inherited array is still the parent's memory
    assert out.stdout.split() == ["2", "False", "True"]


CHARGE_AS_THE_BUDGET_CLOSES = """
import threading, time
from actorshm import _budget, _shm
_shm.shared_budget()  # (as a runtime opens)
charge, trim = _budget.SharedBudget.charge, _shm.HostPool.trim
trimmed, charging = threading.Event(), threading.Event()

def slow_charge(self, slot, size):  # a thread's charge, caught halfway
    charging.set()
    time.sleep(0.3)
    return charge(self, slot, size)

def trim_then_wait(self):  # the close, caught after its trim
    n = trim(self)
    trimmed.set()
    charging.wait(10)
    return n

_budget.SharedBudget.charge, _shm.HostPool.trim = slow_charge, trim_then_wait
out = []

def allocate():
    trimmed.wait(10)
    try:
        out.append(_shm.empty(64 << 20, dtype="u1").nbytes)  # (a region of its own)
    except Exception as exc:
        out.append(repr(exc))

t = threading.Thread(target=allocate)
t.start()
_shm.release_budget(0, trim=True)  # (as the last runtime closes)
t.join(10)
print(out, _shm._shared, _shm.pool().shared)
"""


def test_a_thread_allocating_as_the_last_runtime_closes_gets_its_array():
    # A driver thread allocating while the last runtime closed: the budget the driver
    # shares with its actors was unmapped under its charge, and the allocation failed
    # with "ValueError: operation forbidden on released memoryview object" (or a
    # negative fd), neither an error about memory nor one about the runtime.
    out = subprocess.run([sys.executable, "-c", CHARGE_AS_THE_BUDGET_CLOSES],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[67108864]", "None", "None"], out.stdout


ANSWER_AS_THE_BUDGET_CLOSES = """
import asyncio, threading
from actorshm import _shm
_shm.shared_budget()  # (as a runtime opens)
trim = _shm.HostPool.trim
trimming, closed = threading.Event(), threading.Event()

def slow_trim(self):  # the watch's trim, caught before it answers
    if threading.current_thread().name == "watching":
        trimming.set()
        closed.wait(10)
    return trim(self)

_shm.HostPool.trim = slow_trim
loop = asyncio.new_event_loop()
errors = []
loop.set_exception_handler(lambda _loop, context: errors.append(context["exception"]))

def watch():
    asyncio.set_event_loop(loop)
    _shm.watch_for_room(loop)  # (a runtime's loop, watching for asks for room)
    loop.run_forever()

t = threading.Thread(target=watch, name="watching")
t.start()
_shm.pool().shared.ask_for_room()  # (another process short of room)
trimming.wait(10)
_shm.release_budget(0, trim=True)  # (the last runtime closes, on this thread)
closed.set()
loop.call_soon_threadsafe(loop.call_later, 0.3, loop.stop)
t.join(10)
print([repr(e) for e in errors])
"""


def test_a_watch_for_room_answering_as_the_last_runtime_closes_fails_nothing():
    # (a runtime's loop answering another process's ask for room while the last runtime
    # closed on another thread's loop: "ValueError: operation forbidden on released
    # memoryview object" from the watch, logged by its loop)
    out = subprocess.run([sys.executable, "-c", ANSWER_AS_THE_BUDGET_CLOSES],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"], out.stdout
