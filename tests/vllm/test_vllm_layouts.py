"""The GPU backends' KV caches of vLLM 0.32 described by the connector and moved by the planner,
outside vLLM (no GPU here): tensors shaped and strided as each ``KVCacheLayout`` places them
(vLLM's own enum: logical ``[layers, blocks, kv_heads, block_size, 2 * head_size]``, K|V in each
row), made on the CPU; ``cache_regions(rows=True)`` gives each rank's layout and regions, and a
TP mismatch plan between two of them, executed as byte copies between those regions, puts every
head's rows where the other side's tensors name them, and nothing else."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from conftest import HAVE_VLLM

if not HAVE_VLLM:
    pytest.skip("vllm is not installed (make test-vllm)", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.errors import UnsupportedError  # noqa: E402
from kvxfer.integrations.vllm.layout import cache_regions  # noqa: E402
from kvxfer.layout import Sharding  # noqa: E402
from kvxfer.planner import plan  # noqa: E402

L, BLOCKS, HEADS, BS, HD = 3, 6, 4, 16, 8      # layers, blocks, total KV heads, block size, head size
EXPRESSIBLE = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


def _cache(kind: str, tp: int, seed: int, per_layer: bool = False) -> dict:
    """One rank's ``kv_caches``: each layer ``[blocks, local heads, block_size, 2 * head_size]``
    (bf16), a view of one storage laid out as ``KVCacheLayout[kind]`` says (or, ``per_layer``,
    an allocation per layer, blocks inside as the layout orders them), random bytes."""
    order = KVCacheLayout[kind].stride_order
    logical = (L, BLOCKS, HEADS // tp, BS, 2 * HD)
    g = torch.Generator().manual_seed(seed)
    if per_layer:
        inner = [a - 1 for a in order if a != 0]
        phys = [torch.randint(-2**15, 2**15, [logical[1:][i] for i in inner], generator=g, dtype=torch.int16)
                for _ in range(L)]
        return {f"model.layers.{i}.self_attn": p.view(torch.bfloat16).permute(*np.argsort(inner).tolist())
                for i, p in enumerate(phys)}
    phys = torch.randint(-2**15, 2**15, [logical[a] for a in order], generator=g, dtype=torch.int16)
    view = phys.view(torch.bfloat16).permute(*np.argsort(order).tolist())
    return {f"model.layers.{i}.self_attn": view[i] for i in range(L)}


def _execute(p, src: list, dst: list) -> None:
    """Every planned write as a byte copy between the ranks' registered regions."""
    for (s, d) in p.pairs:
        w = p.writes(s, d)
        for sr, so, dr, do, n in zip(w.src_region, w.src_offset, w.dst_region, w.dst_offset, w.length):
            (sp, sn), (dp, dn) = src[s].regions[sr], dst[d].regions[dr]
            assert 0 <= so and so + n <= sn and 0 <= do and do + n <= dn
            ctypes.memmove(dp + int(do), sp + int(so), int(n))


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("src_kind", EXPRESSIBLE)
@pytest.mark.parametrize("dst_kind", EXPRESSIBLE)
def test_gpu_layouts_tp_mismatch_byte_exact(src_kind, dst_kind, src_tp, dst_tp):
    """P at ``src_tp`` in one KVCacheLayout, D at ``dst_tp`` in another: blocks ``SRC`` of
    every P rank land as blocks ``DST`` of every D rank, each D rank getting exactly its heads'
    rows (K|V) from the P rank holding them; every other byte of D's cache is untouched."""
    src_blocks, dst_blocks = [4, 0, 5], [1, 3, 2]
    src = [cache_regions(_cache(src_kind, src_tp, 10 + r), None, HEADS, src_tp, rows=True) for r in range(src_tp)]
    dst = [cache_regions(_cache(dst_kind, dst_tp, 20 + r, per_layer=dst_kind == "LBNHC"), None, HEADS, dst_tp,
                         rows=True) for r in range(dst_tp)]
    for c, kind, tp in [(c, src_kind, src_tp) for c in src] + [(c, dst_kind, dst_tp) for c in dst]:
        assert c.layout.kv == "packed_rows"
        if HEADS // tp > 1:                              # one head a block: HND and NHD are one form
            assert c.layout.order == ("HND" if "HN" in kind else "NHD")
        assert len(c.regions) == (L if (c in dst and kind == "LBNHC") else 1)
    before = [[t.view(torch.int16).clone() for t in c.owner] for c in dst]
    p = plan(src[0].layout, src[0].sharding, dst[0].layout, dst[0].sharding, src_blocks, dst_blocks)
    _execute(p, src, dst)
    per_src, per_dst = HEADS // src_tp, HEADS // dst_tp
    untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
    for d, c in enumerate(dst):
        for layer, (t, old) in enumerate(zip(c.owner, before[d])):
            got = t.view(torch.int16)
            for h in range(per_dst):
                gh = d * per_dst + h                      # the global head
                s, sh = divmod(gh, per_src)
                want = src[s].owner[layer].view(torch.int16)[src_blocks, sh]
                assert torch.equal(got[dst_blocks, h], want), (layer, d, gh)
            assert torch.equal(got[untouched], old[untouched])


@pytest.mark.parametrize("kind", ["LHBNC", "BHLNC"])
def test_heads_outside_the_blocks_are_refused(kind):
    """KVCacheLayouts whose heads are outside the blocks have no kvxfer layout: refused with
    what was found."""
    order = KVCacheLayout[kind].stride_order
    logical = (L, BLOCKS, HEADS, BS, 2 * HD)
    view = torch.zeros([logical[a] for a in order], dtype=torch.bfloat16).permute(*np.argsort(order).tolist())
    with pytest.raises(UnsupportedError, match="heads outside the blocks"):
        cache_regions({f"l{i}": view[i] for i in range(L)}, None, HEADS, 1, rows=True)


def test_cpu_backend_form_is_hnd_only():
    """The CPU kernel's form (``rows=False``, the default for CPU tensors) is HND: an NHD
    cache on the CPU is refused; the same tensors as GPU rows are described."""
    c = _cache("LBNHC", 1, 1)
    with pytest.raises(UnsupportedError, match="CPU backend keeps its blocks HND"):
        cache_regions(c, None, HEADS, 1)
    assert cache_regions(c, None, HEADS, 1, rows=True).layout.order == "NHD"
    hnd = cache_regions(_cache("LBHNC", 1, 1), None, HEADS, 1)
    assert hnd.layout.kv == "packed" and len(hnd.regions) == 1
