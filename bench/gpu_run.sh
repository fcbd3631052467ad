#!/usr/bin/env bash
# bench/compare.py on the H200 host: synthetic Llama-3.2-1B (bf16) and Llama-3-8B (4-bit) shapes,
# raw mlx-lm vs the trio-mlx engine vs `trio-mlx serve` vs mlx_lm.server, in about 8 minutes.
# vllm-mlx needs mlx-lm<0.32, so it gets a site of its own on the host (/tmp/site-vllm, before
# /tmp/site on its path, run through the wrapper /tmp/vllm-python); without it it is skipped.
#
# Here, in the checkout (once):
#   bash bench/gpu_run.sh stage
#     = ../shared/gpu/stage-wheels with the versions of /tmp/venv pinned, plus the SmolLM2
#       tokenizer files in .whl/2/tokenizer (the host cannot fetch the GGUF they come from)
# On the GPU host (device tool, from the checkout root):
#   step 1, carry [".whl/1"]:  bash .whl/1/on-gpu-host stash
#   step 2, carry [".whl/2"]:  bash .whl/2/on-gpu-host install && bash bench/gpu_run.sh
# With vllm-mlx: `bash bench/gpu_run.sh stage-vllm` here (fills .whl/3, ~19 MB), and on the host,
# between steps 1 and 2 or after step 2: carry [".whl/3"], `bash bench/gpu_run.sh install-vllm`.
# The results land in $OUT (JSON, markdown, a label-less PNG as matplotlib is absent there, and
# logs.tar.gz). Back here, redraw the plot with matplotlib:
#   python -m bench.compare --render docs/benchmarks/<name>.json
#
# Knobs: MODELS (default "synthetic:llama-1b-bf16 synthetic:llama-8b-q4"; one per command if the two
# do not fit one call), DEADLINE_1B / DEADLINE_8B (seconds after which no new cell starts), REPEATS
# (default 2), DECODE_PAIRS (default 0: `bench.compare --decode-pairs`, decode ratios within
# back-to-back pairs; ~2 s a pair and system on the 1B). Each model's run is also killed (SIGINT: it
# still writes what it has and stops its servers) TIMEOUT_PAD seconds after its deadline. The
# deadlines count from the start of each model's run (building the synthetic weights, loading three
# copies, warm-up included); the defaults (170 s + 230 s, hard caps 230 s + 290 s) keep install +
# both models under the 10-minute command limit, at the price of an incomplete second repeat (and,
# on 8B, perhaps the last cell: prompt 2048 x 16 streams). For the full grid run one model per
# command with a larger deadline:
#   MODELS=synthetic:llama-8b-q4 DEADLINE_8B=420 bash bench/gpu_run.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || dirname "$(dirname "$(readlink -f "$0")")")"

# Versions as installed in /tmp/venv (Python 3.11 there; the host has 3.12: stage-wheels fetches
# cp312 wheels). These are what trio-mlx, its HTTP stack and the openai client need that the host
# lacks or may have too old; mlx/mlx-cuda-13/mlx-lm come pinned from stage-wheels itself.
PINS=(
  trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 sortedcontainers==2.4.0 attrs==26.1.0
  hypercorn==0.18.0 h11==0.16.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0
  wsproto==1.3.2
  quart==0.22.0 quart-trio==0.12.0 blinker==1.9.0 flask==3.1.3 itsdangerous==2.2.0
  aiofiles==25.1.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20
  anyio==4.16.0
  llguidance==1.9.1
)

# vllm-mlx 0.6.0 and what its server imports, as in the CPU runs' venv (docs/benchmarks/README.md).
VLLM_PINS=(
  vllm-mlx==0.6.0 mlx-lm==0.31.3 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
  uvicorn==0.55.0 python-multipart==0.0.34 psutil==7.2.2 pillow==13.0.0 tabulate==0.10.0
  pytz==2026.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 prometheus_client==0.26.0 opentelemetry-api==1.45.2 rich==15.0.0
  markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 typer==0.29.2 shellingham==1.5.4
  tqdm==4.70.1 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1
  charset-normalizer==3.5.3 regex==2026.11.19
)  # huggingface-hub: the host's own (its transformers wants <2.0)

if [[ "${1:-}" == "stage-vllm" ]]; then
  rm -rf .whl/3 && mkdir -p .whl/3
  platforms=()
  for n in 17 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl/3 "${VLLM_PINS[@]}"
  du -sh .whl/3
  exit 0
fi
if [[ "${1:-}" == "install-vllm" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-vllm .whl/3/*.whl
  printf '#!/bin/sh\nPYTHONPATH=/tmp/site-vllm:/tmp/site exec python3 "$@"\n' > /tmp/vllm-python
  chmod +x /tmp/vllm-python
  /tmp/vllm-python -c 'import vllm_mlx.server, mlx_lm, mlx.core as mx; print("vllm-mlx ready:", mlx_lm.__version__, mx.default_device())'
  exit 0
fi

if [[ "${1:-}" == "stage" ]]; then
  ../shared/gpu/stage-wheels "${PINS[@]}" "${@:2}"  # extra packages after "stage"
  tok=$(${PYTHON:-/tmp/venv/bin/python} -c 'from trio_mlx.engine.model_spec import resolve_model_path as r; print(r(None).path)')
  mkdir -p .whl/2/tokenizer
  cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json .whl/2/tokenizer/
  [[ -f "$tok/special_tokens_map.json" ]] && cp "$tok/special_tokens_map.json" .whl/2/tokenizer/
  du -sh .whl/1 .whl/2
  exit 0
fi

: "${OUT:?OUT must name the folder for the results}"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TRIO_MLX_BENCH_TOKENIZER=${TRIO_MLX_BENCH_TOKENIZER:-$PWD/.whl/2/tokenizer}
python3 -c 'import mlx.core as mx, trio, hypercorn, quart_trio, pydantic, openai, mlx_lm; print("ready:", mx.default_device())'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

REPEATS=${REPEATS:-2}
MODELS=${MODELS:-"synthetic:llama-1b-bf16 synthetic:llama-8b-q4"}
DEADLINE_1B=${DEADLINE_1B:-170}
DEADLINE_8B=${DEADLINE_8B:-230}
TIMEOUT_PAD=${TIMEOUT_PAD:-60}
WORK=/tmp/trio-mlx-compare
common=(--systems raw,engine,http,mlx_lm_server,vllm_mlx --prompt-tokens 128,2048 --max-tokens 256
        --concurrency 1,4,16 --repeats "$REPEATS" --workdir "$WORK" --cell-timeout-s 120
        --server-start-timeout-s 180 --engine-own-weights --decode-pairs "${DECODE_PAIRS:-0}")
if [[ -x /tmp/vllm-python ]]; then common+=(--vllm-python /tmp/vllm-python); else common+=(--vllm-python none); fi
stamp=$(date +%Y-%m-%d)
# the card in the results' names (the device lends an H100 or an H200)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && echo h100 || echo h200)
status=0
for model in $MODELS; do
  case "$model" in
    *-1b-*) deadline=$DEADLINE_1B ;;
    *-8b-*) deadline=$DEADLINE_8B ;;
    *) deadline=${DEADLINE_OTHER:-150} ;;
  esac
  name=${model#synthetic:}
  timeout -s INT $((deadline + TIMEOUT_PAD)) python3 -m bench.compare --model "$model" \
    "${common[@]}" --deadline-s "$deadline" --out "$OUT/$stamp-$card-$name" || status=$?
done
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null || true
ls -la "$OUT"
exit $status
