"""Hypothesis strategies shared by the messenger's codec tests, its stress fuzzing, and the
planner and counting property tests (one side of a TP pairing)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvxfer.messenger import _codec as C

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
rids = st.one_of(st.text(max_size=40), st.binary(max_size=60), st.integers(-2**200, 2**200))


@st.composite
def controls(draw, src=u64, dst=u64, hello_blob=st.binary(min_size=1, max_size=200), request_ids=rids,
             reasons=st.text(max_size=100)):
    """A valid control message of any type (sender and receiver uids from `src`, `dst`)."""
    t = draw(st.sampled_from(sorted(C.MSG_TYPES)))
    kw = {}
    if t == C.HELLO:
        kw["blob"] = draw(hello_blob)
    elif t == C.REQUEST:
        kw.update(imm=draw(u32), num_tokens=draw(u64), slot=draw(st.integers(-2**31, 2**31 - 1)),
                  request_id=draw(request_ids), pages=np.array(draw(st.lists(u32, max_size=50)), np.int64),
                  first_token=draw(u64), meta=draw(st.binary(max_size=C.MAX_META)), flags=draw(st.integers(0, 1)))
    elif t == C.ANNOUNCE:
        kw.update(imm=draw(u32), count=draw(u64))
    elif t == C.ABORT:
        kw.update(imm=draw(u32))
    elif t == C.ABORTED:
        kw.update(imm=draw(u32), count=draw(u64), flags=draw(st.integers(0, 7)))
        if kw["flags"] & C.ABORTED_REJECTED:       # a rejection after posting carries its reason
            kw["reason"] = draw(reasons)
    elif t == C.REJECT:
        kw.update(imm=draw(u32), reason=draw(reasons))
    elif t == C.EXPOSE:          # the pull road (kvxfer/messenger/_pullcodec.py)
        kw.update(imm=draw(u32), num_tokens=draw(u64), count=draw(u64), request_id=draw(request_ids),
                  pages=np.array(draw(st.lists(u32, max_size=50)), np.int64))
    elif t == C.DONE:
        kw.update(imm=draw(u32), flags=draw(st.integers(0, 3)))
    return C.Control(t, draw(src), draw(dst), draw(u64), **kw)


@st.composite
def side_shape(draw, kv_heads: int, mla: bool, tps, forms=("fused", "stacked", "separate")) -> tuple:
    """(replicated, tp, kv, placement, order) of one side of a TP pairing: an MLA latent is
    replicated or sharded, GQA heads split over ``tp`` (any of ``tps`` that divides or is
    divided by ``kv_heads``) or are replicated; ``kv`` one of ``forms`` (or ``mla``)."""
    replicated = draw(st.booleans()) if mla else draw(st.sampled_from([False] * 5 + [True]))
    tp = draw(st.sampled_from([t for t in tps if replicated or kv_heads % t == 0 or t % kv_heads == 0]))
    kv = "mla" if mla else draw(st.sampled_from(list(forms)))
    placement = draw(st.sampled_from(["per_layer", "layer_major"]))
    order = draw(st.sampled_from(["HND", "NHD"]))
    return replicated, tp, kv, placement, order
