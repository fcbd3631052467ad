"""Structured output without an engine: `OutputFormat` keys, the grammar compiler and its cache,
the matcher's masks on logits of every width, and the forced tool-call grammar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from trio_mlx.errors import InvalidRequest
from trio_mlx.structured import (
    GrammarCompiler,
    GrammarViolation,
    OutputFormat,
    OutputFormatError,
    apply_token_mask,
    forced_tool_calls_format,
    parse_forced_tool_calls,
)
from trio_mlx.structured.matcher import allowed_words_of, token_mask

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
            "$defs": {"zone": {"enum": ["UTC", "CET"]}},
        },
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def accepts(compiler: GrammarCompiler, tokenizer: Any, fmt: OutputFormat, text: str) -> bool:
    """Whether `text` (tokenized as the model would write it) is a complete match."""
    matcher = compiler.compile(fmt).matcher()
    try:
        for token in encode(tokenizer, text):
            matcher.allowed_words()
            matcher.consume(token)
    except GrammarViolation:
        return False
    return matcher.accepting


def test_formats_are_keys_whatever_field_names_them() -> None:
    a = OutputFormat.json_schema(PERSON, param="response_format")
    b = OutputFormat.json_schema(dict(PERSON), param="text.format")
    assert a == b and hash(a) == hash(b)
    assert OutputFormat.json_schema(PERSON, strict=False) != a
    assert OutputFormat.json_object() != OutputFormat.json_schema({"type": "object"})
    assert a.schema == PERSON
    # the order of properties is the order of generation: it is kept
    swapped = {**PERSON, "properties": dict(reversed(PERSON["properties"].items()))}
    assert OutputFormat.json_schema(swapped) != a


@pytest.mark.parametrize("schema", [["not", "an", "object"], 5, {"bad": float("nan")}])
def test_a_schema_that_is_not_a_json_object_is_refused_naming_the_param(schema: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        OutputFormat.json_schema(schema, param="response_format")
    assert caught.value.param == "response_format"


@pytest.mark.parametrize(
    "fmt",
    [
        OutputFormat.json_schema({"type": "foo"}, param="response_format"),
        OutputFormat.json_schema({"$ref": "#/nowhere"}, param="response_format"),
        OutputFormat.json_schema({"type": "string", "pattern": "("}, param="response_format"),
        OutputFormat.json_schema(
            {"type": "string", "minLength": 5, "maxLength": 2}, param="response_format"
        ),
        OutputFormat.json_schema(
            {"type": "string", "format": "no-such-format"}, strict=True, param="response_format"
        ),
        OutputFormat.regex("a(", param="response_format"),
        OutputFormat.lark("start: undefined_rule", param="response_format"),
    ],
)
def test_what_cannot_compile_is_an_invalid_request_naming_the_param(
    compiler: GrammarCompiler, fmt: OutputFormat
) -> None:
    with pytest.raises(OutputFormatError) as caught:
        compiler.compile(fmt)
    assert isinstance(caught.value, InvalidRequest)
    assert caught.value.param == "response_format"
    assert caught.value.code == "invalid_output_format"
    assert str(caught.value)


def test_a_non_strict_schema_ignores_keywords_it_cannot_enforce(compiler: GrammarCompiler) -> None:
    schema = {"type": "string", "format": "no-such-format", "maxLength": 3}
    compiler.compile(OutputFormat.json_schema(schema, strict=False))


def test_compiled_grammars_are_cached_and_the_cache_is_bounded(tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, cache_size=2)
    formats = [OutputFormat.regex(p) for p in ("a+", "b+", "c+")]
    first = compiler.compile(formats[0])
    assert compiler.compile(formats[0]) is first
    assert compiler.cache_info().hits == 1 and compiler.cache_info().misses == 1
    compiler.compile(formats[1])
    compiler.compile(formats[2])  # evicts "a+", the least recently used
    info = compiler.cache_info()
    assert info.size == 2 and info.capacity == 2 and info.misses == 3
    assert compiler.compile(formats[0]) is not first
    assert compiler.cache_info().misses == 4
    # a cached grammar asked for under another field's name reports errors under that name
    renamed = compiler.compile(formats[0].naming("text.format"))
    assert renamed.format.param == "text.format"


def test_a_matcher_follows_its_schema_and_is_done_when_complete(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    fmt = OutputFormat.json_schema(PERSON)
    assert accepts(compiler, tokenizer, fmt, '{"name": "Ann", "ok": true}')
    assert not accepts(compiler, tokenizer, fmt, '{"name": "Ann", "ok": 1}')
    assert not accepts(compiler, tokenizer, fmt, '{"name": "far too long", "ok": true}')
    matcher = compiler.compile(fmt).matcher()
    for token in encode(tokenizer, '{"name": "Ann", "ok": true}'):
        assert not matcher.done
        matcher.consume(token)
    assert matcher.done  # nothing may follow the closing brace
    words = matcher.allowed_words()
    allowed = np.nonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))[0]
    assert allowed.tolist() == sorted(tokenizer.eos_token_ids)


def test_every_request_gets_its_own_matcher(compiler: GrammarCompiler, tokenizer: Any) -> None:
    compiled = compiler.compile(OutputFormat.json_schema(PERSON))
    one, two = compiled.matcher(), compiled.matcher()
    for token in encode(tokenizer, '{"name": "A'):
        one.consume(token)
    fresh = compiled.matcher().allowed_words()
    assert np.array_equal(two.allowed_words(), fresh)
    assert not np.array_equal(one.allowed_words(), fresh)
    both = allowed_words_of([one, two])
    assert np.array_equal(both[0], one.allowed_words()) and np.array_equal(both[1], fresh)


def test_a_refused_token_is_a_grammar_violation(compiler: GrammarCompiler, tokenizer: Any) -> None:
    matcher = compiler.compile(OutputFormat.regex("[0-9]+")).matcher()
    with pytest.raises(GrammarViolation):
        matcher.consume(encode(tokenizer, "x")[0])


@pytest.mark.parametrize("extra", [0, 64, -100])
def test_masks_fit_logits_wider_or_narrower_than_the_vocabulary(
    compiler: GrammarCompiler, tokenizer: Any, extra: int
) -> None:
    matcher = compiler.compile(OutputFormat.regex("[0-9]")).matcher()
    words = matcher.allowed_words()[None]
    vocab = 32 * words.shape[1]
    width = vocab + extra
    logits = mx.zeros((1, width), dtype=mx.bfloat16)
    masked = apply_token_mask(logits, words)
    assert masked.shape == (1, width) and masked.dtype == mx.bfloat16
    finite = np.nonzero(np.isfinite(np.array(masked.astype(mx.float32))[0]))[0].tolist()
    digits = sorted({t for d in "0123456789" for t in encode(tokenizer, d)})
    assert finite == [t for t in digits if t < width]
    if extra > 0:  # padding rows of the embedding are never allowed
        assert not np.array(token_mask(words, width))[0, vocab:].any()


def test_forced_call_grammar_for_a_named_tool(compiler: GrammarCompiler, tokenizer: Any) -> None:
    fmt = forced_tool_calls_format([WEATHER, TIME], "get_weather", parallel=False)
    good = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
    assert accepts(compiler, tokenizer, fmt, good)
    other = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert not accepts(compiler, tokenizer, fmt, other)
    bad_args = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}'
    assert not accepts(compiler, tokenizer, fmt, bad_args)
    (call,) = parse_forced_tool_calls(good)
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    assert call.id.startswith("call_")


def test_forced_call_grammar_for_required_pairs_each_name_with_its_own_arguments(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    fmt = forced_tool_calls_format([WEATHER, TIME], "required", parallel=False)
    assert accepts(compiler, tokenizer, fmt, '{"name": "get_time", "arguments": {"zone": "CET"}}')
    # the referenced definition of get_time's parameters still applies ($ref rebased)
    assert not accepts(
        compiler, tokenizer, fmt, '{"name": "get_time", "arguments": {"zone": "PST"}}'
    )
    assert not accepts(
        compiler, tokenizer, fmt, '{"name": "get_time", "arguments": {"city": "Paris"}}'
    )


def test_parallel_forced_calls_are_an_array(compiler: GrammarCompiler, tokenizer: Any) -> None:
    fmt = forced_tool_calls_format([WEATHER, TIME], "required", parallel=True, max_calls=2)
    text = (
        '[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}]'
    )
    assert accepts(compiler, tokenizer, fmt, text)
    assert not accepts(compiler, tokenizer, fmt, "[]")
    calls = parse_forced_tool_calls(text)
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    assert len({c.id for c in calls}) == 2


def test_a_tool_without_parameters_takes_an_empty_object(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    ping = {"type": "function", "name": "ping"}  # the Responses API's flat shape
    fmt = forced_tool_calls_format([ping], "ping", parallel=False)
    assert accepts(compiler, tokenizer, fmt, '{"name": "ping", "arguments": {}}')
    assert not accepts(compiler, tokenizer, fmt, '{"name": "ping", "arguments": {"a": 1}}')


@pytest.mark.parametrize(
    "parameters",
    [
        {},
        {"description": "no type"},
        {"maxLength": 3},
        {"properties": {"a": {"type": "integer"}}},
        {"type": ["object", "null"]},
        {"$ref": "#/$defs/args", "$defs": {"args": {"properties": {"a": {"type": "integer"}}}}},
    ],
)
def test_forced_arguments_are_an_object_whatever_the_schema_leaves_open(
    compiler: GrammarCompiler, tokenizer: Any, parameters: Any
) -> None:
    # A schema without `"type": "object"` (`parameters: {}` is common) allowed any JSON value
    # as the arguments: the model wrote `"arguments": "..."` and the reply's `arguments` was no
    # JSON object (a string's text, unparseable by the client).
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    fmt = forced_tool_calls_format([tool], "f", parallel=False)
    assert accepts(compiler, tokenizer, fmt, '{"name": "f", "arguments": {"a": 1}}')
    for value in ('"abc"', "1", "null", "[1]"):
        assert not accepts(compiler, tokenizer, fmt, f'{{"name": "f", "arguments": {value}}}')


@pytest.mark.parametrize("kind", ["string", ["string", "null"], "array"])
def test_forced_arguments_of_a_schema_that_is_no_object_are_refused(kind: Any) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}
    with pytest.raises(InvalidRequest) as caught:
        forced_tool_calls_format([tool], "f", parallel=False)
    assert caught.value.param == "tools[0].function.parameters.type"


@pytest.mark.parametrize(
    ("tools", "choice"),
    [([], "required"), ([WEATHER], "get_time"), ([{"type": "web_search"}], "required")],
)
def test_forcing_a_call_that_cannot_be_made_is_refused(tools: Any, choice: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        forced_tool_calls_format(tools, choice, parallel=False)
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize("text", ['{"name": "get_weather", "argu', "[1]", '{"arguments": {}}'])
def test_text_that_is_not_a_forced_call_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_forced_tool_calls(text)
