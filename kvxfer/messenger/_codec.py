"""Versioned codecs for the messenger: the control messages (and the primitives the handshake
blob of ``_handshake.py`` shares: tags, items).

A leaf over ``kvxfer.errors``, ``kvxfer.layout`` and ``kvxfer.wire`` (no libfabric), so the
codecs are fuzzed on their own. Every decoder takes arbitrary bytes and either returns a
value or raises ``DescriptorError`` (a ``ValueError``); nothing else escapes.

Authentication: with a ``secret`` every blob and every control message carries a 32-byte
HMAC-SHA256 tag over all bytes before it, and a decoder given the secret refuses a message
whose tag is missing or wrong. Without a secret no tag is sent and none is accepted (the
sizes differ, so a tagged message fails to parse): a node then trusts the fabric.

The handshake blob (its format, and the encryption of its region table with a secret) is
``_handshake.py``'s; its names are re-exported here (``C.Handshake``, ...).

Items: a byte string travels as u16 length + bytes (``pack_item`` / ``read_item``, and
``read_items`` for a counted list of them: the one parser of every length-prefixed list here
and in paged.py's region table). A reason is an item of UTF-8 text, at most ``MAX_REASON``
bytes (``reason_bytes`` cuts a longer one before the first character that does not fit
whole); a decoder refuses one that is longer, cut short or not UTF-8.

Control message, version 3 (version 2 had no flags byte in REQUEST and no EXPOSE or DONE;
version 1 carried a REJECT's reason unprefixed and an ABORTED without one; a peer of another
version is refused by the version check)::

    b"KC" | u8 version | u8 type | u64 src uid | u64 dst uid | u64 seq | payload | [32-byte tag]

``src`` names the sender (the uid of its handshake), ``dst`` the receiver, ``seq`` counts the
sender's messages to that receiver from 1 (a receiver drops anything not newer than the last
it accepted: with a secret this refuses replays). Payloads by type:

====== ============ =====================================================================
type   name         payload
====== ============ =====================================================================
1      HELLO        a handshake blob (the sender's)
2      HELLO_ACK    empty
3      REQUEST      ``<I Q i I>`` imm, num_tokens, context slot (-1: none), page count;
                    request id (u8 kind: 0 str, 1 bytes, 2 int; u16 length; bytes);
                    pages as u32; ``<Q H B>`` first_token, meta length, flags (1:
                    pull, ``_pullcodec.REQUEST_PULL``); meta (at most ``MAX_META`` bytes)
4      ANNOUNCE     ``<I Q>`` imm, messages the prefiller posts for it (context included)
5      ABORT        ``<I>`` imm
6      ABORTED      ``<I Q B>`` imm, messages posted, flags (1: request unknown,
                    2: the prefiller gave up on its own, 4: with 2, it rejected
                    the request after posting: ``Request.reject``); with flag 4
                    the reason (an item), else nothing
7      REJECT       ``<I>`` imm, the reason (an item)
8      HEARTBEAT    empty
9      BYE          empty
10     EXPOSE       the pull road (``_pullcodec``): imm, num_tokens, the prefiller's other
                    writes (its context), request id, the source pages
11     DONE         the pull road: imm, flags (1: aborted, reads drained; 2: unknown)
====== ============ =====================================================================
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, Optional, Union

import numpy as np

from kvxfer.errors import DescriptorError, InvalidArgumentError
from kvxfer.messenger import _pullcodec as P

__all__ = [
    "Control", "RequestId", "encode_request_id", "decode_request_id", "CONTROL_VERSION", "TAG_BYTES", "MSG_TYPES",
    "HELLO", "HELLO_ACK", "REQUEST", "ANNOUNCE", "ABORT", "ABORTED", "REJECT", "HEARTBEAT", "BYE", "EXPOSE", "DONE",
    "ABORTED_UNKNOWN", "ABORTED_BY_PREFILLER", "ABORTED_REJECTED", "MAX_PAGES", "MAX_META", "MAX_REASON",
    "pack_item", "read_item", "read_items", "reason_bytes",
]

CONTROL_MAGIC = b"KC"
CONTROL_VERSION = 3
TAG_BYTES = 32

HELLO, HELLO_ACK, REQUEST, ANNOUNCE, ABORT, ABORTED, REJECT, HEARTBEAT, BYE = range(1, 10)
EXPOSE, DONE = P.EXPOSE, P.DONE
MSG_TYPES = {HELLO: "HELLO", HELLO_ACK: "HELLO_ACK", REQUEST: "REQUEST", ANNOUNCE: "ANNOUNCE",
             ABORT: "ABORT", ABORTED: "ABORTED", REJECT: "REJECT", HEARTBEAT: "HEARTBEAT", BYE: "BYE", **P.NAMES}
ABORTED_UNKNOWN = 1
ABORTED_BY_PREFILLER = 2
ABORTED_REJECTED = 4          # with BY_PREFILLER: Request.reject after writes were posted

_HDR = struct.Struct("<2sBBQQQ")
_REQ = struct.Struct("<IQiI")
_REQ_TAIL = struct.Struct("<QHB")        # first_token, meta length, flags
_ANN = struct.Struct("<IQ")
_IMM = struct.Struct("<I")
_ABD = struct.Struct("<IQB")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")

#: The largest control message the engine carries (Engine.send: 64 KiB).
MAX_MESSAGE = 65536
#: Pages one request may name: what fits one control message (with a 255-byte id and a tag).
#: the most bytes of ``meta`` a REQUEST carries (``Messenger.receive(meta=)``, ``Request.meta``)
MAX_META = 256
MAX_PAGES = (MAX_MESSAGE - _HDR.size - _REQ.size - 3 - 1024 - _REQ_TAIL.size - MAX_META - TAG_BYTES) // 4
#: the most bytes of a rejection's reason that travel (``Request.reject``; UTF-8, cut at a character)
MAX_REASON = 1024
_U64 = 2**64

RequestId = Union[str, bytes, int]


# -- authentication -----------------------------------------------------------------------

def _check_secret(secret: Optional[bytes]) -> Optional[bytes]:
    if secret is None:
        return None
    if isinstance(secret, str):
        try:
            secret = secret.encode()
        except UnicodeEncodeError:
            raise InvalidArgumentError("a str secret must be encodable as UTF-8") from None
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise InvalidArgumentError("secret must be bytes (or str) of at least 16 bytes")
    return bytes(secret)


def _tag(secret: bytes, data: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


def _seal(data: bytes, secret: Optional[bytes]) -> bytes:
    return data + _tag(secret, data) if secret else data


def _open(data: bytes, secret: Optional[bytes], what: str) -> bytes:
    """The body of a sealed message: tag checked and stripped (with a secret)."""
    if not secret:
        return data
    if len(data) < TAG_BYTES:
        raise DescriptorError(f"{what} is too short to carry an authentication tag")
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if not hmac.compare_digest(_tag(secret, body), tag):
        raise DescriptorError(f"{what} failed authentication (wrong or missing shared secret)")
    return body


# -- items: u16 length + bytes ------------------------------------------------------------

def pack_item(b: bytes) -> bytes:
    """``b`` as an item: u16 length + bytes (``InvalidArgumentError`` past 65535 bytes)."""
    if len(b) > 0xFFFF:
        raise InvalidArgumentError(f"an item is at most 65535 bytes, got {len(b)}")
    return _U16.pack(len(b)) + bytes(b)


def read_item(data: bytes, pos: int, what: str, most: int = 0xFFFF, empty: bool = True) -> tuple[bytes, int]:
    """The item of ``data`` at ``pos`` and the position after it. ``DescriptorError`` naming
    ``what`` if it is cut short, longer than ``most`` bytes, or empty where ``empty`` is False."""
    if pos + 2 > len(data):
        raise DescriptorError(f"{what} is truncated")
    (n,) = _U16.unpack_from(data, pos)
    pos += 2
    if n > most:
        raise DescriptorError(f"{what} is {n} bytes; at most {most}")
    if not n and not empty:
        raise DescriptorError(f"{what} is empty")
    if pos + n > len(data):
        raise DescriptorError(f"{what} is truncated")
    return bytes(data[pos:pos + n]), pos + n


def read_items(data: bytes, pos: int, count: int, what: str) -> tuple[list[bytes], int]:
    """``count`` non-empty items of ``data`` from ``pos``, and the position after them."""
    out = []
    for _ in range(count):
        b, pos = read_item(data, pos, what, empty=False)
        out.append(b)
    return out, pos


def reason_bytes(reason: str) -> bytes:
    """``reason`` as it travels: UTF-8 (a lone surrogate as ``?``), at most ``MAX_REASON``
    bytes, cut before the first character that would not fit whole."""
    b = reason.encode("utf-8", "replace")
    if len(b) > MAX_REASON:
        b = b[:MAX_REASON].decode("utf-8", "ignore").encode("utf-8")
    return b


def _read_reason(data: bytes, pos: int, t: int) -> tuple[str, int]:
    b, pos = read_item(data, pos, f"{MSG_TYPES[t]}'s reason", MAX_REASON)
    try:
        return b.decode("utf-8"), pos
    except UnicodeDecodeError:
        raise DescriptorError(f"{MSG_TYPES[t]}'s reason is not UTF-8") from None


# -- request ids --------------------------------------------------------------------------

def encode_request_id(rid: Any) -> bytes:
    """u8 kind + u16 length + bytes; str, bytes and ints (|x| < 2**1000) travel."""
    if isinstance(rid, bool):
        raise InvalidArgumentError("a request id is a str, bytes or int, not a bool")
    if isinstance(rid, str):
        kind, b = 0, rid.encode("utf-8", "surrogatepass")
    elif isinstance(rid, (bytes, bytearray)):
        kind, b = 1, bytes(rid)
    elif isinstance(rid, (int, np.integer)):
        v = int(rid)
        n = (v.bit_length() + 8) // 8
        kind, b = 2, v.to_bytes(n, "little", signed=True)
    else:
        raise InvalidArgumentError(f"a request id is a str, bytes or int, not {type(rid).__name__}")
    if len(b) > 255:
        raise InvalidArgumentError(f"request id is {len(b)} bytes encoded; at most 255")
    return bytes([kind]) + _U16.pack(len(b)) + b


def decode_request_id(data: bytes, pos: int = 0) -> tuple[RequestId, int]:
    if pos + 3 > len(data):
        raise DescriptorError("request id is truncated")
    kind = data[pos]
    (n,) = _U16.unpack_from(data, pos + 1)
    pos += 3
    if n > 255 or pos + n > len(data):
        raise DescriptorError("request id is truncated or too long")
    b = bytes(data[pos:pos + n])
    pos += n
    if kind == 0:
        try:
            return b.decode("utf-8", "surrogatepass"), pos
        except UnicodeDecodeError:
            raise DescriptorError("request id is not valid UTF-8") from None
    if kind == 1:
        return b, pos
    if kind == 2:
        if n == 0:
            raise DescriptorError("integer request id has no bytes")
        return int.from_bytes(b, "little", signed=True), pos
    raise DescriptorError(f"request id has unknown kind {kind}")


# -- control messages ---------------------------------------------------------------------

class Control:
    """One decoded control message. Fields not carried by its type stay at their defaults."""

    __slots__ = ("type", "src", "dst", "seq", "imm", "count", "num_tokens", "slot", "request_id", "pages",
                 "flags", "reason", "blob", "first_token", "meta")

    def __init__(self, type: int, src: int, dst: int, seq: int, *, imm: int = 0, count: int = 0,
                 num_tokens: int = 0, slot: int = -1, request_id: Any = None, pages: Optional[np.ndarray] = None,
                 flags: int = 0, reason: str = "", blob: bytes = b"", first_token: int = 0,
                 meta: bytes = b"") -> None:
        self.type, self.src, self.dst, self.seq = type, src, dst, seq
        self.imm, self.count, self.num_tokens, self.slot = imm, count, num_tokens, slot
        self.request_id, self.pages, self.flags, self.reason, self.blob = request_id, pages, flags, reason, blob
        self.first_token, self.meta = first_token, meta

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Control):
            return NotImplemented
        for f in self.__slots__:
            a, b = getattr(self, f), getattr(other, f)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or not np.array_equal(a, b):
                    return False
            elif a != b or type(a) is not type(b):
                return False
        return True

    def __repr__(self) -> str:
        return f"<Control {MSG_TYPES.get(self.type, self.type)} {self.src:x}->{self.dst:x} seq={self.seq} imm={self.imm}>"

    # -- encoding -------------------------------------------------------------------------
    def encode(self, secret: Optional[bytes] = None) -> bytes:
        head = _HDR.pack(CONTROL_MAGIC, CONTROL_VERSION, self.type, self.src, self.dst, self.seq)
        t = self.type
        if t == HELLO:
            body = bytes(self.blob)
        elif t in (HELLO_ACK, HEARTBEAT, BYE):
            body = b""
        elif t == REQUEST:
            pages = np.ascontiguousarray(self.pages, dtype="<u4")
            if len(pages) > MAX_PAGES:
                raise InvalidArgumentError(f"a request names at most {MAX_PAGES} pages, got {len(pages)}")
            meta = bytes(self.meta)
            if len(meta) > MAX_META:
                raise InvalidArgumentError(f"a request's meta is at most {MAX_META} bytes, got {len(meta)}")
            if self.flags & ~P.REQUEST_PULL:
                raise InvalidArgumentError(f"REQUEST has flags {self.flags}")
            body = (_REQ.pack(self.imm, self.num_tokens, self.slot, len(pages))
                    + encode_request_id(self.request_id) + pages.tobytes()
                    + _REQ_TAIL.pack(self.first_token, len(meta), self.flags) + meta)
        elif t == ANNOUNCE:
            body = _ANN.pack(self.imm, self.count)
        elif t == ABORT:
            body = _IMM.pack(self.imm)
        elif t == ABORTED:
            body = _ABD.pack(self.imm, self.count, self.flags)
            if self.flags & ABORTED_REJECTED:
                body += pack_item(reason_bytes(self.reason))
        elif t == REJECT:
            body = _IMM.pack(self.imm) + pack_item(reason_bytes(self.reason))
        elif t in P.NAMES:
            body = P.encode(self, MAX_PAGES)
        else:
            raise InvalidArgumentError(f"unknown control message type {t}")
        return _seal(head + body, secret)

    @classmethod
    def decode(cls, data: Any, secret: Optional[bytes] = None) -> "Control":
        """Parse one message; a defect of any kind raises ``DescriptorError``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DescriptorError(f"a control message is bytes, not {type(data).__name__}")
        data = _open(bytes(data), secret, "control message")
        if len(data) < _HDR.size:
            raise DescriptorError("control message is truncated")
        magic, ver, t, src, dst, seq = _HDR.unpack_from(data)
        if magic != CONTROL_MAGIC:
            raise DescriptorError("not a kvxfer control message (bad magic)")
        if ver != CONTROL_VERSION:
            raise DescriptorError(f"control message version {ver} is not supported")
        body = data[_HDR.size:]
        m = cls(t, src, dst, seq)
        try:
            if t == HELLO:
                if not body:
                    raise DescriptorError("HELLO without a handshake")
                m.blob = body
            elif t in (HELLO_ACK, HEARTBEAT, BYE):
                if body:
                    raise DescriptorError(f"{MSG_TYPES[t]} carries no payload")
            elif t == REQUEST:
                m.imm, m.num_tokens, m.slot, n = _REQ.unpack_from(body)
                m.request_id, pos = decode_request_id(body, _REQ.size)
                end = pos + 4 * n
                if n > MAX_PAGES or len(body) < end + _REQ_TAIL.size:
                    raise DescriptorError("REQUEST page list does not match its count")
                m.pages = np.frombuffer(body, dtype="<u4", count=n, offset=pos).astype(np.int64)
                m.first_token, mlen, m.flags = _REQ_TAIL.unpack_from(body, end)
                if mlen > MAX_META or len(body) != end + _REQ_TAIL.size + mlen:
                    raise DescriptorError("REQUEST meta does not match its length")
                if m.flags & ~P.REQUEST_PULL:
                    raise DescriptorError("REQUEST has unknown flags")
                m.meta = bytes(body[end + _REQ_TAIL.size:])
            elif t == ANNOUNCE:
                _exact(body, _ANN.size, t)
                m.imm, m.count = _ANN.unpack(body)
            elif t == ABORT:
                _exact(body, _IMM.size, t)
                (m.imm,) = _IMM.unpack(body)
            elif t == ABORTED:
                m.imm, m.count, m.flags = _ABD.unpack_from(body)
                if m.flags & ~(ABORTED_UNKNOWN | ABORTED_BY_PREFILLER | ABORTED_REJECTED):
                    raise DescriptorError("ABORTED has unknown flags")
                pos = _ABD.size
                if m.flags & ABORTED_REJECTED:
                    m.reason, pos = _read_reason(body, pos, t)
                _exact(body, pos, t)
            elif t == REJECT:
                (m.imm,) = _IMM.unpack_from(body)
                m.reason, pos = _read_reason(body, _IMM.size, t)
                _exact(body, pos, t)
            elif t in P.NAMES:
                P.decode(m, body, MAX_PAGES)
            else:
                raise DescriptorError(f"unknown control message type {t}")
        except struct.error:
            raise DescriptorError(f"{MSG_TYPES.get(t, t)} payload is truncated") from None
        return m


def _exact(body: bytes, n: int, t: int) -> None:
    if len(body) != n:
        raise DescriptorError(f"{MSG_TYPES[t]} payload is {len(body)} bytes, expected {n}")


# -- the handshake (``_handshake.py``), under its old names here -------------------------------

_HANDSHAKE_NAMES = ("Handshake", "safe_decode_handshake", "layout_dict", "HANDSHAKE_MAGIC", "HANDSHAKE_VERSION",
                    "HANDSHAKE_SEALED_VERSION", "_table_cipher", "_encrypt_table", "_decrypt_table",
                    "_LAYOUT_FIELDS", "_ENGINE_FIELDS", "_LAYOUT_ATTRS", "_DTYPE_NAME", "_int")


def __getattr__(name: str) -> Any:
    if name in _HANDSHAKE_NAMES:       # lazily: _handshake imports this module
        from kvxfer.messenger import _handshake
        return getattr(_handshake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
