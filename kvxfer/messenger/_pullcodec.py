"""The pull road's control messages, EXPOSE and DONE: their payloads (``_codec.Control``
frames them, version 3 and after).

A leaf like ``_codec`` (no libfabric): every decoder takes arbitrary bytes and returns or
raises ``DescriptorError``. Little-endian::

    10  EXPOSE  ``<I Q Q I>`` imm, num_tokens, writes the prefiller posts besides (its
                context: 1 where it holds the request's context slot, else 0), page count;
                request id (as in REQUEST); the source pages as u32 (the prefiller's own
                page size, every token of the request: ``ceil(num_tokens / page_size)``)
    11  DONE    ``<I B>`` imm, flags (1 ``DONE_ABORTED``: the reads were cancelled or never
                posted, and none is in flight any more; 2 ``DONE_UNKNOWN``: with 1, the
                decoder knew no such request)

A REQUEST asking for pull carries ``REQUEST_PULL`` in its flags byte (``_codec``).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kvxfer.errors import DescriptorError, InvalidArgumentError

__all__ = ["EXPOSE", "DONE", "DONE_ABORTED", "DONE_UNKNOWN", "REQUEST_PULL", "NAMES", "encode", "decode"]

EXPOSE, DONE = 10, 11
NAMES = {EXPOSE: "EXPOSE", DONE: "DONE"}
DONE_ABORTED = 1
DONE_UNKNOWN = 2
#: REQUEST flag: the decoder reads the pages itself (the prefiller answers EXPOSE, not writes)
REQUEST_PULL = 1

_EXP = struct.Struct("<IQQI")
_DONE = struct.Struct("<IB")


def encode(m: Any, max_pages: int) -> bytes:
    """The payload of EXPOSE or DONE ``m`` (a ``_codec.Control``)."""
    from kvxfer.messenger._codec import encode_request_id

    if m.type == EXPOSE:
        pages = np.ascontiguousarray(m.pages if m.pages is not None else [], dtype="<u4")
        if len(pages) > max_pages:
            raise InvalidArgumentError(f"an EXPOSE names at most {max_pages} pages, got {len(pages)}")
        return _EXP.pack(m.imm, m.num_tokens, m.count, len(pages)) + encode_request_id(m.request_id) + pages.tobytes()
    if m.flags & ~(DONE_ABORTED | DONE_UNKNOWN):
        raise InvalidArgumentError(f"DONE has flags {m.flags}")
    return _DONE.pack(m.imm, m.flags)


def decode(m: Any, body: bytes, max_pages: int) -> None:
    """Fill EXPOSE or DONE ``m`` from ``body`` (``struct.error`` where it is cut short)."""
    from kvxfer.messenger._codec import decode_request_id

    if m.type == EXPOSE:
        m.imm, m.num_tokens, m.count, n = _EXP.unpack_from(body)
        m.request_id, pos = decode_request_id(body, _EXP.size)
        if n > max_pages or len(body) != pos + 4 * n:
            raise DescriptorError("EXPOSE page list does not match its count")
        m.pages = np.frombuffer(body, dtype="<u4", count=n, offset=pos).astype(np.int64)
        return
    if len(body) != _DONE.size:
        raise DescriptorError(f"DONE payload is {len(body)} bytes, expected {_DONE.size}")
    m.imm, m.flags = _DONE.unpack(body)
    if m.flags & ~(DONE_ABORTED | DONE_UNKNOWN):
        raise DescriptorError("DONE has unknown flags")
