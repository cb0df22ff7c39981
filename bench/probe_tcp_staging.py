"""Probe (issue 13, tcp (b)): scattered RMA writes against contiguous chunks plus a target-side scatter.

    .venv/bin/python bench/probe_tcp_staging.py --chunk 1M --iters 12 [--gather]

Case (b) of ``kvxfer-bench bw`` (4096 pages of 16 KiB into a random permutation of as many
destination pages) two ways, interleaved, over ``tcp;ofi_rxm`` on 127.0.0.1:

* ``rma``: one ``write_pages`` (1,024 messages of 4 pages: tcp's iovec limit);
* ``stage``: the 64 MiB source written in ``--chunk`` writes into a staging region of the
  target, which copies each chunk's pages to their destinations (numpy) as its counter
  completes.

``--gather`` scatters the source pages too, as a prefiller's KV cache is: ``rma`` then writes
them from their places and ``stage`` first gathers each chunk's pages into a bounce buffer.
Each iteration ends when the target's 8-byte acknowledgement lands. What it asks: would a
staged path (larger messages, one more copy at the target) beat the provider's per-message
cost on TCP? It is a probe, not a product path: a real one needs staging slots per peer,
credits, scatter lists checked against the granted region and a counting rule of its own,
and an RDMA NIC scatters for free (docs/benchmarks.md, "Staging on tcp").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

PAGE, PAGES = 16384, 4096
NBYTES = PAGE * PAGES
ACK = 1 << 20            # the acknowledgement's imm is the iteration's base plus this


def size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def target(conn, chunk: int) -> None:
    import kvxfer
    from kvxfer.wire import count_writes

    with kvxfer.Engine("tcp;ofi_rxm", node="127.0.0.1") as eng:
        dst = np.zeros(NBYTES, np.uint8)
        stage = np.zeros(NBYTES, np.uint8)
        one = np.zeros(8, np.uint8)
        with eng.register(dst) as dmr, eng.register(stage) as smr, eng.register(one) as omr:
            conn.send((eng.address, dmr.descriptor(), smr.descriptor()))
            addr, ack_desc = conn.recv()
            peer, ack = eng.connect(addr), eng.remote(ack_desc)
            d2, s2 = dst.reshape(PAGES, PAGE), stage.reshape(PAGES, PAGE)
            per = chunk // PAGE
            while (cmd := conn.recv()) is not None:
                mode, imm, perm, spages, check = cmd
                if mode == "rma":
                    so = spages.astype(np.uint64) * np.uint64(PAGE)
                    do = perm.astype(np.uint64) * np.uint64(PAGE)
                    ln = np.full(PAGES, PAGE, np.uint64)
                    eng.expect(imm, count_writes(so, do, ln, eng.iov, eng.max_write, 0, rails=1)).wait(30)
                else:
                    counters = [eng.expect(imm + j, 1) for j in range(PAGES // per)]
                    for j, c in enumerate(counters):
                        c.wait(30)
                        d2[perm[j * per:(j + 1) * per]] = s2[j * per:(j + 1) * per]
                eng.write(omr, 0, peer, ack, 0, 8, imm=imm + ACK).wait(30)
                if check:     # after the clock stopped: page perm[i] holds source page spages[i]
                    src = np.random.default_rng(0).integers(0, 255, NBYTES, dtype=np.uint8).reshape(PAGES, PAGE)
                    conn.send(bool(np.array_equal(d2[perm], src[spages])))
                    dst[:] = 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=size, default=1 << 20, help="bytes per staged write (a multiple of 16K)")
    ap.add_argument("--iters", type=int, default=12, help="iterations of each mode, interleaved; the first is warm-up")
    ap.add_argument("--gather", action="store_true",
                    help="source pages scattered too: stage gathers each chunk's pages into a bounce buffer "
                         "first (numpy), rma writes them from their scattered places")
    args = ap.parse_args()
    if args.chunk % PAGE or NBYTES % args.chunk:
        ap.error("--chunk must be a multiple of 16K that divides 64M")
    import kvxfer

    here, there = mp.Pipe()
    proc = mp.get_context("fork").Process(target=target, args=(there, args.chunk))
    proc.start()
    gbps: dict = {"rma": [], "stage": []}
    bad: list = []
    try:
        with kvxfer.Engine("tcp;ofi_rxm", node="127.0.0.1") as eng:
            src = np.random.default_rng(0).integers(0, 255, NBYTES, dtype=np.uint8)
            flag = np.zeros(8, np.uint8)
            bounce = np.zeros(NBYTES, np.uint8)
            s2, b2 = src.reshape(PAGES, PAGE), bounce.reshape(PAGES, PAGE)
            per = args.chunk // PAGE
            spages = np.random.default_rng(99).permutation(PAGES) if args.gather else np.arange(PAGES)
            with eng.register(src) as smr, eng.register(flag) as fmr, eng.register(bounce) as bmr:
                addr, ddesc, sdesc = here.recv()
                here.send((eng.address, fmr.descriptor()))
                peer, dst, stage = eng.connect(addr), eng.remote(ddesc), eng.remote(sdesc)
                imm = 1
                for it in range(args.iters):
                    perm = np.random.default_rng(it).permutation(PAGES)
                    for mode in ("rma", "stage"):
                        here.send((mode, imm, perm, spages, it == args.iters - 1))
                        time.sleep(0.05)                      # the target's expectations first
                        done = eng.expect(imm + ACK, 1)
                        t0 = time.perf_counter()
                        if mode == "rma":
                            eng.write_pages(smr, spages, peer, dst, perm, PAGE, imm=imm)
                        else:
                            for j in range(NBYTES // args.chunk):
                                off = j * args.chunk
                                if args.gather:
                                    b2[j * per:(j + 1) * per] = s2[spages[j * per:(j + 1) * per]]
                                    eng.write(bmr, off, peer, stage, off, args.chunk, imm=imm + j)
                                else:
                                    eng.write(smr, off, peer, stage, off, args.chunk, imm=imm + j)
                        done.wait(30)
                        if it:
                            gbps[mode].append(NBYTES / (time.perf_counter() - t0) / 1e9)
                        if it == args.iters - 1 and not here.recv():
                            bad.append(mode)
                        imm += 2 * ACK
        here.send(None)
    finally:
        proc.join(60)
    for mode, v in gbps.items():
        print(f"{mode:<6} chunk {args.chunk >> 10} KiB: median {np.median(v):.2f} GB/s over {len(v)} "
              f"({', '.join(f'{x:.2f}' for x in v)}), last iteration's data {'BAD' if mode in bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
