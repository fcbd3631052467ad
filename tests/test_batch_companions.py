"""A request's output on the batched route does not depend on its companions, whatever mix of
settings they carry (tiny fp32 model): seeded random mixes of prompt lengths, `max_tokens`,
greedy and seeded sampling (temperature, top-p, top-k, min-p), penalties, logit biases, stop
strings and logprobs, with and without `max_kv_size`, each request run alone and then all started
at one step boundary on the same engine: the same tokens, finish reasons and text, and logprobs
equal within float rounding; and on the tiny vision model, mixes of requests with and without an
image (some with an output format). Bounded: 2 mixes x 2 windows of 6 requests and 3 mixes of 6
on the vision model (one with a window), 24 tokens at most. Also: sampled rows drawn together in
the batch's one sampling pass against the serialized route, and a biased sampled row when the
logits are wider than the vocabulary."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

import trio_mlx
from model_wrappers import _Wrapped, wrapping_loader
from runner_intake import hold_the_runner_intake
from servers import eventually

WORDS = [
    "the",
    "lighthouse",
    "keeper",
    "watched",
    "a",
    "grey",
    "sea",
    "roll",
    "under",
    "the",
    "evening",
    "sky",
    "and",
    "wrote",
]


def request_mix(seed: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    """`count` (prompt, options) pairs drawn from `seed`."""
    rng = random.Random(seed)
    mix = []
    for i in range(count):
        prompt = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        options: dict[str, Any] = {"max_tokens": rng.randint(4, 24)}
        if rng.random() < 0.5:
            options |= {"temperature": 0.9, "seed": rng.randint(0, 1000)}
            options |= rng.choice([{}, {"top_p": 0.8}, {"top_k": 20}, {"min_p": 0.05}])
        else:
            options["temperature"] = 0.0
        if rng.random() < 0.3:
            options["repetition_penalty"] = 1.3
        if rng.random() < 0.3:
            options["presence_penalty"] = 0.5
        if rng.random() < 0.3:
            options["logit_bias"] = {rng.randint(100, 40_000): 5.0, rng.randint(100, 40_000): -5.0}
        if rng.random() < 0.3:
            options["logprobs"] = True
            options["top_logprobs"] = 2
        if rng.random() < 0.2:
            options["stop"] = [rng.choice(WORDS)]
        mix.append((prompt, options))
    return mix


async def alone_then_together(
    engine: trio_mlx.Engine, calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], list[Any]]:
    """Each of `calls` (no-argument coroutine functions) run alone, one after the other; then
    all started at one step boundary of the runner. Their outputs, alone and together."""
    alone = [await call() for call in calls]
    hold = hold_the_runner_intake(monkeypatch)
    together: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        together[i] = await calls[i]()

    hold.close()
    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
        await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == len(calls))
        hold.open()
    return alone, together


def summary(out: Any) -> tuple[Any, ...]:
    return (tuple(out.tokens), out.finish_reason, out.text)


def logprob_values(out: Any) -> list[float]:
    return [entry.logprob for entry in out.logprobs or ()]


@pytest.mark.usefixtures("batch_pipeline")
@pytest.mark.parametrize("max_kv_size", [None, 24])
@pytest.mark.parametrize("seed", [3, 11])
async def test_each_request_gives_alone_what_it_gives_with_any_companions(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, seed: int, max_kv_size: int | None
) -> None:
    mix = request_mix(seed, 6)
    async with trio_mlx.open_engine(
        tiny_model_dir,
        max_num_seqs=8,
        max_kv_size=max_kv_size,
        cache_memory_bytes=0,
        admission="wait",
        max_waiting=8,
    ) as engine:
        alone, together = await alone_then_together(
            engine, [partial(engine.generate, p, **o) for p, o in mix], monkeypatch
        )
        assert max(int(n) for n in engine.get_stats()["runner"]["batch_sizes"]) >= 4
    assert [summary(o) for o in together] == [summary(o) for o in alone]
    for a, b in zip(alone, together, strict=True):
        assert logprob_values(a) == pytest.approx(logprob_values(b), abs=1e-4)


#: sampled and greedy requests without penalties or processors: the batch draws the sampled ones
#: together in one pass (`batch_choice`, `row_sampling`), each with its filters, bias and logprobs
DRAWN_TOGETHER: list[dict[str, Any]] = [
    {"temperature": 0.9, "seed": 1, "max_tokens": 12},
    {"temperature": 1.3, "seed": 2, "top_p": 0.8, "max_tokens": 9, "logprobs": True},
    {"temperature": 0.7, "seed": 3, "top_k": 20, "logit_bias": {"2048": 4.0}, "max_tokens": 12},
    {"temperature": 1.0, "seed": 4, "min_p": 0.05, "top_logprobs": 2, "logprobs": True},
    {"temperature": 0.0, "logit_bias": {"1000": 2.0}, "max_tokens": 7},
    {"temperature": 2.0, "seed": 5, "top_k": 5, "top_p": 0.9, "max_tokens": 3},
]


@pytest.mark.usefixtures("batch_pipeline")
async def test_rows_drawn_together_give_what_the_serialized_route_gives(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's sampling pass gives each seeded request the tokens (and logprobs) it gets on
    the serialized route: its draw depends on its seed and its own filters only."""
    prompts = [f"Request {i}: the keeper watched the grey sea" for i in range(len(DRAWN_TOGETHER))]
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1, cache_memory_bytes=0) as one:
        alone = [await one.generate(p, **o) for p, o in zip(prompts, DRAWN_TOGETHER, strict=True)]
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=8, cache_memory_bytes=0, admission="wait", max_waiting=8
    ) as engine:
        calls = [
            partial(engine.generate, p, **o) for p, o in zip(prompts, DRAWN_TOGETHER, strict=True)
        ]
        _, together = await alone_then_together(engine, calls, monkeypatch)
        assert max(int(n) for n in engine.get_stats()["runner"]["batch_sizes"]) >= 4
    assert [summary(o) for o in together] == [summary(o) for o in alone]
    assert len({tuple(o.tokens) for o in alone}) == len(alone)
    for a, b in zip(alone, together, strict=True):
        assert logprob_values(a) == pytest.approx(logprob_values(b), abs=1e-4)


class WideLogits(_Wrapped):
    """The real model with its logits padded past the vocabulary by 8 entries that are never
    drawn (an output layer padded past the tokenizer's ids, as some checkpoints have)."""

    def __call__(self, tokens: Any, cache: Any = None, **kwargs: Any) -> Any:
        logits = self._inner(tokens, cache=cache, **kwargs)
        pad = mx.full((*logits.shape[:-1], 8), -1e9, dtype=logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)


async def test_a_biased_sampled_row_keeps_its_bias_when_the_logits_are_wider(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits wider than the biases: a sampled row with a logit bias is chosen on its own (its
    selector widens the bias), not dropped from it in the batch's pass; here a bias of +100
    forces its token on both routes."""
    loader, _ = wrapping_loader(WideLogits)
    requests = [
        {"temperature": 0.9, "seed": 1, "max_tokens": 6, "logit_bias": {"2048": 100.0}},
        {"temperature": 0.9, "seed": 2, "max_tokens": 6},
        {"temperature": 0.9, "seed": 3, "max_tokens": 6, "top_p": 0.9},
    ]
    prompts = [f"Request {i}: the grey sea" for i in range(len(requests))]
    async with trio_mlx.open_engine(
        tiny_model_dir, loader=loader, max_num_seqs=1, cache_memory_bytes=0
    ) as one:
        alone = [await one.generate(p, **o) for p, o in zip(prompts, requests, strict=True)]
    assert list(alone[0].tokens) == [2048] * 6
    async with trio_mlx.open_engine(
        tiny_model_dir,
        loader=loader,
        max_num_seqs=4,
        cache_memory_bytes=0,
        admission="wait",
        max_waiting=4,
    ) as engine:
        calls = [partial(engine.generate, p, **o) for p, o in zip(prompts, requests, strict=True)]
        _, together = await alone_then_together(engine, calls, monkeypatch)
    assert [summary(o) for o in together] == [summary(o) for o in alone]


def media_mix(seed: int, count: int) -> list[tuple[Any, dict[str, Any]]]:
    """`count` (messages, options) pairs on the tiny vision model: about half with an image (one
    of a few sizes), the options drawn as `request_mix` draws them, some with an output format."""
    from media_samples import data_url, image_message, png
    from trio_mlx.structured.formats import OutputFormat

    rng = random.Random(seed)
    mix = []
    for i, (prompt, options) in enumerate(request_mix(seed, count)):
        if rng.random() < 0.5:
            size = rng.choice([(56, 56), (84, 56), (112, 112)])
            messages: Any = image_message(data_url(png(i, size)), prompt)
        else:
            messages = [{"role": "user", "content": prompt}]
        if rng.random() < 0.2:
            options = {**options, "output_format": OutputFormat.regex("(yes|no)[a-z ]{0,12}")}
            options.pop("stop", None)
        mix.append((messages, options))
    return mix


@pytest.mark.parametrize(("seed", "max_kv_size"), [(5, None), (17, None), (23, 40)])
async def test_image_and_text_requests_give_alone_what_they_give_together(
    tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch, seed: int, max_kv_size: int | None
) -> None:
    mix = media_mix(seed, 6)
    async with trio_mlx.open_engine(
        tiny_vlm_dir,
        max_num_seqs=8,
        max_kv_size=max_kv_size,
        cache_memory_bytes=0,
        admission="wait",
        max_waiting=8,
    ) as engine:
        alone, together = await alone_then_together(
            engine, [partial(engine.chat, m, **o) for m, o in mix], monkeypatch
        )
        assert engine.get_stats()["runner"]["media_joined"] > 0
    assert [summary(o) for o in together] == [summary(o) for o in alone]
    for a, b in zip(alone, together, strict=True):
        assert logprob_values(a) == pytest.approx(logprob_values(b), abs=1e-4)
