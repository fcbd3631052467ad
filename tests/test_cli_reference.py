"""The command line's conventions: help and a default for every option, `--version`, the
environment variables, and the README's command-line section agreeing with the parser."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trio_mlx.cli_reference as reference
from trio_mlx.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_section() -> str:
    text = README.read_text()
    start = text.index("## Command line")
    return text[start : text.index("\n## ", start + 1)]


def readme_tables() -> dict[str, dict[str, str]]:
    """{command: {option: the README's default cell}} from the section's tables."""
    tables: dict[str, dict[str, str]] = {}
    current = None
    for line in readme_section().splitlines():
        heading = re.fullmatch(r"`trio-mlx (\w+)`:", line.strip())
        if heading:
            current = tables.setdefault(heading.group(1), {})
            continue
        row = re.match(r"\| `([^`]+)` \| ([^|]*) \|", line)
        if row and current is not None:
            current[row.group(1)] = row.group(2).strip().strip("`")
    return tables


@pytest.mark.parametrize("command", reference.COMMANDS)
def test_the_readme_lists_every_option_of_the_parser_with_its_default(command: str) -> None:
    tables = readme_tables()
    documented = tables.get(command, {})
    fix = "run `python -m trio_mlx.cli_reference` and paste its tables into the README"
    for option in reference.options(command):
        assert option.name in documented, f"README lacks trio-mlx {command} {option.name}; {fix}"
        assert documented[option.name] == option.default, (
            f"README gives {command} {option.name} the default {documented[option.name]!r}, "
            f"the parser {option.default!r}; {fix}"
        )
    known = {option.name for option in reference.options(command)}
    stale = set(documented) - known
    assert not stale, f"README documents {command} options the parser lacks: {stale}; {fix}"


@pytest.mark.parametrize("command", reference.COMMANDS)
def test_every_option_has_help_and_says_its_default(command: str) -> None:
    for option in reference.options(command):
        assert option.help, f"{command} {option.name} has no help"
    help_text = " ".join(
        subprocess.run(
            [sys.executable, "-m", "trio_mlx", command, "--help"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.split()
    )
    for option in reference.options(command):
        if option.default:
            assert f"default: {option.default}" in help_text, (command, option.name)


def test_version_prints_the_package_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_mlx", "--version"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0
    assert re.fullmatch(r"trio-mlx \d+\.\d+\.\S+\n", done.stdout)


def test_environment_variables_set_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_MLX_HOST", "0.0.0.0")
    monkeypatch.setenv("TRIO_MLX_PORT", "9123")
    monkeypatch.setenv("TRIO_MLX_MODEL", "/models/x")
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("0.0.0.0", 9123, "/models/x")
    assert build_parser().parse_args(["generate", "hi"]).model == "/models/x"
    # the command line wins
    args = build_parser().parse_args(["serve", "/other", "--port", "1", "--host", "::1"])
    assert (args.host, args.port, args.model) == ("::1", 1, "/other")


def test_a_bad_port_in_the_environment_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_mlx", "serve"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ, "TRIO_MLX_PORT": "eighty"},
    )
    assert done.returncode == 2
    assert "TRIO_MLX_PORT='eighty' is not a port number" in done.stderr
