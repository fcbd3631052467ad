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

This module builds the parser (`build_parser`: the options every command shares, the
subcommands, `convert`'s and `generate`'s own arguments), dispatches a command (`main`) and
reports its failure; the options of `serve`, and those `generate` shares with it, are defined in
`cli_options`.
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

from trio_mlx import cli_options, log_setup
from trio_mlx.errors import TrioMLXError


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


def _version() -> str:
    try:
        return importlib.metadata.version("trio-mlx")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout
        return "unknown"


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
    cli_options.add_serve_arguments(serve)

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
    cli_options.add_cpu_arguments(generate)
    cli_options.add_sampling_arguments(generate)

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

            cli_options.apply_cpu_arguments(args)
            return int(run_serve(args))
        if args.command == "generate":
            cli_options.apply_cpu_arguments(args)
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
