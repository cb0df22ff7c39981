"""The messenger's fast paths: a source rank's writes on the rail nearest to it (placements),
a request answered on the messenger thread (inline_requests), one engine call per rank pair.

In one process; the prefill engine has two rails (two tcp;ofi_rxm endpoints on "lo", as in
tests/fabric/test_rails.py), the decoder one. Byte-exact against views of the FlashAttention tensor shape.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding, errors

TCP = "tcp;ofi_rxm"
LAYOUT = KVLayout.flash_attn(3, 2, 8, 4, 32, "float16")   # one region per layer: 3 region pairs
SH = Sharding(1)


class _Placement:
    """What Topology.assign gives the messenger: NIC domains, nearest first."""

    def __init__(self, domains):
        self.domains = tuple(domains)


def _engine(rails):
    try:
        return kvxfer.Engine(TCP, "127.0.0.1", nics=["lo"] * rails)
    except errors.KvxferError as exc:  # pragma: no cover - only where tcp is missing
        pytest.skip(f"{TCP} on lo unavailable: {exc}")


def _pages(region):
    """The per-layer tensor [2, pages, page_size, heads, dim] as (K/V, page, bytes)."""
    return region.reshape(2, LAYOUT.num_pages, -1)


@pytest.mark.parametrize("placement", [None, 1, "nearest"])
def test_rank_posts_on_its_rail_and_inline_answers_land(placement):
    ea, eb = _engine(2), _engine(1)
    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, s, dtype=np.uint8) for s in LAYOUT.region_sizes(SH)]
    dst = [np.zeros(s, np.uint8) for s in LAYOUT.region_sizes(SH)]
    where = {None: None, 1: {0: 1}, "nearest": {0: _Placement(["mlx5_7", ea.info["rails"][1]])}}[placement]
    answered = []
    p = d = None
    try:
        def answer(req):                 # runs on the prefiller's messenger thread
            answered.append(req.request_id)
            p.send(req, list(range(len(req.dst_pages)))).finish(b"ctx-" + str(req.request_id).encode())

        p = kvxfer.Messenger(ea, LAYOUT, SH, {0: src}, peer_timeout=10, on_request=answer, inline_requests=True,
                             placements=where)
        d = kvxfer.Messenger(eb, LAYOUT, SH, {0: dst}, context_slots=8, context_bytes=32, peer_timeout=10)
        pg = d.connect(p.handshake())
        before = [r.stats()["writes_posted"] for r in ea._rails]
        wants = [[5], [9, 10, 11, 3], list(range(20, 31))]
        rs = [d.receive(pg, f"r{i}", w, len(w) * LAYOUT.page_size) for i, w in enumerate(wants)]
        for i, (r, w) in enumerate(zip(rs, wants)):
            assert r.wait(20) == "done"
            assert bytes(r.context) == f"ctx-r{i}".encode()
            for lay in range(LAYOUT.num_layers):
                got = _pages(dst[lay])[:, w]
                assert np.array_equal(got, _pages(src[lay])[:, : len(w)]), (i, lay)
            r.release()
        assert answered == ["r0", "r1", "r2"]
        used = [r.stats()["writes_posted"] - b for r, b in zip(ea._rails, before)]
        if placement is None:
            assert used[0] > 0 and used[1] > 0          # striped over both rails
        else:
            # rail 1 by index; by placement, the first rail on the nearest NIC's domain (both
            # stand-in rails are on "lo", so rail 0)
            k = 1 if placement == 1 else 0
            assert used[k] > 0 and used[1 - k] == 0     # every write on the rank's rail
    finally:
        for m in (d, p):
            if m is not None:
                m.close()
        eb.close()
        ea.close()


def test_placements_refused_up_front():
    ea = _engine(2)
    try:
        regions = {0: [np.zeros(s, np.uint8) for s in LAYOUT.region_sizes(SH)]}
        for bad in ({0: 2}, {1: 0}, {0: "eth0"}, [1]):
            with pytest.raises(errors.InvalidArgumentError):
                kvxfer.Messenger(ea, LAYOUT, SH, regions, placements=bad)
    finally:
        ea.close()
