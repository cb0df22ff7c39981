"""The pieces a node runs around the model: a page allocator, an in-process TP group, the
prefill and decode procedures, and the colocated reference run.

Numpy only (plus ``kvxfer.layout``); no libfabric.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxfer.demo.model import F32, DraftHead, Forward, ModelConfig, RankCache, RankModel, lockstep
from kvxfer.errors import InvalidArgumentError

__all__ = ["PagePool", "LocalGroup", "prefill_chunks", "Decoding", "Generation", "colocated",
           "context_of", "prompt_pages", "decode_pages", "check_prompt", "kv_crc"]


def check_prompt(cfg: ModelConfig, prompt: Sequence[int] | np.ndarray, max_new: int) -> np.ndarray:
    """The prompt as int64 ids, or ``InvalidArgumentError``: empty, not 1-D, ids outside the
    vocabulary, or more positions than the model has."""
    a = np.asarray(prompt)
    if a.ndim != 1 or a.size == 0:
        raise InvalidArgumentError("a prompt is a non-empty 1-D list of token ids")
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token ids must be integers, got {a.dtype}")
    if a.min() < 0 or a.max() >= cfg.vocab:
        raise InvalidArgumentError(f"token ids must lie in the vocabulary [0, {cfg.vocab}), got {a.min()}..{a.max()}")
    if len(a) - 1 + max_new > cfg.max_positions:
        raise InvalidArgumentError(f"a {len(a)}-token prompt plus {max_new} new tokens exceeds "
                                   f"max_positions={cfg.max_positions}")
    return a.astype(np.int64)


def prefill_chunks(n_prefill: int, chunk: int) -> list[tuple[int, int]]:
    """The fixed chunks ``[0, c), [c, 2c), ...`` of the prefilled positions. Prefiller and
    colocated reference must use the same ones: chunk shapes fix the BLAS kernels."""
    if chunk < 1:
        raise InvalidArgumentError(f"chunk must be >= 1, got {chunk}")
    return [(a, min(a + chunk, n_prefill)) for a in range(0, n_prefill, chunk)]


def prompt_pages(cfg: ModelConfig, prompt_len: int) -> int:
    """Pages the prefill fills (and the transfer moves): positions ``[0, prompt_len - 1)``."""
    return cfg.pages_for(max(prompt_len - 1, 0))


def decode_pages(cfg: ModelConfig, prompt_len: int, max_new: int) -> int:
    """Pages a decoder holds for a request: every position it will attend to,
    ``[0, prompt_len - 1 + max_new)`` (the last generated token is never run)."""
    return cfg.pages_for(prompt_len - 1 + max_new)


class PagePool:
    """A free list of page ids. LIFO reuse scatters a request's pages after some churn, which
    is what a real allocator does to a long-running server."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` pages, or None when fewer are free (the caller queues the request)."""
        if n > self.num_pages:
            raise InvalidArgumentError(f"{n} pages asked, the pool has {self.num_pages} in all")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return np.asarray(out, np.int64)

    def release(self, pages: Sequence[int] | np.ndarray) -> None:
        for p in np.asarray(pages, np.int64).tolist():
            if p not in self._used:
                raise InvalidArgumentError(f"page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)


class LocalGroup:
    """A TP group whose ranks run in this process, in lockstep (decode nodes, the reference).
    ``memories[r]`` is rank r's KV memory (a numpy byte array or a ``KVBuffer.numpy()`` view)."""

    def __init__(self, cfg: ModelConfig, tp: int, num_pages: int, memories: Sequence[np.ndarray] | None = None) -> None:
        cfg.check_tp(tp)
        self.cfg, self.tp = cfg, tp
        self.layout = cfg.layout(num_pages)
        self.sharding = cfg.sharding(tp)
        nbytes = RankCache.nbytes_for(self.layout, self.sharding)
        if memories is None:
            memories = [np.zeros(nbytes, np.uint8) for _ in range(tp)]
        if len(memories) != tp:
            raise InvalidArgumentError(f"{len(memories)} KV memories for tp={tp}")
        self.caches = [RankCache(self.layout, self.sharding, m) for m in memories]
        self.ranks = [RankModel(cfg, r, tp, self.caches[r]) for r in range(tp)]
        self.draft = DraftHead(cfg, self.ranks[0].embed)

    def run(self, tokens: Sequence[int] | np.ndarray, start: int, page_table: np.ndarray) -> np.ndarray:
        gens: list[Forward] = [m.forward(np.asarray(tokens), start, page_table) for m in self.ranks]
        return lockstep(gens)

    def logits(self, h: np.ndarray) -> np.ndarray:
        return self.ranks[0].logits(h)


def context_of(cfg: ModelConfig, run, prompt: np.ndarray, page_table: np.ndarray, chunk: int) -> np.ndarray:
    """Prefill ``prompt[:-1]`` chunk by chunk with ``run(tokens, start, page_table)``; return the
    context: the last prefilled position's final hidden state, zeros for a one-token prompt."""
    n = len(prompt) - 1
    ctx = np.zeros(cfg.hidden, F32)
    for a, b in prefill_chunks(n, chunk):
        h = run(prompt[a:b], a, page_table)
        if b == n:
            ctx = np.array(h[-1], F32)
    return ctx


def kv_crc(cfg: ModelConfig, caches: Sequence[RankCache], pages: np.ndarray, n: int) -> int:
    """CRC-32 of the KV of a request's positions ``[0, n)`` (its pages ``pages``), over the
    ranks ``caches`` of one TP group, in a form that does not depend on the TP size: per
    layer and plane, GQA's KV heads in order (rank by rank: a rank holds consecutive heads),
    MLA's latent once. Two groups of any TP sizes holding the same KV give the same CRC.
    -1 (never a CRC) when MLA's replicated latent differs between the ranks."""
    if n <= 0:
        return 0
    ps = cfg.page_size
    need = cfg.pages_for(n)
    pt = np.asarray(pages, np.int64)[:need]
    crc = 0
    for layer in range(cfg.layers):
        per_rank = []
        for c in caches:
            a = c.layers[layer][pt]  # [pages, planes, local heads, page_size, dim]
            a = a.transpose(1, 2, 0, 3, 4).reshape(a.shape[1], a.shape[2], need * ps, a.shape[4])[:, :, :n]
            per_rank.append(np.ascontiguousarray(a))
        if cfg.attention == "mla":
            first = per_rank[0].tobytes()
            if any(x.tobytes() != first for x in per_rank[1:]):
                return -1
            crc = zlib.crc32(first, crc)
        else:
            crc = zlib.crc32(np.concatenate(per_rank, axis=1).tobytes(), crc)
    return crc


@dataclass
class Decoding:
    """A request on a decoder: the last prompt token first, then greedy steps; the draft head
    proposes each next token from the previous hidden state and is credited when right."""

    prompt_len: int
    last_token: int
    pages: np.ndarray
    max_new: int
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    _draft: int = -1
    _hidden: np.ndarray | None = None

    def start(self, group: LocalGroup, context: np.ndarray) -> None:
        self._draft = group.draft.propose(context, self.last_token)

    @property
    def finished(self) -> bool:
        return len(self.tokens) >= self.max_new

    def step(self, group: LocalGroup) -> int:
        """One decode step of this request alone (a 1-row pass: see the model's rule 2)."""
        token = self.tokens[-1] if self.tokens else self.last_token
        pos = self.prompt_len - 1 + len(self.tokens)
        h = group.run([token], pos, self.pages)
        nxt = int(np.argmax(group.logits(h), axis=-1)[0])
        self.accepted += int(nxt == self._draft)
        self.tokens.append(nxt)
        if not self.finished:
            self._draft = group.draft.propose(h[0], nxt)
        return nxt


@dataclass(frozen=True)
class Generation:
    """What a request produced: tokens, accepted drafts, the context the decoder used, and
    the CRC-32 of the prefilled KV (``kv_crc`` of positions ``[0, len(prompt) - 1)``; None:
    not known, which no disaggregated run matches)."""

    tokens: tuple[int, ...]
    accepted: int
    context: bytes = b""
    kv_crc: int | None = None


def colocated(cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new: int = 32, chunk: int = 64,
              num_pages: int | None = None) -> list[Generation]:
    """The reference: prefill and decode in one process, one paged cache (TP=1), the same
    prefill chunks and speculative convention as a disaggregated run."""
    if max_new < 1:
        raise InvalidArgumentError(f"max_new must be >= 1, got {max_new}")
    need = max((decode_pages(cfg, len(p), max_new) for p in prompts), default=1)
    group = LocalGroup(cfg, 1, num_pages or need)
    pool = PagePool(group.layout.num_pages)
    out = []
    for p in prompts:
        prompt = check_prompt(cfg, p, max_new)
        pages = pool.alloc(decode_pages(cfg, len(prompt), max_new))
        assert pages is not None
        ctx = context_of(cfg, group.run, prompt, pages, chunk)
        kv = kv_crc(cfg, group.caches, pages, len(prompt) - 1)
        d = Decoding(len(prompt), int(prompt[-1]), pages, max_new)
        d.start(group, ctx)
        while not d.finished:
            d.step(group)
        pool.release(pages)
        out.append(Generation(tuple(d.tokens), d.accepted, ctx.tobytes(), kv))
    return out
