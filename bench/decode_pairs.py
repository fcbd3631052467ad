"""Decode speed against raw mlx-lm in back-to-back pairs, for `bench.compare --decode-pairs N`.

On a shared GPU host the decode speed of raw mlx-lm itself swings by ±25 % between requests a
few seconds apart, so a ratio of two medians taken minutes apart (the grid's `×raw`) cannot show
a 2-3 % difference. Here every other system runs one request right after (or right before,
alternately) a raw mlx-lm request on the same prompt, `N` times, and the ratio is taken within
each pair; the summary is the median ratio with its quartiles over the pairs.
"""

from __future__ import annotations

import statistics
from typing import Any, Protocol


class PairRunner(Protocol):
    """`bench.compare.Runners`: runs one burst of prompts on a system."""

    async def run(self, system: str, prompts: list[tuple[Any, list[int]]], n: int) -> list[Any]: ...


class PromptMaker(Protocol):
    def make(self, n_tokens: int, seed: int) -> tuple[Any, list[int]]: ...


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """25th, 50th and 75th percentiles (the median of each half for the outer two)."""
    ordered = sorted(values)
    if len(ordered) < 2:
        return ordered[0], ordered[0], ordered[0]
    q1, q2, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return q1, q2, q3


async def measure_pairs(
    runner: PairRunner,
    prompts: PromptMaker,
    systems: list[str],
    *,
    pairs: int,
    prompt_tokens: int,
    max_tokens: int,
) -> dict[str, Any]:
    """`pairs` back-to-back (raw, system) requests per system other than raw, order alternating;
    each request one stream of `max_tokens` tokens on a fresh prompt of `prompt_tokens`."""
    others = [s for s in systems if s != "raw"]
    rows: list[dict[str, Any]] = []
    for i in range(pairs):
        for k, system in enumerate(others):
            batch = [prompts.make(prompt_tokens, 7_000_000 + 100 * i + k)]
            order = ["raw", system] if i % 2 == 0 else [system, "raw"]
            tps: dict[str, float | None] = {}
            for s in order:
                results = await runner.run(s, batch, max_tokens)
                tps[s] = results[0].decode_tps if results else None
            raw, other = tps["raw"], tps[system]
            rows.append(
                {
                    "pair": i,
                    "system": system,
                    "first": order[0],
                    "raw_tps": raw,
                    "tps": other,
                    "ratio": other / raw if raw and other else None,
                }
            )
    summary: dict[str, Any] = {}
    for system in others:
        ratios = [r["ratio"] for r in rows if r["system"] == system and r["ratio"] is not None]
        if ratios:
            q1, q2, q3 = quartiles(ratios)
            summary[system] = {"pairs": len(ratios), "ratio_p25": q1, "ratio": q2, "ratio_p75": q3}
    return {
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rows": rows,
        "summary": summary,
    }


def markdown(result: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """The summary as markdown lines (a heading and a table)."""
    lines = [
        f"Decode against raw mlx-lm in back-to-back pairs (`--decode-pairs`): one stream, prompt "
        f"{result['prompt_tokens']}, {result['max_tokens']} tokens, ratio within each pair.",
        "",
        "| system | pairs | decode ×raw, median | 25th-75th percentile |",
        "|---|---|---|---|",
    ]
    for system, s in result["summary"].items():
        lines.append(
            f"| {labels.get(system, system)} | {s['pairs']} | {s['ratio']:.3f} "
            f"| {s['ratio_p25']:.3f}-{s['ratio_p75']:.3f} |"
        )
    return [*lines, ""]
