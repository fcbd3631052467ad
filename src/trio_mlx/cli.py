"""`trio-mlx serve | generate | convert`: the command line.

- `serve [MODEL]`: the OpenAI-compatible HTTP server (see `trio_mlx.http.server`).
- `generate "PROMPT" [--model M] [--chat]`: stream one completion to the terminal.
- `convert FILE.gguf OUT_DIR`: convert a GGUF file into an mlx-lm model directory.

MODEL is an mlx-lm directory, a Hugging Face repo id in the local cache, a `.gguf` file, or
nothing for the bundled SmolLM2-135M-Instruct.

Every option has help text and shows its default in `--help`; `TRIO_MLX_HOST`, `TRIO_MLX_PORT`
and `TRIO_MLX_MODEL` set the defaults of `--host`, `--port` and MODEL. Exit status: 0, 1 for a
failure (the one line `trio-mlx: error: ...` says why and what to do), 2 for a usage error,
130 for Ctrl-C during `generate`, 128 + N when a second signal N stopped `serve`. Tracebacks
only with `-v`. The README's command-line section is checked against this parser
(tests/test_cli_reference.py; `python -m trio_mlx.cli_reference` prints it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import trio

from trio_mlx import log_setup
from trio_mlx.engine.cpu_path import CHOICES as CPU_WEIGHTS_CHOICES
from trio_mlx.errors import TrioMLXError
from trio_mlx.tools.registry import PARSER_CHOICES
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P

#: Prefill chunk sizes: on a GPU, and on MLX's CPU backend (where 2,048 tokens take ~15 s and an
#: abort waits for the chunk in progress).
PREFILL_STEP_SIZE = 2048
CPU_PREFILL_STEP_SIZE = 256


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` with each option's default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction | argparse._VersionAction):
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            return f"{text} (default: %(default)s)"
        return text


def _env_port() -> int:
    value = os.environ.get("TRIO_MLX_PORT", "8000")
    try:
        return int(value)
    except ValueError:
        print(f"trio-mlx: error: TRIO_MLX_PORT={value!r} is not a port number", file=sys.stderr)
        raise SystemExit(2) from None


def _version() -> str:
    try:
        return importlib.metadata.version("trio-mlx")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout
        return "unknown"


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
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


def _add_cpu_arguments(parser: argparse.ArgumentParser) -> None:
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


def _apply_cpu_arguments(args: argparse.Namespace) -> None:
    """Hand the CPU-path choices to the engine (by environment: the loader reads them there)."""
    os.environ["TRIO_MLX_CPU_WEIGHTS"] = args.cpu_weights
    os.environ["TRIO_MLX_BLAS"] = args.blas
    if args.prefill_step_size is None:
        from trio_mlx.engine.cpu_path import on_cpu_backend

        args.prefill_step_size = CPU_PREFILL_STEP_SIZE if on_cpu_backend() else PREFILL_STEP_SIZE


async def _generate(args: argparse.Namespace) -> None:
    from trio_mlx.actors.supervisor import open_engine

    async with open_engine(args.model, prefill_step_size=args.prefill_step_size) as engine:
        sampling = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "stop": args.stop,
            "seed": args.seed,
        }
        if args.chat:
            stream = engine.stream_chat([{"role": "user", "content": args.prompt}], **sampling)
        else:
            stream = engine.stream_generate(args.prompt, **sampling)
        final = None
        async for out in stream:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            final = out
        sys.stdout.write("\n")
        if final is not None and getattr(args, "verbose", False):
            ttft = final.time_to_first_token or 0.0
            print(
                f"[{final.prompt_tokens} prompt tokens, {final.completion_tokens} completion "
                f"tokens, finish_reason={final.finish_reason}, first token after {ttft:.3f} s, "
                f"{final.generation_tps or 0.0:.1f} tokens/s]",
                file=sys.stderr,
            )


def _convert(args: argparse.Namespace) -> None:
    from trio_mlx.engine.gguf import convert_gguf

    out = convert_gguf(Path(args.gguf), Path(args.out_dir))
    print(f"converted {args.gguf} -> {out}")


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
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
        "1: one at a time (default: 1 on the CPU, 64 on a GPU)",
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
    _add_cpu_arguments(parser)
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
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fuse each layer's q/k/v and gate/up projections at load (fewer kernel launches a "
        "decode step; default: on on a GPU for unquantized weights, else off)",
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
        "--num-draft-tokens",
        type=int,
        default=4,
        help="tokens the draft model proposes per step (default: 4)",
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
        "prefill only the kept part (serialized route only; needs --specprefill-draft-model or "
        "--draft-model; not with --max-kv-size)",
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
        "--mllm",
        action="store_true",
        help="load MODEL through mlx-vlm as a vision-language model "
        "(default: when its config has a vision tower mlx-vlm knows)",
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


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log at debug level, and print the traceback of an error",
    )
    common.add_argument(
        "--log-level",
        choices=log_setup.LEVELS,
        default=argparse.SUPPRESS,
        help="trio-mlx's log level (default: info for serve, warning otherwise)",
    )
    common.add_argument(
        "--log-format",
        choices=log_setup.FORMATS,
        default=argparse.SUPPRESS,
        help="text lines, or one JSON object a line (default: text)",
    )
    parser = argparse.ArgumentParser(
        prog="trio-mlx",
        description=__doc__.split("\n")[0],
        parents=[common],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server.",
        parents=[common],
        formatter_class=HelpFormatter,
    )
    _add_serve_arguments(serve)

    generate = commands.add_parser(
        "generate",
        help="stream one completion to the terminal",
        description="Stream one completion to the terminal.",
        parents=[common],
        formatter_class=HelpFormatter,
    )
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--model",
        default=os.environ.get("TRIO_MLX_MODEL") or None,
        help="model spec, as serve's MODEL; env TRIO_MLX_MODEL (default: the bundled SmolLM2)",
    )
    generate.add_argument("--chat", action="store_true", help="send PROMPT as a user message")
    _add_cpu_arguments(generate)
    _add_sampling_arguments(generate)

    convert = commands.add_parser(
        "convert",
        help="convert a GGUF file to an mlx-lm directory",
        description="Convert a GGUF file to an mlx-lm directory.",
        parents=[common],
        formatter_class=HelpFormatter,
    )
    convert.add_argument("gguf", help="the .gguf file")
    convert.add_argument("out_dir", help="the mlx-lm directory to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    verbose = bool(getattr(args, "verbose", False))
    level = getattr(args, "log_level", None) or (
        "debug" if verbose else "info" if args.command == "serve" else "warning"
    )
    log_setup.configure(level, getattr(args, "log_format", "text"))
    try:
        if args.command == "serve":
            from trio_mlx.http.server import run_serve

            _apply_cpu_arguments(args)
            return int(run_serve(args))
        if args.command == "generate":
            _apply_cpu_arguments(args)
            trio.run(_generate, args)
        elif args.command == "convert":
            _convert(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _report(exc, verbose)
    return 0


def _report(exc: Exception, verbose: bool) -> int:
    """Print the error as one line (and its traceback under -v); the exit status."""
    from trio_mlx.http.preflight import StartupError

    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, StartupError):
        message, status = str(exc), exc.exit_code
    elif isinstance(exc, TrioMLXError):
        message, status = str(exc), 1
    elif isinstance(exc, MemoryError):
        message = "not enough memory; close other programs or use a smaller or quantized model"
        status = 1
    else:
        message, status = f"{type(exc).__name__}: {exc}", 1
    hint = "" if verbose else " (-v shows the traceback)"
    if isinstance(exc, TrioMLXError):
        hint = ""
    print(f"trio-mlx: error: {message}{hint}", file=sys.stderr)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
