"""SpecPrefill on real weights: the bundled SmolLM2 scoring a long-ish chat prompt for itself.

Keep 1.0 gives full prefill's greedy output token for token; at keep 0.5 and 0.3 the answer stays
sane (ordinary text, not one token repeated) and its greedy agreement with full prefill (tokens
equal at the same index, and the length of the common prefix) is measured and printed: an
approximation has no exact expected value, the figures go in the report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import trio_mlx
from trio_mlx.engine.model_spec import resolve_model_path

pytestmark = pytest.mark.slow

FACTS = [
    "The lighthouse on Gull Island was built in 1871 and painted red and white.",
    "Its keeper, Martha Wren, kept a logbook of every ship that passed.",
    "In winter the island was cut off for weeks by storms from the north.",
    "The lamp burned whale oil until 1912, then kerosene, then electricity.",
    "A small garden behind the tower grew potatoes, onions and thyme.",
    "Every Sunday a supply boat brought letters, flour and coal from the mainland.",
]
QUESTION = (
    "What did the lamp of the Gull Island lighthouse burn before 1912? Answer in one sentence."
)


def messages() -> list[dict[str, str]]:
    story = " ".join(FACTS[i % len(FACTS)] for i in range(60))  # about 1,000 tokens
    return [
        {"role": "system", "content": "You answer questions about the document you are given."},
        {"role": "user", "content": f"Document:\n{story}\n\nQuestion: {QUESTION}"},
    ]


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    same = sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b), 1)
    prefix = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return same, prefix


async def test_specprefill_on_smollm2_stays_close_to_full_prefill() -> None:
    bundled: Path = resolve_model_path(None).path
    sampling = {"max_tokens": 24, "temperature": 0.0}
    async with trio_mlx.open_engine(bundled, max_num_seqs=1) as engine:
        full = await engine.chat(messages(), **sampling)
    assert full.prompt_tokens > 900
    results = {}
    async with trio_mlx.open_engine(
        bundled,
        max_num_seqs=1,
        specprefill_enabled=True,
        specprefill_threshold=512,
        specprefill_draft_model=bundled,
    ) as engine:
        for keep in (1.0, 0.5, 0.3):
            out = await engine.chat(messages(), specprefill_keep_pct=keep, **sampling)
            results[keep] = out
        stats = engine.get_stats()["specprefill"]
    assert stats["requests"] == 3
    assert results[1.0].tokens == full.tokens
    print(f"\nfull prefill: {full.text!r}")
    for keep in (0.5, 0.3):
        out = results[keep]
        same, prefix = agreement(list(out.tokens), list(full.tokens))
        print(f"keep {keep}: agreement {same:.2f}, common prefix {prefix} tokens: {out.text!r}")
        assert out.tokens
        assert len(set(out.tokens)) > len(out.tokens) // 4  # not one token over and over
        assert out.text.isprintable() or "\n" in out.text
