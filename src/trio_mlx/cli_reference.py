"""The README's command-line reference, made from the parser: `python -m trio_mlx.cli_reference`.

`options(command)` lists each option of `trio-mlx COMMAND` with its default and help, as the
parser has them; `markdown()` renders every command as the README's tables. The README is
checked against `options` (tests/test_cli_reference.py), so an option added to the parser fails
that test until the README names it; paste this module's output to fix it.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

COMMANDS = ("serve", "generate", "convert")
#: Options of every command that the tables leave out (they are shown once, above them).
COMMON = ("--help", "--verbose", "--log-level", "--log-format")
_DEFAULT_IN_HELP = re.compile(r"\s*\(default: (.*)\)$")
_ENV = ("TRIO_MLX_HOST", "TRIO_MLX_PORT", "TRIO_MLX_MODEL", "TRIO_MLX_CPU_WEIGHTS", "TRIO_MLX_BLAS")


@dataclass(frozen=True)
class Option:
    name: str  # "--port", or "MODEL" for a positional
    default: str  # as written in the help ("8000", "the bundled SmolLM2...", "" for none)
    help: str


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[command]
            return found
    raise KeyError(command)


def options(command: str) -> list[Option]:
    """`trio-mlx COMMAND`'s options as the parser has them (environment defaults ignored)."""
    from trio_mlx.cli import build_parser

    saved = {name: os.environ.pop(name) for name in _ENV if name in os.environ}
    try:
        sub = _subparser(build_parser(), command)
    finally:
        os.environ.update(saved)
    out = []
    for action in sub._actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            name = action.option_strings[0]  # `--x`, not the `--no-x` it adds
        elif action.option_strings:
            name = max(action.option_strings, key=len)
        else:
            name = action.dest
        if name in COMMON or isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:
            name = action.dest.upper()
        text = (action.help or "") % {"default": action.default, "prog": "trio-mlx"}
        match = _DEFAULT_IN_HELP.search(text)
        if match:
            default = match.group(1).strip()
        elif action.default in (None, argparse.SUPPRESS) or isinstance(
            action, argparse._StoreTrueAction
        ):
            default = ""
        else:
            default = str(action.default)
        out.append(Option(name, default, text))
    return out


def markdown() -> str:
    """Every command's options as markdown tables (what the README's section holds)."""
    lines = []
    for command in COMMANDS:
        lines += [f"`trio-mlx {command}`:", "", "| option | default | |", "| --- | --- | --- |"]
        for option in options(command):
            text = _DEFAULT_IN_HELP.sub("", option.help).replace("|", "\\|")
            default = f"`{option.default}`" if option.default else ""
            lines.append(f"| `{option.name}` | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(markdown())
