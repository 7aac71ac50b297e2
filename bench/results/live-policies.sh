#!/bin/bash
# Eviction policies on a live server (docs/retention.md, "The default policy"): for each of
# lru, cost and predicted-reuse, without and with retention, a fresh `radixkv serve` with a
# pool at about half of the live sessions' working set replays tau-bench agent sessions with
# think time between turns; one summary JSON (bench/results/live-policies.json). The model is
# $MODEL_DIR when set (the published run: a tiny random-init Llama with SmolLM2's tokenizer and
# a 16k context, tests.conftest.make_tiny_model_dir, so that think time, not compute, paces
# the sessions on 2 cores; prompts and cached tokens are SmolLM2's), else SmolLM2.
# Needs the shared data (--shared). Raw bench serve output goes to $LOGS.
set -u
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
LOGS=${LOGS:-$(mktemp -d /tmp/live-policies-XXXX)}
OUT=${OUT:-bench/results/live-policies.json}
BLOCKS=${BLOCKS:-442}          # half of the peak live working set (883 blocks) of 20 sessions, 4 live
BENCH="--source tau-bench --shared --sessions ${SESSIONS:-20} --concurrency ${CONCURRENCY:-4} \
 --think-time-s ${THINK:-exp:2} --seed 0 --max-tokens 16"
PORT=8310
for policy in lru cost predicted-reuse; do
  for ret in none anthropic-1h; do
    .venv/bin/radixkv serve --port $PORT --num-blocks $BLOCKS --eviction-policy $policy \
        ${MODEL_DIR:+--model $MODEL_DIR} \
        --log-level warning > $LOGS/serve-$policy-$ret.log 2>&1 &
    P=$!
    for _ in $(seq 300); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
    R=""; [ $ret != none ] && R="--retention $ret --retain-share ${SHARE:-0.1}"
    .venv/bin/radixkv bench serve --url http://127.0.0.1:$PORT $BENCH $R --label $policy \
        --json $LOGS/serve-$policy-$ret.json > $LOGS/bench-$policy-$ret.out 2>&1
    curl -s 127.0.0.1:$PORT/stats > $LOGS/stats-$policy-$ret.json
    kill $P; wait $P 2>/dev/null
    echo "$policy $ret done $(date +%T)"
  done
done
.venv/bin/python - "$LOGS" "$OUT" "$BLOCKS" "$BENCH" <<'PY'
import json, os, sys
from pathlib import Path
sys.path.insert(0, "bench")
from _provenance import provenance
logs, out, blocks, bench = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
keys = ("requests", "failed_requests", "prompt_tokens", "cached_tokens", "ideal_cached_tokens",
        "cached_over_prompt", "cached_over_ideal", "ttft_ms_p50", "ttft_ms_p90")
runs = []
for policy in ("lru", "cost", "predicted-reuse"):
    for ret in ("none", "anthropic-1h"):
        result = json.loads((logs / f"serve-{policy}-{ret}.json").read_text())
        result = result["results"][0] if "results" in result else result
        stats = json.loads((logs / f"stats-{policy}-{ret}.json").read_text())
        run = {"policy": policy, "retention": ret, **{k: result.get(k) for k in keys},
               "evicted_blocks": stats.get("evicted_blocks_total")}
        for name, group in (result.get("groups") or {}).items():
            run[name] = {k: group.get(k) for k in keys}
        runs.append(run)
Path(out).write_text(json.dumps({"model": os.environ.get("MODEL_DIR") or "SmolLM2-135M-Instruct",
                                 "num_blocks": blocks, "bench_serve_args": bench, "runs": runs,
                                 "provenance": provenance(["bash", "bench/results/live-policies.sh"])}, indent=1) + "\n")
print(f"wrote {out}")
PY
