"""The options of `trio-mlx serve` and `trio-mlx generate`: their names, types, defaults and help.

- `add_serve_arguments(parser)`: every option of `serve` (MODEL, the listening address, admission,
  batching, prefill, speculative decoding, SpecPrefill, caches, stored responses, media, the API
  key, tool calls),
  in the order `--help` and the README list them. `http.server.settings_from_args` reads them.
- `add_cpu_arguments(parser)`: `--cpu-weights`, `--blas` and `--prefill-step-size`, shared by
  `serve` and `generate`; `apply_cpu_arguments(args)` hands the first two to the engine through
  the environment (the loader reads them there) and resolves `--prefill-step-size`
  (`PREFILL_STEP_SIZE`, or `CPU_PREFILL_STEP_SIZE` on MLX's CPU backend).
- `add_sampling_arguments(parser)`: `generate`'s sampling options, with the engine API's defaults.

Defaults from the environment (`TRIO_MLX_HOST`, `TRIO_MLX_PORT`, `TRIO_MLX_MODEL`,
`TRIO_MLX_CPU_WEIGHTS`, `TRIO_MLX_BLAS`, `TRIO_MLX_API_KEY`) are read when the options are added,
that is when `cli.build_parser` runs; a `TRIO_MLX_PORT` that is not a number exits with status 2.
The parser itself, the subcommands and their dispatch are `cli`'s.
"""

from __future__ import annotations

import argparse
import os
import sys

from trio_mlx.config import MLLM_DRAFT_KINDS
from trio_mlx.engine.cpu_path import CHOICES as CPU_WEIGHTS_CHOICES
from trio_mlx.engine.self_draft import DraftLayers, parse_layers
from trio_mlx.http.responses.store import DEFAULT_MEGABYTES, DEFAULT_RESPONSES
from trio_mlx.tools.registry import PARSER_CHOICES
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P

#: Prefill chunk sizes: on a GPU, and on MLX's CPU backend (where 2,048 tokens take ~15 s and an
#: abort waits for the chunk in progress).
PREFILL_STEP_SIZE = 2048
CPU_PREFILL_STEP_SIZE = 256


def _env_port() -> int:
    value = os.environ.get("TRIO_MLX_PORT", "8000")
    try:
        return int(value)
    except ValueError:
        print(f"trio-mlx: error: TRIO_MLX_PORT={value!r} is not a port number", file=sys.stderr)
        raise SystemExit(2) from None


def _draft_layers(text: str) -> DraftLayers:
    try:
        return parse_layers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    # The same defaults as the engine API and the HTTP routes (types.DEFAULT_*).
    parser.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help="sampling temperature; 0 is greedy",
    )
    parser.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="nucleus sampling mass")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def add_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu-weights",
        choices=CPU_WEIGHTS_CHOICES,
        default=os.environ.get("TRIO_MLX_CPU_WEIGHTS", "auto"),
        help="on MLX's CPU backend: auto runs quantized and half-precision weights as float32 "
        "where OpenBLAS serves and they fit in a quarter of memory; float32 always; as-stored "
        "never; env TRIO_MLX_CPU_WEIGHTS",
    )
    parser.add_argument(
        "--blas",
        choices=("auto", "reference"),
        default=os.environ.get("TRIO_MLX_BLAS", "auto") or "auto",
        help="on MLX's CPU backend: auto uses the OpenBLAS of scipy-openblas32 (or one already "
        "loaded); reference keeps the reference BLAS MLX ships; env TRIO_MLX_BLAS",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=None,
        help=f"the most prompt tokens in one prefill chunk; chunks are sized by measured time "
        f"up to it (default: {PREFILL_STEP_SIZE}, {CPU_PREFILL_STEP_SIZE} on MLX's CPU backend)",
    )


def apply_cpu_arguments(args: argparse.Namespace) -> None:
    """Hand the CPU-path choices to the engine (by environment: the loader reads them there)."""
    os.environ["TRIO_MLX_CPU_WEIGHTS"] = args.cpu_weights
    os.environ["TRIO_MLX_BLAS"] = args.blas
    if args.prefill_step_size is None:
        from trio_mlx.engine.cpu_path import on_cpu_backend

        args.prefill_step_size = CPU_PREFILL_STEP_SIZE if on_cpu_backend() else PREFILL_STEP_SIZE


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=os.environ.get("TRIO_MLX_MODEL") or None,
        help="an mlx-lm directory, a .gguf file or a Hugging Face repo id in the local cache; "
        "env TRIO_MLX_MODEL (default: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("TRIO_MLX_HOST", "127.0.0.1"),
        help="address to listen on; 0.0.0.0 for every interface; env TRIO_MLX_HOST",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=_env_port(),
        help="port to listen on; 0 picks a free one; env TRIO_MLX_PORT",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="a name clients may use for the model, repeatable, the first listed first "
        "(default: the model's name)",
    )
    parser.add_argument(
        "--admission",
        choices=["fail-fast", "wait"],
        default="wait",
        help="when every slot is taken: queue the request (wait) or answer 429 at once (fail-fast)",
    )
    parser.add_argument(
        "--max-waiting", type=int, default=256, help="queue length in wait mode (default: 256)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="sequences decoding together, one forward pass per step (continuous batching); "
        "1: one at a time (default: 8 on the CPU, 64 on a GPU)",
    )
    parser.add_argument(
        "--kv-memory-mb",
        type=float,
        default=None,
        help="memory for the running sequences' KV caches, each counted at its token limit; "
        "requests beyond it wait or get 429 (default: half the device memory left after the "
        "weights; 0: no accounting)",
    )
    parser.add_argument(
        "--prefill-chunk-seconds",
        type=float,
        default=0.25,
        help="prefill chunks are sized to take about this long, so a cancel frees the runner "
        "within about that time (default: 0.25)",
    )
    parser.add_argument("--max-wait", type=float, default=30.0, help="seconds a request may wait")
    add_cpu_arguments(parser)
    parser.add_argument(
        "--prefill-block",
        type=int,
        default=None,
        help="pad prefill to multiples of this many tokens (default: 64 on CUDA, else off)",
    )
    parser.add_argument(
        "--fused-tail-tokens",
        type=int,
        default=None,
        help="prompt tokens fed with the first token's forward pass "
        "(default: 1024 on CUDA, 64 on another GPU, else 1)",
    )
    parser.add_argument(
        "--compiled-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fuse q/k/v and gate/up projections and decode through a traced step replayed per "
        "KV length bucket; experimental: slower than the plain step on the H200 (default: off)",
    )
    parser.add_argument(
        "--traced-batch-rows",
        type=int,
        default=None,
        metavar="N",
        help="batches of 2 to N rows decode through a step traced at load and replayed, where "
        "the plain step is bound by the host (a GPU; faster on small models: 1.42x at 2 streams "
        "on a 1B bf16, H100); costs start-up time (default: 0, off)",
    )
    parser.add_argument(
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fuse each layer's q/k/v and gate/up projections at load (fewer kernel launches a "
        "decode step; default: on on a GPU, for quantized weights on MLX's CUDA backend only; "
        "off on the CPU)",
    )
    parser.add_argument(
        "--lean-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode a lone sequence through the lean one-token step (llama, qwen2, qwen3: the "
        "model's arithmetic in fewer graph nodes, less host time a token; default: on on a GPU, "
        "off on the CPU)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MLX's CUDA graphs (MLX_USE_CUDA_GRAPHS): faster for one stream; "
        "--no-cuda-graphs is faster for many at once (H100, 16 streams: 1.3-1.4x the aggregate, "
        "one stream 0.6-0.85x) (default: MLX's, on)",
    )
    parser.add_argument(
        "--dequantize-from-rows",
        type=int,
        default=None,
        metavar="N",
        help="quantized layers multiply an input of at least N rows (sequences of a decode batch, "
        "tokens of a prefill chunk) by their weight dequantized, a dense product, and fewer rows "
        "by MLX's quantized kernel with the rows as one matrix; 0: off (default: 128 on CUDA, "
        "else off)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="server-wide cap on a request's max_tokens (default: none beyond the context)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="max_tokens of a request that gives none",
    )
    parser.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        help="tokens a request's KV cache keeps, in a rotating cache (default: unbounded)",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a smaller model with the same tokenizer that drafts tokens for the target to verify "
        "(speculative decoding; lossless; only while one request decodes; not with --max-kv-size)",
    )
    parser.add_argument(
        "--draft-layers",
        type=_draft_layers,
        default=None,
        metavar="N|LAYERS",
        help="self-speculative decoding: the model's own first N layers (or those listed, e.g. "
        "0-11,16-29), then its norm and head, draft for it; no second model, lossless; how often "
        "they agree depends on the checkpoint (not with --draft-model, --mtp or --max-kv-size)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=4,
        help="tokens the draft model (or --draft-layers) proposes per step (default: 4)",
    )
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="native multi-token prediction: the model's own MTP head drafts tokens for it to "
        "verify (DeepSeek-V3, GLM-4.5/4.6/4.7-Flash and MiMo checkpoints with MTP weights; "
        "lossless; only while one request decodes; refused for a model without MTP weights)",
    )
    parser.add_argument(
        "--mtp-num-draft-tokens",
        type=int,
        default=4,
        help="tokens the MTP head proposes per step (default: 4)",
    )
    parser.add_argument(
        "--specprefill",
        action="store_true",
        help="SpecPrefill (approximate): score long prompts with a small model's attention and "
        "prefill only the kept part (needs --specprefill-draft-model, "
        "--specprefill-draft-layers, --draft-model or --draft-layers; not with --max-kv-size)",
    )
    parser.add_argument(
        "--specprefill-threshold",
        type=int,
        default=8192,
        help="prompt tokens from which SpecPrefill applies (default: 8192)",
    )
    parser.add_argument(
        "--specprefill-keep-pct",
        type=float,
        default=0.3,
        help="fraction of a long prompt the target prefills (default: 0.3)",
    )
    parser.add_argument(
        "--specprefill-backbone-pct",
        type=float,
        default=0.05,
        help="leading fraction of the prompt always kept, e.g. a system prompt (default: 0.05)",
    )
    parser.add_argument(
        "--specprefill-draft-model",
        default=None,
        help="the model SpecPrefill scores prompts with (default: --draft-model)",
    )
    parser.add_argument(
        "--specprefill-draft-layers",
        type=_draft_layers,
        default=None,
        metavar="N|LAYERS",
        help="SpecPrefill scores with the model's own first N layers (or those listed) instead "
        "of a second model, as GemFilter does (default: --draft-layers where no model is named)",
    )
    parser.add_argument(
        "--cache-memory-mb",
        type=float,
        default=None,
        help="memory for the prefix KV cache in MiB; 0 disables it "
        "(default: half the model's weights, 256 MiB to 8 GiB)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest request body accepted; larger ones get 413",
    )
    parser.add_argument(
        "--response-store-size",
        type=int,
        default=DEFAULT_RESPONSES,
        metavar="N",
        help="Responses API responses (store: true) kept in memory for previous_response_id "
        "and GET /v1/responses/{id}, the oldest evicted first (and as many ended background "
        "responses besides, and as many /v1/conversations, the least recently used evicted "
        "first); 0 keeps none and refuses background and conversations",
    )
    parser.add_argument(
        "--response-store-mb",
        type=float,
        default=DEFAULT_MEGABYTES,
        metavar="MB",
        help="memory for the kept responses in MiB (their JSON text, a conversation's earlier "
        "items counted with each turn), and as much again for the conversations; 0 keeps none",
    )
    parser.add_argument(
        "--mllm",
        action="store_true",
        help="load MODEL through mlx-vlm as a vision-language model "
        "(default: when its config has a vision tower mlx-vlm knows)",
    )
    parser.add_argument(
        "--mllm-draft-model",
        default=None,
        metavar="PATH",
        help="an mlx-vlm drafter (DFlash, EAGLE-3 or MTP checkpoint) that decodes a vision "
        "model's requests with media through mlx-vlm's speculative loop (lossless for greedy "
        "requests; no prefix cache for them; text-only requests never use it)",
    )
    parser.add_argument(
        "--mllm-draft-kind",
        default=None,
        choices=MLLM_DRAFT_KINDS,
        help="the drafter's round loop: dflash, eagle3 or mtp (default: what mlx-vlm resolves "
        "from its config)",
    )
    parser.add_argument(
        "--mllm-draft-block-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens the mlx-vlm drafter proposes a round (default: the drafter's own)",
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="image and video parts may name local files under DIR (default: never)",
    )
    parser.add_argument(
        "--allow-private-media-urls",
        action="store_true",
        help="let image and video URLs reach private and loopback addresses",
    )
    parser.add_argument(
        "--max-media-mb",
        type=float,
        default=20.0,
        help="largest image or video a request may name, in MiB",
    )
    parser.add_argument(
        "--video-fps", type=float, default=2.0, help="frames sampled per second of video"
    )
    parser.add_argument(
        "--video-max-frames", type=int, default=16, help="frames sampled from one video at most"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight streams may finish after SIGINT/SIGTERM before they are aborted",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TRIO_MLX_API_KEY") or None,
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on every route but "
        "/health and the chat page; env TRIO_MLX_API_KEY, which keeps it out of the process list "
        "(default: none, every route is open)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSER_CHOICES,
        default="auto",
        metavar="NAME",
        help="how function calls are read from the model's replies: auto (from the chat "
        f"template) or one of {', '.join(PARSER_CHOICES[1:])}",
    )
