"""Simulated ``cupy.cuda.runtime``: devices, allocations and IPC handles on host memory.

See tests/simgpu/README.md. Device memory is a memfd mapped into this process; an IPC
handle packs the exporter's pid, the memfd's fd number and the size, and is opened by
mapping ``/proc/<pid>/fd/<fd>``, so two processes really see the same bytes.
"""

import ctypes
import mmap
import os
import struct
import threading

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

_HANDLE = struct.Struct("<qqq")


class CUDARuntimeError(RuntimeError):
    _names = {2: "cudaErrorMemoryAllocation: out of memory",
              100: "cudaErrorNoDevice: no CUDA-capable device is detected",
              101: "cudaErrorInvalidDevice: invalid device ordinal",
              400: "cudaErrorInvalidResourceHandle: invalid resource handle"}

    def __init__(self, status):
        self.status = status
        super().__init__(self._names.get(status, f"cudaError {status}"))


def _machine():
    ids = os.environ.get("ACTORSHM_SIMGPU_BUS_IDS", "0000:01:00.0,0000:02:00.0")
    all_ids = [x for x in ids.split(",") if x]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return all_ids
    out = []
    for tok in env.split(","):
        tok = tok.strip()
        if not tok.isdigit() or int(tok) >= len(all_ids):
            break
        out.append(all_ids[int(tok)])
    return out


_VISIBLE = _machine()
_CAPACITY = int(os.environ.get("ACTORSHM_SIMGPU_MEMORY", 1 << 30))
_used = [0] * len(_VISIBLE)
_allocs = {}  # ptr -> (fd, size, device)
_opened = {}  # ptr -> size
_lock = threading.Lock()
_tls = threading.local()


def getDeviceCount():
    if not _VISIBLE:
        raise CUDARuntimeError(100)
    return len(_VISIBLE)


def getDevice():
    return getattr(_tls, "device", 0)


def setDevice(device):
    _check(device)
    _tls.device = device


def _check(device):
    if not 0 <= device < len(_VISIBLE):
        raise CUDARuntimeError(101)


def deviceGetPCIBusId(device):
    _check(device)
    return _VISIBLE[device]


def deviceGetByPCIBusId(bus_id):
    try:
        return _VISIBLE.index(bus_id)
    except ValueError:
        raise CUDARuntimeError(101) from None


streamLegacy = 1


def deviceSynchronize():
    pass  # simulated kernels finish when they are launched


def eventRecord(event, stream):
    pass


def memGetInfo():
    d = getDevice()
    return _CAPACITY - _used[d], _CAPACITY


def _map(fd, size):
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise CUDARuntimeError(2)
    return addr


def malloc(size):
    d = getDevice()
    size = max(int(size), 1)
    with _lock:
        if _used[d] + size > _CAPACITY:
            raise CUDARuntimeError(2)
        _used[d] += size
    fd = os.memfd_create("simgpu", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    ptr = _map(fd, size)
    _allocs[ptr] = (fd, size, d)
    return ptr


def free(ptr):
    fd, size, d = _allocs.pop(ptr)
    _libc.munmap(ptr, size)
    os.close(fd)
    with _lock:
        _used[d] -= size


def ipcGetMemHandle(ptr):
    if ptr not in _allocs:  # CUDA: only an allocation's base can be exported
        raise CUDARuntimeError(400)
    fd, size, _ = _allocs[ptr]
    return _HANDLE.pack(os.getpid(), fd, size).ljust(64, b"\0")


def ipcOpenMemHandle(handle, flags=1):
    pid, fd, size = _HANDLE.unpack_from(handle)
    if pid == os.getpid():  # CUDA refuses to open a handle in the process that made it
        raise CUDARuntimeError(400)
    try:
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError:
        raise CUDARuntimeError(400) from None
    try:
        ptr = _map(local, size)
    finally:
        os.close(local)
    _opened[ptr] = size
    return ptr


def ipcCloseMemHandle(ptr):
    size = _opened.pop(ptr)
    _libc.munmap(ptr, size)
