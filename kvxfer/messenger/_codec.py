"""Versioned codecs for the messenger: the handshake blob and the control messages.

A leaf over ``kvxfer.errors``, ``kvxfer.layout`` and ``kvxfer.wire`` (no libfabric), so the
codecs are fuzzed on their own. Every decoder takes arbitrary bytes and either returns a
value or raises ``DescriptorError`` (a ``ValueError``); nothing else escapes.

Authentication: with a ``secret`` every blob and every control message carries a 32-byte
HMAC-SHA256 tag over all bytes before it, and a decoder given the secret refuses a message
whose tag is missing or wrong. Without a secret no tag is sent and none is accepted (the
sizes differ, so a tagged message fails to parse): a node then trusts the fabric.

Confidentiality: a region descriptor holds the region's remote keys, which are all a process
on the fabric needs to write into the region. With a ``secret`` the handshake's descriptor
table is encrypted (version 2): AES-256-GCM (the ``cryptography`` package, ``kvxfer[secure]``)
under a key derived from the secret with HKDF-SHA256, with a fresh random 96-bit nonce per
blob and the bytes before the table (magic, version, header) as associated data. A holder of
the blob without the secret reads the header (uid, address, layout) but no descriptor, and a
decoder given the secret refuses a version 1 blob (keys in clear). Without a secret the blob
stays version 1, as before.

Handshake, version 1 (no secret) and 2 (a secret; little-endian)::

    b"KXHS" | u8 version | u32 header length | header (UTF-8 JSON) | table | [32-byte tag]
    table, version 1:  u32 descriptors | per descriptor: an item (u16 length + wire.Descriptor bytes)
    table, version 2:  u32 sealed length | 12-byte nonce | AES-GCM(version 1 table) + 16-byte GCM tag

The JSON header holds ``uid`` (the messenger's random 64-bit identity, new per process),
``address`` (hex of the engine address), ``layout`` (KVLayout fields), ``sharding``
(``[tp_size, replicated]``), ``ranks`` (TP ranks held, ascending), ``engine``
(``provider``, ``iov``, ``max_write``, ``pack_min``, ``rails``: what fixes the message count),
``context`` (``[slots, bytes]``) and ``peer_timeout``. Descriptors: for each rank held, the
layout's regions in region-id order; then the context region when ``slots > 0``.

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

Handshake of a messenger offering pull (``Messenger(offer_pull=True)``): the header has a
ninth field ``"reads": 1`` and the table, after every rank's region descriptors, holds every
rank's **reads-only** descriptors (read keys, no write key) in the same order, then the
context descriptor.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from kvxfer.errors import DescriptorError, InvalidArgumentError, KvxferError, LayoutError, UnsupportedError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _pullcodec as P

__all__ = [
    "Handshake", "Control", "RequestId", "encode_request_id", "decode_request_id",
    "HANDSHAKE_VERSION", "HANDSHAKE_SEALED_VERSION", "CONTROL_VERSION", "TAG_BYTES", "MSG_TYPES",
    "HELLO", "HELLO_ACK", "REQUEST", "ANNOUNCE", "ABORT", "ABORTED", "REJECT", "HEARTBEAT", "BYE", "EXPOSE", "DONE",
    "ABORTED_UNKNOWN", "ABORTED_BY_PREFILLER", "ABORTED_REJECTED", "MAX_PAGES", "MAX_META", "MAX_REASON",
    "pack_item", "read_item", "read_items", "reason_bytes",
]

HANDSHAKE_MAGIC = b"KXHS"
HANDSHAKE_VERSION = 1           #: without a secret: the descriptor table in clear
HANDSHAKE_SEALED_VERSION = 2    #: with a secret: the descriptor table encrypted
_NONCE_BYTES = 12
_GCM_TAG_BYTES = 16
_TABLE_KEY_INFO = b"kvxfer handshake region table, AES-256-GCM, v2"
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


def _table_cipher(secret: bytes) -> Any:
    """The AEAD of a handshake's descriptor table: AES-256-GCM under HKDF-SHA256(secret)."""
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise UnsupportedError("a messenger secret encrypts the handshake's region keys with the "
                               "'cryptography' package: pip install 'kvxfer[secure]'") from None
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_TABLE_KEY_INFO).derive(secret)
    return AESGCM(key)


def _encrypt_table(secret: bytes, table: bytes, aad: bytes) -> bytes:
    nonce = os.urandom(_NONCE_BYTES)
    sealed = nonce + _table_cipher(secret).encrypt(nonce, table, aad)
    return _U32.pack(len(sealed)) + sealed


def _decrypt_table(secret: bytes, data: bytes, pos: int, aad: bytes) -> bytes:
    """The version 1 table inside a version 2 blob's sealed table at ``pos`` (which must run
    to the end); DescriptorError where it does not decrypt."""
    if pos + 4 > len(data):
        raise DescriptorError("handshake is truncated")
    (n,) = _U32.unpack_from(data, pos)
    pos += 4
    if n < _NONCE_BYTES + _GCM_TAG_BYTES or pos + n != len(data):
        raise DescriptorError("handshake's sealed region table has a bad length")
    nonce, ct = data[pos:pos + _NONCE_BYTES], data[pos + _NONCE_BYTES:pos + n]
    try:
        cipher = _table_cipher(secret)
    except UnsupportedError as exc:
        raise DescriptorError(str(exc)) from None
    from cryptography.exceptions import InvalidTag

    try:
        return cipher.decrypt(nonce, ct, aad)
    except InvalidTag:
        raise DescriptorError("handshake's region table failed authentication (wrong shared secret)") from None


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


# -- handshake ----------------------------------------------------------------------------

_LAYOUT_FIELDS = ("num_layers", "kv_heads", "head_dim", "page_size", "num_pages", "dtype", "order", "kv",
                  "placement", "page_stride", "layer_stride")
_ENGINE_FIELDS = ("iov", "max_write", "pack_min", "rails")
# >>> issue 22: deprecated name
#: handshake key -> KVLayout attribute where they differ (the key stays: wire format)
_LAYOUT_ATTRS = {"placement": "layer_regions"}
# <<< issue 22
_DTYPE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")


def layout_dict(layout: KVLayout) -> dict:
    d = {f: getattr(layout, _LAYOUT_ATTRS.get(f, f)) for f in _LAYOUT_FIELDS}
    d["dtype"] = layout.dtype_format      # a plain name either side reads as the same format
    return d


def _int(v: Any, what: str, lo: int = 0, hi: int = _U64 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise DescriptorError(f"handshake field {what} must be an int in [{lo}, {hi}], got {v!r}")
    return v


@dataclass(frozen=True)
class Handshake:
    """Everything a peer needs to talk to a messenger; ``encode`` / ``decode`` the blob."""

    uid: int
    address: bytes
    layout: KVLayout
    sharding: Sharding
    ranks: tuple[int, ...]
    provider: str
    iov: int
    max_write: int
    pack_min: int
    rails: int
    context_slots: int
    context_bytes: int
    peer_timeout: float
    regions: tuple[tuple[bytes, ...], ...]   #: per rank held: the layout's region descriptors
    context: Optional[bytes] = None           #: the context region's descriptor (slots > 0)
    #: per rank held: reads-only descriptors of the same regions (a messenger offering pull), else ()
    read_regions: tuple[tuple[bytes, ...], ...] = ()

    def encode(self, secret: Optional[bytes] = None) -> bytes:
        header = json.dumps({
            "uid": self.uid, "address": self.address.hex(), "layout": layout_dict(self.layout),
            "sharding": [self.sharding.tp_size, bool(self.sharding.replicated)], "ranks": list(self.ranks),
            "engine": {"provider": self.provider, "iov": self.iov, "max_write": self.max_write,
                       "pack_min": self.pack_min, "rails": self.rails},
            "context": [self.context_slots, self.context_bytes], "peer_timeout": self.peer_timeout,
            **({"reads": 1} if self.read_regions else {}),
        }, separators=(",", ":")).encode()
        if self.read_regions and len(self.read_regions) != len(self.regions):
            raise InvalidArgumentError("a handshake offering reads names reads-only descriptors for every rank")
        descs = [d for per_rank in self.regions + self.read_regions for d in per_rank]
        if self.context_slots:
            if self.context is None:
                raise InvalidArgumentError("a handshake with context slots needs the context descriptor")
            descs.append(self.context)
        table = [_U32.pack(len(descs))]
        for d in descs:
            if not d:
                raise InvalidArgumentError("a descriptor must be 1..65535 bytes")
            table.append(pack_item(d))
        secret = _check_secret(secret)
        version = HANDSHAKE_SEALED_VERSION if secret else HANDSHAKE_VERSION
        head = b"".join([HANDSHAKE_MAGIC, bytes([version]), _U32.pack(len(header)), header])
        body = _encrypt_table(secret, b"".join(table), head) if secret else b"".join(table)
        return _seal(head + body, secret)

    @classmethod
    def decode(cls, data: Any, secret: Optional[bytes] = None) -> "Handshake":
        """Parse and check a blob; any defect raises ``DescriptorError`` (or ``LayoutError``
        for a layout or sharding that cannot exist)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DescriptorError(f"a handshake is bytes, not {type(data).__name__}")
        secret = _check_secret(secret)
        data = bytes(data)
        if data[:4] == HANDSHAKE_MAGIC and data[4:5] == bytes([HANDSHAKE_SEALED_VERSION]) and not secret:
            raise DescriptorError("handshake version 2 has its region table encrypted: decoding it needs the "
                                  "shared secret")
        data = _open(data, secret, "handshake")
        if data[:4] != HANDSHAKE_MAGIC:
            raise DescriptorError("not a kvxfer messenger handshake (bad magic)")
        if len(data) < 5:
            raise DescriptorError("handshake is truncated")
        want = HANDSHAKE_SEALED_VERSION if secret else HANDSHAKE_VERSION
        if data[4] == HANDSHAKE_VERSION and secret:
            raise DescriptorError("handshake carries its region keys in clear (version 1); with a shared secret "
                                  "they must be encrypted (version 2)")
        if data[4] != want:
            raise DescriptorError(f"handshake version {data[4]} is not supported (this kvxfer speaks "
                                  f"{HANDSHAKE_VERSION} and, with a secret, {HANDSHAKE_SEALED_VERSION})")
        pos = 5
        if pos + 4 > len(data):
            raise DescriptorError("handshake is truncated")
        (hl,) = _U32.unpack_from(data, pos)
        pos += 4
        if pos + hl > len(data):
            raise DescriptorError("handshake header is truncated")
        try:
            h = json.loads(data[pos:pos + hl].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise DescriptorError("handshake header is not valid JSON") from None
        pos += hl
        if secret:                     # the rest is the sealed table: parse its plaintext
            data, pos = _decrypt_table(secret, data, pos, data[:pos]), 0
        if pos + 4 > len(data):
            raise DescriptorError("handshake is truncated")
        (nd,) = _U32.unpack_from(data, pos)
        descs, pos = read_items(data, pos + 4, nd, "handshake descriptor")
        if pos != len(data):
            raise DescriptorError(f"handshake has {len(data) - pos} trailing bytes")
        return cls._from_header(h, descs)

    @classmethod
    def _from_header(cls, h: Any, descs: list[bytes]) -> "Handshake":
        if not isinstance(h, dict):
            raise DescriptorError("handshake header is not an object")
        try:
            uid = _int(h["uid"], "uid", 1)
            addr = h["address"]
            if not isinstance(addr, str):
                raise DescriptorError("handshake address must be hex text")
            try:
                address = bytes.fromhex(addr)
            except ValueError:
                raise DescriptorError("handshake address is not hex") from None
            lay = h["layout"]
            if not isinstance(lay, dict) or set(lay) != set(_LAYOUT_FIELDS):
                raise DescriptorError("handshake layout has missing or unknown fields")
            for f in _LAYOUT_FIELDS:
                v = lay[f]
                if f in ("dtype", "order", "kv", "placement"):
                    if not isinstance(v, str) or len(v) > 64:
                        raise DescriptorError(f"handshake layout field {f} must be a short string")
                elif f in ("page_stride", "layer_stride") and v is None:
                    continue
                else:
                    _int(v, f"layout.{f}", 1, 2**62)
            if not _DTYPE_NAME.fullmatch(lay["dtype"]):
                raise DescriptorError(f"handshake layout dtype {lay['dtype']!r} is not a plain dtype name")
            try:
                layout = KVLayout(**{_LAYOUT_ATTRS.get(f, f): v for f, v in lay.items()})
            except LayoutError:
                raise
            except (TypeError, ValueError, OverflowError) as exc:   # e.g. a dtype numpy refuses
                raise DescriptorError(f"handshake layout is invalid: {exc}") from None
            if layout.itemsize not in (1, 2, 4, 8):
                raise DescriptorError(f"handshake layout dtype {lay['dtype']!r} has itemsize {layout.itemsize}")
            sh = h["sharding"]
            if not isinstance(sh, list) or len(sh) != 2 or not isinstance(sh[1], bool):
                raise DescriptorError("handshake sharding must be [tp_size, replicated]")
            sharding = Sharding(_int(sh[0], "tp_size", 1, 4096), sh[1])
            layout.resolve(sharding)    # LayoutError when the heads cannot be sharded so
            ranks = h["ranks"]
            if (not isinstance(ranks, list) or not ranks
                    or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks)
                    or sorted(set(ranks)) != ranks or ranks[0] < 0 or ranks[-1] >= sharding.tp_size):
                raise DescriptorError("handshake ranks must be distinct ascending ranks of the sharding")
            eng = h["engine"]
            if not isinstance(eng, dict) or set(eng) != {"provider", *_ENGINE_FIELDS}:
                raise DescriptorError("handshake engine parameters have missing or unknown fields")
            if not isinstance(eng["provider"], str) or not 0 < len(eng["provider"]) < 256:
                raise DescriptorError("handshake provider must be a short string")
            iov = _int(eng["iov"], "iov", 1, 1024)
            max_write = _int(eng["max_write"], "max_write", 1)
            pack_min = _int(eng["pack_min"], "pack_min", 0)
            rails = _int(eng["rails"], "rails", 1, 255)
            ctx = h["context"]
            if not isinstance(ctx, list) or len(ctx) != 2:
                raise DescriptorError("handshake context must be [slots, bytes]")
            slots = _int(ctx[0], "context slots", 0, 2**31 - 1)
            cbytes = _int(ctx[1], "context bytes", 0, 2**40)
            pt = h["peer_timeout"]
            if isinstance(pt, bool) or not isinstance(pt, (int, float)) or not (0 < pt < 1e6) or math.isnan(pt):
                raise DescriptorError("handshake peer_timeout must be a positive number of seconds")
            reads = "reads" in h
            if reads and (isinstance(h["reads"], bool) or h["reads"] != 1) or len(h) != 8 + reads:
                raise DescriptorError("handshake header has unknown fields")
        except KeyError as exc:
            raise DescriptorError(f"handshake header lacks {exc}") from None
        nreg = layout.num_regions
        sets = 2 if reads else 1              # the write descriptors, then (offering pull) the reads-only ones
        want = sets * len(ranks) * nreg + (1 if slots else 0)
        if len(descs) != want:
            raise DescriptorError(f"handshake carries {len(descs)} descriptors; {sets} x {len(ranks)} rank(s) x "
                                  f"{nreg} region(s){' + context' if slots else ''} = {want} expected")
        per = [tuple(descs[i * nreg:(i + 1) * nreg]) for i in range(sets * len(ranks))]
        regions, read_regions = tuple(per[:len(ranks)]), tuple(per[len(ranks):])
        return cls(uid, address, layout, sharding, tuple(ranks), eng["provider"], iov, max_write, pack_min, rails,
                   slots, cbytes, float(pt), regions, descs[-1] if slots else None, read_regions)


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


def safe_decode_handshake(data: Any, secret: Optional[bytes]) -> Handshake:
    """``Handshake.decode`` with any stray exception turned into ``DescriptorError``."""
    try:
        return Handshake.decode(data, secret)
    except KvxferError:
        raise
    except Exception as exc:  # pragma: no cover - defensive: fuzzing found none
        raise DescriptorError(f"malformed handshake: {exc}") from None
