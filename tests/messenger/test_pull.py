"""The pull road's planner-driven reads (kvxfer/messenger/pull.py) on both providers, node mode
(one engine per side holding every rank's regions) and per-rank mode (one engine per rank):
the decoder reads a plan's pieces from the prefiller's exposed layout with one read_groups per
rank pair, and every byte lands exactly where a push of the same plan writes it (the
independent reference, tests/unit/_planner_ref.py), with TP 2->1, 1->2, 4->2, GQA replication,
MLA and differing page sizes; a layout not exposed for reading is refused with nothing read."""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding, plan
from kvxfer.errors import DescriptorError
from kvxfer.messenger import register_layout, remote_layout
from kvxfer.messenger.pull import expose_layout, pull_plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from _planner_ref import RankMemory, execute  # noqa: E402

CASES = {
    # name: (src layout, src sharding, dst layout, dst sharding, num_tokens or None)
    "tp2to1": (KVLayout.vllm(2, 4, 16, 16, 12, "float16"), Sharding(2),
               KVLayout.vllm(2, 4, 16, 16, 12, "float16"), Sharding(1), None),
    "tp1to2-nhd": (KVLayout.flash_attn(2, 4, 16, 16, 12, "float16"), Sharding(1),
                   KVLayout.vllm(2, 4, 16, 16, 12, "float16"), Sharding(2), None),
    "tp4to2-gqa": (KVLayout.vllm(2, 2, 16, 16, 12, "float16"), Sharding(4),
                   KVLayout.layer_major(2, 2, 16, 16, 12, "float16", order="NHD"), Sharding(2), None),
    "mla-tp2to1": (KVLayout.mla(3, 72, 16, 12, "float16"), Sharding(2, replicated=True),
                   KVLayout.mla(3, 72, 16, 12, "float16"), Sharding(1, replicated=True), None),
    "mla-tp1to2": (KVLayout.mla(3, 72, 16, 12, "float16"), Sharding(1, replicated=True),
                   KVLayout.mla(3, 72, 16, 12, "float16"), Sharding(2, replicated=True), None),
    "pages16to32-tp2to1": (KVLayout.vllm(2, 4, 16, 16, 12, "float16"), Sharding(2),
                           KVLayout.vllm(2, 4, 16, 32, 8, "float16"), Sharding(1), 90),
    "pages32to16-gqa-tp4to2": (KVLayout.vllm(2, 2, 16, 32, 8, "float16", order="NHD"), Sharding(4),
                               KVLayout.vllm(2, 2, 16, 16, 16, "float16"), Sharding(2), 77),
    "mla-pages8to5": (KVLayout.mla(2, 40, 8, 16, "float16"), Sharding(1, replicated=True),
                      KVLayout.mla(2, 40, 5, 24, "float16"), Sharding(2, replicated=True), 61),
}


def _pages(layout: KVLayout, tokens: int, rng) -> np.ndarray:
    n = -(-tokens // layout.page_size)
    return rng.permutation(layout.num_pages)[:n].astype(np.int64)


@pytest.mark.parametrize("mode", ["node", "per-rank"])
@pytest.mark.parametrize("case", list(CASES))
def test_pull_lands_what_push_writes(provider, case, mode):
    sl, ss, dl, ds, tokens = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    n_tokens = tokens if tokens is not None else 5 * sl.page_size
    sp, dp = _pages(sl, n_tokens, rng), _pages(dl, n_tokens, rng)
    p = plan(sl, ss, dl, ds, sp, dp, num_tokens=tokens) if tokens is not None else plan(sl, ss, dl, ds, sp, dp)
    srcs = [RankMemory(sl, ss, r, rng=rng) for r in range(ss.tp_size)]
    dsts = [RankMemory(dl, ds, r, fill=0xEE) for r in range(ds.tp_size)]
    refs = [RankMemory(dl, ds, r, fill=0xEE) for r in range(ds.tp_size)]
    execute(p, srcs, refs)
    assert all(any((r != 0xEE).any() for r in m.regions) for m in refs), "the plan moves nothing to a rank"
    n_src = 1 if mode == "node" else ss.tp_size
    n_dst = 1 if mode == "node" else ds.tp_size
    prefill = [kvxfer.Engine(provider, "127.0.0.1") for _ in range(n_src)]
    decode = [kvxfer.Engine(provider, "127.0.0.1") for _ in range(n_dst)]
    try:
        exposed = [expose_layout(prefill[0 if mode == "node" else s], sl, ss, srcs[s].regions)
                   for s in range(ss.tp_size)]
        local = [register_layout(decode[0 if mode == "node" else d], dl, ds, dsts[d].regions, remote=False)
                 for d in range(ds.tp_size)]
        posted = []
        for d in range(ds.tp_size):
            eng = decode[0 if mode == "node" else d]
            for s in range(ss.tp_size):
                if not len(p.writes(s, d)):
                    continue
                peer = eng.connect(prefill[0 if mode == "node" else s].address)
                table = remote_layout(eng, exposed[s].descriptor())
                posted.append(pull_plan(eng, p, s, d, local[d], peer, table))
        assert posted, "the plan moves nothing"
        for t in posted:
            t.wait(60)
            assert t.done and t.error is None
        for d in range(ds.tp_size):
            for r, (got, want) in enumerate(zip(dsts[d].regions, refs[d].regions)):
                if not np.array_equal(got, want):
                    bad = np.flatnonzero(got != want)
                    raise AssertionError(f"rank {d} region {r}: {len(bad)} bytes differ from the push reference, "
                                         f"first at {bad[:4].tolist()}")
        for t in local + exposed:
            t.close()
    finally:
        for e in prefill + decode:
            e.close()


def test_pull_refuses_a_layout_not_exposed_for_reading(provider):
    """A prefiller's layout registered for push (writable, not readable): its table names no
    read keys, so the decoder's engine refuses the reads before posting any, although tcp 1.17
    would serve them with the write keys (finding 23)."""
    sl, ss, dl, ds, _ = CASES["tp2to1"]
    rng = np.random.default_rng(5)
    sp, dp = _pages(sl, 48, rng), _pages(dl, 48, rng)
    p = plan(sl, ss, dl, ds, sp, dp)
    src = RankMemory(sl, ss, 0, rng=rng)
    dst = RankMemory(dl, ds, 0, fill=0)
    with kvxfer.Engine(provider, "127.0.0.1") as ea, kvxfer.Engine(provider, "127.0.0.1") as eb:
        pushed = register_layout(ea, sl, ss, src.regions)
        local = register_layout(eb, dl, ds, dst.regions, remote=False)
        peer = eb.connect(ea.address)
        with pytest.raises(DescriptorError, match="not offered for reads"):
            pull_plan(eb, p, 0, 0, local, peer, remote_layout(eb, pushed.descriptor()))
        assert not any(r.any() for r in dst.regions)
        assert pull_plan(eb, p, 0, 0, local, peer, remote_layout(eb, pushed.descriptor()), layers=[]).done
        local.close()
        pushed.close()
