#!/bin/bash
# hog_kv.sh: item 3's acceptance shape beside a CPU hog, N runs per provider, one line each.
#
#   bash bench/hog_kv.sh [N] [extra kvxfer-bench kv arguments...]
#
# Per run: two busy loops (`python3 -c "while 1: pass"`, one per core of this 2-core machine),
# then `kvxfer-bench kv --preset stream-tp2-tp1 --tokens 384 --layer-ms 20 --repeat 5` on
# tcp;ofi_rxm and on shm, alternating; the loops are killed after each run. Prints per run
# the provider, one layer's transfer in bulk, the stream's tail (decoder done - last bump),
# tail / layer (goal <= 1.5) and the tail to the engine's own stamp of the last write
# (`landed`: Receive.t_landed), so tail - landed is the decoder's Python share. Run from
# outside the checkout with PYTHONPATH naming the tree to measure another one (as
# bench/ab_vs_nixl.sh). PYTHON: the interpreter (default: .venv/bin/python of this checkout).
set -u
N=${1:-8}
shift || true
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
for i in $(seq 1 "$N"); do
    for p in 'tcp;ofi_rxm' shm; do
        pids=()
        for _ in 1 2; do python3 -c "while 1: pass" & pids+=($!); done
        sleep 0.5
        line=$(timeout 300 "$PY" -m kvxfer.cli.bench kv --preset stream-tp2-tp1 --tokens 384 --layer-ms 20 \
               --repeat 5 --provider "$p" "$@" 2>&1 | grep '^stream-tp2-tp1 ' | tail -1)
        kill "${pids[@]}" 2>/dev/null
        wait "${pids[@]}" 2>/dev/null
        if [ -z "$line" ]; then echo "$p failed (no result row)"; continue; fi
        echo "$p $(echo "$line" | awk '{print "layer", $7, "tail", $8, "tail/layer", $9, "landed", $10}')"
    done
done
