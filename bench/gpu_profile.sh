#!/usr/bin/env bash
# Profile one request's hot path on the H200 host (after bench/gpu_run.sh's two install steps):
# bench.hot_path (TTFT phases, raw vs engine, with and without MLX's buffer-cache clearing; decode
# CPU per token per thread), then `trio-mlx serve` under py-spy (GIL holders, and wall time with
# idle frames) while bench/stream_client.py streams from it. Results in $OUT.
#   MODEL=synthetic:llama-1b-bf16 bash bench/gpu_profile.sh
set -uo pipefail
: "${OUT:?OUT must name the folder for the results}"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TRIO_MLX_BENCH_TOKENIZER=${TRIO_MLX_BENCH_TOKENIZER:-$PWD/.whl/2/tokenizer}
MODEL=${MODEL:-synthetic:llama-1b-bf16}
WORK=/tmp/trio-mlx-bench
SPY=/tmp/site/bin/py-spy
python3 -m bench.hot_path --model "$MODEL" --workdir "$WORK" --repeats "${REPEATS:-3}" \
  --json "$OUT/hot_path.json" 2>&1 | tail -n 40
python3 -m bench.prefix_cache --model "$MODEL" --workdir "$WORK" --system-tokens 2000 \
  --repeats "${REPEATS:-3}" --json "$OUT/prefix_cache.json" 2>&1 | tail -n 5
dir="$WORK/${MODEL#synthetic:}"
serve() {  # $1: name, rest: py-spy options (none: no py-spy)
  local name=$1; shift
  if [[ $# -gt 0 ]]; then
    "$SPY" record "$@" --format raw -o "$OUT/spy-$name.txt" -- \
      python3 -m trio_mlx serve "$dir" --port 8801 --served-model-name bench --cache-memory-mb 0 \
      > "$OUT/serve-$name.log" 2>&1 &
  else
    python3 -m trio_mlx serve "$dir" --port 8801 --served-model-name bench --cache-memory-mb 0 \
      > "$OUT/serve-$name.log" 2>&1 &
  fi
  for _ in $(seq 120); do
    curl -sf http://127.0.0.1:8801/health > /dev/null && break; sleep 0.5
  done
  for _ in 1 2 3; do
    timeout 120 python3 bench/stream_client.py --base-url http://127.0.0.1:8801/v1 --model bench \
      --prompt 128 --tokens 256 --concurrency 1 | tee -a "$OUT/client-$name.jsonl" | cut -c1-200
  done
  pkill -INT -f "trio_mlx serve $dir"; wait; sleep 1
}
serve plain
if "$SPY" --version; then
  serve gil --rate 1000 --threads --gil
  serve idle --rate 1000 --threads --idle
fi
ls -la "$OUT"
