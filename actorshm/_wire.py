"""The wire format: frame header, frame kinds and flags, limits, region kinds.

A frame is an 18-byte header followed by its payload::

    uint32 payload length | uint8 kind | uint8 flags | uint16 fd count | uint16 marker
    | uint64 call id

The marker is always ``MARK``. A reader that lost its place in the stream (a truncated
frame) reads a header from the middle of a frame, and the marker, the kind, the flags,
the fd count and the length checks catch it (``_framing``): a few integer comparisons
per frame.

File descriptors ride as SCM_RIGHTS ancillary data on the ``sendmsg`` that carries the
first byte of their frame (``_framing``). Payloads are pickles (``_serialization``);
flags say what rides ahead of the user's objects.
"""

from __future__ import annotations

import socket
import struct

MARK = 0xAC5F  # the frame marker


class _Header(struct.Struct):
    """The frame header: ``pack(length, kind, flags, fd count, call id)`` adds the
    marker; ``unpack_from`` gives (length, kind, flags, fd count, marker, call id)."""

    def pack(self, plen: int, kind: int, flags: int, nfds: int, cid: int) -> bytes:
        return _pack(self, plen, kind, flags, nfds, MARK, cid)


_pack = struct.Struct.pack
HEADER = _Header("<IBBHHQ")
HSIZE = HEADER.size

# Frame kinds.
CALL, RESULT, ERROR, RELEASE, RETIRE = 1, 2, 3, 4, 5
# A cancelled call (caller to callee, no payload); an item of a streaming call (callee to
# caller, a pickle like a result's); credit for more items (caller to callee: <I count).
CANCEL, ITEM, CREDIT = 6, 7, 8
# An actor that begins to stop (``sys.exit``, its runtime's close) tells the driver and
# its peers how long its clean-up may take, atexit functions included (<d seconds): its
# connections close before those run.
LEAVING = 9
LAST_KIND = LEAVING

# Frame flags.
HAS_BLOCKS = 1  # the payload starts with a block table (``_serialization``)
PLAIN = 2  # the payload is a plain pickle of builtin scalars and containers
HAS_RELEASES = 4  # releases (and forward notices) ride ahead of the payload
# With HAS_BLOCKS: after the block table, a plain pickle of builtin scalars in which each
# array is a hole, a tuple naming its place in a block (a flat message: ``_flat``).
FLAT = 8
MAX_FLAGS = HAS_BLOCKS | PLAIN | HAS_RELEASES | FLAT  # a header with other bits set is corrupt
LEN = struct.Struct("<I")  # length prefix of what rides ahead of a payload
LEAVING_PAYLOAD = struct.Struct("<d")  # a LEAVING frame's: seconds

# Limits.
MAX_FRAME = (1 << 31) - 1
MAX_MESSAGE = (1 << 31) - (1 << 20)  # a frame's limit, less room for its block table
MAX_FDS_PER_SEND = 250  # Linux caps SCM_RIGHTS at 253 fds per message
MAX_FDS_PER_FRAME = 4096
RECV_SIZE = 1 << 18
ANC_SIZE = socket.CMSG_SPACE(MAX_FDS_PER_SEND * 4)

# Region kinds in a block table: how the receiver opens a region it has not seen. A
# plug-in registers the opener of its kind (``_serialization.register_region_kind``).
ARENA, GPU_SLAB = 0, 1
