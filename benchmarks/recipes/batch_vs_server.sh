#!/usr/bin/env bash
# One round of docs/performance/cpu.md, "Batch jobs against the server": the same pointwise rerank
# file answered by `radixserve-batch` (grouped, then --no-grouping) and by a server under the load
# tester, with the prefix cache at `auto` and then off (0), one run after another.
#
#   benchmarks/recipes/batch_vs_server.sh MODEL_DIR OUT      (repo root; the package installed)
#
# MODEL_DIR: a reranker checkpoint (python -m fixtures /tmp/q06b-rerank --preset qwen3-0.6b
# --layers 2 --kind reranker). OUT/C/ gets, per cache setting C: g.json and n.json (the job's
# reports: compact_tokens, cpu_seconds), s/ (the load tester's run: tokens_compact) and
# server-cpu.txt (the server's utime+stime in seconds around the load test, from /proc/PID/stat;
# the load tester's own CPU not counted). OUT/load.txt: `uptime` before and after. The server
# listens on port 18431.
set -euo pipefail
model=$1 out=$2
mkdir -p "$out"; pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null' EXIT
cpu_s() {  # utime + stime of process $1, in seconds
  awk -v hz="$(getconf CLK_TCK)" '{sub(/.*\) /, ""); print ($12 + $13) / hz}' "/proc/$1/stat"
}
uptime > "$out/load.txt"
python -m benchmarks.batch_file --workload rerank-pointwise --order interleave:16 --source synthetic \
  --queries 48 --query-words 40,80 --seed 0 --out "$out/pairs.jsonl"
for C in auto 0; do
  d=$out/$C; mkdir -p "$d"
  radixserve-batch -i "$out/pairs.jsonl" -o "$d/g.jsonl" --model "$model" --device cpu --prefix-cache-size "$C" \
    --report "$d/g.json" --no-progress
  radixserve-batch -i "$out/pairs.jsonl" -o "$d/n.jsonl" --model "$model" --device cpu --prefix-cache-size "$C" \
    --report "$d/n.json" --no-progress --no-grouping
  radixserve --model-id "$model" --device cpu --prefix-cache-size "$C" --port 18431 > "$d/server.log" 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:18431/health > /dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "the server exited: $d/server.log" >&2; exit 1; }
    sleep 1
  done
  before=$(cpu_s "$pid")
  radixserve-loadtest run --url http://127.0.0.1:18431 --workload rerank-pointwise --order interleave:16 \
    --source synthetic --queries 48 --query-words 40,80 --seed 0 --concurrency 64 --warmup 0 --out "$d/s" \
    --no-progress
  awk -v a="$before" -v b="$(cpu_s "$pid")" 'BEGIN {print b - a}' > "$d/server-cpu.txt"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
done
uptime >> "$out/load.txt"
