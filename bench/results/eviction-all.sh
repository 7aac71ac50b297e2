#!/bin/bash
# The eviction table of docs/eviction.md: every eviction policy on every trace of the shared
# data folder ($RADIXKV_SHARED_DIR, default ../shared), with block-by-block eviction. Conversation (Mooncake, block 512, llama3-8b cost model) at
# 2/5/10/20 %; the agent transcripts (block 16, smollm2-135m) at 2/5/10/20/30 %. Chat traces
# run on the modeled clock (reply tokens x 20 ms ITL, 1 s tool latency, 8 sessions live).
# Writes $OUT/<trace>/{results.json,results.csv,hit_rate.png}, each trace's stdout table to
# $LOGS/<trace>.txt, and $OUT/table.md (one markdown table: each policy's FLOP hit rate, the
# better oracle, the share of the LRU->oracle gap that predicted-reuse closes and its CPU us per
# evicted block). bench/results/README.md says which of these files are committed (the CSVs and
# most plots are not).
# Env: OUT (default bench/results/eviction), LOGS (default $TMPDIR or /tmp), JOBS (parallel
# replays, default 2),
# CACHE (tokenized transcripts kept between runs), EXTRA (more flags for every run, e.g.
# "--policies lru,cost,predicted-reuse,belady,belady-cost"), TRACES (subset, space-separated).
# mini-swe-agent-gemini3's tokenization (~2.5 min) is cached in $CACHE for later runs; the
# conversation trace took ~6 min for 10 policies x 4 capacities with JOBS=2 on this 2-core VM.
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/eviction}
LOGS=${LOGS:-${TMPDIR:-/tmp}}
JOBS=${JOBS:-2}
CACHE=${CACHE:-${TMPDIR:-/tmp}/radixkv-trace-cache}
EXTRA=${EXTRA:-}
TRACES=${TRACES:-conversation tau-bench swe-agent mini-swe-agent-gemini3 crewai openhands}
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
run() {
  local name=$1; shift
  echo "== $name" >&2
  nice -n 10 .venv/bin/radixkv bench eviction --shared --jobs "$JOBS" --label "$name" \
      --out "$OUT/$name" "$@" $EXTRA > "$LOGS/$name.txt"
  cat "$LOGS/$name.txt"
}
results=()
for t in $TRACES; do
  if [ "$t" = conversation ]; then
    run conversation --capacity 0.02,0.05,0.1,0.2
  else
    run "$t" --format chat --source "$t" --block-size 16 --trace-cache "$CACHE" \
        --capacity 0.02,0.05,0.1,0.2,0.3
  fi
  results+=("$OUT/$t/results.json")
done
.venv/bin/python bench/_eviction_report.py "${results[@]}" > "$OUT/table.md"
cat "$OUT/table.md"
