#!/bin/bash
# Quantized KV at a fixed pool memory (docs/quantized-kv.md, "Capacity"): one fresh
# `radixkv serve` per --kv-cache-dtype (float32, int8), each given the same --kv-cache-memory,
# sized so that fp32 KV holds about 30 % of the live sessions' peak working set (and the longest
# request); each replays the same tau-bench agent sessions with think time between turns. One
# summary JSON ($OUT, default bench/results/kv-dtype-capacity.json): cached ÷ ideal, prompt and
# cached tokens, TTFT and the pool each format got. The published run (docs/quantized-kv.md)
# used KV_GIB=0.18196 SESSIONS=12 CONCURRENCY=4 MAX_TOKENS=8: 264 fp32 blocks, so fp32 refused
# the requests longer than its pool; these defaults serve every request in both formats but
# took over 30 minutes for the fp32 run alone on 2 cores. SmolLM2-135M-Instruct (fp32 weights) unless
# $MODEL_DIR. Needs the shared data (--shared). Raw bench serve output goes to $LOGS.
set -u
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
LOGS=${LOGS:-$(mktemp -d /tmp/kv-dtype-capacity-XXXX)}
OUT=${OUT:-bench/results/kv-dtype-capacity.json}
# The pool: 540 fp32 blocks of 16 tokens (540 x 737,280 B = 398,131,200 B), the longest
# tau-bench request (8,192 tokens, 513 blocks) plus a little, since a request longer than the
# whole pool is refused (HTTP 400) and the formats must serve the same requests. With 8 sessions
# live that is about 30 % of their peak working set (883 blocks with 4 live, live-policies.sh).
KV_GIB=${KV_GIB:-0.370789}
DTYPES=${DTYPES:-float32 int8}
BENCH="--source tau-bench --shared --sessions ${SESSIONS:-20} --concurrency ${CONCURRENCY:-8} \
 --think-time-s ${THINK:-exp:2} --seed 0 --max-tokens ${MAX_TOKENS:-16}"
PORT=${PORT:-8320}
for dtype in $DTYPES; do
  .venv/bin/radixkv serve --port $PORT --kv-cache-memory $KV_GIB --kv-cache-dtype $dtype \
      ${MODEL_DIR:+--model $MODEL_DIR} --log-level warning > $LOGS/serve-$dtype.log 2>&1 &
  P=$!
  for _ in $(seq 300); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  .venv/bin/radixkv bench serve --url http://127.0.0.1:$PORT $BENCH --label kv-$dtype \
      --json $LOGS/serve-$dtype.json > $LOGS/bench-$dtype.out 2>&1
  curl -s 127.0.0.1:$PORT/stats > $LOGS/stats-$dtype.json
  kill $P; wait $P 2>/dev/null
  echo "$dtype done $(date +%T)"
done
.venv/bin/python - "$LOGS" "$OUT" "$KV_GIB" "$BENCH" "$DTYPES" <<'PY'
import json, os, sys
from pathlib import Path
sys.path.insert(0, "bench")
from _provenance import provenance
logs, out, kv_gib, bench, dtypes = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5].split()
keys = ("requests", "failed_requests", "prompt_tokens", "cached_tokens", "ideal_cached_tokens",
        "cached_over_prompt", "cached_over_ideal", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50")
runs = []
for dtype in dtypes:
    result = json.loads((logs / f"serve-{dtype}.json").read_text())
    result = result["results"][0] if "results" in result else result
    stats = json.loads((logs / f"stats-{dtype}.json").read_text())
    pool = stats.get("pool") or {}
    runs.append({"kv_cache_dtype": dtype, **{k: result.get(k) for k in keys},
                 "num_blocks": pool.get("total_blocks"), "bytes_per_block": pool.get("bytes_per_block"),
                 "kv_bytes_per_token": stats.get("kv_bytes_per_token"),
                 "evicted_blocks": stats.get("evicted_blocks_total")})
Path(out).write_text(json.dumps({"model": os.environ.get("MODEL_DIR") or "SmolLM2-135M-Instruct",
                                 "kv_cache_memory_gib": kv_gib, "bench_serve_args": bench, "runs": runs,
                                 "provenance": provenance(["bash", "bench/results/kv-dtype-capacity.sh"])}, indent=1) + "\n")
print(json.dumps(runs, indent=1))
print(f"wrote {out}")
PY
