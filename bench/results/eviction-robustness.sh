#!/bin/bash
# Eviction policies beyond the tuned settings (docs/eviction.md, robustness): every online policy, predicted-reuse and the oracles on the agent
# sources (40 sessions each) with 4 and 16 sessions live instead of 8, and with exponential
# tool latencies (mean 1 s) instead of a fixed 1 s. Writes $OUT/<source>-<setting>/,
# $LOGS/<source>-<setting>.txt and $OUT/table.md (the only file of $OUT that is committed). ~4 min on the 2-core VM with tokenized transcripts cached ($CACHE).
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/eviction/robustness}
LOGS=${LOGS:-${TMPDIR:-/tmp}}
CACHE=${CACHE:-${TMPDIR:-/tmp}/radixkv-trace-cache}
POLICIES=lru,lfu,fifo,gdsf,s3fifo,cost,predicted-reuse,belady,belady-cost
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
results=()
for t in tau-bench swe-agent mini-swe-agent-gemini3 crewai openhands; do
  for setting in c4 c16 exp; do
    case $setting in
      c4) flags="--concurrency 4" ;;
      c16) flags="--concurrency 16" ;;
      exp) flags="--tool-latency-dist exp" ;;
    esac
    nice -n 10 .venv/bin/radixkv bench eviction --shared --format chat --source "$t" \
        --block-size 16 --max-sessions 40 --trace-cache "$CACHE" --capacity 0.02,0.05,0.1,0.2 \
        --policies "$POLICIES" --jobs 2 --label "$t-$setting" --out "$OUT/$t-$setting" \
        $flags > "$LOGS/$t-$setting.txt" 2>/dev/null
    results+=("$OUT/$t-$setting/results.json")
  done
done
.venv/bin/python bench/_eviction_report.py "${results[@]}" > "$OUT/table.md"
cat "$OUT/table.md"
