"""The messenger's handshake blob: everything a peer needs to talk to a messenger, versioned,
with its region table encrypted under a shared secret.

A leaf like ``_codec`` (whose primitives it uses: tags, items; ``_codec`` re-exports its
names). Every decoder takes arbitrary bytes and returns or raises ``DescriptorError``.

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

Handshake of a messenger offering pull (``Messenger(offer_pull=True)``): the header has a
ninth field ``"reads": 1`` and the table, after every rank's region descriptors, holds every
rank's **reads-only** descriptors (read keys, no write key) in the same order, then the
context descriptor.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from kvxfer.errors import DescriptorError, InvalidArgumentError, KvxferError, LayoutError, UnsupportedError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger._codec import _U32, _U64, _check_secret, _open, _seal, pack_item, read_items

__all__ = ["Handshake", "safe_decode_handshake", "layout_dict", "HANDSHAKE_VERSION", "HANDSHAKE_SEALED_VERSION"]

HANDSHAKE_MAGIC = b"KXHS"
HANDSHAKE_VERSION = 1           #: without a secret: the descriptor table in clear
HANDSHAKE_SEALED_VERSION = 2    #: with a secret: the descriptor table encrypted
_NONCE_BYTES = 12
_GCM_TAG_BYTES = 16
_TABLE_KEY_INFO = b"kvxfer handshake region table, AES-256-GCM, v2"

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



def safe_decode_handshake(data: Any, secret: Optional[bytes]) -> Handshake:
    """``Handshake.decode`` with any stray exception turned into ``DescriptorError``."""
    try:
        return Handshake.decode(data, secret)
    except KvxferError:
        raise
    except Exception as exc:  # pragma: no cover - defensive: fuzzing found none
        raise DescriptorError(f"malformed handshake: {exc}") from None
