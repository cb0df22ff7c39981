"""Context data: what travels with a request's KV into the decoder's context slot.

**The convention (speculative decoding, MTP).** The prefiller does not sample. Its prefill
covers the prompt except the last token (``num_tokens = len(prompt) - 1`` KV tokens); the
hidden state (or the logits) of the last prefilled position travels as context, and the
decoder runs the last prompt token as its first decode step, so a draft model or MTP head
at the decoder has what it needs (e.g. DeepSeek-V3's MTP takes the main model's hidden state
of the previous position). A hidden state of a large model is ``7168 x bf16`` = 14 KiB;
size ``context_bytes`` for it plus whatever else the engine sends.

**Slot format.** A slot (``context_stride(context_bytes)`` bytes, a multiple of 64) holds an
8-byte little-endian length ``n`` and ``n`` bytes of data (``Receive.context`` is a view of
the data). ``pack_context`` fills the data with several named arrays:

    b"KXC1" | u32 count | count x entry header | data
    entry header: u8 name length | name (utf-8) | u8 dtype length | dtype str (numpy, e.g.
                  "<f2", "|V2" for bfloat16 seen as raw) | u8 ndim | ndim x u32 shape |
                  u32 offset of its data from the start of the context
    data: each array C-contiguous, starting at a multiple of 16

``unpack_context`` returns read-only numpy views of the slot (no copy) and raises
``DescriptorError`` on anything malformed (truncated, overlapping, unknown magic).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kvxfer.errors import DescriptorError, InvalidArgumentError

__all__ = ["pack_context", "unpack_context", "MAGIC"]

MAGIC = b"KXC1"
_ALIGN = 16


def pack_context(**arrays: Any) -> bytes:
    """Named arrays (numpy or anything ``np.asarray`` takes; torch bf16: pass
    ``t.view(torch.int16).numpy()``) as one context blob, for ``Send.finish(context=...)``."""
    if not arrays:
        raise InvalidArgumentError("pack_context needs at least one array")
    head = bytearray(MAGIC + struct.pack("<I", len(arrays)))
    items = []
    for name, a in arrays.items():
        try:
            arr = np.require(np.asarray(a), requirements="C")   # keeps 0-d arrays 0-d
        except (TypeError, ValueError, OverflowError) as exc:   # e.g. ragged lists
            raise InvalidArgumentError(f"context array {name!r} is not an array: {exc}") from None
        if arr.dtype.hasobject:
            raise InvalidArgumentError(f"context array {name!r} holds Python objects")
        if arr.dtype.fields is not None:    # its str is "|Vn": the fields would be lost
            raise InvalidArgumentError(f"context array {name!r} has a structured dtype, which the format "
                                       f"cannot carry: pack each field, or pass .view(np.uint8)")
        if any(d > 0xFFFFFFFF for d in arr.shape):
            raise InvalidArgumentError(f"context array {name!r}: dimension past 2**32 - 1 in {arr.shape}")
        try:
            nm, dt = name.encode(), arr.dtype.str.encode()
        except UnicodeEncodeError:
            raise InvalidArgumentError(f"context array name {name!r} is not valid UTF-8") from None
        if len(nm) > 255 or len(dt) > 255 or arr.ndim > 255:
            raise InvalidArgumentError(f"context array {name!r}: name, dtype or rank too long")
        items.append((nm, dt, arr))
    # header size first, then offsets
    hsize = len(head) + sum(1 + len(nm) + 1 + len(dt) + 1 + 4 * arr.ndim + 4 for nm, dt, arr in items)
    off = -(-hsize // _ALIGN) * _ALIGN
    offsets = []
    for _, _, arr in items:
        offsets.append(off)
        off = -(-(off + arr.nbytes) // _ALIGN) * _ALIGN
    for (nm, dt, arr), o in zip(items, offsets):
        head += bytes([len(nm)]) + nm + bytes([len(dt)]) + dt + bytes([arr.ndim])
        head += struct.pack(f"<{arr.ndim}I", *arr.shape) + struct.pack("<I", o)
    if offsets[-1] > 0xFFFFFFFF:
        raise InvalidArgumentError(f"context arrays of {offsets[-1] + items[-1][2].nbytes} bytes: the "
                                   f"format's offsets stop at 4 GiB")
    out = bytearray(offsets[-1] + items[-1][2].nbytes)
    out[:len(head)] = head
    for (_, _, arr), o in zip(items, offsets):
        out[o:o + arr.nbytes] = arr.tobytes()
    return bytes(out)


def unpack_context(data: Any) -> dict[str, np.ndarray]:
    """The named arrays of a ``pack_context`` blob (e.g. ``Receive.context``), as read-only
    views of it."""
    try:
        buf = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    except (TypeError, ValueError, BufferError):
        raise DescriptorError(f"a context blob is a C-contiguous buffer, not {type(data).__name__}") from None
    raw = buf.tobytes()
    n = len(buf)
    try:
        if raw[:4] != MAGIC:
            raise DescriptorError("context blob: bad magic")
        (count,) = struct.unpack_from("<I", raw, 4)
        pos = 8
        out: dict[str, np.ndarray] = {}
        spans: list[tuple[str, int, int, np.dtype, tuple]] = []
        names: set[str] = set()
        for _ in range(count):
            ln = raw[pos]
            name = raw[pos + 1:pos + 1 + ln].decode()
            pos += 1 + ln
            ld = raw[pos]
            dt = np.dtype(raw[pos + 1:pos + 1 + ld].decode())
            pos += 1 + ld
            nd = raw[pos]
            shape = struct.unpack_from(f"<{nd}I", raw, pos + 1)
            pos += 1 + 4 * nd
            (off,) = struct.unpack_from("<I", raw, pos)
            pos += 4
            if dt.hasobject or dt.itemsize == 0 and int(np.prod(shape)) != 0:
                raise DescriptorError(f"context array {name!r}: bad dtype {dt}")
            size = int(np.prod(shape, dtype=object)) * dt.itemsize     # exact: no int64 wrap
            if name in names:
                raise DescriptorError(f"context array {name!r} appears twice")
            names.add(name)
            spans.append((name, off, size, dt, shape))
        # the data of every array lies after the whole header table, in order, unshared
        end_prev = pos
        for name, off, size, dt, shape in spans:
            if off < end_prev or off + size > n:
                raise DescriptorError(f"context array {name!r} overlaps or runs past the blob")
            end_prev = off + size
            v = buf[off:off + size].view(dt).reshape(shape)
            v.flags.writeable = False
            out[name] = v
        return out
    except DescriptorError:
        raise
    except (IndexError, struct.error, UnicodeDecodeError, TypeError, ValueError, OverflowError,
            SyntaxError) as exc:                     # np.dtype(",") raises SyntaxError
        raise DescriptorError(f"malformed context blob: {exc}") from None
