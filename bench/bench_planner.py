"""How long planning takes, and how many writes HND and NHD cost.

The goal (issue 5): a 128k-token prompt (8192 pages of 16 tokens) over 80 layers, TP8 -> TP4,
planned in well under 50 ms so planning never shows in time to first token.

    .venv/bin/python bench/bench_planner.py            # the table in docs/benchmarks.md ("Planner")
    .venv/bin/python bench/bench_planner.py --repeat 5 --pages 2048
    .venv/bin/python bench/bench_planner.py --other-page-sizes 32,24   # the page-size rows

Rows marked ``ps -> pd`` plan the same tokens into decode pages of another size
(``plan(..., num_tokens=)``, the token path).

``plan`` is the time of ``kvxfer.plan`` (what sits on the critical path before the first
write); ``all layers`` is the extra time to materialise every write of every layer through
``plan.layer(l).groups(s, d)``, which a messenger pays layer by layer while streaming.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from kvxfer.layout import KVLayout, Sharding
from kvxfer.planner import plan


def _time(fn, repeat: int) -> tuple[float, float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), out


def _stream(p) -> int:
    n = 0
    for layer in p.layers:
        lp = p.layer(layer)
        for s, d in lp.pairs:
            for _sr, _dr, so, do, ln in lp.groups(s, d):
                n += ln.shape[0]
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=8192, help="pages in the prompt (default 8192 = 128k tokens)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--other-page-sizes", default="32,24",
                    help="decode page sizes for the page-size rows (comma-separated; '' for none)")
    args = ap.parse_args()

    n, capacity = args.pages, 2 * args.pages
    rng = np.random.default_rng(0)
    scattered = (rng.permutation(capacity)[:n], rng.permutation(capacity)[:n])
    contiguous = (np.arange(n), np.arange(n))

    def mha(order: str, kind: str = "vllm") -> KVLayout:  # Llama-3-70B: 8 KV heads of 128, bf16
        make = KVLayout.sglang if kind == "sglang" else KVLayout.vllm
        extra = {} if kind == "sglang" else {"order": order}
        return make(args.layers, 8, 128, args.page_size, capacity, dtype="bfloat16", **extra)

    def mha_pages(order: str, page_size: int) -> tuple[KVLayout, tuple]:
        """A decode layout of ``page_size``-token pages holding the same tokens, scattered."""
        m = -(-n * args.page_size // page_size)
        lay = KVLayout.vllm(args.layers, 8, 128, page_size, 2 * m, dtype="bfloat16", order=order)
        return lay, (scattered[0], np.random.default_rng(1).permutation(2 * m)[:m])

    mla = KVLayout.mla(args.layers, 576, args.page_size, capacity, dtype="bfloat16")  # DeepSeek latent
    cases = [
        ("vLLM HND", mha("HND"), Sharding(8), mha("HND"), Sharding(4), scattered),
        ("vLLM NHD", mha("NHD"), Sharding(8), mha("NHD"), Sharding(4), scattered),
        ("vLLM HND", mha("HND"), Sharding(4), mha("HND"), Sharding(8), scattered),
        ("vLLM NHD", mha("NHD"), Sharding(4), mha("NHD"), Sharding(8), scattered),
        ("vLLM HND", mha("HND"), Sharding(8), mha("HND"), Sharding(8), scattered),
        ("vLLM HND contiguous", mha("HND"), Sharding(8), mha("HND"), Sharding(8), contiguous),
        ("HND -> SGLang", mha("HND"), Sharding(8), mha("NHD", "sglang"), Sharding(4), scattered),
        ("MLA replicated", mla, Sharding(8, True), mla, Sharding(4, True), scattered),
    ]
    for pd in [int(x) for x in args.other_page_sizes.split(",") if x.strip()]:
        for order, (st, dt) in (("HND", (8, 4)), ("NHD", (8, 4)), ("HND", (8, 8))):
            dl, pages = mha_pages(order, pd)
            cases.append((f"vLLM {order} {args.page_size}->{pd}", mha(order), Sharding(st), dl, Sharding(dt), pages))
    print(f"# {n} pages x {args.page_size} tokens ({n * args.page_size} tokens), {args.layers} layers; "
          f"python {platform.python_version()}, numpy {np.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'case':<22} {'TP':>7} {'plan ms (min/med)':>18} {'all layers ms':>14} "
          f"{'writes/layer':>13} {'writes total':>13} {'bytes/write':>12}")
    for name, sl, ss, dl, ds, (sp, dp) in cases:
        kw = {} if sl.page_size == dl.page_size else {"num_tokens": n * args.page_size}
        best, med, p = _time(lambda: plan(sl, ss, dl, ds, sp, dp, seed=0, **kw), args.repeat)
        sbest, _smed, count = _time(lambda: _stream(p), max(1, args.repeat // 3))
        assert count == p.num_triples
        per_layer = p.num_triples // args.layers
        print(f"{name:<22} {f'{ss.tp_size}->{ds.tp_size}':>7} {f'{best * 1e3:.1f} / {med * 1e3:.1f}':>18} "
              f"{sbest * 1e3:>14.1f} {per_layer:>13,} {p.num_triples:>13,} {p.num_bytes // max(p.num_triples, 1):>12,}")


if __name__ == "__main__":
    main()
