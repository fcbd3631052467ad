"""The documentation's relative links resolve: every link in docs/benchmarks/README.md and every
link from README.md into docs/ names a file that exists (and, with a `#fragment` into a markdown
file, a heading of that file); and the benchmarks index lists every file in docs/benchmarks/."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks"
BENCHMARKS_README = BENCHMARKS / "README.md"

#: [text](target) and ![alt](target); the target ends at the first space or closing bracket.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def links(path: Path) -> list[str]:
    """The link targets of a markdown file, outside fenced and indented code blocks."""
    found: list[str] = []
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        line = re.sub(r"`[^`]*`", "", line)
        found.extend(LINK.findall(line))
    return found


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken(source: Path, targets: list[str]) -> list[str]:
    problems = []
    for target in targets:
        file_part, _, fragment = target.partition("#")
        resolved = (source.parent / unquote(file_part)).resolve()
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and unquote(fragment) not in anchors(resolved):
            problems.append(f"{target}: {resolved.name} has no heading #{fragment}")
    return problems


def test_every_relative_link_in_the_benchmarks_index_resolves() -> None:
    targets = [t for t in links(BENCHMARKS_README) if relative(t)]
    assert targets, "docs/benchmarks/README.md links to no file"
    problems = broken(BENCHMARKS_README, targets)
    assert not problems, "docs/benchmarks/README.md: " + "; ".join(problems)


def test_every_link_from_the_readme_into_docs_resolves() -> None:
    targets = [t for t in links(README) if relative(t) and t.startswith("docs/")]
    assert targets, "README.md links into docs/ nowhere"
    problems = broken(README, targets)
    assert not problems, "README.md: " + "; ".join(problems)


def index_section() -> str:
    text = BENCHMARKS_README.read_text()
    start = text.index("## Current figures, by shape")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_benchmarks_index_lists_every_file_there() -> None:
    listed = {
        unquote(t.partition("#")[0])
        for line in index_section().splitlines()
        for t in LINK.findall(line)
        if relative(t)
    }
    files = {p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.name != "README.md"}
    missing = sorted(files - listed)
    assert not missing, f"docs/benchmarks/README.md's index lacks {missing}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        (
            "Constrained decoding: `python -m bench.constrained`",
            "constrained-decoding-python--m-benchconstrained",
        ),
        (
            "Many streams on the CPU: the default `--max-num-seqs` 8",
            "many-streams-on-the-cpu-the-default---max-num-seqs-8",
        ),
        (
            "The event loop's cost per streamed token (issue 21)",
            "the-event-loops-cost-per-streamed-token-issue-21",
        ),
    ],
)
def test_slug_matches_githubs_anchors(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
