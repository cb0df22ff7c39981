"""The public names issue 22 renamed still work, each with a DeprecationWarning, and the
renames changed no byte on the wire (docs/glossary-native.md, "Words with more than one
meaning"). This file names the old names on purpose: the rename codemod leaves it alone."""

import dataclasses
import json
import warnings

import pytest

import kvxfer
from kvxfer import layout as layout_mod
from kvxfer import messenger, wire
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import paged
from kvxfer.messenger._codec import layout_dict

# encoded by the code before the renames (main at 2026-12-02 00:20), byte for byte
_V3_DESCRIPTOR = bytes.fromhex(
    "4b584d03190373686d00100000000000000000010000000000414243444546474801080101010101010101d204"
    "00000700000001000000000000006300000000000000001000000000000009000000050000000700000001000000"
    "000000006400000000000000")
_MLA_LAYOUT_JSON = ('{"dtype": "float16", "head_dim": 576, "kv": "mla", "kv_heads": 1, "layer_stride": null, '
                    '"num_layers": 3, "num_pages": 50, "order": "HND", "page_size": 16, "page_stride": null, '
                    '"placement": "layer_major"}')


def _descriptor(share):
    return wire.Descriptor("shm", 4096, 65536, (b"\x01" * 8,), True, False, False, b"ABCDEFGH", share)


def test_the_permit_encodes_the_bytes_the_fence_did():
    permit = wire.Permit(9, 1, 100, 5, 7)
    blob = _descriptor(wire.HostShare(1234, 7, 1, 99, 4096, permit)).encode()
    assert blob == _V3_DESCRIPTOR
    assert wire.Descriptor.decode(blob).host_share.permit == permit
    assert wire.FLAG_PERMIT == 16


def test_wire_fence_names_warn_and_mean_the_permit():
    with pytest.warns(DeprecationWarning, match="Permit"):
        assert wire.Fence is wire.Permit
    with pytest.warns(DeprecationWarning, match="FLAG_PERMIT"):
        assert wire.FLAG_FENCE == wire.FLAG_PERMIT == 16
    p = wire.Permit(9, 1, 100, 5, 7)
    with pytest.warns(DeprecationWarning, match="permit="):
        share = wire.HostShare(1234, 7, 1, 99, 4096, fence=p)
    assert share.permit == p and _descriptor(share).encode() == _V3_DESCRIPTOR
    with pytest.warns(DeprecationWarning, match="HostShare.permit"):
        assert share.fence == p
    with pytest.warns(DeprecationWarning):
        assert dataclasses.replace(share, fence=None).permit is None
    with pytest.raises(AttributeError):
        wire.NoSuchName  # noqa: B018


def test_layout_placement_warns_and_is_layer_regions():
    with pytest.warns(DeprecationWarning, match="layer_regions="):
        old = KVLayout(4, 8, 128, 16, 100, placement="layer_major")
    new = KVLayout(4, 8, 128, 16, 100, layer_regions="layer_major")
    assert old == new and new.layer_regions == "layer_major"
    with pytest.warns(DeprecationWarning, match="layer_regions"):
        assert new.placement == "layer_major"
    with pytest.warns(DeprecationWarning):
        assert KVLayout.mla(3, 576, 16, 50, "float16", placement="layer_major").layer_regions == "layer_major"
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError):
        KVLayout(4, 8, 128, 16, 100, placement="layer_major", layer_regions="per_layer")
    with pytest.warns(DeprecationWarning, match="LAYER_REGIONS"):
        assert layout_mod.PLACEMENTS == layout_mod.LAYER_REGIONS == ("per_layer", "layer_major")
    # the positional order did not move
    assert KVLayout(4, 8, 128, 16, 100, "bfloat16", "HND", "fused", "layer_major") == new


def test_the_handshake_keeps_its_placement_key_and_warns_nothing():
    lay = KVLayout.mla(3, 576, 16, 50, "float16", layer_regions="layer_major")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = layout_dict(lay)
        assert json.dumps(d, sort_keys=True) == _MLA_LAYOUT_JSON
        from kvxfer.messenger import _codec
        assert KVLayout(**{_codec._LAYOUT_ATTRS.get(f, f): v for f, v in d.items()}) == lay


def test_plan_num_writes_warns_and_is_num_triples():
    la = KVLayout(2, 4, 8, 4, 16, "float16")
    p = kvxfer.plan(la, Sharding(1), la, Sharding(1), [0, 1, 2], [3, 4, 5])
    assert p.num_triples > 0
    with pytest.warns(DeprecationWarning, match="num_triples"):
        assert p.num_writes == p.num_triples


def test_messenger_region_tables_keep_their_old_names():
    with pytest.warns(DeprecationWarning, match="RegionTable"):
        assert messenger.LayoutRegions is messenger.RegionTable is paged.RegionTable
    with pytest.warns(DeprecationWarning, match="RemoteRegionTable"):
        assert messenger.RemoteLayout is messenger.RemoteRegionTable
    with pytest.warns(DeprecationWarning):
        assert paged.RemoteLayout is paged.RemoteRegionTable
    with pytest.raises(AttributeError):
        messenger.NoSuchName  # noqa: B018
