"""Versioned byte codecs for what peers exchange out of band, and the message-count rule.

A leaf module (numpy and kvxfer.errors only), so a decoder or planner process can compute
what a sender will post without libfabric.

Address, version 1::

    b"KXA" | u8 version | u8 len + provider name | u8 rails | per rail: u16 len + fi_getname bytes

Memory descriptor, versions 1 to 4 (little-endian)::

    b"KXM" | u8 version | u8 flags | u8 len + provider name | u64 base | u64 nbytes
           | 8-byte owner | u8 keys | per key: u8 len + key bytes
           [versions 2-4, flag HOST_SHARE: u32 pid | u32 fd | u64 dev | u64 inode | u64 offset]
           [versions 3-4, flag PERMIT: u32 fd | u32 slot | u32 generation | u64 dev | u64 inode]
           [version 4, flag READABLE: u8 read keys | per key: u8 len + key bytes]

flags: bit 0 VIRT_ADDR (remote addresses are base + offset, else offsets), bit 1 RAW keys
(provider raw keys, mapped with fi_mr_map_raw; otherwise each key is a u64), bit 2 device
memory, bit 3 HOST_SHARE (version 2 and later), bit 4 PERMIT (version 3, where it is
required, and 4; only with HOST_SHARE), bit 5 READABLE (version 4 only, where it is
required). One key per rail, so a region registered on several NICs travels as one
descriptor. ``owner`` is ``owner_digest(address)`` of the engine
that registered the region: an engine refuses to use a descriptor with a peer other than its
owner.

Version 2 adds one optional field, the **host share** (``HostShare``): the region's memory
is bytes ``[offset, offset + nbytes)`` of a memfd that process ``pid`` holds open as ``fd``,
the file (``dev``, ``inode``). A shm peer on the same host maps that range itself and writes
with memcpy (the direct write, docs/architecture.md). A descriptor without a host share is
still encoded as version 1, byte for byte as before, so older peers keep reading it; they
refuse a version 2 descriptor by its version.

Version 3 adds the host share's **permit** (``Permit``): the word ``slot`` of the target's
permit table, a memfd that the same process ``pid`` holds open as ``fd``, the file (``dev``,
``inode``), and the region's ``generation``. A sender copies into the region only while that
word carries the generation and is not revoked, which the target sets when it closes the
region (src/direct.c). A sender given a share without a permit (version 2) does not write
directly: it writes over RMA, which the target's deregistration stops. Whether the
descriptor carries a host share, not a permit, decides the count. The version is the least
that holds the fields: 1 without a share, 2 with one without a permit, 3 with a permit.

Version 4 adds the **read keys** (``Descriptor.read_keys``, one per rail, of the same kind as
the keys): the region was registered readable (``Engine.register(..., readable=True)``), and
these are the keys of its separate read registration (``FI_REMOTE_READ`` only); the keys
before them are the write registration's. A version 4 descriptor may carry no write keys at
all (``MemoryRegion.descriptor(reads_only=True)``: a reader that may not write). Only a
readable descriptor is written as version 4 (a share and its permit are optional there, as
their flags say); every other descriptor keeps its version 1-3 bytes. An engine reads from a
remote region only with its read keys: a descriptor without them is refused by
``Engine.read_pages`` before anything is posted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvxfer.errors import DescriptorError, InvalidArgumentError

__all__ = ["Address", "Descriptor", "HostShare", "Permit", "count_writes", "stripe_bounds", "split_write", "owner_digest", "ADDRESS_VERSION", "DESCRIPTOR_VERSION"]

ADDRESS_MAGIC = b"KXA"
DESCRIPTOR_MAGIC = b"KXM"
ADDRESS_VERSION = 1
DESCRIPTOR_VERSION = 4          # the newest this kvxfer writes; it reads 1 to 4
DESCRIPTOR_VERSIONS = (1, 2, 3, 4)

FLAG_VIRT_ADDR = 1
FLAG_RAW_KEY = 2
FLAG_DEVICE = 4
FLAG_HOST_SHARE = 8
FLAG_PERMIT = 16
FLAG_READABLE = 32              # version 4: read keys follow


class _Reader:
    """Bounds-checked cursor: every short read becomes a DescriptorError."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = bytes(data)
        self.pos = 0
        self.what = what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise DescriptorError(f"{self.what} is truncated at byte {self.pos} (needs {n} more)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def end(self) -> None:
        if self.pos != len(self.data):
            raise DescriptorError(f"{self.what} has {len(self.data) - self.pos} trailing bytes")


def _header(r: _Reader, magic: bytes, versions: tuple[int, ...]) -> int:
    got = r.take(len(magic))
    if got != magic:
        raise DescriptorError(f"not a kvxfer {r.what} (magic {got!r}, expected {magic!r})")
    v = r.u8()
    if v not in versions:
        spoken = " and ".join(map(str, versions))
        raise DescriptorError(f"{r.what} version {v} is not supported (this kvxfer speaks {spoken})")
    return v


def _name(s: str) -> bytes:
    b = s.encode()
    if not 0 < len(b) < 256:
        raise InvalidArgumentError(f"provider name {s!r} must be 1..255 bytes")
    return bytes([len(b)]) + b


@dataclass(frozen=True)
class Address:
    """An engine's endpoint names, one per rail (NIC), and its provider."""

    provider: str
    names: tuple[bytes, ...]

    def encode(self) -> bytes:
        if not 0 < len(self.names) < 256:
            raise InvalidArgumentError("an address needs 1..255 rails")
        out = [ADDRESS_MAGIC, bytes([ADDRESS_VERSION]), _name(self.provider), bytes([len(self.names)])]
        for n in self.names:
            if not 0 < len(n) < 65536:
                raise InvalidArgumentError("an endpoint name must be 1..65535 bytes")
            out += [struct.pack("<H", len(n)), n]
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes) -> "Address":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DescriptorError(f"an address is bytes, not {type(data).__name__}")
        r = _Reader(data, "address")
        _header(r, ADDRESS_MAGIC, (ADDRESS_VERSION,))
        prov = r.take(r.u8()).decode("utf-8", "replace")
        n = r.u8()
        if n == 0:
            raise DescriptorError("address has no rails")
        names = tuple(r.take(r.u16()) for _ in range(n))
        if any(len(x) == 0 for x in names):
            raise DescriptorError("address has an empty endpoint name")
        r.end()
        return cls(prov, names)


@dataclass(frozen=True)
class Permit:
    """The permit of a host share (version 3): word ``slot`` of the memfd that the share's
    process holds open as ``fd``, the file (``dev``, ``inode``), and the ``generation`` the
    word carries while the region is registered (src/direct.c)."""

    fd: int
    dev: int
    inode: int
    slot: int
    generation: int

    _FORMAT = struct.Struct("<IIIQQ")

    def encode(self) -> bytes:
        if not (0 <= self.fd < 2**31 and 0 <= self.slot < 2**28 and 0 <= self.generation < 2**32
                and 0 <= self.dev < 2**64 and 0 <= self.inode < 2**64):
            raise InvalidArgumentError(f"permit out of range: {self}")
        return self._FORMAT.pack(self.fd, self.slot, self.generation, self.dev, self.inode)

    @classmethod
    def read(cls, r: _Reader) -> "Permit":
        fd, slot, generation, dev, inode = (r.u32(), r.u32(), r.u32(), r.u64(), r.u64())
        if fd >= 2**31 or slot >= 2**28:
            raise DescriptorError("descriptor's permit names no fd or slot")
        return cls(fd, dev, inode, slot, generation)


@dataclass(frozen=True)
class HostShare:
    """Where a peer on the same host can map a region's memory itself: bytes ``[offset,
    offset + nbytes)`` of the memfd that process ``pid`` holds open as ``fd``, which is the
    file (``dev``, ``inode``) (a mapping's ``st_dev``/``st_ino``). The peer opens
    ``/proc/<pid>/fd/<fd>`` and maps the range only if the file it gets is that one, so a
    reused fd number or pid never points it elsewhere. ``permit`` (version 3): where the
    target revokes the share when it closes the region; a sender maps no share without one."""

    pid: int
    fd: int
    dev: int
    inode: int
    offset: int
    permit: Optional[Permit] = None

    _FORMAT = struct.Struct("<IIQQQ")

    def encode(self) -> bytes:
        if not (0 < self.pid < 2**31 and 0 <= self.fd < 2**31 and 0 <= self.dev < 2**64
                and 0 <= self.inode < 2**64 and 0 <= self.offset < 2**63):
            raise InvalidArgumentError(f"host share out of range: {self}")
        return self._FORMAT.pack(self.pid, self.fd, self.dev, self.inode, self.offset)

    @classmethod
    def read(cls, r: _Reader, nbytes: int) -> "HostShare":
        pid, fd, dev, inode, offset = (r.u32(), r.u32(), r.u64(), r.u64(), r.u64())
        if not 0 < pid < 2**31 or fd >= 2**31:
            raise DescriptorError("descriptor's host share names no process or fd")
        if offset + nbytes > 2**63:
            raise DescriptorError("descriptor's host share lies beyond any file")
        return cls(pid, fd, dev, inode, offset)


@dataclass(frozen=True)
class Descriptor:
    """What a peer needs to write into (``keys``) or read from (``read_keys``, version 4) a
    registered region: base, size and keys per rail."""

    provider: str
    base: int
    nbytes: int
    keys: tuple[bytes, ...]
    virt_addr: bool = False
    raw: bool = False
    device: bool = False
    owner: bytes = bytes(8)
    host_share: Optional[HostShare] = None      # version 2: a shm peer may map the memory itself
    read_keys: tuple[bytes, ...] = ()           # version 4: the region may be read, with these

    @property
    def readable(self) -> bool:
        """The region was offered for reading (version 4, its read keys)."""
        return bool(self.read_keys)

    @property
    def writable(self) -> bool:
        """The descriptor carries write keys (every version but a reads-only version 4)."""
        return bool(self.keys)

    def _owner(self) -> bytes:
        if len(self.owner) != 8:
            raise InvalidArgumentError("a descriptor's owner digest is 8 bytes")
        return bytes(self.owner)

    def encode(self) -> bytes:
        share = self.host_share
        permit = share.permit if share is not None else None
        flags = (FLAG_VIRT_ADDR if self.virt_addr else 0) | (FLAG_RAW_KEY if self.raw else 0) | (
            FLAG_DEVICE if self.device else 0
        ) | (FLAG_HOST_SHARE if share is not None else 0) | (FLAG_PERMIT if permit is not None else 0) | (
            FLAG_READABLE if self.read_keys else 0)
        if not (0 if self.read_keys else 1) <= len(self.keys) < 256 or len(self.read_keys) >= 256:
            raise InvalidArgumentError("a descriptor needs 1..255 keys (0..255 write keys with read keys)")
        version = 4 if self.read_keys else 3 if permit is not None else 2 if share is not None else 1
        out = [
            DESCRIPTOR_MAGIC,
            bytes([version, flags]),  # the least that holds it
            _name(self.provider),
            struct.pack("<QQ", self.base, self.nbytes),
            self._owner(),
        ]
        for k in self.keys + self.read_keys:
            if not 0 < len(k) < 256:
                raise InvalidArgumentError("a key must be 1..255 bytes")
        out += _keys(self.keys)
        if share is not None:
            if share.offset + self.nbytes > 2**63:
                raise InvalidArgumentError("host share lies beyond any file")
            out.append(share.encode())
        if permit is not None:
            out.append(permit.encode())
        if self.read_keys:
            out += _keys(self.read_keys)
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes) -> "Descriptor":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DescriptorError(f"a descriptor is bytes, not {type(data).__name__}")
        r = _Reader(data, "descriptor")
        version = _header(r, DESCRIPTOR_MAGIC, DESCRIPTOR_VERSIONS)
        flags = r.u8()
        known = FLAG_VIRT_ADDR | FLAG_RAW_KEY | FLAG_DEVICE | (FLAG_HOST_SHARE if version >= 2 else 0) | (
            FLAG_PERMIT if version >= 3 else 0) | (FLAG_READABLE if version >= 4 else 0)
        if flags & ~known:
            raise DescriptorError(f"descriptor has unknown flags {flags:#x} for version {version}")
        # version 3 exists for the permit, version 4 for the read keys; a permit belongs to a host share
        if ((version == 3) != bool(flags & FLAG_PERMIT and not flags & FLAG_READABLE)
                or (version == 4) != bool(flags & FLAG_READABLE)
                or (flags & FLAG_PERMIT and not flags & FLAG_HOST_SHARE)):
            raise DescriptorError(f"descriptor has flags {flags:#x} that version {version} does not allow")
        prov = r.take(r.u8()).decode("utf-8", "replace")
        base, nbytes = r.u64(), r.u64()
        owner = r.take(8)
        raw = bool(flags & FLAG_RAW_KEY)
        keys = _read_keys(r, raw, empty=bool(flags & FLAG_READABLE))    # a reads-only one has none
        if base + nbytes > 2**64:
            raise DescriptorError("descriptor range wraps around the address space")
        share = HostShare.read(r, nbytes) if flags & FLAG_HOST_SHARE else None
        if flags & FLAG_PERMIT:
            share = dataclasses.replace(share, permit=Permit.read(r))
        read_keys = _read_keys(r, raw, empty=False) if flags & FLAG_READABLE else ()
        r.end()
        return cls(prov, base, nbytes, keys, bool(flags & FLAG_VIRT_ADDR), raw, bool(flags & FLAG_DEVICE), owner,
                   share, read_keys)


def _keys(keys: tuple[bytes, ...]) -> list[bytes]:
    """A key list as it travels: u8 count, then per key u8 length + bytes."""
    out = [bytes([len(keys)])]
    for k in keys:
        out += [bytes([len(k)]), k]
    return out


def _read_keys(r: _Reader, raw: bool, empty: bool) -> tuple[bytes, ...]:
    """``_keys``'s reverse; a key of the wrong length (8 bytes unless raw) is refused, and so
    is an empty list unless ``empty`` allows it (a reads-only descriptor's write keys)."""
    n = r.u8()
    if n == 0 and not empty:
        raise DescriptorError("descriptor has no keys")
    keys = tuple(r.take(r.u8()) for _ in range(n))
    if any(len(k) == 0 or (not raw and len(k) != 8) for k in keys):
        raise DescriptorError("descriptor key has the wrong length")
    return keys


def owner_digest(address: bytes) -> bytes:
    """8 bytes naming the engine whose address this is (BLAKE2b of the encoded address)."""
    return hashlib.blake2b(bytes(address), digest_size=8).digest()


def stripe_bounds(n: int, rails: int) -> list[int]:
    """Where a list of ``n`` triples is cut for ``rails`` rails: rail k posts
    ``[bounds[k], bounds[k+1])``, contiguous chunks in order, sizes differing by at most one."""
    rails = max(1, int(rails))
    return [n * k // rails for k in range(rails + 1)]


def split_write(src_offset: int, dst_offset: int, nbytes: int, rails: int):
    """``Engine.write`` as triples: one equal byte range per rail (one range with one rail)."""
    rails = max(1, int(rails)) if nbytes >= rails else 1
    cut = np.array([nbytes * k // rails for k in range(rails + 1)], dtype=np.uint64)
    ln = np.diff(cut)
    return cut[:-1] + np.uint64(src_offset), cut[:-1] + np.uint64(dst_offset), ln


def _u64_array(a, name: str) -> np.ndarray:
    """Offsets or lengths as a flat uint64 array; anything but non-negative integers is
    refused (a cast would truncate floats and wrap negatives into a wrong count)."""
    arr = np.asarray(a)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise InvalidArgumentError(f"{name} has a negative entry ({int(arr.min())})")
    return np.ascontiguousarray(arr, dtype=np.uint64).ravel()


def count_writes(src_offsets, dst_offsets, lengths, iov: int, max_write: int, pack_min: int = 0,
                 rails: int = 1) -> int:
    """How many RMA messages (= immediates at the target) a write of these triples posts.

    The rule, shared with the native poster (include/kvxfer/post.h):
      1. adjacent triples contiguous on both sides merge into one segment;
      2. segments are packed in order into messages of at most ``iov`` pieces and at most
         ``max_write`` bytes; a segment that does not fit is split at the message boundary;
      3. a piece shorter than ``pack_min`` bytes travels alone in its message.
    ``iov``, ``max_write`` and ``pack_min`` are the sender engine's (``Engine.iov``, ...),
    except that rule 3 never applies to a region whose descriptor carries a host share
    (``Descriptor.host_share``, ``MemoryRegion.host_share``): count writes into one with
    ``pack_min=0``, whether the sender writes directly or over RMA. With an engine at hand,
    ``Engine.count_writes(..., region=)`` chooses for you. With
    several rails the triples are first cut by ``stripe_bounds`` and each chunk is counted
    on its own (rails never merge writes with each other).
    For ``write_pages`` the triples are ``(src_offset + src_pages*src_stride,
    dst_offset + dst_pages*dst_stride, page_bytes)``. For ``Engine.write_groups`` /
    ``write_pairs`` count each group on its own and add (groups never merge, even when
    contiguous); with ``rail=`` pinned, count with ``rails=1``.
    """
    so, do, ln = (_u64_array(a, name) for a, name in ((src_offsets, "src_offsets"), (dst_offsets, "dst_offsets"),
                                                      (lengths, "lengths")))
    if not (len(so) == len(do) == len(ln)):
        raise InvalidArgumentError("offset and length arrays differ in length")
    if rails > 1:
        b = stripe_bounds(len(ln), rails)
        return sum(count_writes(so[b[k]:b[k + 1]], do[b[k]:b[k + 1]], ln[b[k]:b[k + 1]], iov, max_write, pack_min)
                   for k in range(rails))
    iov = max(1, int(iov))
    max_write = int(max_write)
    if max_write <= 0:
        raise InvalidArgumentError("max_write must be positive")
    if len(ln) == 0:
        return 0
    # rule 1: a new segment starts where either side is not contiguous with the previous
    brk = np.ones(len(ln), dtype=bool)
    brk[1:] = (so[1:] != so[:-1] + ln[:-1]) | (do[1:] != do[:-1] + ln[:-1])
    starts = np.flatnonzero(brk)
    seg = np.add.reduceat(ln, starts)
    seg = seg[seg > 0]
    if len(seg) == 0:
        return 0
    pack_min = max(0, int(pack_min))
    # fast paths: nothing is split, and rule 3 either never or always applies
    if int(seg.max()) < pack_min and int(seg.max()) <= max_write:
        return len(seg)
    if int(seg.min()) >= pack_min:
        windows = np.add.reduceat(seg, np.arange(0, len(seg), iov))
        if int(windows.max()) < max_write:
            return -(-len(seg) // iov)
    msgs, pieces, nbytes = 0, 0, 0
    for length in seg.tolist():
        while length > 0:
            if pieces == iov or nbytes == max_write:
                msgs += 1
                pieces, nbytes = 0, 0
            if length < pack_min:          # rule 3: alone in its message
                if pieces:
                    msgs += 1
                msgs += 1
                pieces, nbytes = 0, 0
                length = 0
                break
            take = min(max_write - nbytes, length)
            pieces += 1
            nbytes += take
            length -= take
    return msgs + (1 if pieces else 0)


# >>> issue 22: deprecated names: Fence -> Permit, FLAG_FENCE -> FLAG_PERMIT, HostShare.fence -> .permit.
_DEPRECATED = {"Fence": ("Permit", Permit), "FLAG_FENCE": ("FLAG_PERMIT", FLAG_PERMIT)}


def __getattr__(name: str) -> object:
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(f"kvxfer.wire.{name} is deprecated, use {new}", DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _share_fence(self: HostShare) -> Optional[Permit]:
    warnings.warn("HostShare.fence is deprecated, use HostShare.permit", DeprecationWarning, stacklevel=2)
    return self.permit


_share_init = HostShare.__init__


_UNSET: object = object()


def _share_init_compat(self: HostShare, *args: object, fence: object = _UNSET, **kw: object) -> None:
    if fence is not _UNSET:
        warnings.warn("HostShare(fence=) is deprecated, use permit=", DeprecationWarning, stacklevel=2)
        kw["permit"] = fence
    _share_init(self, *args, **kw)


HostShare.fence = property(_share_fence)  # type: ignore[attr-defined]
HostShare.__init__ = _share_init_compat  # type: ignore[method-assign]
# <<< issue 22
