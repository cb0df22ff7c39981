#!/bin/bash
# ab_arm.sh: issue 28 item 2's minimal request with the engine's ANNOUNCE arm (src/announce.c,
# the default) against the messenger thread arming it (KVXFER_NATIVE_ANNOUNCE=0), interleaved.
#
#   bash bench/ab_arm.sh [N] [ITERS] [extra kvxfer-bench msg arguments...]
#
# Per round and provider (shm, then tcp;ofi_rxm): `kvxfer-bench msg --requests 20
# --latency-iters ITERS --placement per_layer` once with the arm, once without, and one line
# each: the minimal request's p50, the write round trip's p50 beside it, their ratio (goal
# <= 1.5), the p50 of each step (receive() -> Receive made -> counted (the engine's stamp) ->
# done -> wait() returned), and per minimal request the decoder's CPU (its progress threads')
# and its Python threads' wake-ups (MainThread, kvxfer-msg). With BASE=<another checkout, built
# in place> each round also runs that tree ("base": run from outside both checkouts, so
# PYTHONPATH picks the tree). PYTHON: the interpreter (default: .venv/bin/python of this checkout).
set -u
N=${1:-4}
ITERS=${2:-2000}
shift 2 || shift $#
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
J=$(mktemp /tmp/ab_arm.XXXXXX.json)
trap 'rm -f "$J"' EXIT
for i in $(seq 1 "$N"); do
    for p in shm 'tcp;ofi_rxm'; do
        for arm in ${BASE:+base} 1 0; do
            tree=$HERE
            [ "$arm" = base ] && tree=$BASE
            if ! PYTHONPATH=$tree KVXFER_NATIVE_ANNOUNCE=${arm/base/1} timeout 300 "$PY" -m kvxfer.cli.bench msg --requests 20 \
                    --latency-iters "$ITERS" --placement per_layer --provider "$p" --json "$J" "$@" > /dev/null 2>&1; then
                echo "$p arm=$arm failed"; continue
            fi
            "$PY" - "$J" "$p" "$arm" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
c = r.get("minimal_cpu", {})
th = c.get("decoder_sleeps_by_thread", {})
steps = "/".join(f"{r.get(k, float('nan')):.0f}" for k in ("minimal_to_made_p50_us", "minimal_to_landed_p50_us",
                                                          "minimal_landed_to_done_p50_us",
                                                          "minimal_done_to_return_p50_us"))
print(f"{sys.argv[2][:3]} {dict(base='base', **{'1': 'arm', '0': 'msg'})[sys.argv[3]]} minimal {r['minimal_p50_us']:.0f} us "
      f"rtt {r['write_rtt_p50_us']:.0f} us ratio {r['minimal_p50_us'] / r['write_rtt_p50_us']:.1f} "
      f"steps {steps} decoder cpu {c.get('decoder_cpu_us', float('nan')):.0f} "
      f"(progress {c.get('decoder_progress_cpu_us', float('nan')):.0f}) us "
      f"wakes main {th.get('MainThread', 0):.1f} msg {th.get('kvxfer-msg', 0):.1f}")
PY
        done
    done
done
