"""Side by side: kvxfer's case results against a peer library's (NIXL, Mooncake) from the same run.

Pure data in, text / JSON / PNG out; no libfabric, no peer library. Every ratio reads
"kvxfer is x times as fast": GB/s divided for bandwidth, times divided the other way round for
latency, so > 1 always favours kvxfer.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["compare", "median_round", "table", "chart"]

_GOAL = {"a": 1.0, "b": 2.0, "c": 2.0}   # issue 13's goals, x the peer


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if not num or not den or not math.isfinite(num) or not math.isfinite(den):
        return None
    return num / den


def median_round(rounds: Sequence[dict]) -> dict:
    """One case's result over several rounds (``bw --rounds``): the round with the median
    GB/s (the lower middle of an even count), whole, so its columns stay one measurement;
    every round's GB/s, sender p50 and check under ``rounds``, every round's problems (and
    the sum of bad iterations); a failed check in any round fails the case."""
    if not rounds:
        raise ValueError("no rounds")
    order = sorted(range(len(rounds)), key=lambda k: rounds[k].get("gbps") or 0.0)
    out = dict(rounds[order[(len(rounds) - 1) // 2]])
    out["round"] = order[(len(rounds) - 1) // 2]
    out["rounds"] = [{"gbps": r.get("gbps"), "local_p50_s": r.get("local_p50_s"), "check": r.get("check")}
                     for r in rounds]
    # every round's problems, so a failed case says why whichever round failed
    out["problems"] = [f"round {k + 1}: {p}" for k, r in enumerate(rounds) for p in r.get("problems") or ()]
    out["bad_iterations"] = sum(int(r.get("bad_iterations") or 0) for r in rounds)
    if any(r.get("check") != "ok" for r in rounds):
        out["check"] = "FAIL"
    return out


def _median(v: Sequence[Optional[float]]) -> Optional[float]:
    """The middle value, the lower middle of an even count (as ``median_round`` picks)."""
    v = sorted(x for x in v if x is not None and math.isfinite(x))
    return v[(len(v) - 1) // 2] if v else None


def compare(provider: str, ours: Sequence[dict], theirs: Sequence[dict], peer: str) -> list[dict]:
    """One row per case both ran (matched by case spec), in kvxfer's order. With rounds
    (``median_round``), each figure is that figure's median over the rounds (the sender p50 of
    the median-GB/s round can be an outlier), and every round's pair of ratios is kept."""
    by_case = {(r["case"], r.get("op", "write")): r for r in theirs}     # a read row beside its write row
    rows = []
    for k in ours:
        t = by_case.get((k["case"], k.get("op", "write")))
        if t is None or k.get("kind") == "memmove":
            continue
        kr, tr = k.get("rounds"), t.get("rounds")
        paired = bool(kr and tr and len(kr) == len(tr))

        def fig(res: dict, rounds: Optional[list], key: str) -> Optional[float]:
            return _median([x.get(key) for x in rounds]) if paired and rounds else res.get(key)

        kg, tg = fig(k, kr, "gbps"), fig(t, tr, "gbps")
        ks, ts = fig(k, kr, "local_p50_s"), fig(t, tr, "local_p50_s")
        row = {
            "provider": provider, "case": k["case"], "label": k["label"], "letter": k.get("letter"), "peer": peer,
            "kvxfer_gbps": kg, "peer_gbps": tg, "gbps_ratio": _ratio(kg, tg),
            "kvxfer_sender_p50_s": ks, "peer_sender_p50_s": ts, "sender_ratio": _ratio(ts, ks),
            "kvxfer_check": k.get("check"), "peer_check": t.get("check"),
            "goal": _GOAL.get(k.get("letter") or "") if k.get("op", "write") == "write" else None,   # goals are for writes
        }
        if paired:   # bw --rounds: each round's pair, measured back to back
            row["rounds"] = len(kr)
            row["round_ratios"] = [_ratio(a.get("gbps"), b.get("gbps")) for a, b in zip(kr, tr)]
            row["sender_round_ratios"] = [_ratio(b.get("local_p50_s"), a.get("local_p50_s")) for a, b in zip(kr, tr)]
        rows.append(row)
    return rows


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, fmt)


def _us(v: Optional[float]) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v * 1e6:.1f} us"


def _span(v: Optional[Sequence[Optional[float]]]) -> str:
    """The range of per-round ratios, "-" without rounds."""
    v = [x for x in (v or ()) if x is not None]
    return f"{min(v):.2f}-{max(v):.2f}" if len(v) > 1 else "-"


def table(rows: Sequence[dict]) -> str:
    """The comparison as text: one block per peer, one line per (provider, case); with
    ``--rounds``, each figure is its median over the rounds and ``rounds`` is the range of
    the per-round ratios."""
    blocks = []
    for peer in dict.fromkeys(r["peer"] for r in rows):
        head = (f"{'provider':<11}  {'case':<25}  {'kvxfer GB/s':>11}  {peer + ' GB/s':>10}  {'x ' + peer:>7}  "
                f"{'rounds':>11}  {'kvxfer sender p50':>17}  {peer + ' sender p50':>16}  {'x ' + peer:>7}  "
                f"{'rounds':>11}  {'goal':>5}  check")
        lines = [head, "-" * len(head)]
        for r in rows:
            if r["peer"] != peer:
                continue
            check = "ok" if r["kvxfer_check"] == "ok" and r["peer_check"] == "ok" else "FAIL"
            lines.append(
                f"{r['provider']:<11}  {r['label']:<25}  {_f(r['kvxfer_gbps'], '.2f'):>11}  "
                f"{_f(r['peer_gbps'], '.2f'):>10}  {_f(r['gbps_ratio'], '.2f'):>7}  "
                f"{_span(r.get('round_ratios')):>11}  "
                f"{_us(r['kvxfer_sender_p50_s']):>17}  {_us(r['peer_sender_p50_s']):>16}  "
                f"{_f(r['sender_ratio'], '.2f'):>7}  {_span(r.get('sender_round_ratios')):>11}  "
                f"{_f(r['goal'], '.1f'):>5}  {check}"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def chart(rows: Sequence[dict], path: str) -> Optional[str]:
    """A PNG bar chart of GB/s per case, kvxfer beside the peer; None, or why not drawn."""
    if not rows:
        return "nothing to draw"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvxfer[compare]')"
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    keys = list(dict.fromkeys((r["provider"], r["label"]) for r in rows))
    ours = {}
    theirs = {p: {} for p in peers}
    for r in rows:
        k = (r["provider"], r["label"])
        ours.setdefault(k, r["kvxfer_gbps"] or 0.0)
        theirs[r["peer"]][k] = (r["peer_gbps"] or 0.0, r["gbps_ratio"])
    labels = [f"{p}\n{lab}" for p, lab in keys]
    x = range(len(keys))
    w = 0.8 / (1 + len(peers))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(keys)), 4.0))
    ax.bar([i - 0.4 + w / 2 for i in x], [ours[k] for k in keys], w, label="kvxfer")
    for j, peer in enumerate(peers):
        xs = [i - 0.4 + w * (j + 1.5) for i in x]
        vals = [theirs[peer].get(k, (0.0, None))[0] for k in keys]
        ax.bar(xs, vals, w, label=peer)
        for xi, k in zip(xs, keys):
            ratio = theirs[peer].get(k, (0.0, None))[1]
            if ratio:
                ax.annotate(f"{ratio:.2f}x", (xi, max(ours[k], theirs[peer][k][0])), ha="center", va="bottom",
                            fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s (p50)")
    ax.set_title(f"kvxfer vs {', '.join(peers)}, same run (ratios: kvxfer / peer)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
