"""register_layout / remote_layout / post_plan: a plan's rank pair in one call, without the
messenger; the target counts ``num_writes`` arrivals and the bytes match the reference."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding, plan
from kvxfer.errors import DescriptorError, InvalidArgumentError
from kvxfer.messenger import post_plan, register_layout, remote_layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from _planner_ref import RankMemory  # noqa: E402


@pytest.mark.parametrize("layers", [None, [1], [0, 2]])
def test_post_plan_pair(provider, layers):
    sl, dl = KVLayout.vllm(3, 4, 8, 4, 16, "float16"), KVLayout.layer_major(3, 4, 8, 4, 24, "float16", order="NHD")
    ss, ds = Sharding(2), Sharding(1)
    rng = np.random.default_rng(1)
    srcs = [RankMemory(sl, ss, r, rng=rng) for r in range(2)]
    dst = RankMemory(dl, ds, 0, fill=0)
    ref = RankMemory(dl, ds, 0, fill=0)
    with kvxfer.Engine(provider, "127.0.0.1") as ea, kvxfer.Engine(provider, "127.0.0.1") as eb:
        tables = [register_layout(ea, sl, ss, m.regions, remote=False) for m in srcs]
        target = register_layout(eb, dl, ds, dst.regions)
        blob = target.descriptor()
        remote = remote_layout(ea, blob)
        assert len(remote) == len(target) == 1
        peer = ea.connect(eb.address)
        sp, dp = [3, 4, 5, 9], [20, 0, 1, 7]
        p = plan(sl, ss, dl, ds, sp, dp)
        for s in range(2):
            t = post_plan(ea, p, s, 0, tables[s], peer, remote, imm=40 + s, layers=layers)
            c = eb.expect(40 + s, t.num_writes)
            c.wait(10)
            t.wait(10)
            assert t.done and t.posted == t.num_writes and t.error is None
        # the reference: the same plan restricted to those layers, executed as byte copies
        from _planner_ref import execute

        want = p if layers is None else plan(sl, ss, dl, ds, sp, dp, layers=layers)
        execute(want, srcs, [ref])
        assert all(np.array_equal(a, b) for a, b in zip(dst.regions, ref.regions))
        with pytest.raises(DescriptorError):
            remote_layout(ea, blob[:-1])
        with pytest.raises(InvalidArgumentError):
            register_layout(eb, dl, ds, [np.zeros(10, np.uint8)])
        for tb in tables:
            tb.close()
        target.close()


def test_post_plan_of_no_layers_posts_nothing(provider):
    """``layers=[]`` (nothing ready yet) used to post the whole plan, every layer before it
    was computed; a layer named twice is refused rather than quietly posted once."""
    from kvxfer.errors import PlanError

    lay = KVLayout.vllm(4, 2, 8, 4, 8, "float16")
    src, dst = RankMemory(lay, Sharding(1), 0, rng=np.random.default_rng(2)), RankMemory(lay, Sharding(1), 0, fill=0)
    with kvxfer.Engine(provider, "127.0.0.1") as ea, kvxfer.Engine(provider, "127.0.0.1") as eb:
        table = register_layout(ea, lay, Sharding(1), src.regions, remote=False)
        target = register_layout(eb, lay, Sharding(1), dst.regions)
        remote = remote_layout(ea, target.descriptor())
        peer = ea.connect(eb.address)
        p = plan(lay, Sharding(1), lay, Sharding(1), [0, 1], [2, 3])
        before = ea.stats()["writes_posted"]
        t = post_plan(ea, p, 0, 0, table, peer, remote, imm=7, layers=[])
        t.wait(1)
        assert t.num_writes == 0 and t.posted == 0 and t.done
        with pytest.raises(PlanError):
            post_plan(ea, p, 0, 0, table, peer, remote, imm=7, layers=[2, 2])
        assert ea.stats()["writes_posted"] == before and eb.banked(7) == 0
        assert not any(r.any() for r in dst.regions)
        table.close()
        target.close()
