"""Per-page templates (kvxfer/_templates.py) against a fresh ``plan``: the same writes, replica
choices included (a permutation of the template's candidates, not a plan per request)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer._templates import PageTemplate, plan_layers, writing_ranks
from kvxfer.layout import KVLayout, Sharding
from kvxfer.planner import PageTemplate as FromPlanner
from kvxfer.planner import chooses_replicas, plan

from test_planner import configs


def _coalesce(rows: list) -> list:
    """Join each write to the previous one where both sides continue it (the engine's rule)."""
    out: list = []
    for so, do, ln in rows:
        if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
            out[-1][2] += ln
        else:
            out.append([so, do, ln])
    return [tuple(x) for x in out]


def _bytes(rows: list) -> set:
    """Every (src byte, dst byte) the writes move."""
    return {(so + k, do + k) for so, do, ln in rows for k in range(ln)}


def _plan_rows(p, srcs, dsts) -> dict:
    """``plan``'s writes per (src rank, dst rank, src region, dst region, layer), in order."""
    out: dict = {}
    for s, d in p.pairs:
        if s in srcs and d in dsts:
            w = p.writes(s, d)
            for sr, dr, so, do, ln, lay in zip(w.src_region.tolist(), w.dst_region.tolist(), w.src_offset.tolist(),
                                               w.dst_offset.tolist(), w.length.tolist(), w.layer.tolist()):
                out.setdefault((s, d, sr, dr, lay), []).append((so, do, ln))
    return out


def _batch_rows(batches) -> dict:
    out: dict = {}
    for s, d, sr, dr, lay, so, do, ln, starts in batches:
        assert len(starts) == len(lay) + 1 and starts[0] == 0 and starts[-1] == len(ln)
        for g, layer in enumerate(lay.tolist()):
            a, b = int(starts[g]), int(starts[g + 1])
            rows = list(zip(so[a:b].tolist(), do[a:b].tolist(), ln[a:b].tolist()))
            key = (int(s), int(d), int(sr), int(dr), layer)
            assert key not in out                      # one group per (pair, region pair, layer)
            out[key] = rows
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.data())
def test_template_writes_are_a_fresh_plans(cfg, data):
    """For any layouts, shardings (replicated, GQA with fewer heads than ranks, MLA), page lists
    and seed: the template's pages per pair (``assign``) shifted and coalesced are exactly the
    writes of ``plan(..., seed=seed)``, write for write and in order, per rank pair, region
    pair and layer; ``pair_writes`` holds the same triples as ``pair_layers``."""
    (sl, ss), (dl, ds), sp, dp, _, seed = cfg
    srcs = data.draw(st.sets(st.integers(0, ss.tp_size - 1), min_size=1))
    dsts = data.draw(st.sets(st.integers(0, ds.tp_size - 1), min_size=1))
    p = plan(sl, ss, dl, ds, sp, dp, seed=seed)
    t = PageTemplate(sl, ss, dl, ds, srcs, dsts)
    assert t.replicas == chooses_replicas(sl, ss)
    got: dict = {}
    seen = set()
    for i, a, b in t.assign(np.asarray(sp), np.asarray(dp), seed):
        assert i not in seen                            # one chunk per pair and request
        seen.add(i)
        batches = t.pair_layers(i, a, b)
        rows = _batch_rows(batches)
        got.update({k: _coalesce(v) for k, v in rows.items()})
        so, do, ln, counts = t.pair_writes(i, a, b)
        assert sum(counts.tolist()) == len(ln) == sum(len(v) for v in rows.values())
        assert np.array_equal(so, np.concatenate([x[5] for x in batches]))
        assert np.array_equal(ln, np.concatenate([x[7] for x in batches]))
    want = {k: _coalesce(v) for k, v in _plan_rows(p, srcs, dsts).items()}
    if len(set(sp)) == len(sp):
        assert got == want
    else:
        # a repeated source page: plan sorts the blocks of both copies plane by plane, the
        # template keeps a page's planes together, so K|V of one page may join in one and not
        # the other; the same bytes from the same places either way
        assert {k: _bytes(v) for k, v in got.items()} == {k: _bytes(v) for k, v in want.items()}
    assert {t.pairs[i][0] for i in seen if t.pairs[i][1] in dsts} == set(
        writing_ranks(sl, ss, dl, ds, dsts, len(sp), seed=seed)) & srcs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_plan_layers_hold_every_write_of_the_plan(cfg):
    """``plan_layers`` (the token path's arming form) holds exactly ``plan``'s writes, layer
    by layer and in order, for the planned layers only."""
    (sl, ss), (dl, ds), sp, dp, layers, seed = cfg
    p = plan(sl, ss, dl, ds, sp, dp, layers=layers, seed=seed)
    srcs, dsts = set(range(ss.tp_size)), set(range(ds.tp_size))
    assert _batch_rows(plan_layers(p, srcs, dsts)) == _plan_rows(p, srcs, dsts)


def test_replica_choice_is_a_permutation_per_seed():
    """MLA TP4 (replicated) -> TP2: one template; different seeds give different owners, each
    segment's chunks dealt to all four candidates, the same seed the same pages."""
    sl = KVLayout.mla(2, 16, 4, 64, "float16")
    t = PageTemplate(sl, Sharding(4, replicated=True), sl, Sharding(2, replicated=True), range(4), range(2))
    assert t.replicas and len(t.pairs) == 8              # every candidate of every destination
    sp, dp = np.arange(8), np.arange(8, 16)
    owners = {}
    for seed in range(20):
        a = t.assign(sp, dp, seed)
        assert sorted(len(x[1]) for x in a) == [2] * 8   # 8 pages, 4 chunks per destination rank
        owners[seed] = tuple((t.pairs[i][0], t.pairs[i][1], tuple(x.tolist())) for i, x, _ in a)
        assert owners[seed] == tuple((t.pairs[i][0], t.pairs[i][1], tuple(x.tolist()))
                                     for i, x, _ in t.assign(sp, dp, seed))
    assert len(set(owners.values())) > 1
    assert FromPlanner is PageTemplate                    # still importable from the planner


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.data())
def test_a_requests_parts_go_to_the_whole_requests_owners(cfg, data):
    """Any split of a request's pages into ascending parts (the chunks of a streamed or
    chunked send): ``assign_part`` over the parts gives every pair exactly the pages
    ``assign`` over the whole request gives it, so a chunk never reaches a rank the request's
    draw did not pick (issue 23's TP8 finding); and only ranks ``writing_ranks`` names."""
    (sl, ss), (dl, ds), sp, dp, _, seed = cfg
    sp, dp = np.asarray(sp), np.asarray(dp)
    t = PageTemplate(sl, ss, dl, ds, range(ss.tp_size), range(ds.tp_size))
    n = len(dp)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=4))) if n > 1 else []
    bounds = [0, *[c for c in cuts if 0 < c < n], n]
    whole = {i: (a.tolist(), b.tolist()) for i, a, b in t.assign(sp, dp, seed)}
    parts: dict = {}
    for lo, hi in zip(bounds, bounds[1:]):
        idx = np.arange(lo, hi)
        for i, a, b in t.assign_part(sp[idx], dp, idx, seed):
            x = parts.setdefault(i, ([], []))
            x[0].extend(a.tolist())
            x[1].extend(b.tolist())
    # the same (source, destination) page pairs per rank pair (by_source orders within a part)
    assert {i: sorted(zip(*v)) for i, v in parts.items()} == {i: sorted(zip(*v)) for i, v in whole.items()}
    writers = set(writing_ranks(sl, ss, dl, ds, range(ds.tp_size), n, seed=seed))
    assert {t.pairs[i][0] for i in parts} <= writers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.data())
def test_chunks_of_a_request_with_its_replica_span_are_the_requests_plan(cfg, data):
    """The token path: a request of ``T`` tokens from ``first`` split into chunks of tokens,
    each planned alone with the request's ``replica_span``: together they move exactly the
    bytes of the whole request's plan, from the same rank pairs, region pairs and layers."""
    (sl, ss), (dl, ds), sp, dp, _, seed = cfg
    ps, n = sl.page_size, len(sp)
    if dl.page_size != ps:
        return
    total = data.draw(st.integers((n - 1) * ps + 1, n * ps))
    first = data.draw(st.integers(0, total - 1))
    cuts = sorted(data.draw(st.sets(st.integers(first + 1, max(first + 1, total - 1)), max_size=3)))
    bounds = [first, *[c for c in cuts if first < c < total], total]
    sp, dp = np.asarray(sp), np.asarray(dp)
    srcs, dsts = set(range(ss.tp_size)), set(range(ds.tp_size))
    span = (first // ps, n)
    whole = plan(sl, ss, dl, ds, sp, dp, seed=seed, num_tokens=total, first_token=first)
    want: dict = {}
    for k, v in _plan_rows(whole, srcs, dsts).items():
        want.setdefault(k, set()).update(_bytes(v))
    got: dict = {}
    for a, b in zip(bounds, bounds[1:]):
        m = -(-b // ps)
        p = plan(sl, ss, dl, ds, sp[:m], dp[:m], seed=seed, num_tokens=b, first_token=a, replica_span=span)
        for k, v in _plan_rows(p, srcs, dsts).items():
            got.setdefault(k, set()).update(_bytes(v))
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
