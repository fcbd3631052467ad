"""`trio-mlx serve | generate | convert`: the command line.

- `serve [MODEL]`: the OpenAI-compatible HTTP server (see `trio_mlx.http.server`).
- `generate "PROMPT" [--model M] [--chat]`: stream one completion to the terminal.
- `convert FILE.gguf OUT_DIR`: convert a GGUF file into an mlx-lm model directory.

MODEL is an mlx-lm directory, a Hugging Face repo id in the local cache, a `.gguf` file, or
nothing for the bundled SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from trio_mlx.errors import TrioMLXError


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=None)


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
    parser.add_argument("model", nargs="?", default=None, help="model spec (default: SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="a name clients may use for the model (repeatable; the first is listed first)",
    )
    parser.add_argument(
        "--admission",
        choices=["fail-fast", "wait"],
        default="wait",
        help="when every slot is taken: queue the request (wait, the default) or answer 429 at "
        "once (fail-fast)",
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
    parser.add_argument("--prefill-step-size", type=int, default=2048)
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
    parser.add_argument("--max-tokens", type=int, default=None, help="server-wide cap")
    parser.add_argument("--default-max-tokens", type=int, default=256)
    parser.add_argument("--max-kv-size", type=int, default=None)
    parser.add_argument(
        "--cache-memory-mb",
        type=float,
        default=None,
        help="memory for the prefix KV cache in MiB (default: half the model's weights, "
        "256 MiB to 8 GiB; 0 disables it)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight streams may finish after SIGINT/SIGTERM before they are aborted",
    )


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log more"
    )
    parser = argparse.ArgumentParser(
        prog="trio-mlx", description=__doc__.split("\n")[0], parents=[common]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", parents=[common]
    )
    _add_serve_arguments(serve)

    generate = commands.add_parser(
        "generate", help="stream one completion to the terminal", parents=[common]
    )
    generate.add_argument("prompt")
    generate.add_argument("--model", default=None, help="model spec (default: bundled SmolLM2)")
    generate.add_argument("--chat", action="store_true", help="send PROMPT as a user message")
    generate.add_argument("--prefill-step-size", type=int, default=2048)
    _add_sampling_arguments(generate)

    convert = commands.add_parser(
        "convert", help="convert a GGUF file to an mlx-lm directory", parents=[common]
    )
    convert.add_argument("gguf")
    convert.add_argument("out_dir")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            from trio_mlx.http.server import run_serve

            return int(run_serve(args))
        if args.command == "generate":
            trio.run(_generate, args)
        elif args.command == "convert":
            _convert(args)
    except TrioMLXError as exc:
        print(f"trio-mlx: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
