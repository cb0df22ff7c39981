"""A prefill instance (TP2, or src_sharding's) and a decoder (TP1) in one process over real engines, in node mode
(one prefill messenger holding both ranks) or per-rank mode (one messenger per rank): the
harness of the engine-facing API tests (tests/messenger/test_engine_api.py)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import kvxfer
from kvxfer import KVLayout, Sharding

from _nodes import logical, scatter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
import _planner_ref as ref  # noqa: E402

#: 2 layers, 4 KV heads, head_dim 8, 4 tokens a page, 32 pages, fp16
LAYOUT = KVLayout.vllm(2, 4, 8, 4, 32, "float16")
SRC_SH, DST_SH = Sharding(2), Sharding(1)
FILL = 0xEE


class Cluster:
    """``pre``: the prefill messengers (one in node mode, one per rank per-rank); ``d``: the
    decoder (context slots of 32 bytes); ``peer``: what ``d.receive`` takes; every source
    byte from ``logical``; ``close()`` closes all (bounded)."""

    def __init__(self, provider: str, per_rank: bool, *, context_slots: int = 8, layout: KVLayout = LAYOUT,
                 src_sharding: Sharding = SRC_SH, dst_sharding: Sharding = DST_SH, **dkw) -> None:
        SRC_SH, DST_SH = src_sharding, dst_sharding          # noqa: N806 (the module's defaults, or these)
        assert DST_SH.tp_size == 1
        self.per_rank = per_rank
        self.layout = LAYOUT = layout
        self.cache = logical(LAYOUT, 11)
        self.engines, self.pre = [], []
        tp = SRC_SH.tp_size
        self.src = [ref.RankMemory(LAYOUT, SRC_SH, r, fill=0) for r in range(tp)]
        for mem in self.src:
            scatter(mem, self.cache)
        groups = [{r: self.src[r].regions} for r in range(tp)] if per_rank else \
            [{r: self.src[r].regions for r in range(tp)}]
        for kv in groups:
            e = kvxfer.Engine(provider, "127.0.0.1")
            self.engines.append(e)
            self.pre.append(kvxfer.Messenger(e, LAYOUT, SRC_SH, kv, peer_timeout=5))
        e = kvxfer.Engine(provider, "127.0.0.1")
        self.engines.append(e)
        self.mem = ref.RankMemory(LAYOUT, DST_SH, 0, fill=FILL)
        self.d = kvxfer.Messenger(e, LAYOUT, DST_SH, {0: self.mem.regions}, peer_timeout=5,
                                  context_slots=context_slots, context_bytes=32, **dkw)
        self.pgs = [self.d.connect(p.handshake()) for p in self.pre]
        self.peer = self.pgs if per_rank else self.pgs[0]

    def requests(self, n: int, timeout: float = 10) -> list[list]:
        """``n`` requests from every prefill messenger, by messenger, in arrival order."""
        out = []
        deadline = time.monotonic() + timeout
        for p in self.pre:
            got: list = []
            while len(got) < n and time.monotonic() < deadline:
                got += p.requests(timeout=0.05)
            assert len(got) == n, (len(got), n)
            out.append(got)
        return out

    def by_id(self, timeout: float = 10) -> dict:
        """Every request that arrives within ``timeout`` (until none for 0.2 s), as
        ``request_id -> [Request per prefill messenger]``."""
        out: dict = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [(i, q) for i, p in enumerate(self.pre) for q in p.requests(timeout=0.2)]
            if not got:
                break
            for i, q in got:
                out.setdefault(q.request_id, [None] * len(self.pre))[i] = q
        return out

    def view(self, layer: int, plane: int, pages, first: int, end: int, mem=None) -> np.ndarray:
        """Tokens ``[first, end)`` of ``pages`` (a request's pages in order) as
        ``[heads, tokens, head bytes]`` of the decoder (or of ``mem``, a logical cache)."""
        if mem is None:
            v = self.mem.page_view(layer, plane)[np.asarray(pages)]
        else:
            v = mem[layer, plane][np.asarray(pages)]
        v = np.concatenate([v[i] for i in range(len(v))], axis=1)       # heads, tokens, bytes
        return v[:, first:end]

    def check(self, dst_pages, src_pages, num_tokens: int | None = None, first_token: int = 0) -> None:
        """The decoder's pages hold the source's bytes: whole pages without ``num_tokens``;
        else tokens ``[first_token, num_tokens)`` exactly (``dst_pages`` cover that range,
        ``src_pages`` the whole request), and the tokens of ``dst_pages`` before
        ``first_token``'s page offset untouched."""
        ps = self.layout.page_size
        for layer in range(self.layout.num_layers):
            for plane in range(self.mem.planes):
                if num_tokens is None:
                    got = self.mem.page_view(layer, plane)[np.asarray(dst_pages)]
                    want = self.cache[layer, plane][np.asarray(src_pages)]
                    assert np.array_equal(got, want), (layer, plane)
                    continue
                off = first_token % ps
                got = self.view(layer, plane, dst_pages, off, off + num_tokens - first_token)
                want = self.view(layer, plane, src_pages, first_token, num_tokens, mem=self.cache)
                assert np.array_equal(got, want), (layer, plane)
                if off:
                    assert (self.view(layer, plane, dst_pages, 0, off) == FILL).all(), (layer, plane)

    def untouched(self, dst_pages) -> bool:
        return all((self.mem.page_view(layer, plane)[np.asarray(dst_pages)] == FILL).all()
                   for layer in range(self.layout.num_layers) for plane in range(self.mem.planes))

    def close(self) -> None:
        self.d.close()
        for p in self.pre:
            p.close()
        for e in self.engines:
            e.close()


def drain(m, want, timeout: float = 10, into: list | None = None) -> list:
    """``m.poll()`` until ``want(seen)`` holds for everything polled so far (bounded);
    returns what was polled."""
    seen = [] if into is None else into
    deadline = time.monotonic() + timeout
    while not want(seen):
        assert time.monotonic() < deadline, f"poll() gave {seen} within {timeout} s"
        seen += m.poll()
        time.sleep(0.001)
    return seen
