"""The engine API on the tiny random model: output, stop strings, UTF-8, seeds, limits, stats."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest
import trio

import trio_mlx
from model_wrappers import ScriptedModel, wrapping_loader

PROMPT = "The quick brown fox jumps over the lazy dog because"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def reference_tokens(model_dir: Path, prompt_tokens: list[int], max_tokens: int) -> list[int]:
    """What raw mlx-lm generates greedily for the same prompt (EOS excluded)."""
    model, tokenizer = mlx_lm.load(str(model_dir))
    out = []
    for response in mlx_lm.stream_generate(model, tokenizer, prompt_tokens, max_tokens=max_tokens):
        if response.finish_reason == "stop" and response.token in tokenizer.eos_token_ids:
            break
        out.append(response.token)
    return out


async def test_greedy_generate_equals_mlx_lm_token_for_token(
    engine: trio_mlx.Engine, tiny_model_dir: Path
) -> None:
    prompt_tokens = list(engine.prepare_generate(PROMPT).prompt_tokens)
    out = await engine.generate(PROMPT, max_tokens=40, temperature=0.0)
    assert out.tokens == reference_tokens(tiny_model_dir, prompt_tokens, 40)
    assert out.finished and out.finish_reason == "length"
    assert out.completion_tokens == 40
    assert out.prompt_tokens == len(prompt_tokens)
    assert out.text == engine.tokenizer.decode(out.tokens, skip_special_tokens=True)


async def test_greedy_chat_equals_mlx_lm_with_the_chat_template(
    engine: trio_mlx.Engine, tiny_model_dir: Path
) -> None:
    rendered = engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    prompt_tokens = engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert list(engine.prepare_chat(MESSAGES).prompt_tokens) == prompt_tokens
    out = await engine.chat(MESSAGES, max_tokens=24, temperature=0.0)
    assert out.tokens == reference_tokens(tiny_model_dir, prompt_tokens, 24)


async def test_token_id_prompts_and_chunked_prefill_give_the_same_output(
    tiny_model_dir: Path,
) -> None:
    # The serialized route's prefill plan. Here on the CPU the last prompt token goes alone, as
    # mlx-lm feeds it.
    async with trio_mlx.open_engine(tiny_model_dir, prefill_step_size=4, max_num_seqs=1) as engine:
        ids = list(engine.prepare_generate(PROMPT).prompt_tokens)
        chunked = await engine.generate(ids, max_tokens=16, temperature=0.0)
        stats = engine.get_stats()
    assert stats["runner"]["prefill_chunks"] == -(-(len(ids) - 1) // 4)
    assert chunked.tokens == reference_tokens(tiny_model_dir, ids, 16)
    # With a fused tail (the GPU default): chunks of 4 until at most 4 tokens are left, and those
    # go with the first token's forward pass.
    async with trio_mlx.open_engine(
        tiny_model_dir, prefill_step_size=4, fused_tail_tokens=4, max_num_seqs=1
    ) as engine:
        fused = await engine.generate(ids, max_tokens=16, temperature=0.0)
        stats = engine.get_stats()
    assert stats["runner"]["prefill_chunks"] == -(-(len(ids) - 4) // 4)
    assert fused.tokens == chunked.tokens


async def test_streamed_deltas_add_up_to_the_final_text(engine: trio_mlx.Engine) -> None:
    outputs = [o async for o in engine.stream_generate(PROMPT, max_tokens=30, temperature=0.0)]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert "".join(o.new_text for o in outputs) == outputs[-1].text
    assert sum(len(o.new_tokens) for o in outputs) == outputs[-1].completion_tokens == 30
    final = outputs[-1]
    assert final.time_to_first_token is not None and final.time_to_first_token > 0
    assert final.prompt_tps == pytest.approx(final.prompt_tokens / final.time_to_first_token)


async def test_stop_string_across_token_boundaries_ends_the_text_before_it(
    engine: trio_mlx.Engine,
) -> None:
    free = await engine.generate(PROMPT, max_tokens=30, temperature=0.0)
    pieces = [engine.tokenizer.decode([t]) for t in free.tokens]
    # A stop string made of the end of token 5 and the start of token 6.
    k = next(i for i in range(4, 20) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = free.text.index(stop)
    stopped = await engine.generate(PROMPT, max_tokens=30, temperature=0.0, stop=[stop, "zzzz"])
    assert stopped.finish_reason == "stop"
    assert stopped.stop_sequence == stop and free.stop_sequence is None  # which one ended it
    assert stopped.text == free.text[:cut]
    assert stop not in stopped.text
    # Counted: every token up to the one that completed the stop string.
    assert stopped.tokens == free.tokens[: stopped.completion_tokens]
    completing = engine.tokenizer.decode(free.tokens[: stopped.completion_tokens])
    assert stop in completing
    assert stop not in engine.tokenizer.decode(free.tokens[: stopped.completion_tokens - 1])


async def test_multibyte_utf8_split_across_tokens_never_streams_broken_text(
    tiny_model_dir: Path,
) -> None:
    text = "Café 🙂 日本語 ünïcødé 🚀🚀"
    async with trio_mlx.open_engine(tiny_model_dir) as probe:
        script = probe.tokenizer.encode(text, add_special_tokens=False)
        prompt = list(probe.prepare_generate("Say it:").prompt_tokens)
    lone = [probe.tokenizer.decode([t]) for t in script]
    assert any("\ufffd" in piece for piece in lone), "the text must split characters across tokens"

    loader, _ = wrapping_loader(lambda m: ScriptedModel(m, len(prompt), script))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        outputs = [
            o async for o in engine.stream_generate(prompt, max_tokens=len(script), temperature=0.0)
        ]
    assert outputs[-1].tokens == script
    assert all("\ufffd" not in o.new_text for o in outputs)
    assert "".join(o.new_text for o in outputs) == text == outputs[-1].text


async def test_eos_ends_the_completion_without_counting_it(tiny_model_dir: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_dir) as probe:
        script = probe.tokenizer.encode(" Paris.", add_special_tokens=False)
        eos = probe.tokenizer.eos_token_id
        prompt = list(probe.prepare_generate("Capital?").prompt_tokens)
    loader, _ = wrapping_loader(lambda m: ScriptedModel(m, len(prompt), [*script, eos]))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        out = await engine.generate(prompt, max_tokens=50, temperature=0.0)
    assert out.finish_reason == "stop"
    assert out.tokens == script and out.completion_tokens == len(script)
    assert out.text == " Paris."


async def test_same_seed_same_tokens_different_seed_different_tokens(
    engine: trio_mlx.Engine,
) -> None:
    a = await engine.generate(PROMPT, max_tokens=20, temperature=1.0, top_p=1.0, seed=7)
    b = await engine.generate(PROMPT, max_tokens=20, temperature=1.0, top_p=1.0, seed=7)
    c = await engine.generate(PROMPT, max_tokens=20, temperature=1.0, top_p=1.0, seed=8)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


async def test_a_tiny_top_p_is_greedy(engine: trio_mlx.Engine) -> None:
    greedy = await engine.generate(PROMPT, max_tokens=15, temperature=0.0)
    nucleus = await engine.generate(PROMPT, max_tokens=15, temperature=1.5, top_p=1e-6, seed=3)
    assert nucleus.tokens == greedy.tokens


async def test_prompt_that_fills_the_context_is_refused_before_admission(
    engine: trio_mlx.Engine,
) -> None:
    too_long = [100] * engine.context_length
    with pytest.raises(trio_mlx.PromptTooLong) as info:
        await engine.generate(too_long, max_tokens=4)
    assert info.value.param == "prompt"
    assert engine.get_stats()["admitted"] == 0


async def test_max_tokens_is_capped_by_the_context(engine: trio_mlx.Engine) -> None:
    prompt = [100] * (engine.context_length - 3)
    out = await engine.generate(prompt, max_tokens=50, temperature=0.0)
    assert out.finish_reason == "length"
    assert out.completion_tokens == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
async def test_invalid_sampling_values_name_their_parameter(
    engine: trio_mlx.Engine, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(trio_mlx.InvalidRequest) as info:
        engine.prepare_generate(PROMPT, **kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "messages[0].content[0].image_url",
        ),
    ],
)
async def test_invalid_messages_name_the_offending_field(
    engine: trio_mlx.Engine, messages: list[dict[str, object]], param: str
) -> None:
    with pytest.raises(trio_mlx.InvalidRequest) as info:
        engine.prepare_chat(messages)
    assert info.value.param == param


async def test_token_ids_outside_the_vocabulary_are_refused(engine: trio_mlx.Engine) -> None:
    with pytest.raises(trio_mlx.InvalidRequest) as info:
        engine.prepare_generate([1, 2, 10**9])
    assert info.value.param == "prompt"


async def test_content_parts_render_like_plain_content(engine: trio_mlx.Engine) -> None:
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": " of France?"},
            ],
        }
    ]
    assert engine.prepare_chat(parts).prompt_tokens == engine.prepare_chat(MESSAGES).prompt_tokens


async def test_stats_count_requests_and_tokens(engine: trio_mlx.Engine) -> None:
    await engine.generate(PROMPT, max_tokens=5, temperature=0.0)
    await engine.chat(MESSAGES, max_tokens=7, temperature=0.0)
    stats = engine.get_stats()
    assert stats["admitted"] == 2
    assert stats["finished"] == {"length": 2}
    assert stats["runner"]["generated_tokens"] == 12
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["last_request"]["completion_tokens"] == 7
    assert stats["model_name"] == engine.model_name == "tiny-llama"


async def test_two_engines_run_side_by_side_in_one_trio_program(tiny_model_dir: Path) -> None:
    async with (
        trio_mlx.open_engine(tiny_model_dir) as first,
        trio_mlx.open_engine(tiny_model_dir) as second,
    ):
        results: dict[str, list[int]] = {}

        async def run(name: str, engine: trio_mlx.Engine) -> None:
            results[name] = (await engine.generate(PROMPT, max_tokens=10, temperature=0.0)).tokens

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", first)
            nursery.start_soon(run, "b", second)
    assert results["a"] == results["b"]


async def test_a_seed_reproduces_across_engine_restarts(tiny_model_dir: Path) -> None:
    outputs = []
    for _ in range(2):
        async with trio_mlx.open_engine(tiny_model_dir) as fresh:
            out = await fresh.generate(PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=11)
            outputs.append(out.tokens)
    assert outputs[0] == outputs[1]


async def test_any_integer_is_a_seed(engine: trio_mlx.Engine) -> None:
    # OpenAI's seeds are signed 64-bit; MLX keys are unsigned: negative and huge seeds work too.
    for seed in (-1, -(2**63), 2**64 + 5):
        a = await engine.generate(PROMPT, max_tokens=6, temperature=1.0, seed=seed)
        b = await engine.generate(PROMPT, max_tokens=6, temperature=1.0, seed=seed)
        assert a.finish_reason == "length" and a.tokens == b.tokens
