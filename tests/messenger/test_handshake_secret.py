"""With ``secret=`` the handshake's region table (every region's remote keys) is encrypted
(kvxfer/messenger/_codec.py, version 2: AES-256-GCM under HKDF-SHA256 of the secret), so a
process that holds a decoder's handshake but not the secret cannot write into its pool
(issue 26 #3). Before, the table travelled in clear under an HMAC tag: stripping the tag
gave every descriptor, and a process holding only the blob wrote 4,096 bytes into the pool.

What holds where (docs/architecture.md, "Security"): on tcp the keys are the whole barrier
(random 64-bit, offsets from 0); on shm they stop writes through the provider too, but a
process of the same user can reach another's memory without libfabric (CMA, /proc), which no
key or cipher changes."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

import kvxfer
from kvxfer import wire
from kvxfer.errors import DescriptorError, KvxferError
from kvxfer.messenger import _codec as C
from _pair import LAYOUT, SECRET, SH, regions
from _procs import run_in_child
from _providers import available

pytest.importorskip("cryptography")


def _descriptors(hs: C.Handshake) -> list[bytes]:
    return [d for per_rank in hs.regions for d in per_rank] + ([hs.context] if hs.context else [])


def _decoder(provider):
    eng = kvxfer.Engine(provider, "127.0.0.1")
    pool = regions(0xEE)
    m = kvxfer.Messenger(eng, LAYOUT, SH, {0: pool}, context_slots=2, context_bytes=16, peer_timeout=5,
                         secret=SECRET)
    return eng, m, pool


# -- the codec -------------------------------------------------------------------------------

def test_no_descriptor_or_key_travels_in_clear(provider):
    eng, m, pool = _decoder(provider)
    try:
        blob = m.handshake()
        hs = C.Handshake.decode(blob, SECRET)
        descs = _descriptors(hs)
        assert descs
        for d in descs:
            assert d not in blob
            for k in wire.Descriptor.decode(d).keys:
                assert bytes(k) not in blob               # no region key, in any form we send
        assert blob[4] == C.HANDSHAKE_SEALED_VERSION
        assert hs.encode(SECRET) != hs.encode(SECRET)     # a fresh nonce per blob
        with pytest.raises(DescriptorError, match="secret"):
            C.Handshake.decode(blob)                      # no secret: no table
        with pytest.raises(DescriptorError):
            C.Handshake.decode(blob[:-C.TAG_BYTES])       # nor with the tag stripped
    finally:
        m.close()
        eng.close()


def _v1_tagged(hs: C.Handshake) -> bytes:
    """What the old encoder sent with a secret: the table in clear, under the HMAC tag."""
    return C._seal(hs.encode(None), SECRET)


def test_a_clear_table_is_refused_with_a_secret(provider):
    eng, m, pool = _decoder(provider)
    try:
        hs = C.Handshake.decode(m.handshake(), SECRET)
        with pytest.raises(DescriptorError, match="clear"):
            C.Handshake.decode(_v1_tagged(hs), SECRET)
    finally:
        m.close()
        eng.close()


def test_a_tampered_or_transplanted_table_is_refused():
    """The HMAC tag re-made over edited bytes (as by a holder of the secret's HMAC alone):
    the GCM tag and its associated data (the header) still refuse a flipped ciphertext byte
    and a table moved under another header."""
    from test_codec import _handshake

    a = _handshake(LAYOUT, SH, (0,), 2, 16)
    b = dataclasses.replace(a, uid=a.uid + 1)
    blob_a, blob_b = a.encode(SECRET)[:-C.TAG_BYTES], b.encode(SECRET)[:-C.TAG_BYTES]
    flipped = bytearray(blob_a)
    flipped[-1] ^= 1
    hl_a = struct.unpack_from("<I", blob_a, 5)[0]
    hl_b = struct.unpack_from("<I", blob_b, 5)[0]
    moved = blob_b[:9 + hl_b] + blob_a[9 + hl_a:]
    for bad in (bytes(flipped), moved):
        with pytest.raises(DescriptorError, match="region table"):
            C.Handshake.decode(C._seal(bad, SECRET), SECRET)


# -- a process holding only the blob ---------------------------------------------------------

def _attack(provider: str, blob: bytes, bases: list[int], real: list[bytes] | None, imm: int | None = None) -> dict:
    """A rogue process with the decoder's handshake (and, on shm, the pool's addresses, which a
    same-user process reads in /proc/<pid>/maps) but not the secret: decode what it can,
    else guess keys; write 4 KiB of 0x41 wherever it got. ``real``: the true descriptors
    (the control: with them the same writes land)."""
    import kvxfer
    from kvxfer import wire
    from kvxfer.errors import KvxferError
    from kvxfer.messenger import _codec as C

    out = {"decoded": False, "writes": 0, "refused": 0}
    descs = None
    for attempt in (blob, blob[:-C.TAG_BYTES]):       # as sent; the HMAC tag stripped
        try:
            hs = C.Handshake.decode(attempt)
            descs = [d for per_rank in hs.regions for d in per_rank]
            out["decoded"] = True
            break
        except KvxferError:
            pass
    hl = struct.unpack_from("<I", blob, 5)[0]
    address = bytes.fromhex(json.loads(blob[9:9 + hl])["address"])   # the header is in clear
    with kvxfer.Engine(provider, "127.0.0.1") as eng:
        virt = bool(eng._rails[0].mr_mode & kvxfer._fabric.MR_VIRT_ADDR)
        if real is not None:
            descs = real
        elif descs is None:
            guesses = [0, 1, 2, 3, 2**32 - 1, 2**63, 2**64 - 1, 0x1234567890ABCDEF]
            descs = [wire.Descriptor(provider, base if virt else 0, 4096, (k.to_bytes(8, "little"),), virt, False,
                                     False, wire.owner_digest(address)).encode()
                     for base in bases for k in guesses]
        peer = eng.connect(address)
        src = eng.register(np.full(4096, 0x41, np.uint8))
        for d in descs:
            dst = eng.remote(d)
            try:
                eng.write(src, 0, peer, dst, 0, 4096, imm=imm).wait(3)
                out["writes"] += 1
            except KvxferError:
                out["refused"] += 1
    return out


@pytest.mark.parametrize("imm", [None, 77])
def test_a_process_with_only_the_handshake_cannot_write_into_the_pool(provider, imm):
    if provider == "shm" and imm is None:
        pytest.skip("shm 1.17 checks no key on a write without imm: test_on_shm_a_write_without_imm_checks_no_key")
    eng, m, pool = _decoder(provider)
    try:
        blob = m.handshake()
        bases = [r.ctypes.data for r in pool]
        got = run_in_child(_attack, provider, blob, bases, None, imm, timeout=90)
        assert not got["decoded"]
        assert all((r == 0xEE).all() for r in pool), got          # not one byte landed
        if imm is not None:
            assert eng.banked(imm) == 0                           # and no arrival counted
        # the control: the same process given the real descriptors writes into the pool
        real = [d for per_rank in C.Handshake.decode(blob, SECRET).regions for d in per_rank]
        ok = run_in_child(_attack, provider, blob, bases, real[:1], imm, timeout=90)
        assert ok["writes"] == 1 and (pool[0][:4096] == 0x41).all()
    finally:
        m.close()
        eng.close()


def test_on_shm_a_write_without_imm_checks_no_key():
    """What does not hold on shm (libfabric 1.17), pinned so the docs stay true: a write
    without imm is the sender's own process_vm_writev into the target's addresses (shm's fast
    RMA path), and no key is checked; a same-user process that reads the target's maps
    writes into its pool with any key. Encryption keeps the keys secret; on shm the barrier
    is the OS user (docs/architecture.md, "Security")."""
    if not available("shm"):
        pytest.skip("provider shm is not available here")
    eng, m, pool = _decoder("shm")
    try:
        got = run_in_child(_attack, "shm", m.handshake(), [pool[0].ctypes.data], None, None, timeout=90)
        assert not got["decoded"]
        assert (pool[0][:4096] == 0x41).all()
    finally:
        m.close()
        eng.close()


def test_region_keys_are_random_and_64_bit(provider):
    """Where the provider lets kvxfer choose keys (FI_MR_PROV_KEY off: tcp;ofi_rxm and shm on
    libfabric 1.17), each is drawn from getrandom: distinct, full width, in no order."""
    with kvxfer.Engine(provider, "127.0.0.1") as eng:
        if eng._rails[0].mr_mode & getattr(kvxfer._fabric, "MR_PROV_KEY", 0):
            pytest.skip("the provider chooses its keys")
        bufs = [np.zeros(4096, np.uint8) for _ in range(64)]
        keys = []
        for b in bufs:
            mr = eng.register(b)
            keys.append(int(mr._handles[0].key))
            mr.close()
    assert len(set(keys)) == 64
    assert max(keys) >= 2**60 and sum(k >= 2**63 for k in keys) >= 8    # the top bits are used
    assert len(set(np.diff(np.array(keys, dtype=object)))) > 60          # not a sequence
