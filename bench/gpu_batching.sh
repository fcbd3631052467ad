#!/usr/bin/env bash
# Continuous batching on the H200 host (see bench/gpu_run.sh for staging the wheels):
#   step 1, carry [".whl/1", ".whl/3"]:  bash bench/gpu_batching.sh stash
#   step 2, carry [".whl/2"]:            bash bench/gpu_batching.sh run-1b
#   step 3 (same host):                  bash bench/gpu_batching.sh run-8b
# long-arrival (same host, MODEL to change the 8B bf16 shape): bench.long_arrival with the prefill
# chunks apart and in the decode step's pass, then bench.prefill_chunks' bucketed and mixed.
# sampled (same host, MODEL as above): bench.sampled_rows, a step's graph and time with 1/16/64
# sampled rows drawn together against row by row, with MLX's CUDA graphs on, then off.
# rows-sweep (same host, MODEL as above): bench.batch_ceiling at B = 1, 8-64 (BATCHES), graphs
# on then off.
# run-1b: the bare batched step ceiling (bench/batch_ceiling.py) at B = 1/4/16/64, then
# bench.compare through HTTP at 1/4/16/64 streams beside mlx_lm.server and vllm-mlx
# --continuous-batching, then trio-mlx alone at 1 stream with --max-num-seqs 1 (the serialized
# route) for the single-stream comparison. Results in $OUT.
# Run from the checkout root (where .whl/ is); the code measured is the one beside this script
# (CODE), which may be a copy staged under .whl/ when the device gets another checkout.
# HTTP_ARGS: extra arguments for trio-mlx serve (e.g. --no-cuda-graphs); SYSTEMS: which to run;
# COMPARE_ARGS: more for bench.compare (e.g. --start-one-by-one on an 80 GB card).
set -euo pipefail
CODE=$(dirname "$(dirname "$(readlink -f "$0")")")
case "${1:-}" in
  stash)
    bash .whl/1/on-gpu-host stash
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-vllm .whl/3/*.whl
    printf '#!/bin/sh\nPYTHONPATH=/tmp/site-vllm:/tmp/site exec python3 "$@"\n' > /tmp/vllm-python
    chmod +x /tmp/vllm-python
    exit 0 ;;
  run-1b) model=synthetic:llama-1b-bf16; name=llama-1b-bf16; deadline=${DEADLINE:-300} ;;
  run-8b) model=synthetic:llama-8b-bf16; name=llama-8b-bf16; deadline=${DEADLINE:-330} ;;
  run-8b-q4) model=synthetic:llama-8b-q4; name=llama-8b-q4; deadline=${DEADLINE:-330} ;;
  long-arrival|sampled|rows-sweep) model=${MODEL:-synthetic:llama-8b-bf16}; name=${model#synthetic:} ;;
  *) echo "usage: $0 stash | run-1b | run-8b | run-8b-q4 | long-arrival | sampled | rows-sweep" >&2
     exit 2 ;;
esac
: "${OUT:?OUT must name the folder for the results}"
if ! PYTHONPATH=/tmp/site python3 -c 'import mlx.core' 2>/dev/null; then bash .whl/2/on-gpu-host install; fi
export PYTHONPATH=/tmp/site:$CODE/src:$CODE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TRIO_MLX_BENCH_TOKENIZER=${TRIO_MLX_BENCH_TOKENIZER:-$PWD/.whl/2/tokenizer}
[[ -d $TRIO_MLX_BENCH_TOKENIZER ]] || export TRIO_MLX_BENCH_TOKENIZER=/tmp/trio-mlx-tokenizer
mkdir -p /tmp/trio-mlx-tokenizer && cp -n .whl/2/tokenizer/* /tmp/trio-mlx-tokenizer/ 2>/dev/null || true
[[ -f /tmp/trio-mlx-tokenizer/tokenizer.json ]] && export TRIO_MLX_BENCH_TOKENIZER=/tmp/trio-mlx-tokenizer
WORK=/tmp/trio-mlx-compare
stamp=$(date +%Y-%m-%d)
# the card in the results' names (the device lends an H100 or an H200)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && echo h100 || echo h200)
vllm=(--vllm-python none)
[[ -x /tmp/vllm-python ]] && vllm=(--vllm-python /tmp/vllm-python)
cd "$CODE"
if [[ "$1" == rows-sweep ]]; then
  # The bare batched step and BatchDecoder's at batch sizes around 16, with CUDA graphs on then
  # off: bench.sampled_rows stepped 16 rows of the 8B in 15.8 ms and 64 in 9.6-10.4 (H100,
  # 2026-12-06, one process), a lead to a slow path at some row counts.
  for graphs in 1 0; do
    MLX_USE_CUDA_GRAPHS=$graphs timeout 250 python3 -m bench.batch_ceiling --model "$model" \
      --batch "${BATCHES:-1,8,12,16,17,24,32,48,64}" --workdir "$WORK" \
      --out "$OUT/$stamp-$card-rows-sweep-$name-graphs-$graphs.json" | tail -12 || true
  done
  exit 0
fi
if [[ "$1" == sampled ]]; then
  for graphs in 1 0; do
    MLX_USE_CUDA_GRAPHS=$graphs timeout -s INT 250 python3 -m bench.sampled_rows --model "$model" \
      --rows 1,16,64 --steps 30 --workdir "$WORK" \
      --json "$OUT/$stamp-$card-sampled-rows-$name-graphs-$graphs.json" | tail -9 || true
  done
  exit 0
fi
if [[ "$1" == long-arrival ]]; then
  # Issue 16's ITL p99 while an 8k prompt is admitted, chunks apart against chunks in the
  # decode step's pass (`engine/mixed_step.py`), one process each; then the two passes apart.
  for mixed in ${MIXED:-off on}; do
    TRIO_MLX_MIXED_STEP=$mixed timeout -s INT 200 python3 -m bench.long_arrival --models "$model" \
      --streams 16 --prompt-tokens 8000 --repeats 3 --long-max-tokens 64 --trace-chunks --workdir "$WORK" \
      --json "$OUT/$stamp-$card-long-arrival-$name-mixed-$mixed.json" | tail -4 || true
  done
  [[ -n "${NO_CHUNKS:-}" ]] && exit 0
  timeout -s INT 200 python3 -m bench.prefill_chunks --model "$model" --chunks 128,256,512 \
    --variants bucketed,mixed --warm --deadline-s 150 --out "$OUT/$stamp-$card-prefill-chunks-$name.json" \
    | tail -13 || true
  exit 0
fi
for ceiling in ${CEILING_MODELS:-$model}; do
  timeout 150 python3 -m bench.batch_ceiling --model "$ceiling" --batch 1,4,16,64 --workdir "$WORK" \
    --out "$OUT/$stamp-$card-batch-ceiling-${ceiling#synthetic:}.json" || true
done
if [[ -z "${NO_COMPARE:-}" ]]; then
  timeout -s INT $((deadline + 60)) python3 -m bench.compare --model "$model" \
    --systems "${SYSTEMS:-http,mlx_lm_server,vllm_mlx}" --prompt-tokens 128 --max-tokens 256 \
    --concurrency "${CONCURRENCY:-1,4,16,64}" --repeats "${REPEATS:-2}" --workdir "$WORK" \
    --cell-timeout-s 120 --server-start-timeout-s 180 "${vllm[@]}" \
    --vllm-mlx-args=--continuous-batching --http-args="${HTTP_ARGS:-}" --deadline-s "$deadline" \
    ${COMPARE_ARGS:-} \
    --out "$OUT/$stamp-$card-batching-$name${SUFFIX:-}" || true
fi
if [[ "${SERIAL:-1}" == 1 && "$1" == "run-1b" ]]; then
  timeout -s INT 120 python3 -m bench.compare --model "$model" --systems http \
    --prompt-tokens 128 --max-tokens 256 --concurrency 1 --repeats 3 --workdir "$WORK" \
    --vllm-python none --http-args="--max-num-seqs 1" --deadline-s 60 \
    --out "$OUT/$stamp-$card-serialized-$name" || true
fi
tar -czf "$OUT/logs-$name.tar.gz" -C "$WORK" logs 2>/dev/null || true
ls -la "$OUT"
