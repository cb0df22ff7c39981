"""``kvxfer-demo``: disaggregated inference of a small model, checked token for token.

Starts a prefill node (TP worker processes) and a decode node, runs a batch of prompts
through them with a live progress line, prints per-request figures and whether the tokens are
identical to a colocated run; ``--json`` prints the figures as JSON. Exit status 1 on any
mismatch (tokens, accepted drafts, context, or the KV pages a request received), on a failed
request (with ``--kill-prefiller-after``, only requests of the killed node that failed after
the kill are expected; a drill whose kill never fired fails), or when the run itself fails
(a TP worker died, a node could not start); 2 on a bad command line; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from kvxfer.demo.flow import DemoConfig, Report, check_config, run

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    p = argparse.ArgumentParser(prog="kvxfer-demo", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--prompts", type=int, default=d.prompts, help="number of requests (default %(default)s)")
    p.add_argument("--min-len", type=int, default=d.min_len, help="shortest prompt (tokens)")
    p.add_argument("--max-len", type=int, default=d.max_len, help="longest prompt (tokens)")
    p.add_argument("--max-new", type=int, default=d.max_new, help="tokens generated per request")
    p.add_argument("--attention", choices=("gqa", "mla"), default=d.attention)
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp, help="prefill TP ranks (worker processes)")
    p.add_argument("--decode-tp", type=int, default=d.decode_tp, help="decode TP ranks (1, 2 or 4)")
    p.add_argument("--chunk", type=int, default=d.chunk, help="prefill chunk (tokens)")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="requests decoding at once")
    p.add_argument("--arrival-ms", type=float, default=d.arrival_ms, help="mean gap between arrivals (ms)")
    p.add_argument("--decode-pages", type=int, default=0, help="decoder pool pages (0: max-batch longest requests)")
    p.add_argument("--transport", choices=("numpy", "shm", "tcp;ofi_rxm", "tcp"), default=d.transport,
                   help="how KV moves: shm or tcp;ofi_rxm (kvxfer messengers; 'tcp' means tcp;ofi_rxm), "
                        "or numpy (plan-following copies, no fabric)")
    p.add_argument("--prefill-nodes", type=int, default=d.prefill_nodes,
                   help="prefill nodes (messenger transports; requests go round-robin)")
    p.add_argument("--kill-prefiller-after", type=int, default=0, metavar="N",
                   help="SIGKILL prefill node 0 once it prefilled N requests and holds another "
                        "(needs --prefill-nodes 2)")
    p.add_argument("--peer-timeout", type=float, default=d.peer_timeout, help="messenger dead-peer timeout (s)")
    p.add_argument("--no-stream", action="store_true",
                   help="move every layer after the last one is computed (default: layer by layer, "
                        "as the lead TP rank computes them; messenger transports only)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    return p


def _ms(x: float) -> str:
    return f"{x * 1e3:8.1f}"


def _table(r: Report) -> str:
    head = (f"{'req':>4} {'node':>4} {'prompt':>6} {'pages':>5} {'bytes':>9} {'queue ms':>8} {'prefill':>8} "
            f"{'tail':>8} {'wait':>8} {'step1':>8} {'TTFT ms':>8} {'acc':>3} same")
    lines = [head]
    for s in r.requests:
        node = "-" if s.node < 0 else str(s.node)
        if s.error:
            when = f" {s.failed_after:.2f} s after the kill" if s.after_kill else ""
            lines.append(f"{s.rid:>4} {node:>4} {s.prompt_len:>6}  failed{when}: {s.error[:70]}")
            continue
        lines.append(f"{s.rid:>4} {node:>4} {s.prompt_len:>6} {s.pages:>5} {s.bytes:>9} {_ms(s.queued)} "
                     f"{_ms(s.prefill)} {_ms(s.tail)} {_ms(s.wait)} {_ms(s.first_step)} {_ms(s.ttft)} "
                     f"{s.accepted:>3} {'yes' if s.identical else 'NO' if s.kv_identical else 'NO (KV)'}")
    c = r.config
    moved = sum(s.bytes for s in r.requests)
    ok = [s for s in r.requests if not s.error]
    ttft = np.array([s.ttft for s in ok]) * 1e3
    tail = np.array([s.tail for s in ok if s.pages]) * 1e3
    lines += [
        "",
        f"{len(r.requests)} requests, {c['attention']} TP{c['prefill_tp']} -> TP{c['decode_tp']}, "
        f"transport {c['transport']}: {r.wall:.2f} s, {r.tokens_per_s:.0f} tokens/s, "
        f"{moved / 1e6:.1f} MB of KV moved",
        f"TTFT ms p50 {np.percentile(ttft, 50):.1f} p90 {np.percentile(ttft, 90):.1f}; transfer tail ms p50 "
        f"{np.percentile(tail, 50) if tail.size else 0:.1f} p90 {np.percentile(tail, 90) if tail.size else 0:.1f}",
        f"layer streaming: {_streaming(r)}; tail = the lead rank's last layer computed -> KV and "
        "context landed at the decoder",
        f"draft tokens accepted: {sum(s.accepted for s in r.requests)} of "
        f"{sum(len(s.tokens) for s in r.requests)}",
        f"tokens identical to colocated: {'yes' if r.identical else 'NO (requests ' + str(r.mismatches) + ')'}"
        + (f" ({len(r.failed)} request(s) failed: {r.failed})" if r.failed else ""),
        f"received KV pages identical to colocated: "
        f"{'yes' if not r.kv_mismatches else 'NO (requests ' + str(r.kv_mismatches) + ')'}",
    ]
    return "\n".join(lines)


def _streaming(r: Report) -> str:
    moved = [s for s in r.requests if s.pages and not s.error]
    if r.config["transport"] == "numpy":
        return "off (numpy transport: every layer after the last)"
    if not r.config["stream"]:
        return "off (--no-stream: every layer moves after the last)"
    n = sum(1 for s in moved if s.streamed)
    return f"on ({n} of {len(moved)} transfers moved layer by layer, chunk {r.config['chunk']} tokens)"


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    from kvxfer.demo._blas import limit_blas_threads

    limit_blas_threads(1)
    dc = DemoConfig(prompts=a.prompts, min_len=a.min_len, max_len=a.max_len, max_new=a.max_new,
                    attention=a.attention, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, chunk=a.chunk,
                    max_batch=a.max_batch, arrival_ms=a.arrival_ms, decode_pool_pages=a.decode_pages,
                    transport="tcp;ofi_rxm" if a.transport == "tcp" else a.transport,
                    prefill_nodes=a.prefill_nodes, kill_prefiller_after=a.kill_prefiller_after,
                    peer_timeout=a.peer_timeout, stream=not a.no_stream, seed=a.seed)
    show = None
    if not a.quiet and not a.json:
        def show(line: str) -> None:
            sys.stderr.write("\r\x1b[2K" + line if sys.stderr.isatty() else line + "\n")
            sys.stderr.flush()
    try:
        check_config(dc)
    except Exception as e:  # a clear line, not a traceback, for a bad command line
        print(f"kvxfer-demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        report = run(dc, progress=show)
    except KeyboardInterrupt:  # the nodes were stopped on the way out
        print("\nkvxfer-demo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the run failed (a worker died, a node did not start): one clear line
        if show is not None and sys.stderr.isatty():
            sys.stderr.write("\n")
        print(f"kvxfer-demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if show is not None and sys.stderr.isatty():
        sys.stderr.write("\n")
    if a.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(_table(report))
    why = verdict(report)
    for line in why:
        print(f"kvxfer-demo: {line}", file=sys.stderr)
    return 1 if why else 0


def verdict(r: Report) -> list[str]:
    """Why the run fails ([] when it passes): a mismatch, a request that failed and is not
    excused by the kill drill (only node 0's, failed after its kill), or a drill whose kill
    never fired."""
    out = []
    if not r.identical:
        out.append(f"requests {r.mismatches} differ from the colocated run"
                   + (f" (received KV pages differ for {r.kv_mismatches})" if r.kv_mismatches else ""))
    k = int(r.config.get("kill_prefiller_after", 0))
    if k > 0 and not r.killed:
        out.append(f"--kill-prefiller-after {k}: the kill never fired (prefill node 0 never held another "
                   f"request after prefilling {k}; too few prompts for the drill?)")
    excused = {s.rid for s in r.requests if s.error and k > 0 and r.killed and s.node == 0 and s.after_kill}
    bad = [s for s in r.requests if s.error and s.rid not in excused]
    if bad:
        out.append(f"requests {[s.rid for s in bad]} failed"
                   + (" (not on the killed node after its kill)" if k > 0 else "") + f": {bad[0].error}")
    return out


if __name__ == "__main__":
    sys.exit(main())
