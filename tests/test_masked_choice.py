"""The masked choice (`structured/masked_choice`) against the plain operations it replaced
(`apply_token_mask`, then the argmax or the sampler): the same logits element for element, the
same tokens greedy and sampled; the forced-token shortcut names exactly the masks that allow one
token; and in the engine, on both routes, every kind of constrained request writes the same
tokens (and logprobs) as with the plain operations, while the shortcut does fire."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import trio_mlx
from test_structured_output import FORMAT, USER, assert_valid, decode_together, each_alone
from trio_mlx.engine.sampling import TokenSelector
from trio_mlx.structured import OutputFormat, masked_choice
from trio_mlx.structured.matcher import apply_token_mask
from trio_mlx.types import SamplingParams

VOCAB = 49152
WORDS = VOCAB // 32


def packed(allowed: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """Boolean rows (rows, 32 * n) as llguidance's mask words (rows, n)."""
    return np.packbits(allowed, axis=-1, bitorder="little").view(np.uint32)


def random_masks(rng: np.random.Generator, rows: int, density: float) -> Any:
    return packed(rng.random((rows, 32 * WORDS)) < density)


def random_logits(rng: np.random.Generator, rows: int, width: int, dtype: Any) -> Any:
    return mx.array(rng.normal(size=(rows, width)).astype(np.float32) * 4).astype(dtype)


def use_plain_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The masked choice as it was before `masked_choice`: plain MLX operations
    (`apply_token_mask`), no forced-token shortcut."""
    monkeypatch.setattr(masked_choice, "forced_tokens", lambda words, width: [None] * len(words))
    monkeypatch.setattr(
        masked_choice,
        "masked_argmax",
        lambda logits, words: mx.argmax(apply_token_mask(logits, words), -1),
    )
    monkeypatch.setattr(masked_choice, "masked_logits", apply_token_mask)


def count_forced(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Spy on `forced_tokens`: how many tokens it has forced so far."""
    forced = [0]
    real = masked_choice.forced_tokens

    def spy(words: Any, width: int) -> list[int | None]:
        found = real(words, width)
        forced[0] += sum(token is not None for token in found)
        return found

    monkeypatch.setattr(masked_choice, "forced_tokens", spy)
    return lambda: forced[0]


# ---- the functions, against apply_token_mask ------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("extra", [0, 64, -100, 5], ids=["exact", "wider", "narrower", "odd"])
def test_masked_logits_equal_the_plain_operations(dtype: Any, extra: int) -> None:
    rng = np.random.default_rng(abs(extra) + 1)
    width = VOCAB + extra
    for rows, density in ((1, 0.0), (1, 1e-4), (3, 0.01), (2, 0.5), (1, 1.0)):
        words = random_masks(rng, rows, density)
        words[0, 0] |= np.uint32(1)  # at least one allowed token in the first row
        logits = random_logits(rng, rows, width, dtype)
        expected = apply_token_mask(logits, words)
        got = masked_choice.masked_logits(logits, words)
        assert got.dtype == expected.dtype and got.shape == expected.shape == (rows, width)
        assert mx.array_equal(got, expected).item()
        chosen = masked_choice.masked_argmax(logits, words)
        assert chosen.dtype == mx.uint32 and chosen.shape == (rows,)
        assert chosen.tolist() == mx.argmax(expected, -1).tolist()


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 20, "min_p": 0.02},
        {"temperature": 0.8, "presence_penalty": 0.5, "logit_bias": ((7, 3.0), (300, -2.0))},
    ],
)
def test_sampling_from_masked_logits_draws_the_same_tokens(sampling: dict[str, Any]) -> None:
    rng = np.random.default_rng(7)
    for seed in (0, 1, 12345):
        params = SamplingParams(max_tokens=40, seed=seed, **sampling)
        fused, plain = (TokenSelector(params, VOCAB, [1, 2, 3]) for _ in range(2))
        for step in range(40):
            words = random_masks(rng, 1, (0.001, 0.05, 0.5)[step % 3])
            words[0, 3] |= np.uint32(1 << 9)
            raw = random_logits(rng, 1, VOCAB, mx.bfloat16)
            a = fused.choose(masked_choice.masked_logits(fused.adjust(raw), words))
            b = plain.choose(apply_token_mask(plain.adjust(raw), words))
            assert a.item() == b.item()


def test_forced_tokens_name_exactly_the_masks_that_allow_one_token() -> None:
    allowed = np.zeros((7, 32 * WORDS), dtype=bool)
    allowed[0, 0] = True  # the first token
    allowed[1, 1234] = True  # within a word
    allowed[2, 32 * WORDS - 1] = True  # the last bit of the last word
    allowed[3, [5, 6]] = True  # two in one word
    allowed[4, [40, 4000]] = True  # two in two words
    allowed[6, VOCAB - 1] = True  # allowed, but past a narrower output layer below
    words = packed(allowed)
    assert masked_choice.forced_tokens(words, VOCAB) == [
        0,
        1234,
        32 * WORDS - 1,
        None,
        None,
        None,  # nothing allowed
        VOCAB - 1,
    ]
    assert masked_choice.forced_tokens(words, VOCAB - 1)[6] is None
    # wherever it forces a token, that is what the masked argmax chooses
    logits = random_logits(np.random.default_rng(0), 7, VOCAB, mx.bfloat16)
    argmax = masked_choice.masked_argmax(logits, words).tolist()
    for row, token in enumerate(masked_choice.forced_tokens(words, VOCAB)):
        if token is not None:
            assert argmax[row] == token


# ---- in the engine, against the plain operations ---------------------------------------------

#: (prompt-free request options) constrained requests of every kind a row's choice can take
REQUESTS: list[dict[str, Any]] = [
    {"temperature": 0.0},  # forced tokens and the fused masked argmax
    {"temperature": 0.0, "logprobs": True, "top_logprobs": 3},
    {"temperature": 0.9, "top_p": 0.9, "seed": 7},
    {"temperature": 1.2, "top_k": 8, "min_p": 0.05, "seed": 3},
    {"temperature": 0.0, "presence_penalty": 0.4, "logit_bias": {260: 2.0}},
]


@pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
async def test_each_request_writes_what_the_plain_operations_write(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, max_num_seqs: int
) -> None:
    async def run_all() -> list[trio_mlx.GenerationOutput]:
        async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=max_num_seqs) as engine:
            return [
                await engine.chat(USER, max_tokens=120, output_format=FORMAT, **options)
                for options in REQUESTS
            ]

    forced = count_forced(monkeypatch)
    fused = await run_all()
    assert forced() > 10  # the greedy requests took forced tokens without the device
    with monkeypatch.context() as patch:
        use_plain_operations(patch)
        plain = await run_all()
    for got, expected in zip(fused, plain, strict=True):
        assert got.tokens == expected.tokens
        assert got.logprobs == expected.logprobs
        assert_valid(got.text)


@pytest.mark.parametrize("sampled", [True, False], ids=["mixed", "all-greedy"])
async def test_constrained_rows_together_write_what_the_plain_operations_write(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, sampled: bool
) -> None:
    other = OutputFormat.regex(r"(yes|no)( indeed)?")
    base = {"max_tokens": 120, "output_format": FORMAT}
    last = {"temperature": 1.0, "seed": 9} if sampled else {"temperature": 0.0}
    jobs = [
        ("Describe a person.", {**base, "temperature": 0.0}),
        ("Another person.", {**base, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}),
        ("Well?", {"max_tokens": 20, "temperature": 0.0, "output_format": other}),
        ("Someone else.", {**base, **last}),
    ]
    forced = count_forced(monkeypatch)
    got, stats = await decode_together(tiny_model_dir, monkeypatch, jobs)
    assert max(int(size) for size in stats["batch_sizes"]) == 4
    assert forced() > 10
    with monkeypatch.context() as patch:
        use_plain_operations(patch)
        expected = await each_alone(tiny_model_dir, jobs)
    for a, b in zip(got, expected, strict=True):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
