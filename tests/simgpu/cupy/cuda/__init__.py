"""Simulated ``cupy.cuda``: devices, memory objects and streams (see tests/simgpu/README.md)."""

from . import runtime


class Device:
    def __init__(self, device=None):
        self.id = runtime.getDevice() if device is None else int(device)
        self._prev = []

    def __enter__(self):
        self._prev.append(runtime.getDevice())
        runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc):
        runtime.setDevice(self._prev.pop())

    def synchronize(self):
        runtime.deviceSynchronize()


class BaseMemory:
    ptr = 0
    size = 0
    device_id = 0


class Memory(BaseMemory):
    """An allocation of its own (``cudaMalloc``): ``ptr`` is its base."""

    def __init__(self, size):
        self.size = int(size)
        self.device_id = runtime.getDevice()
        self.ptr = runtime.malloc(self.size) if self.size else 0

    def __del__(self):
        if self.ptr:
            try:
                runtime.free(self.ptr)
            except Exception:  # interpreter shutdown
                pass
            self.ptr = 0


class UnownedMemory(BaseMemory):
    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr = ptr
        self.size = size
        self._owner = owner
        self.device_id = runtime.getDevice() if device_id < 0 else device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    @property
    def device(self):
        return Device(self.device_id)


class Event:
    """Done at once (simulated kernels finish when launched), unless the simulation sets
    ``Event.busy``: then each event reports busy until it is waited on, so that the
    path where actorshm waits for a busy device in a helper thread runs too."""

    busy = False  # simulation knob, not CuPy API
    spinning_waits = 0  # waits on events made without block=True (CUDA spins a core)
    _count = 0

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        Event._count += 1
        self.ptr = Event._count
        self._done = not Event.busy
        self._block = block

    @property
    def done(self):
        return self._done

    def synchronize(self):
        if not self._block:
            Event.spinning_waits += 1
        self._done = True


class Stream:
    synchronizes = 0  # simulation counter, not CuPy API

    def synchronize(self):
        Stream.synchronizes += 1


_stream = Stream()


def get_current_stream():
    return _stream

