"""The stream actor's text machinery, without Trio or MLX: stop strings and detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from trio_mlx.text.detokenizer import IncrementalDetokenizer, decoder_for
from trio_mlx.text.stop import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        emitted, stopped = matcher.feed(piece)
        out.append(emitted)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        (["Hello", " wor", "ld"], ["world"], ("Hello ", True)),
        (["a", "b", "c", "d"], ["bc"], ("a", True)),
        (["abc"], ["x"], ("abc", False)),
        (["ab", "c##", "d"], ["##"], ("abc", True)),
        # A partial match that fails is released, not lost.
        (["wor", "m"], ["world"], ("worm", False)),
        # The earliest of several stop strings wins.
        (["xx STOP yy END"], ["END", "STOP"], ("xx ", True)),
        # Overlapping prefixes: "aab" must be found after "aa" looked like a start.
        (["a", "a", "a", "b"], ["aab"], ("a", True)),
    ],
)
def test_stop_matcher(pieces: list[str], stops: list[str], expected: tuple[str, bool]) -> None:
    assert feed_all(StopMatcher(stops), pieces) == expected


def test_stop_matcher_holds_back_only_a_possible_start() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("The answer is 4 </ans") == ("The answer is 4 ", False)
    assert matcher.held == "</ans"
    assert matcher.feed("wer> done") == ("", True)
    assert matcher.stopped_by == "</answer>"


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.held == ""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize(
    "text",
    [
        "Plain ASCII text, with punctuation!",
        "Emoji 🙂🚀 and CJK 日本語 and accents é ü ñ",
        "  leading spaces and\nnew lines\n\n  indented",
        "<|im_start|>user",  # special tokens are skipped
    ],
)
def test_incremental_detokenization_equals_decoding_the_whole(tokenizer: object, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    decode = decoder_for(tokenizer)
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


def test_an_incomplete_character_is_held_back_until_completed(tokenizer: object) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)  # type: ignore[attr-defined]
    assert len(ids) > 1
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🙂"


def test_a_truncated_character_at_the_end_is_flushed_as_replacement(tokenizer: object) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)  # type: ignore[attr-defined]
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    for t in ids[:-1]:
        detok.add(t)
    assert detok.flush() == "\ufffd"


def test_tool_markup_held_as_special_tokens_is_kept_other_specials_skipped(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    from trio_mlx.tools.registry import MARKUP_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    text = '<|im_start|>[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}<|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    kept = decoder_for(tokenizer, keep=MARKUP_TOKENS)
    assert kept(ids) == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert decoder_for(tokenizer)(ids) == 'get_weather{"city": "Paris"}'
    # A tokenizer with none of the markup as special tokens decodes as before.
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain_ids = plain.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert decoder_for(plain, keep=MARKUP_TOKENS)(plain_ids) == "hi"
