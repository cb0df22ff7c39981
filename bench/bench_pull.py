"""Push against pull through Messenger, one request at a time: milliseconds per request.

Two engines in one process (``python bench/bench_pull.py 'tcp;ofi_rxm'`` or ``shm``), a
prefiller offering pull that serves every request at once from pages ``0..n-1``, a decoder
asking ``receive(..., pull=False)`` then ``pull=True`` for 1 page (256 KiB: 4 layers, K and V,
16 tokens of 8 heads x 128 in float16) and 32 pages (8 MiB), 30 requests per point, three
rounds interleaved; prints each point's median of the rounds. A pull pays one more control
round trip (EXPOSE, the reads, DONE) than a push (REQUEST, the writes, ANNOUNCE).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import kvxfer
from kvxfer import KVLayout, Sharding


def main(provider: str, rounds: int = 3, per_point: int = 30) -> None:
    layout, sh = KVLayout.vllm(4, 8, 128, 16, 512, "float16"), Sharding(1)
    ea, eb = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
    src = [np.full(s, 7, np.uint8) for s in layout.region_sizes(sh)]
    dst = [np.zeros(s, np.uint8) for s in layout.region_sizes(sh)]
    p = kvxfer.Messenger(ea, layout, sh, {0: src}, peer_timeout=20, offer_pull=True,
                         on_request=lambda q: p.send(q, np.arange(len(q.dst_pages)), context=None))
    d = kvxfer.Messenger(eb, layout, sh, {0: dst}, peer_timeout=20)
    try:
        pg = d.connect(p.handshake())
        res: dict[tuple[bool, int], list[float]] = {}
        for rep in range(rounds):
            for pull in (False, True):
                for pages in (1, 32):
                    t0 = time.perf_counter()
                    for i in range(per_point):
                        d.receive(pg, f"{rep}-{pull}-{pages}-{i}", np.arange(pages), pages * layout.page_size,
                                  pull=pull).wait(30)
                    res.setdefault((pull, pages), []).append((time.perf_counter() - t0) / per_point)
        kib = 2 * layout.num_layers * layout.page_size * 8 * 128 * 2 // 1024
        for (pull, pages), v in sorted(res.items()):
            print(f"{provider} {'pull' if pull else 'push'} {pages} pages ({pages * kib} KiB) "
                  f"median ms/request {1e3 * sorted(v)[len(v) // 2]:.2f}")
    finally:
        d.close()
        p.close()
        ea.close()
        eb.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tcp;ofi_rxm")
