"""A small Llama-style decoder in numpy whose KV cache is a paged ``kvxfer.KVLayout``.

The point of this model is one property: tokens generated after a disaggregated hand-off
(prefill on TP=a, KV moved by kvxfer, decode on TP=b) are *bitwise* those of a colocated run.
Float addition is not associative, so that needs three rules, all followed here:

1. **Fixed reduction units.** Every tensor-parallel reduction (attention output projection,
   MLP down projection) is computed as ``units`` partial sums, one per fixed slice of heads or
   of the MLP's intermediate dimension, and summed in unit order ``((p0 + p1) + p2) + ...``.
   A TP rank holds ``units / tp`` consecutive units, computes their partials with the same
   array shapes a TP=1 run uses, and the all-reduce gathers all partials and sums them in that
   same order. So the sum is the same for TP 1, 2 and 4, and the colocated model is simply
   TP=1. Weights are generated per unit, so no rank ever slices a larger matrix.
2. **Fixed shapes.** BLAS picks its kernel (and so its summation order) by shape: a 1-row
   product goes through gemv, more rows through gemm (measured: row 0 of ``x[:1] @ W`` differs
   from row 0 of ``x[:2] @ W``). So a prompt is prefilled alone in fixed chunks
   (``[0, c), [c, 2c), ...``) and a decode step computes each request as its own 1-row pass,
   whatever else is in the batch. The colocated reference uses the same chunks.
3. **Identical inputs.** The KV pages the decoder reads are byte copies of what the prefiller
   wrote, and the hidden state the draft head starts from travels as context bytes.

Speculative-decoding convention (issue 10): the prefill covers the prompt except its last
token; the final hidden state (before the final norm) of the last prefilled position is the
request's *context*; the decoder runs the last prompt token as its first decode step, and the
draft head proposes the first generated token from the context. A one-token prompt has an
empty prefill and a zero context.

Numpy only, plus ``kvxfer.layout`` (a leaf): importable without libfabric.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from kvxfer._check import is_int
from kvxfer.errors import InvalidArgumentError
from kvxfer.layout import KVLayout, Sharding

__all__ = ["ModelConfig", "RankModel", "RankCache", "Forward", "lockstep", "reduce_units", "DraftHead", "rmsnorm"]

F32 = np.float32


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and seed. Both nodes must agree on all of it (see :meth:`fingerprint`)."""

    vocab: int = 512
    hidden: int = 256
    layers: int = 8
    q_heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    intermediate: int = 768
    units: int = 4  #: fixed reduction units; every TP size must divide it
    page_size: int = 16
    attention: Literal["gqa", "mla"] = "gqa"
    kv_lora: int = 64  #: MLA: compressed latent size
    rope_dim: int = 16  #: MLA: decoupled rotary key size (stored after the latent)
    rope_theta: float = 10000.0
    eps: float = 1e-5
    max_positions: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "q_heads", "kv_heads", "head_dim", "intermediate", "units",
                     "page_size", "kv_lora", "rope_dim", "max_positions"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        if self.attention not in ("gqa", "mla"):
            raise InvalidArgumentError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.head_dim % 2 or self.rope_dim % 2:
            raise InvalidArgumentError("head_dim and rope_dim must be even (rotary pairs)")
        if self.q_heads % self.units:
            raise InvalidArgumentError(f"q_heads={self.q_heads} must be a multiple of units={self.units}")
        if self.intermediate % self.units:
            raise InvalidArgumentError(f"intermediate={self.intermediate} must be a multiple of units={self.units}")
        if self.attention == "gqa" and self.kv_heads != self.units:
            # one unit = one KV head and its query group, so a unit never spans two ranks' heads
            raise InvalidArgumentError(f"gqa needs kv_heads == units, got {self.kv_heads} and {self.units}")

    # -- derived --------------------------------------------------------------------------
    @property
    def q_per_unit(self) -> int:
        return self.q_heads // self.units

    @property
    def i_per_unit(self) -> int:
        return self.intermediate // self.units

    @property
    def latent(self) -> int:
        """MLA: floats stored per token and layer (latent, then the rotary key)."""
        return self.kv_lora + self.rope_dim

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` ranks can split the reduction units evenly."""
        if not is_int(tp) or tp < 1 or self.units % tp:
            raise InvalidArgumentError(f"tp={tp!r} must divide units={self.units}")

    def units_of(self, rank: int, tp: int) -> range:
        """The reduction units rank ``rank`` of ``tp`` computes."""
        self.check_tp(tp)
        n = self.units // tp
        return range(rank * n, (rank + 1) * n)

    def layout(self, num_pages: int) -> KVLayout:
        """The paged KV layout (float32, HND, vLLM-style fused K/V pages; MLA: one latent per token)."""
        if self.attention == "mla":
            return KVLayout.mla(self.layers, self.latent, self.page_size, num_pages, dtype="float32")
        return KVLayout.vllm(self.layers, self.kv_heads, self.head_dim, self.page_size, num_pages,
                             dtype="float32", order="HND")

    def sharding(self, tp: int) -> Sharding:
        """GQA: KV heads split over ranks; MLA: the latent replicated on every rank."""
        self.check_tp(tp)
        return Sharding(tp, replicated=self.attention == "mla")

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def fingerprint(self) -> str:
        """A short digest of every field: two nodes with different models refuse to pair."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- weights --------------------------------------------------------------------------------

def _w(cfg: ModelConfig, shape: tuple[int, ...], *key: int, scale: float | None = None) -> np.ndarray:
    """One weight tensor, from its own seed stream (so a rank can make only its units)."""
    rng = np.random.default_rng([cfg.seed, *key])
    fan_in = shape[-2] if len(shape) >= 2 else 1
    s = (_GAIN.get(key[0], 1.0) / np.sqrt(fan_in)) if scale is None else scale
    return (rng.standard_normal(shape) * s).astype(F32)


def _norm_w(cfg: ModelConfig, n: int, *key: int) -> np.ndarray:
    rng = np.random.default_rng([cfg.seed, *key])
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(F32)


# tensor ids in the seed key (never renumber: they fix the weights)
_EMBED, _FINAL_NORM, _ATTN_NORM, _MLP_NORM, _QKV, _O, _GU, _DOWN = range(8)
_DKV, _KV_NORM, _Q, _UK, _UV = range(8, 13)
_D_PROJ, _D_NORM_H, _D_NORM_E, _D_NORM_M, _D_GU, _D_DOWN = range(13, 19)
# A small embedding and larger output projections keep the residual stream from being
# dominated by the input token (with a tied head that makes a random model repeat one token).
_GAIN = {_O: 2.0, _DOWN: 2.0}
_EMBED_SCALE = 0.05


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return (x * (F32(1.0) / np.sqrt(ms + F32(eps)))) * w


def _rope_tables(cfg: ModelConfig, dim: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    ang = np.arange(cfg.max_positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half rotary embedding; ``x`` is ``(M, ..., d)``, ``cos``/``sin`` ``(M, d/2)``."""
    h = x.shape[-1] // 2
    while cos.ndim < x.ndim:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def reduce_units(partials: Sequence[np.ndarray]) -> np.ndarray:
    """The all-reduce's arithmetic: unit partials summed in unit order, one add at a time."""
    acc = np.array(partials[0], dtype=F32, copy=True)
    for p in partials[1:]:
        np.add(acc, p, out=acc)
    return acc


class RankCache:
    """One rank's paged KV cache: typed views of the regions ``layout.region_sizes(sharding)``
    asks for. ``memory`` is one byte buffer holding them end to end, or one buffer per region
    (numpy arrays or ``KVBuffer.numpy()`` views)."""

    def __init__(self, layout: KVLayout, sharding: Sharding, memory: Any) -> None:
        sizes = layout.region_sizes(sharding)
        g = layout.resolve(sharding)
        self.layout, self.sharding, self.geometry = layout, sharding, g
        self.regions: list[np.ndarray] = []  #: uint8 view of each region, in the layout's region order
        if isinstance(memory, (list, tuple)):
            if len(memory) != len(sizes):
                raise InvalidArgumentError(f"{len(memory)} region buffers for a layout of {len(sizes)} regions")
            for m, n in zip(memory, sizes):
                a = np.asarray(m).view(np.uint8).reshape(-1)
                if a.nbytes < n:
                    raise InvalidArgumentError(f"a region buffer of {a.nbytes} bytes is smaller than the layout's {n}")
                self.regions.append(a[:n])
        else:
            mem = np.asarray(memory).view(np.uint8).reshape(-1)
            if mem.nbytes < sum(sizes):
                raise InvalidArgumentError(f"KV memory of {mem.nbytes} bytes is smaller than the layout's {sum(sizes)}")
            off = 0
            for n in sizes:
                self.regions.append(mem[off:off + n])
                off += n
        self.nbytes = sum(sizes)
        # one typed view per layer: [pages, planes, local heads, page_size, dim]
        self.layers: list[np.ndarray] = []
        for layer in range(layout.num_layers):
            r = self.regions[g.region(layer, 0)]
            self.layers.append(r[g.base(layer, 0):].view(F32)[: layout.num_pages * g.page_stride // 4].reshape(
                layout.num_pages, g.planes, g.local_heads, layout.page_size, layout.head_dim))

    @staticmethod
    def nbytes_for(layout: KVLayout, sharding: Sharding) -> int:
        return sum(layout.region_sizes(sharding))


# -- the forward pass -------------------------------------------------------------------------

#: A rank's forward pass as a generator: it yields the list of its units' partial sums at each
#: all-reduce and receives the reduced sum; it returns the final hidden states ``(M, hidden)``.
Forward = Generator[list[np.ndarray], np.ndarray, np.ndarray]


class RankModel:
    """The weights and KV cache of one TP rank (``tp=1`` is the whole, colocated model).

    ``forward`` computes a run of consecutive positions of one request; ``on_layer(layer)``
    (lead rank only) is called after each layer's attention all-reduce, where a streaming
    messenger bumps its layer counter.
    """

    def __init__(self, cfg: ModelConfig, rank: int, tp: int, cache: RankCache | None,
                 on_layer: Callable[[int], None] | None = None) -> None:
        self.cfg, self.rank, self.tp = cfg, rank, tp
        self.units = cfg.units_of(rank, tp)
        self.cache = cache
        self.on_layer = on_layer
        c = cfg
        self.embed = _w(c, (c.vocab, c.hidden), _EMBED, scale=_EMBED_SCALE)
        self.final_norm = _norm_w(c, c.hidden, _FINAL_NORM)
        L, H, qu, iu = c.layers, c.hidden, c.q_per_unit, c.i_per_unit
        self.attn_norm = [_norm_w(c, H, _ATTN_NORM, l) for l in range(L)]
        self.mlp_norm = [_norm_w(c, H, _MLP_NORM, l) for l in range(L)]
        self.gu = [[_w(c, (H, 2 * iu), _GU, l, u) for u in self.units] for l in range(L)]
        self.down = [[_w(c, (iu, H), _DOWN, l, u) for u in self.units] for l in range(L)]
        if c.attention == "gqa":
            d = c.head_dim
            self.qkv = [[_w(c, (H, (qu + 2) * d), _QKV, l, u) for u in self.units] for l in range(L)]
            self.o = [[_w(c, (qu * d, H), _O, l, u) for u in self.units] for l in range(L)]
            self.cos, self.sin = _rope_tables(c, d)
        else:
            d = c.head_dim  # qk "nope" and v head size
            self.dkv = [_w(c, (H, c.latent), _DKV, l) for l in range(L)]
            self.kv_norm = [_norm_w(c, c.kv_lora, _KV_NORM, l) for l in range(L)]
            self.q = [[_w(c, (H, qu * (d + c.rope_dim)), _Q, l, u) for u in self.units] for l in range(L)]
            # per unit: [q heads of the unit, kv_lora, d]
            self.uk = [[_w(c, (qu, c.kv_lora, d), _UK, l, u) for u in self.units] for l in range(L)]
            self.uv = [[_w(c, (qu, c.kv_lora, d), _UV, l, u) for u in self.units] for l in range(L)]
            self.o = [[_w(c, (qu * d, H), _O, l, u) for u in self.units] for l in range(L)]
            self.cos, self.sin = _rope_tables(c, c.rope_dim)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Tied output head on final hidden states ``(M, hidden)``."""
        return rmsnorm(h, self.final_norm, self.cfg.eps) @ self.embed.T

    # -- one run of positions ----------------------------------------------------------------
    def forward(self, tokens: np.ndarray, start: int, page_table: np.ndarray) -> Forward:
        """Positions ``[start, start + len(tokens))`` of one request whose pages are
        ``page_table`` (enough for every position): writes their KV, attends over
        ``[0, start + len(tokens))`` read back from the pages."""
        c = self.cfg
        tokens = np.asarray(tokens, np.int64)
        m = tokens.shape[0]
        end = start + m
        if end > c.max_positions:
            raise InvalidArgumentError(f"position {end - 1} beyond max_positions={c.max_positions}")
        if self.cache is None:
            raise InvalidArgumentError("this rank has no KV cache")
        pos = np.arange(start, end)
        pt = np.asarray(page_table, np.int64)
        need = c.pages_for(end)
        if pt.shape[0] < need:
            raise InvalidArgumentError(f"page table has {pt.shape[0]} pages, positions need {need}")
        where = (pt[pos // c.page_size], pos % c.page_size)
        read_pages = pt[:need]
        # causal mask for these queries against keys [0, end)
        mask = np.arange(end)[None, :] > pos[:, None]
        x = self.embed[tokens]
        for layer in range(c.layers):
            h = rmsnorm(x, self.attn_norm[layer], c.eps)
            if c.attention == "gqa":
                parts = self._gqa(layer, h, pos, where, read_pages, end, mask)
            else:
                parts = self._mla(layer, h, pos, where, read_pages, end, mask)
            a = yield parts
            if self.on_layer is not None:
                self.on_layer(layer)
            x = x + a
            h = rmsnorm(x, self.mlp_norm[layer], c.eps)
            parts = []
            for k in range(len(self.units)):
                gu = h @ self.gu[layer][k]
                g, up = gu[:, : c.i_per_unit], gu[:, c.i_per_unit:]
                parts.append(((g / (F32(1.0) + np.exp(-g))) * up) @ self.down[layer][k])
            f = yield parts
            x = x + f
        return x

    def _attend(self, q: np.ndarray, keys: np.ndarray, vals: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``q`` is ``(heads, M, dk)`` already scaled; returns ``(heads, M, dv)``."""
        nh, m, _ = q.shape
        s = q.reshape(nh * m, -1) @ keys.T
        s = s.reshape(nh, m, -1)
        s[:, mask] = -np.inf
        p = _softmax_rows(s).reshape(nh * m, -1)
        return (p @ vals).reshape(nh, m, -1)

    def _gqa(self, layer, h, pos, where, read_pages, end, mask) -> list[np.ndarray]:
        c = self.cfg
        d, qu, m = c.head_dim, c.q_per_unit, h.shape[0]
        cos, sin = self.cos[pos], self.sin[pos]
        kv = self.cache.layers[layer]
        scale = F32(1.0 / np.sqrt(d))
        parts = []
        for j in range(len(self.units)):  # local KV head j is unit self.units[j]
            qkv = h @ self.qkv[layer][j]
            q = _rope(qkv[:, : qu * d].reshape(m, qu, d), cos, sin)
            k = _rope(qkv[:, qu * d:(qu + 1) * d], cos, sin)
            kv[where[0], 0, j, where[1]] = k
            kv[where[0], 1, j, where[1]] = qkv[:, (qu + 1) * d:]
            keys = kv[read_pages, 0, j].reshape(-1, d)[:end]
            vals = kv[read_pages, 1, j].reshape(-1, d)[:end]
            o = self._attend((q * scale).transpose(1, 0, 2), keys, vals, mask)
            parts.append(o.transpose(1, 0, 2).reshape(m, qu * d) @ self.o[layer][j])
        return parts

    def _mla(self, layer, h, pos, where, read_pages, end, mask) -> list[np.ndarray]:
        c = self.cfg
        d, qu, m, r = c.head_dim, c.q_per_unit, h.shape[0], c.rope_dim
        cos, sin = self.cos[pos], self.sin[pos]
        kv = self.cache.layers[layer]
        # the latent is computed on every rank (replicated, same shapes, so the same bytes)
        ckv = h @ self.dkv[layer]
        lat = np.concatenate([rmsnorm(ckv[:, : c.kv_lora], self.kv_norm[layer], c.eps),
                              _rope(ckv[:, c.kv_lora:], cos, sin)], axis=-1)
        kv[where[0], 0, 0, where[1]] = lat
        keys = kv[read_pages, 0, 0].reshape(-1, c.latent)[:end]
        scale = F32(1.0 / np.sqrt(d + r))
        parts = []
        for j in range(len(self.units)):
            q = (h @ self.q[layer][j]).reshape(m, qu, d + r).transpose(1, 0, 2)  # (qu, M, d + r)
            # absorb W_uk into the query: scores against the latent directly
            q_lat = np.matmul(q[:, :, :d], self.uk[layer][j].transpose(0, 2, 1))  # (qu, M, kv_lora)
            q_rope = _rope(q[:, :, d:].transpose(1, 0, 2), cos, sin).transpose(1, 0, 2)
            qf = np.concatenate([q_lat, q_rope], axis=-1) * scale
            o_lat = self._attend(qf, keys, keys[:, : c.kv_lora], mask)  # (qu, M, kv_lora)
            o = np.matmul(o_lat, self.uv[layer][j])  # (qu, M, d)
            parts.append(o.transpose(1, 0, 2).reshape(m, qu * d) @ self.o[layer][j])
        return parts


def lockstep(forwards: Sequence[Forward]) -> np.ndarray:
    """Run the forward passes of all ranks of one TP group in one process: at each all-reduce,
    gather every rank's unit partials (ranks in order, so units in order) and reduce them.
    Returns rank 0's result (every rank ends with the same hidden states)."""
    msgs: list[list[np.ndarray]] = []
    for g in forwards:
        msgs.append(g.send(None))
    while True:
        total = reduce_units([p for m in msgs for p in m])
        out, done = [], []
        for g in forwards:
            try:
                out.append(g.send(total))
            except StopIteration as e:
                done.append(e.value)
        if done:
            if len(done) != len(forwards):
                raise RuntimeError("TP ranks disagree on the number of all-reduces")
            return done[0]
        msgs = out


class DraftHead:
    """A one-layer MTP-style draft head (DeepSeek-V3's MTP without its attention): from the
    main model's hidden state at position ``t`` and the token at ``t + 1`` it proposes the
    token at ``t + 2``. It needs no KV, only the hidden state, which is why the prefiller's
    last hidden state travels as context data."""

    def __init__(self, cfg: ModelConfig, embed: np.ndarray) -> None:
        c = cfg
        self.cfg, self.embed = c, embed
        self.norm_h = _norm_w(c, c.hidden, _D_NORM_H)
        self.norm_e = _norm_w(c, c.hidden, _D_NORM_E)
        self.norm_m = _norm_w(c, c.hidden, _D_NORM_M)
        self.final = _norm_w(c, c.hidden, _FINAL_NORM)
        self.proj = _w(c, (2 * c.hidden, c.hidden), _D_PROJ)
        self.gu = _w(c, (c.hidden, 2 * c.intermediate), _D_GU)
        self.down = _w(c, (c.intermediate, c.hidden), _D_DOWN)

    def propose(self, hidden: np.ndarray, token: int) -> int:
        c = self.cfg
        h = np.asarray(hidden, F32).reshape(1, c.hidden)
        e = self.embed[[int(token)]]
        ne = rmsnorm(e, self.norm_e, c.eps)
        # the token's own embedding stays in the stream, so the head guesses "more of the
        # same" where the model repeats itself: some drafts are accepted, not none
        x = np.concatenate([rmsnorm(h, self.norm_h, c.eps), ne], axis=-1) @ self.proj + ne
        gu = rmsnorm(x, self.norm_m, c.eps) @ self.gu
        g, up = gu[:, : c.intermediate], gu[:, c.intermediate:]
        x = x + ((g / (F32(1.0) + np.exp(-g))) * up) @ self.down
        return int(np.argmax(rmsnorm(x, self.final, c.eps) @ self.embed.T, axis=-1)[0])
