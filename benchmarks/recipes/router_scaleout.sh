#!/usr/bin/env bash
# docs/performance/cpu.md, "Scale-out: three replicas behind the router": one replica alone and,
# per variant, three fresh replicas behind a router whose config is deploy/haproxy/haproxy.cfg
# (as deploy/haproxy/render.sh renders it) edited by the variant's sed line; then one
# `radixserve-loadtest compare` over all of them (`--target NAME=ROUTER@R1,R2,R3` adds up the
# replicas' /metrics).
#
#   benchmarks/recipes/router_scaleout.sh MODEL_DIR OUT "VARIANT ..." LOADTEST_ARGS...
#
# Run from the repo root with PYTHONPATH=$PWD and haproxy on PATH. VARIANT: affinity (the shipped
# config), affinity-125, affinity-unbounded (other hash-balance-factor bounds), previous (the
# first 64 bytes of the input's text as its key, bound 125), round-robin. OUT gets the compare run,
# each router's config and log, each replica's log, load.txt (`uptime` before and after) and
# split.txt (each cluster's replicas' original tokens, warm-up included).
set -euo pipefail
model=$1 out=$2 variants=$3; shift 3; mkdir -p "$out"; pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
key64='s/%\[lua.radixserve_input_key\]/%[var(txn.prefix_text),bytes(0,64)]/'
declare -A edit=(  # each variant: the rendered config through this sed script
  [affinity]=''
  [affinity-125]='s/^    hash-balance-factor 200$/    hash-balance-factor 125/'
  [affinity-unbounded]='s/^    hash-balance-factor 200$/    hash-balance-factor 0/'
  [previous]="$key64; s/^    hash-balance-factor 200\$/    hash-balance-factor 125/"
  [round-robin]='s/^    balance hash var(txn.prefix_key)$/    balance roundrobin/'
)
serve() { python -m server.cli --model-id "$model" --hostname 127.0.0.1 --port "$1" > "$out/replica-$1.log" 2>&1 & pids+=($!); }
u() { echo "http://127.0.0.1:$1"; }
serve 18200; ports=(18200); targets=(--target "one-replica=$(u 18200)"); k=0
for v in $variants; do k=$((k + 1)); base=$((18200 + 10 * k))
  for i in 1 2 3; do serve $((base + i)); ports+=($((base + i))); done
  deploy/haproxy/render.sh 127.0.0.1:$((base + 1)) 127.0.0.1:$((base + 2)) 127.0.0.1:$((base + 3)) \
    | sed "${edit[$v]}" > "$out/$v.cfg"
  RADIXSERVE_ROUTER_BIND=127.0.0.1:$base RADIXSERVE_ROUTER_STATS_BIND=127.0.0.1:$((base + 5)) \
    haproxy -db -f "$out/$v.cfg" > "$out/haproxy-$v.log" 2>&1 & pids+=($!)
  targets+=(--target "$v=$(u $base)@$(u $((base + 1))),$(u $((base + 2))),$(u $((base + 3)))")
  echo "$v $((base + 1)) $((base + 2)) $((base + 3))" >> "$out/clusters.txt"
done
for p in "${ports[@]}"; do until curl -sf "$(u "$p")/health" > /dev/null; do sleep 1; done; done
sleep 3; uptime > "$out/load.txt"
python -m loadtest.cli compare "${targets[@]}" --out "$out" --quiet --no-plot "$@"
uptime >> "$out/load.txt"
while read -r v a b c; do  # each replica's original tokens (warm-up included)
  echo "$v $(for p in $a $b $c; do curl -s "$(u "$p")/metrics" \
    | awk '/^radixserve_tokens_total\{.*kind="original"/ {s += $2} END {printf "%d ", s}'; done)"
done < "$out/clusters.txt" > "$out/split.txt"
