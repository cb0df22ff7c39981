#!/usr/bin/env bash
# ab_vs_nixl.sh: kvxfer before and after a change, each beside NIXL in the same invocation.
#
#   bash bench/ab_vs_nixl.sh BEFORE_TREE AFTER_TREE [REPS] [-- extra `bw` arguments]
#
# Each tree is a checkout with its extension built in place (a `git worktree` of the old
# commit, say). For REPS repetitions (default 2), per provider (shm, tcp;ofi_rxm), per tree in
# turn, it runs `kvxfer-bench bw --vs nixl --rounds 3 --seconds 0.5` on the 4 KiB write and
# cases (a), (b), (c) from /tmp with PYTHONPATH naming the tree, and prints each case's
# median ratio to NIXL and every round's. NIXL must be importable by PYTHON (default: the
# vLLM suite's venv, where `make test-vllm` installs nixl 1.5.1). docs/benchmarks.md, issue 28.
set -euo pipefail
before=$(realpath "$1"); after=$(realpath "$2"); reps=${3:-2}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
PY=${PYTHON:-$HOME/.cache/kvxfer/venv-vllm-cpu0.32.0-torch2.13.0/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cd /tmp
for rep in $(seq "$reps"); do for prov in shm "tcp;ofi_rxm"; do for tree in before after; do
  root=$before; [ $tree = after ] && root=$after
  json=$out/$rep-${prov%%;*}-$tree.json
  PYTHONPATH=$root "$PY" -m kvxfer.cli.bench bw --provider "$prov" --vs nixl --rounds 3 --seconds 0.5 \
    --case write:4K --case a --case b --case c "$@" --json "$json" >/dev/null 2>&1
  echo "$(date +%T) rep $rep $prov $tree ($root) load $(cut -d' ' -f1 /proc/loadavg)"
  "$PY" - "$json" <<'PY'
import json, sys

def rows(o):
    if isinstance(o, dict):
        if "kvxfer_sender_p50_s" in o:
            yield o
        for v in o.values():
            yield from rows(v)
    elif isinstance(o, list):
        for v in o:
            yield from rows(v)

for r in rows(json.load(open(sys.argv[1]))):
    if r["label"].startswith("write 4"):
        print("   %-22s sender p50 kvxfer %6.1f us nixl %6.1f us  x nixl %.2f  rounds %s" % (
            r["label"], r["kvxfer_sender_p50_s"] * 1e6, r["peer_sender_p50_s"] * 1e6, r["sender_ratio"],
            " ".join("%.2f" % x for x in r["sender_round_ratios"])))
    else:
        print("   %-22s GB/s kvxfer %6.2f nixl %6.2f  x nixl %.2f  rounds %s" % (
            r["label"], r["kvxfer_gbps"], r["peer_gbps"], r["gbps_ratio"],
            " ".join("%.2f" % x for x in r["round_ratios"])))
PY
done; done; done
