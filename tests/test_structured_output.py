"""Constrained decoding in the engine, on the tiny random model: with random weights nothing
but the grammar makes the output valid, so every check here is a check of the constraint.

Both runner routes (serialized, `max_num_seqs=1`, and batched) and its composition with
batching companions, seeds, logprobs, stop strings, the prefix cache and aborts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

import trio_mlx
from runner_intake import hold_the_runner_intake
from servers import eventually
from test_batching import PROMPTS, alone, assert_idle
from tiny_model import build_tiny_model
from trio_mlx.errors import InvalidRequest
from trio_mlx.structured import OutputFormat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "alive"],
    "additionalProperties": False,
}
FORMAT = OutputFormat.json_schema(PERSON)
#: A grammar that cannot end within any token budget used here: only an abort or max_tokens
#: stops it.
ENDLESS = OutputFormat.json_schema({"type": "string", "minLength": 10000})
USER = [{"role": "user", "content": "Describe a person."}]
ROUTES = pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])


#: A request to run: (prompt, `Engine.generate` options).
Job = tuple[str, dict[str, Any]]


def assert_valid(text: str, schema: dict[str, Any] = PERSON) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture
async def routed_engine(tiny_model_dir: Path, max_num_seqs: int) -> AsyncIterator[trio_mlx.Engine]:
    """An engine on the tiny model on the route the test's `ROUTES` parameter names."""
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=max_num_seqs) as engine:
        yield engine


async def each_alone(model_dir: Path, jobs: list[Job]) -> list[trio_mlx.GenerationOutput]:
    """Each job run by itself, one after the other, on the serialized route."""
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
        return [await engine.generate(prompt, **options) for prompt, options in jobs]


async def decode_together(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, jobs: list[Job]
) -> tuple[list[trio_mlx.GenerationOutput], dict[str, Any]]:
    """The jobs sent at once to a batched engine whose runner takes them all at one step
    boundary and (chunks cut by the plan alone, not by a pace measured on a busy machine)
    prefills them in one step, so that they decode together. Their outputs in job order, and
    the runner's stats once the engine is idle again."""
    hold = hold_the_runner_intake(monkeypatch)
    async with trio_mlx.open_engine(
        model_dir, max_num_seqs=4, prefill_chunk_seconds=60.0
    ) as engine:
        got: dict[int, trio_mlx.GenerationOutput] = {}

        async def run(i: int) -> None:
            prompt, options = jobs[i]
            got[i] = await engine.generate(prompt, **options)

        async with trio.open_nursery() as nursery:
            hold.close()
            for i in range(len(jobs)):
                nursery.start_soon(run, i)
            await eventually(
                lambda: engine.get_stats()["runner"]["requests_in_flight"] == len(jobs)
            )
            hold.open()
        await assert_idle(engine)
        return [got[i] for i in range(len(jobs))], engine.get_stats()["runner"]


@ROUTES
async def test_greedy_output_follows_the_schema_and_ends_with_it(
    routed_engine: trio_mlx.Engine,
) -> None:
    out = await routed_engine.chat(USER, max_tokens=200, temperature=0, output_format=FORMAT)
    plain = await routed_engine.chat(USER, max_tokens=20, temperature=0)
    assert_valid(out.text)
    assert out.finish_reason == "stop"  # the closing brace ends it: no EOS needed
    assert out.completion_tokens == len(out.tokens)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.text)  # the model alone writes no JSON


async def test_both_routes_write_the_same_tokens(tiny_model_dir: Path) -> None:
    options = {"max_tokens": 200, "temperature": 0.9, "seed": 11, "output_format": FORMAT}
    texts = []
    for max_num_seqs in (1, 4):
        async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=max_num_seqs) as engine:
            texts.append((await engine.chat(USER, **options)).tokens)
    assert texts[0] == texts[1]


async def test_a_constrained_request_beside_unconstrained_ones_changes_none_of_them(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampling = {"max_tokens": 16, "temperature": 0.0}
    seeded = {"max_tokens": 200, "temperature": 0.8, "seed": 5, "output_format": FORMAT}
    jobs: list[Job] = [*((prompt, sampling) for prompt in PROMPTS[:3]), (PROMPTS[3], seeded)]
    expected = await alone(tiny_model_dir, PROMPTS[:3], **sampling)
    (reference,) = await each_alone(tiny_model_dir, jobs[3:])
    results, stats = await decode_together(tiny_model_dir, monkeypatch, jobs)
    assert [results[i].tokens for i in range(3)] == expected
    assert results[3].tokens == reference.tokens
    assert_valid(results[3].text)
    assert max(int(size) for size in stats["batch_sizes"]) >= 2


async def test_two_constrained_requests_in_one_batch_each_equal_itself_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = OutputFormat.regex(r"(yes|no)( indeed)?")
    options = {"max_tokens": 200, "seed": 3}
    jobs: list[Job] = [
        (PROMPTS[0], {**options, "temperature": 0.0, "output_format": FORMAT}),
        (PROMPTS[1], {**options, "temperature": 1.0, "output_format": other}),
        (PROMPTS[2], {**options, "temperature": 1.0, "output_format": FORMAT}),
    ]
    expected = [out.tokens for out in await each_alone(tiny_model_dir, jobs)]
    got, stats = await decode_together(tiny_model_dir, monkeypatch, jobs)
    assert max(int(size) for size in stats["batch_sizes"]) == 3
    assert [got[i].tokens for i in range(3)] == expected
    assert got[1].text in ("yes", "no", "yes indeed", "no indeed")


async def test_greedy_constrained_rows_chosen_together_equal_each_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = OutputFormat.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 4})
    options: list[dict[str, Any]] = [
        {"output_format": FORMAT, "logprobs": True, "top_logprobs": 3},
        {"output_format": other},
        {"output_format": FORMAT},
        {},  # a plain row beside them
    ]
    base = {"max_tokens": 120, "temperature": 0.0}
    jobs: list[Job] = [(PROMPTS[i], {**base, **options[i]}) for i in range(4)]
    expected = await each_alone(tiny_model_dir, jobs)
    got, stats = await decode_together(tiny_model_dir, monkeypatch, jobs)
    assert max(int(size) for size in stats["batch_sizes"]) == 4
    for i in range(4):
        assert got[i].tokens == expected[i].tokens
    assert got[0].logprobs is not None and expected[0].logprobs is not None
    assert [lp.top for lp in got[0].logprobs] == [lp.top for lp in expected[0].logprobs]
    assert_valid(got[2].text)
    assert isinstance(json.loads(got[1].text), list)


@ROUTES
async def test_logprobs_are_the_models_own_before_the_mask(
    routed_engine: trio_mlx.Engine,
) -> None:
    options: dict[str, Any] = {"temperature": 0, "logprobs": True, "top_logprobs": 5}
    free = await routed_engine.chat(USER, max_tokens=1, **options)
    constrained = await routed_engine.chat(USER, max_tokens=200, output_format=FORMAT, **options)
    assert free.logprobs is not None and constrained.logprobs is not None
    first_free, first = free.logprobs[0], constrained.logprobs[0]
    # same prompt, same raw logits: the same alternatives with the same values, although the
    # grammar chose a token the model alone ranks lower
    assert first.top == first_free.top
    assert first.token != first_free.token and first.logprob < first.top[0][1]
    listed = dict(first.top)
    if first.token in listed:
        assert first.logprob == pytest.approx(listed[first.token])
    assert len(constrained.logprobs) == len(constrained.tokens)
    assert all(lp.logprob <= 0 for lp in constrained.logprobs)


@ROUTES
async def test_a_stop_string_cuts_constrained_output(routed_engine: trio_mlx.Engine) -> None:
    full = await routed_engine.chat(USER, max_tokens=200, temperature=0, output_format=FORMAT)
    stopped = await routed_engine.chat(
        USER, max_tokens=200, temperature=0, output_format=FORMAT, stop='"age"'
    )
    assert stopped.finish_reason == "stop"
    assert full.text.startswith(stopped.text) and '"age"' not in stopped.text
    assert len(stopped.text) < len(full.text)


@ROUTES
async def test_max_tokens_cuts_constrained_output_at_length(routed_engine: trio_mlx.Engine) -> None:
    full = await routed_engine.chat(USER, max_tokens=200, temperature=0, output_format=FORMAT)
    cut = await routed_engine.chat(USER, max_tokens=4, temperature=0, output_format=FORMAT)
    assert cut.finish_reason == "length" and cut.tokens == full.tokens[:4]


async def test_a_cached_prefix_gives_the_same_constrained_output(tiny_model_dir: Path) -> None:
    system = {"role": "system", "content": "You answer in JSON. " * 8}
    messages = [system, {"role": "user", "content": "Describe a person."}]
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        first = await engine.chat(messages, max_tokens=200, temperature=0, output_format=FORMAT)
        again = await engine.chat(messages, max_tokens=200, temperature=0, output_format=FORMAT)
    assert again.cached_tokens > 0  # the grammar's state is per request; the prompt's is cached
    assert again.tokens == first.tokens
    assert_valid(again.text)


@ROUTES
async def test_an_abort_mid_constrained_stream_frees_everything(
    tiny_model_dir: Path, max_num_seqs: int, routed_engine: trio_mlx.Engine
) -> None:
    engine = routed_engine
    companion: dict[str, Any] = {}

    async def other() -> None:
        companion["out"] = await engine.generate(PROMPTS[0], max_tokens=24, temperature=0)

    got: list[int] = []
    async with trio.open_nursery() as nursery:
        if max_num_seqs > 1:
            nursery.start_soon(other)
        request = engine.prepare_chat(
            USER, max_tokens=500, temperature=1.0, seed=4, output_format=ENDLESS
        )
        async with engine.open_stream(request) as stream:
            async for part in stream:
                got.extend(part.new_tokens)
                if len(got) >= 5:
                    break  # the client goes away
    await assert_idle(engine)
    assert engine.get_stats()["runner"]["aborted"] >= 1
    assert engine.tokenizer.decode(got).startswith('"')
    # the engine serves the next constrained request as usual
    out = await engine.chat(USER, max_tokens=200, temperature=0, output_format=FORMAT)
    assert_valid(out.text)
    if max_num_seqs > 1:
        (expected,) = await alone(tiny_model_dir, PROMPTS[:1], max_tokens=24, temperature=0)
        assert companion["out"].tokens == expected


async def test_a_cancelled_caller_mid_constrained_generate_frees_the_batch(
    tiny_model_dir: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        with trio.CancelScope() as scope:
            async for out in engine.stream_generate(
                "Count:", max_tokens=800, temperature=1.0, output_format=ENDLESS
            ):
                if len(out.tokens) >= 3:
                    scope.cancel()  # the caller is cancelled mid-stream
        assert scope.cancelled_caught
        await eventually(lambda: engine.get_stats()["runner"]["live_sequences"] == 0)
        await assert_idle(engine)


async def test_an_uncompilable_schema_is_refused_before_admission(engine: trio_mlx.Engine) -> None:
    bad = OutputFormat.json_schema({"type": "nonsense"}, param="response_format")
    with pytest.raises(InvalidRequest) as caught:
        await engine.prepare_chat_async(USER, output_format=bad)
    assert caught.value.param == "response_format"
    with pytest.raises(InvalidRequest) as caught:
        await engine.prepare_chat_async(USER, output_format={"type": "object"})  # type: ignore[typeddict-item]
    assert caught.value.param == "output_format"
    assert engine.get_stats()["runner"]["started"] == 0


async def test_a_complete_grammar_that_may_go_on_allows_the_eos(engine: trio_mlx.Engine) -> None:
    # after one digit the grammar is complete; a large bias on EOS makes the model take it
    eos = sorted(engine.tokenizer.eos_token_ids)[0]
    out = await engine.generate(
        "n =",
        max_tokens=50,
        temperature=0,
        logit_bias={eos: 100.0},
        output_format=OutputFormat.regex("[0-9]{1,20}"),
    )
    assert out.finish_reason == "stop" and out.text.isdigit() and len(out.tokens) == 1


async def test_json_object_with_a_bias_towards_closing_gives_an_empty_object(
    tiny_model_dir: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        tok = engine.tokenizer
        closing = {t: 100.0 for s in ("}", "{}") for t in tok.encode(s, add_special_tokens=False)}
        out = await engine.chat(
            USER,
            max_tokens=20,
            temperature=0,
            logit_bias=closing,
            output_format=OutputFormat.json_object(),
        )
    assert json.loads(out.text) == {} and out.finish_reason == "stop"


@ROUTES
async def test_an_output_layer_wider_than_the_vocabulary_never_yields_padding_tokens(
    tmp_path: Path, max_num_seqs: int
) -> None:
    model = build_tiny_model(tmp_path / "padded", vocab_size=49152 + 96)
    async with trio_mlx.open_engine(model, max_num_seqs=max_num_seqs) as engine:
        out = await engine.chat(USER, max_tokens=200, temperature=1.0, seed=2, output_format=FORMAT)
    assert all(t < 49152 for t in out.tokens)
    assert_valid(out.text)
