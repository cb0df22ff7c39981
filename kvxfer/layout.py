"""How one rank's paged KV cache sits in memory, and how heads are sharded across TP ranks.

Pure numpy; a leaf next to ``errors``. The planner turns two of these (prefiller side,
decoder side) into byte offsets, so the layout must name every stride a write needs:

    offset(layer, plane, page, head, token)
        = layer_base(layer) + plane_base(plane) + page * page_stride
          + head * head_stride + token * token_stride          (dim is innermost, contiguous)
    region(layer, plane) = layer_region(layer) + plane_region(plane)

Offsets are bytes relative to the start of a registered region, because the engine writes
from one local region to one remote region per call. ``head`` is the rank's *local* head
index; which global heads a rank holds comes from its :class:`Sharding`.

Layout model
------------

`KVLayout(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, kv, layer_regions,
page_stride=None, layer_stride=None)` — `kv_heads` is the **model total**; a rank's share comes
from the `Sharding` passed next to it. `dtype` matters only by size; `"bfloat16"`, `"fp8"`,
`"torch.bfloat16"`… map to same-sized numpy types, and bf16 ≠ fp16.

| field | values | meaning |
|---|---|---|
| `order` | `HND`, `NHD` | within a (plane, page) block: `[heads, tokens, dim]` or `[tokens, heads, dim]` |
| `kv` | `fused` | K and V side by side in each page: `[pages, 2, block]` |
| | `stacked` | all K pages then all V pages in one region: `[2, pages, block]` |
| | `separate` | K and V each in their own region (a K pool and a V pool) |
| | `mla` | one plane, one latent vector per token, `kv_heads=1` |
| | `packed` | vLLM 0.32's `2 * head_dim` rows: HND per head K rows then V rows (CPU), NHD K|V per (token, head) |
| | `packed_rows` | vLLM 0.32's GPU backends: K|V in each (token, head) row of `2 * head_dim`, HND or NHD as `KVCacheLayout` names |
| `layer_regions` | `per_layer` | one region (or one per K/V pool) per layer |
| | `layer_major` | one region (per pool) holding all layers at `layer_stride` |
| `page_stride`, `layer_stride` | bytes | override the dense strides (padding); checked when resolved (below) |

Constructors for the engines people run:

| constructor | tensor per region | regions per rank |
|---|---|---|
| `KVLayout.vllm(..., order="HND")` (FlashInfer) | `[pages, 2, heads, page, dim]` (NHD: `[pages, 2, page, heads, dim]`) | one per layer |
| `KVLayout.flash_attn(...)` (vLLM FlashAttention) | `[2, pages, page, heads, dim]` | one per layer |
| `KVLayout.sglang(...)` | K and V `[tokens, heads, dim]`; page = `page_size` token slots | two per layer |
| `KVLayout.layer_major(..., kv="fused")` | `[layers, pages, 2, heads, page, dim]` | one (two with `kv="separate"`) |
| `KVLayout.mla(layers, latent_dim, ...)` | `[pages, page, latent_dim]` | one per layer (or layer-major) |
| `KVLayout.vllm_packed(..., order="HND")` (vLLM 0.32) | `[pages, heads, page, 2*dim]` (NHD: `[pages, page, heads, 2*dim]`) | one per layer, or one storage (`layer_stride`, `page_stride`) |
| `KVLayout.vllm_packed_rows(..., order="NHD")` (vLLM 0.32 on a GPU) | `[pages, page, heads, 2*dim]` (HND: `[pages, heads, page, 2*dim]`), K|V per row | one per layer, or one storage |

`layout.resolve(sharding) -> RankGeometry` fixes every stride in bytes for a rank of that
sharding (all ranks of one sharding have the same geometry); `layout.region_sizes(sharding)`
says how big each region to register must be.

Offset formulas
---------------

All offsets are bytes **relative to the start of a region**, because the engine's
`write_batch(src, peer, dst, src_offsets, dst_offsets, lengths, imm)` takes one local and one
remote region per call. With `lh` local heads, element size `e`, `c = head_dim * e` (one head
vector of one token), `B = lh * page_size * c` (one plane of one page):

```
region(layer, plane) = layer * regions_per_layer + plane_region[plane]
offset(layer, plane, page, head, token)
    = layer * layer_stride + plane_base[plane] + page * page_stride
      + head * head_stride + token * token_stride            (dim innermost, contiguous)

row = 2c if packed or packed_rows else c   (bytes from one token's vector to the next)
HND: head_stride = page_size * row, token_stride = row      (packed HND: token_stride = c)
NHD: head_stride = row,             token_stride = lh * row

kv        plane_region  plane_base             dense page_stride
fused     (0, 0)        (0, B)                 2B
stacked   (0, 0)        (0, num_pages*page_stride)   B
separate  (0, 1)        (0, 0)                 B
mla       (0,)          (0,)                   B
packed    (0, 0)        HND (0, page_size*c),  2B
                        NHD (0, c)
packed_rows (0, 0)      (0, c)                 2B

per_layer:   regions_per_layer = pools (2 if separate else 1), layer_stride = 0,
             region size = num_pages * page_stride (x2 if stacked)
layer_major: regions_per_layer = 0, layer_stride = that per-layer size unless given,
             region size = num_layers * layer_stride (layers outer: layer_stride >= a layer)
             or num_pages * page_stride (pages outer: every layer's page inside one page
             stride, layer_stride >= a dense page and page_stride >= num_layers * layer_stride;
             not for stacked)
```

The packed form is vLLM 0.32's: its CPU backend gives one tensor per layer,
`[blocks, kv_heads, block_size, 2 * head_size]` (HND), all layers views into one storage, and
its kernel reads each head's `[block_size, 2 * head_size]` as `[2 * block_size, head_size]`:
the block's K, then its `block_size` V rows (checked against vLLM's own cache write in
tests/vllm/test_vllm_pd.py). Its `vec` kernels store that K block transposed,
`[head_size, block_size]`, which this offset model (dim innermost) cannot name per token: a
(head, block) K|V run is exact, so two such caches of one block size move whole blocks
exactly (TP mismatch included, heads being outer), but a write that splits a block by
tokens (another form, another block size) would misplace K: `KVLayout.vllm_packed(...,
layer_regions="layer_major", layer_stride=..., page_stride=...)` with the strides of vLLM's
`kv_cache_config` (layer-major or block-major, both placements above). Its GPU backends pack
K|V per (token, head) in the order `KVCacheLayout` names: NHD `[blocks, block_size, kv_heads,
2 * head_size]`, HND `[blocks, kv_heads, block_size, 2 * head_size]` with K|V in each row
(not the CPU kernel's view): the `packed_rows` form, `KVLayout.vllm_packed_rows`, built by the
connector from the tensors' strides (kvxfer/integrations/vllm/layout.py; layer-major or
block-major storages, as `KVCacheLayout` places them). A packed page's K plane is every other
`c` bytes, so under either order a write moves one (head, token) vector unless the two sides
are the same packed shape, where K and V of a row (and whole pages) coalesce.

Sharding
--------

`Sharding(tp_size, replicated=False)`. With `H` KV heads and `t` ranks:

* `H >= t`: rank `r` holds heads `[r*H/t, (r+1)*H/t)`; `H % t != 0` is a `LayoutError`.
* `H < t` (GQA with fewer KV heads than ranks): each head lives on `t/H` ranks, rank `r` holds
  head `r // (t/H)`; `t % H != 0` is a `LayoutError`.
* `replicated=True` (MLA, or a replicated MHA cache): every rank holds every head. An MLA layout
  has one latent "head", so either sharding gives the same result.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvxfer._check import as_int
from kvxfer.errors import LayoutError

__all__ = ["KVLayout", "Sharding", "RankGeometry", "ORDERS", "KV_FORMS", "LAYER_REGIONS"]

Order = Literal["HND", "NHD"]
KVForm = Literal["fused", "stacked", "separate", "mla", "packed", "packed_rows"]
#: how a rank's layers map to regions: one region (per K/V pool) per layer, or every layer in
#: one region at ``layer_stride`` (the ``KVLayout.layer_regions`` field; not
#: ``kvxfer.topology.Placement``, which is where a GPU's transfers run)
LayerRegions = Literal["per_layer", "layer_major"]

ORDERS: tuple[str, ...] = ("HND", "NHD")
#: fused: K and V side by side inside each page ``[pages, 2, ...]`` (vLLM/FlashInfer);
#: stacked: all K pages then all V pages in one region ``[2, pages, ...]`` (vLLM flash-attn);
#: separate: K and V in their own regions (SGLang's k_buffer / v_buffer);
#: mla: one latent vector per token, no V plane, replicated on every rank;
#: packed: vLLM 0.32's ``2 * head_dim`` rows: HND a head's K rows then its V rows (CPU backend),
#: NHD K then V in each (token, head) row;
#: packed_rows: vLLM 0.32's GPU backends: K then V in each (token, head) row, HND or NHD.
KV_FORMS: tuple[str, ...] = ("fused", "stacked", "separate", "mla", "packed", "packed_rows")
#: per_layer: each layer its own region(s); layer_major: one region (per K/V pool) with
#: layers at ``layer_stride``.
LAYER_REGIONS: tuple[str, ...] = ("per_layer", "layer_major")

# Only the element size matters for byte offsets; numpy has no bf16/fp8, so these map to a
# same-sized integer type (and "bf16" and "fp16" stay distinct, as they should).
_DTYPE_ALIASES = {
    "bfloat16": "u2",
    "bf16": "u2",
    "fp8": "u1",
    "float8_e4m3fn": "u1",
    "float8_e4m3fnuz": "u1",
    "float8_e5m2": "u1",
    "float8_e5m2fnuz": "u1",
    "fp16": "f2",
    "half": "f2",
}


#: the number format an alias names, where two aliases name one ("fp8" stays generic: any
#: 8-bit float format, for a caller who does not say which)
_FORMAT_OF_ALIAS = {"bf16": "bfloat16", "half": "float16", "fp16": "float16"}


def dtype_format(dtype: Any) -> str:
    """The number format ``dtype`` names (``bfloat16``, ``float8_e4m3fn``, ``float16``, a numpy
    name, or the generic ``fp8``): what two layouts must agree on, beyond the element size,
    for the bytes of one to mean the same numbers in the other."""
    name = str(dtype).removeprefix("torch.")
    if name in _DTYPE_ALIASES:
        return _FORMAT_OF_ALIAS.get(name, name)
    return _as_dtype(dtype).name


def same_format(a: str, b: str) -> bool:
    """Whether two ``dtype_format`` names are one format (the generic ``fp8`` matches any fp8)."""
    if a == b:
        return True
    return "fp8" in (a, b) and all(x == "fp8" or x.startswith("float8_") for x in (a, b))


def _as_dtype(dtype: Any) -> np.dtype:
    name = str(dtype).removeprefix("torch.")
    if name in _DTYPE_ALIASES:
        return np.dtype(_DTYPE_ALIASES[name])
    for candidate in (dtype, name):
        try:
            return np.dtype(candidate)
        except TypeError:
            continue
    raise LayoutError(f"dtype {dtype!r} is not a numpy dtype nor one of {sorted(_DTYPE_ALIASES)}")


def _pos_int(name: str, value: Any, minimum: int = 1) -> int:
    return as_int(value, name, minimum=minimum, error=LayoutError)


@dataclass(frozen=True)
class Sharding:
    """Head sharding over ``tp_size`` ranks (GQA rule), or full replication (MLA).

    With ``H`` KV heads and ``H >= tp_size`` rank ``r`` holds heads ``[r*H/t, (r+1)*H/t)``;
    with ``H < tp_size`` each head lives on ``t/H`` ranks and rank ``r`` holds head
    ``r // (t/H)``. ``replicated=True`` puts every head (the MLA latent) on every rank.
    """

    tp_size: int
    replicated: bool = False

    def __post_init__(self) -> None:
        _pos_int("tp_size", self.tp_size)
        if not isinstance(self.replicated, (bool, np.bool_)):
            raise LayoutError(f"replicated must be a bool, got {self.replicated!r}")

    def check(self, kv_heads: int) -> None:
        """Raise :class:`LayoutError` unless ``kv_heads`` can be sharded over ``tp_size`` ranks."""
        if self.replicated:
            return
        t, h = self.tp_size, kv_heads
        if h >= t and h % t:
            raise LayoutError(f"kv_heads={h} cannot be split evenly over tp_size={t}")
        if h < t and t % h:
            raise LayoutError(f"tp_size={t} is not a multiple of kv_heads={h}, so heads cannot be replicated evenly")

    def local_heads(self, kv_heads: int) -> int:
        """How many KV heads each rank holds."""
        self.check(kv_heads)
        if self.replicated:
            return kv_heads
        return max(kv_heads // self.tp_size, 1)

    def heads(self, rank: int, kv_heads: int) -> range:
        """The global heads rank ``rank`` holds, in local order."""
        self.check(kv_heads)
        if not 0 <= rank < self.tp_size:
            raise LayoutError(f"rank {rank} outside tp_size={self.tp_size}")
        if self.replicated:
            return range(kv_heads)
        if kv_heads >= self.tp_size:
            n = kv_heads // self.tp_size
            return range(rank * n, (rank + 1) * n)
        h = rank // (self.tp_size // kv_heads)
        return range(h, h + 1)

    def holders(self, head: int, kv_heads: int) -> range:
        """The ranks that hold global ``head`` (more than one when replicated)."""
        self.check(kv_heads)
        if not 0 <= head < kv_heads:
            raise LayoutError(f"head {head} outside kv_heads={kv_heads}")
        if self.replicated:
            return range(self.tp_size)
        if kv_heads >= self.tp_size:
            r = head // (kv_heads // self.tp_size)
            return range(r, r + 1)
        k = self.tp_size // kv_heads
        return range(head * k, (head + 1) * k)


@dataclass(frozen=True)
class RankGeometry:
    """A :class:`KVLayout` resolved for one sharding: every stride in bytes.

    All ranks of one sharding share a geometry (they hold the same number of heads).
    """

    local_heads: int
    planes: int
    itemsize: int
    head_dim: int
    page_size: int
    num_pages: int
    num_layers: int
    head_stride: int
    token_stride: int
    page_stride: int
    block_bytes: int  #: data bytes of one (plane, page): local_heads * page_size * head_dim * itemsize
    plane_region: tuple[int, ...]
    plane_base: tuple[int, ...]
    regions_per_layer: int  #: region id shift per layer (0 when layer-major)
    layer_stride: int  #: base offset shift per layer (0 when one region per layer)
    num_regions: int
    region_size: int
    packed: bool = False  #: K and V interleaved per (head, token) row (``packed``, ``packed_rows``)

    def region(self, layer: int, plane: int) -> int:
        """Region id holding ``(layer, plane)``."""
        return layer * self.regions_per_layer + self.plane_region[plane]

    def base(self, layer: int, plane: int) -> int:
        """Byte offset of page 0 of ``(layer, plane)`` inside its region."""
        return layer * self.layer_stride + self.plane_base[plane]

    def offset(self, layer: int, plane: int, page: int, head: int = 0, token: int = 0) -> int:
        """Region-relative byte offset of ``(layer, plane, page, local head, token)``, dim 0."""
        return self.base(layer, plane) + page * self.page_stride + head * self.head_stride + token * self.token_stride

    @property
    def chunk(self) -> int:
        """Bytes of one (head, token) vector: the smallest contiguous unit."""
        return self.head_dim * self.itemsize


@dataclass(frozen=True)
class KVLayout:
    """One rank's paged KV memory, precisely enough to compute byte offsets.

    ``kv_heads`` is the model's total; the rank's share comes from the :class:`Sharding`
    passed alongside. ``order`` is the within-page order: ``HND`` keeps a head's tokens
    together (a head slice of a page is one contiguous run), ``NHD`` keeps a token's heads
    together (a head slice is ``page_size`` runs). ``page_stride`` and ``layer_stride`` (bytes)
    override the dense defaults, e.g. for padded pages; they are checked against the
    sharding when resolved. Use the constructors (:meth:`vllm`, :meth:`flash_attn`,
    :meth:`sglang`, :meth:`layer_major`, :meth:`mla`, :meth:`vllm_packed`, :meth:`vllm_packed_rows`) for the common
    engines.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: Any = "bfloat16"
    order: Order = "HND"
    kv: KVForm = "fused"
    layer_regions: LayerRegions = "per_layer"
    page_stride: int | None = None
    layer_stride: int | None = None
    _dtype: np.dtype = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "page_size", "num_pages"):
            _pos_int(name, getattr(self, name))
        object.__setattr__(self, "_dtype", _as_dtype(self.dtype))
        if self.order not in ORDERS:
            raise LayoutError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.kv not in KV_FORMS:
            raise LayoutError(f"kv must be one of {KV_FORMS}, got {self.kv!r}")
        if self.layer_regions not in LAYER_REGIONS:
            raise LayoutError(f"layer_regions must be one of {LAYER_REGIONS}, got {self.layer_regions!r}")
        if self.kv == "mla" and self.kv_heads != 1:
            raise LayoutError(
                f"an MLA layout has one latent vector per token (kv_heads=1), got kv_heads={self.kv_heads}")
        if self.page_stride is not None:
            _pos_int("page_stride", self.page_stride)
        if self.layer_stride is not None:
            if self.layer_regions != "layer_major":
                raise LayoutError("layer_stride only applies to layer_regions='layer_major'")
            _pos_int("layer_stride", self.layer_stride)

    # -- constructors for the engines people run -------------------------------------------
    @classmethod
    def vllm(cls, num_layers: int, kv_heads: int, head_dim: int, page_size: int, num_pages: int,
             dtype: Any = "bfloat16", order: Order = "HND", **kw: Any) -> KVLayout:
        """vLLM with FlashInfer: one tensor per layer, ``[pages, 2, heads, page, dim]`` (HND)
        or ``[pages, 2, page, heads, dim]`` (NHD)."""
        return cls(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, "fused", "per_layer", **kw)

    @classmethod
    def flash_attn(cls, num_layers: int, kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                   dtype: Any = "bfloat16", order: Order = "NHD", **kw: Any) -> KVLayout:
        """vLLM with FlashAttention: one tensor per layer, ``[2, pages, page, heads, dim]``."""
        return cls(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, "stacked", "per_layer", **kw)

    @classmethod
    def sglang(cls, num_layers: int, kv_heads: int, head_dim: int, page_size: int, num_pages: int,
               dtype: Any = "bfloat16", **kw: Any) -> KVLayout:
        """SGLang's MHA token pool: per layer a K buffer and a V buffer ``[tokens, heads, dim]``;
        a page is ``page_size`` consecutive token slots (so NHD, two regions per layer)."""
        return cls(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, "NHD", "separate", "per_layer", **kw)

    @classmethod
    def layer_major(cls, num_layers: int, kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                    dtype: Any = "bfloat16", order: Order = "HND", kv: KVForm = "fused", **kw: Any) -> KVLayout:
        """All layers in one registered region, ``[layers, pages, 2, heads, page, dim]`` by
        default (one region per K/V pool with ``kv='separate'``)."""
        return cls(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, kv, "layer_major", **kw)

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int, page_size: int, num_pages: int, dtype: Any = "bfloat16",
            layer_regions: LayerRegions = "per_layer", **kw: Any) -> KVLayout:
        """MLA (DeepSeek): one latent vector of ``latent_dim`` (e.g. 512 + 64 rope) per token,
        ``[pages, page, latent_dim]`` per layer, the same on every rank."""
        return cls(num_layers, 1, latent_dim, page_size, num_pages, dtype, "HND", "mla", layer_regions, **kw)

    @classmethod
    def vllm_packed(cls, num_layers: int, kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                    dtype: Any = "bfloat16", order: Order = "HND", layer_regions: LayerRegions = "per_layer",
                    **kw: Any) -> KVLayout:
        """vLLM 0.32's packed K|V: per layer ``[pages, heads, page, 2*dim]`` (HND: the CPU backend,
        whose kernel reads a head's block as its K rows then its V rows) or ``[pages, page,
        heads, 2*dim]`` (NHD, K in the first ``head_dim`` elements of a row and V in the second;
        the GPU backends' forms are :meth:`vllm_packed_rows`). vLLM's CPU backend views every
        layer into one storage: pass ``layer_regions="layer_major"`` with its ``layer_stride``
        and ``page_stride`` (block stride) in bytes."""
        return cls(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, "packed", layer_regions, **kw)

    @classmethod
    def vllm_packed_rows(cls, num_layers: int, kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                         dtype: Any = "bfloat16", order: Order = "NHD",
                         layer_regions: LayerRegions = "per_layer", **kw: Any) -> KVLayout:
        """vLLM 0.32's GPU backends (FlashAttention, FlashInfer, Triton): per layer the logical
        ``[pages, heads, page, 2*dim]`` with K then V in each (token, head) row, stored in the
        order ``KVCacheLayout`` names: NHD ``[pages, page, heads, 2*dim]`` or HND ``[pages,
        heads, page, 2*dim]``; one storage for every layer takes ``layer_regions="layer_major"``
        with its ``layer_stride`` and ``page_stride`` (layers outer, or inside each block)."""
        return cls(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, "packed_rows",
                   layer_regions, **kw)

    # -- derived --------------------------------------------------------------------------
    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype standing for ``dtype`` (same itemsize)."""
        return self._dtype

    @property
    def dtype_format(self) -> str:
        """The number format of ``dtype`` (see ``dtype_format``): fp8 e4m3 and e5m2 share a
        size but not a meaning."""
        return dtype_format(self.dtype)

    @property
    def itemsize(self) -> int:
        return self._dtype.itemsize

    @property
    def planes(self) -> int:
        """2 (K and V) or 1 (MLA latent)."""
        return 1 if self.kv == "mla" else 2

    @property
    def num_regions(self) -> int:
        """Registered regions per rank."""
        per_pool = 2 if self.kv == "separate" else 1
        return per_pool * (self.num_layers if self.layer_regions == "per_layer" else 1)

    def resolve(self, sharding: Sharding) -> RankGeometry:
        """Every stride in bytes for a rank of ``sharding``; raises :class:`LayoutError` on
        strides too small for the rank's heads."""
        if not isinstance(sharding, Sharding):
            raise LayoutError(f"expected a Sharding, got {sharding!r}")
        lh = sharding.local_heads(self.kv_heads)
        isz, d, p = self.itemsize, self.head_dim, self.page_size
        packed = self.kv in ("packed", "packed_rows")
        block = lh * p * d * isz
        row = (2 if packed else 1) * d * isz  # one token's vector(s) of one head
        if self.kv == "packed" and self.order == "HND":
            # vLLM's CPU kernel views a head's [page, 2*dim] as [2*page, dim]: page K rows, then
            # page V rows (vllm/v1/attention/backends/cpu_attn.py, view + chunk(2, dim=2))
            head_stride, token_stride = 2 * p * d * isz, d * isz
        elif self.order == "HND":
            head_stride, token_stride = p * row, row
        else:
            head_stride, token_stride = row, lh * row
        planes = self.planes
        in_page = planes if self.kv in ("fused", "packed", "packed_rows") else 1
        dense_page = in_page * block
        page_stride = dense_page if self.page_stride is None else self.page_stride
        if page_stride < dense_page:
            raise LayoutError(
                f"page_stride={page_stride} is smaller than a page ({dense_page} bytes for {lh} local heads)")
        pool = self.num_pages * page_stride  # one (layer, pool) span
        plane_region: tuple[int, ...]
        plane_base: tuple[int, ...]
        if self.kv == "fused":
            plane_region, plane_base = (0, 0), (0, block)
        elif self.kv == "stacked":
            plane_region, plane_base = (0, 0), (0, pool)
        elif self.kv == "separate":
            plane_region, plane_base = (0, 1), (0, 0)
        elif packed:
            plane_region, plane_base = (0, 0), ((0, p * d * isz) if self.kv == "packed" and self.order == "HND"
                                                else (0, d * isz))
        else:
            plane_region, plane_base = (0,), (0,)
        per_layer = pool * (2 if self.kv == "stacked" else 1)
        pools = 2 if self.kv == "separate" else 1
        if self.layer_regions == "per_layer":
            regions_per_layer, layer_stride = pools, 0
            num_regions, region_size = pools * self.num_layers, per_layer
        else:
            layer_stride = per_layer if self.layer_stride is None else self.layer_stride
            regions_per_layer = 0
            if layer_stride >= per_layer:  # layers outer
                num_regions, region_size = pools, self.num_layers * layer_stride
            elif (self.kv != "stacked" and layer_stride >= dense_page
                  and page_stride >= self.num_layers * layer_stride):  # pages outer, layers inside
                num_regions, region_size = pools, self.num_pages * page_stride
            else:
                raise LayoutError(
                    f"layer_stride={layer_stride} is smaller than a layer ({per_layer} bytes) and the layers do "
                    f"not fit inside a page either (that needs layer_stride >= {dense_page}, the page's bytes, "
                    f"and page_stride={page_stride} >= num_layers * layer_stride"
                    + (", and not the stacked form)" if self.kv == "stacked" else ")"))
        return RankGeometry(
            local_heads=lh, planes=planes, itemsize=isz, head_dim=d, page_size=p, num_pages=self.num_pages,
            num_layers=self.num_layers, head_stride=head_stride, token_stride=token_stride,
            page_stride=page_stride, block_bytes=block, plane_region=plane_region, plane_base=plane_base,
            regions_per_layer=regions_per_layer, layer_stride=layer_stride, num_regions=num_regions,
            region_size=region_size, packed=packed,
        )

    def region_sizes(self, sharding: Sharding) -> tuple[int, ...]:
        """Bytes each region of a rank of ``sharding`` must have (what to register)."""
        g = self.resolve(sharding)
        return (g.region_size,) * g.num_regions


# >>> issue 22: deprecated names: KVLayout.placement -> layer_regions, PLACEMENTS -> LAYER_REGIONS.
def __getattr__(name: str) -> Any:
    if name == "PLACEMENTS":
        warnings.warn("kvxfer.layout.PLACEMENTS is deprecated, use LAYER_REGIONS", DeprecationWarning, stacklevel=2)
        return LAYER_REGIONS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _layout_placement(self: KVLayout) -> str:
    warnings.warn("KVLayout.placement is deprecated, use KVLayout.layer_regions", DeprecationWarning, stacklevel=2)
    return self.layer_regions


_layout_init = KVLayout.__init__


_UNSET: Any = object()


def _layout_init_compat(self: KVLayout, *args: Any, placement: Any = _UNSET, **kw: Any) -> None:
    if placement is not _UNSET:
        warnings.warn("KVLayout(placement=) is deprecated, use layer_regions=", DeprecationWarning, stacklevel=2)
        if "layer_regions" in kw or (len(args) > 8 and args[8] != "per_layer"):
            raise TypeError("KVLayout() got both placement= and layer_regions=")
        if len(args) > 8:       # mla() and vllm_packed*() pass their default positionally
            args = args[:8] + (placement,) + args[9:]
        else:
            kw["layer_regions"] = placement
    _layout_init(self, *args, **kw)


KVLayout.placement = property(_layout_placement)  # type: ignore[attr-defined]
KVLayout.__init__ = _layout_init_compat  # type: ignore[method-assign]
# <<< issue 22
