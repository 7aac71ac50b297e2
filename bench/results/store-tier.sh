#!/bin/bash
# Store-tier measurements (bench/results/store-tier.md), one server config at a time.
set -u
cd "$(dirname "$0")/../.."
R=bench/results
export HF_HUB_OFFLINE=1
MC=.venv/bin/mooncake_master
start_master() {  # $1 rpc port, $2 metadata port, $3 metrics port
  $MC --rpc_port=$1 --rpc_address=127.0.0.1 --enable_http_metadata_server=true \
      --http_metadata_server_host=127.0.0.1 --http_metadata_server_port=$2 \
      --metrics_host=127.0.0.1 --metrics_port=$3 > ${LOGS:-/tmp}/master-$1.log 2>&1 &
  MPID=$!; sleep 3
}
serve() {  # $1 port, $2 num blocks, $3 model args, $4 store args
  OMP_NUM_THREADS=${THREADS:-2} .venv/bin/radixkv serve --port $1 --num-blocks $2 $3 $4 --log-level warning \
      > ${LOGS:-/tmp}/serve-$1.log 2>&1 &
  echo $!
}
wait_up() { until curl -sf 127.0.0.1:$1/health >/dev/null; do sleep 1; done; }
MOON() { echo "mooncake://127.0.0.1:$1?metadata=http://127.0.0.1:$2/metadata&local=127.0.0.1:$3&segment_gib=1"; }

capacity() {  # $1 label, $2 model args, $3 blocks, $4 bench args
  for store in none host mooncake; do
    case $store in
      none) S="";; host) S="--kv-store host:2";;
      mooncake) start_master 50261 50262 50263; S="--kv-store $(MOON 50261 50262 50260)";;
    esac
    P=$(serve 8300 $3 "$2" "$S"); wait_up 8300
    .venv/bin/radixkv bench serve --url http://127.0.0.1:8300 $4 --concurrency 4 --max-tokens 16 \
        --json $R/store-capacity-$1-$store.json > ${LOGS:-/tmp}/bench-$1-$store.out 2>&1
    curl -s 127.0.0.1:8300/stats > ${LOGS:-/tmp}/stats-$1-$store.json
    kill $P; wait $P 2>/dev/null
    [ $store = mooncake ] && { kill $MPID; wait $MPID 2>/dev/null; }
    echo "capacity $1 $store done $(date +%T)"
  done
}
sharing() {  # $1 label, $2 model args, $3 bench args
  for store in none mooncake; do
    SA=""; SB=""
    if [ $store = mooncake ]; then start_master 50361 50362 50363; SA="--kv-store $(MOON 50361 50362 50360)"; SB="--kv-store $(MOON 50361 50362 50364)"; fi
    PA=$(THREADS=1 serve 8400 2000 "$2" "$SA"); PB=$(THREADS=1 serve 8401 2000 "$2" "$SB")
    wait_up 8400; wait_up 8401
    .venv/bin/radixkv bench serve --url http://127.0.0.1:8400 --url http://127.0.0.1:8401 --dispatch alternate \
        $3 --concurrency 4 --max-tokens 16 --json $R/store-sharing-$1-$store.json > ${LOGS:-/tmp}/share-$1-$store.out 2>&1
    kill $PA $PB; wait $PA $PB 2>/dev/null
    [ $store = mooncake ] && { kill $MPID; wait $MPID 2>/dev/null; }
    echo "sharing $1 $store done $(date +%T)"
  done
}
TINY="--model ${TINY_MODEL_DIR:?a tiny random-init model dir, see store-tier.md}"
capacity tiny20 "$TINY" 700 "--source tau-bench --shared --sessions 20"
sharing tiny20 "$TINY" "--source tau-bench --shared --sessions 20"
capacity smollm2 "" 320 "--source tau-bench --shared --sessions 6 --max-turns 8"
sharing smollm2 "" "--source tau-bench --shared --sessions 6 --max-turns 8"
echo ALL DONE
