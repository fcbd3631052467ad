"""The book of cached prefixes (`PrefixCache`) and the system-prompt boundary: no Trio, no MLX."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prompt_oracle import encode_chat, system_prefix_length
from trio_mlx.actors.kv_cache import (
    CacheHit,
    PrefixCache,
    StoreDecision,
)
from trio_mlx.engine.prompts import SystemPromptTokens, chat_prompt

BIG = 1 << 40


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stored(book: PrefixCache, tokens: Sequence[int], nbytes: int = 10, **kw: Any) -> int:
    kind = kw.pop("kind", "conversation")
    trimmable = kw.pop("trimmable", True)
    decision = book.store(tokens, nbytes, kind, trimmable)
    assert decision.stored
    assert decision.entry_id is not None
    return decision.entry_id


# ---- lookups ------------------------------------------------------------------------------------


def test_an_empty_book_misses() -> None:
    assert PrefixCache(BIG).lookup([1, 2, 3]) is None


def test_lookup_returns_the_longest_cached_prefix() -> None:
    book = PrefixCache(BIG)
    _stored(book, [1, 2], trimmable=False)
    four = _stored(book, [1, 2, 3, 4], trimmable=False)
    _stored(book, [1, 2, 3, 4, 5, 6, 7], trimmable=False)  # not a prefix of the prompt
    assert book.lookup([1, 2, 3, 4, 5, 6, 9, 9]) == CacheHit(four, 4, needs_trim=False)


def test_a_trimmable_entry_sharing_a_longer_prefix_is_trimmed_to_it() -> None:
    book = PrefixCache(BIG)
    _stored(book, [1, 2, 3], trimmable=False)
    long = _stored(book, [1, 2, 3, 4, 5, 6, 7, 8])
    assert book.lookup([1, 2, 3, 4, 5, 9, 9]) == CacheHit(long, 5, needs_trim=True)


def test_an_untrimmable_longer_entry_is_not_trimmed() -> None:
    book = PrefixCache(BIG)
    three = _stored(book, [1, 2, 3], trimmable=False)
    _stored(book, [1, 2, 3, 4, 5, 6, 7, 8], trimmable=False)
    assert book.lookup([1, 2, 3, 4, 5, 9, 9]) == CacheHit(three, 3, needs_trim=False)


def test_with_an_alignment_a_trimmable_hit_ends_on_a_multiple_of_it() -> None:
    book = PrefixCache(BIG)
    long = _stored(book, list(range(40)))
    prompt = [*range(37), 99, 99]
    assert book.lookup(prompt, align=16) == CacheHit(long, 32, needs_trim=True)
    # A whole trimmable entry is cut down too.
    assert book.lookup([*range(40), 7, 7], align=16) == CacheHit(long, 32, needs_trim=True)
    assert book.lookup([*range(40), 7, 7], align=8) == CacheHit(long, 40, needs_trim=False)
    # Less than one block in common: nothing to reuse.
    assert book.lookup([*range(12), 99, 99], align=16) is None
    assert book.statistics().misses == 1


def test_an_untrimmable_entry_is_used_whole_whatever_the_alignment() -> None:
    book = PrefixCache(BIG)
    whole = _stored(book, list(range(20)), trimmable=False)
    assert book.lookup([*range(20), 5, 5], align=16) == CacheHit(whole, 20, needs_trim=False)


def test_a_whole_entry_is_preferred_to_an_equally_long_trimmed_one() -> None:
    book = PrefixCache(BIG)
    _stored(book, [1, 2, 3, 4, 7, 8])  # trimmable, shares 4 with the prompt
    four = _stored(book, [1, 2, 3, 4], trimmable=False)
    assert book.lookup([1, 2, 3, 4, 9, 9]) == CacheHit(four, 4, needs_trim=False)


def test_a_hit_never_covers_the_whole_prompt() -> None:
    book = PrefixCache(BIG)
    entry = _stored(book, [1, 2, 3, 4])
    assert book.lookup([1, 2, 3, 4]) == CacheHit(entry, 3, needs_trim=True)  # a retry
    assert book.lookup([1, 2, 3, 4, 5]) == CacheHit(entry, 4, needs_trim=False)
    assert book.lookup([1]) is None  # one token: nothing can be reused


def test_an_untrimmable_entry_equal_to_the_prompt_cannot_serve_it() -> None:
    book = PrefixCache(BIG)
    two = _stored(book, [1, 2], trimmable=False)
    _stored(book, [1, 2, 3, 4], trimmable=False)
    assert book.lookup([1, 2, 3, 4]) == CacheHit(two, 2, needs_trim=False)
    assert book.lookup([1, 2]) is None


def test_lookups_across_split_edges() -> None:
    book = PrefixCache(BIG)
    a = _stored(book, [1, 2, 3, 4, 5, 6], trimmable=False)
    b = _stored(book, [1, 2, 3, 9], trimmable=False)  # splits the edge of the first key
    c = _stored(book, [1, 2], trimmable=False)  # an entry on the split point's parent edge
    assert book.lookup([1, 2, 3, 4, 5, 6, 0]) == CacheHit(a, 6, needs_trim=False)
    assert book.lookup([1, 2, 3, 9, 0]) == CacheHit(b, 4, needs_trim=False)
    assert book.lookup([1, 2, 3, 7]) == CacheHit(c, 2, needs_trim=False)
    assert book.remove(c)
    assert book.lookup([1, 2, 3, 7]) is None


def test_a_system_entry_serves_every_user_and_a_conversation_its_next_turn() -> None:
    book = PrefixCache(BIG)
    system = tuple(range(100, 140))
    sys_id = _stored(book, system, kind="system", trimmable=False)
    turn_one = (*system, 7, 8, 9, 50, 51)  # prompt + completion
    conv_id = _stored(book, turn_one, kind="conversation", trimmable=False)
    assert book.lookup((*system, 1, 2)) == CacheHit(sys_id, 40, needs_trim=False)
    assert book.lookup((*turn_one, 60, 61)) == CacheHit(conv_id, 45, needs_trim=False)


# ---- stores, eviction, budget -------------------------------------------------------------------


def test_least_recently_used_entries_are_evicted_until_the_new_one_fits() -> None:
    book = PrefixCache(100)
    a = _stored(book, [1, 1], 40)
    b = _stored(book, [2, 2], 40)
    assert book.lookup([1, 1, 5]) is not None  # a is now the most recently used
    decision = book.store([3, 3], 40, "conversation", True)
    assert decision.evicted == (b,)
    c = decision.entry_id
    assert (book.nbytes, len(book)) == (80, 2)
    decision = book.store([4, 4], 90, "conversation", True)
    assert decision.evicted == (a, c)  # least recently used first
    assert book.nbytes == 90
    assert book.statistics().evictions == 3


def test_storing_a_duplicate_key_refreshes_the_entry() -> None:
    clock = FakeClock()
    book = PrefixCache(100, clock=clock)
    a = _stored(book, [1, 1], 40)
    b = _stored(book, [2, 2], 40)
    clock.now = 200.0
    assert book.store([1, 1], 40, "conversation", True) == StoreDecision(a, refreshed=True)
    assert (book.nbytes, len(book)) == (80, 2)
    refreshed = book.entry(a)
    assert refreshed is not None
    assert refreshed.last_used == 200.0
    assert book.store([3, 3], 40, "conversation", True).evicted == (b,)


def test_a_snapshot_larger_than_the_whole_budget_is_refused() -> None:
    book = PrefixCache(100)
    a = _stored(book, [1, 1], 60)
    decision = book.store([2, 2], 101, "conversation", True)
    assert decision == StoreDecision(None)
    assert not decision.stored
    assert a in book
    assert book.statistics().refused == 1


def test_an_entry_exactly_the_budget_fits_alone() -> None:
    book = PrefixCache(100)
    a = _stored(book, [1, 1], 60)
    decision = book.store([2, 2], 100, "conversation", True)
    assert decision.stored
    assert decision.evicted == (a,)


def test_a_trimmable_entry_supersedes_the_prefixes_it_can_serve() -> None:
    book = PrefixCache(BIG)
    system = _stored(book, [1, 2, 3], kind="system")
    turn_one = _stored(book, [1, 2, 3, 4, 5, 6], trimmable=False)
    unrelated = _stored(book, [1, 2, 9])
    decision = book.store([1, 2, 3, 4, 5, 6, 7, 8], 10, "conversation", True)
    assert decision.superseded == (system, turn_one)
    assert decision.dropped == (system, turn_one)
    assert unrelated in book
    assert book.lookup([1, 2, 3, 0]) == CacheHit(decision.entry_id or 0, 3, needs_trim=True)
    assert book.statistics().superseded == 2


def test_an_untrimmable_entry_supersedes_nothing() -> None:
    book = PrefixCache(BIG)
    system = _stored(book, [1, 2, 3], kind="system", trimmable=False)
    decision = book.store([1, 2, 3, 4, 5], 10, "conversation", False)
    assert decision.superseded == ()
    assert system in book


def test_store_refuses_an_empty_key_and_negative_sizes() -> None:
    book = PrefixCache(BIG)
    with pytest.raises(ValueError, match="at least one token"):
        book.store([], 1, "system", True)
    with pytest.raises(ValueError, match="nbytes"):
        book.store([1], -1, "system", True)
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)


def test_remove_and_clear_forget_entries_and_ids_are_never_reused() -> None:
    book = PrefixCache(BIG)
    a, b, c = (_stored(book, key, trimmable=False) for key in ([1], [2, 3], [2, 4]))
    assert book.remove(b)
    assert not book.remove(b)
    assert book.lookup([2, 3, 5]) is None
    assert book.clear() == [a, c]
    assert (len(book), book.nbytes) == (0, 0)
    assert book.lookup([1, 2]) is None
    assert _stored(book, [1]) > c


# ---- counters -----------------------------------------------------------------------------------


def test_counters_and_statistics() -> None:
    book = PrefixCache(1000)
    _stored(book, [1, 2, 3, 4], 100)
    _stored(book, [7, 8], 50, trimmable=False)
    book.lookup([1, 2, 3, 4, 5])  # hit, 4 tokens
    book.lookup([1, 2, 9])  # trimmed hit, 2 tokens
    book.lookup([5, 5, 5])  # miss
    book.store([7, 8], 50, "conversation", False)  # refresh
    stats = book.statistics()
    assert dataclasses.asdict(stats) == {
        "entries": 2,
        "bytes": 150,
        "budget": 1000,
        "hits": 2,
        "misses": 1,
        "stores": 2,
        "refreshes": 1,
        "refused": 0,
        "evictions": 0,
        "superseded": 0,
        "tokens_saved": 6,
    }
    assert stats.hit_ratio == pytest.approx(2 / 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 0  # type: ignore[misc]
    assert PrefixCache(1).statistics().hit_ratio == 0.0


def test_entries_report_kind_size_and_last_use_in_lru_order() -> None:
    clock = FakeClock()
    book = PrefixCache(BIG, clock=clock)
    a = _stored(book, [1, 2], 10, kind="system", trimmable=False)
    clock.now = 101.0
    b = _stored(book, [3, 4], 20)
    clock.now = 102.0
    book.lookup([1, 2, 3])
    entries = book.entries()
    assert [e.id for e in entries] == [b, a]
    assert (entries[1].kind, entries[1].nbytes, entries[1].trimmable) == ("system", 10, False)
    assert (entries[0].tokens, entries[0].last_used) == ((3, 4), 101.0)
    assert entries[1].last_used == 102.0


# ---- the tree against a brute-force reference ---------------------------------------------------


def _reference_length(entries: Sequence[Any], prompt: tuple[int, ...]) -> int:
    limit = len(prompt) - 1
    best = 0
    for e in entries:
        if len(e.tokens) <= limit and prompt[: len(e.tokens)] == e.tokens:
            best = max(best, len(e.tokens))
        elif e.trimmable:
            common = 0
            while common < min(limit, len(e.tokens)) and e.tokens[common] == prompt[common]:
                common += 1
            best = max(best, common)
    return best


def test_random_operations_agree_with_a_brute_force_reference() -> None:
    rng = random.Random(7)
    book = PrefixCache(2_000)
    for _ in range(3000):
        tokens = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 9)))
        action = rng.random()
        if action < 0.35:
            cached = {e.tokens: e.id for e in book.entries()}
            decision = book.store(tokens, rng.randrange(1, 300), "conversation", rng.random() < 0.5)
            assert decision.refreshed == (tokens in cached)
            if decision.refreshed:
                assert decision.entry_id == cached[tokens]
        elif action < 0.45 and len(book):
            book.remove(rng.choice(book.entries()).id)
        else:
            entries = book.entries()
            expected = _reference_length(entries, tokens)
            hit = book.lookup(tokens)
            if expected == 0:
                assert hit is None
                continue
            assert hit is not None
            assert hit.length == expected
            entry = next(e for e in entries if e.id == hit.entry_id)
            assert entry.tokens[: hit.length] == tokens[: hit.length]
            assert hit.needs_trim == (len(entry.tokens) != hit.length)
            assert entry.trimmable or not hit.needs_trim
        assert book.nbytes == sum(e.nbytes for e in book.entries()) <= book.budget


# ---- the system-prompt boundary -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_system_prefix_covers_exactly_the_rendered_system_message(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ]
    prompt = encode_chat(tokenizer, messages)
    n = system_prefix_length(tokenizer, messages, prompt)
    assert n is not None
    assert tokenizer.decode(prompt[:n]) == "<|im_start|>system\nYou are terse.<|im_end|>\n"
    assert tokenizer.decode(prompt[n:]).startswith("<|im_start|>user\nHi there")


def test_the_same_system_prompt_gives_the_same_prefix_for_different_users(tokenizer: Any) -> None:
    system = {"role": "system", "content": "Answer in French. " * 20}
    one = encode_chat(tokenizer, [system, {"role": "user", "content": "a"}])
    two = encode_chat(tokenizer, [system, {"role": "user", "content": "something else"}])
    n = system_prefix_length(tokenizer, [system, {"role": "user", "content": "a"}], one)
    assert n is not None
    assert one[:n] == two[:n]
    assert n == system_prefix_length(tokenizer, [system, {"role": "user", "x": 1}], two)


def test_several_leading_system_and_developer_messages_form_the_prefix(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "One."},
        {"role": "developer", "content": "Two."},
        {"role": "user", "content": "Hi"},
    ]
    prompt = encode_chat(tokenizer, messages)
    n = system_prefix_length(tokenizer, messages, prompt)
    assert n is not None
    assert tokenizer.decode(prompt[:n]).endswith("Two.<|im_end|>\n")


def test_no_system_message_means_no_system_prefix(tokenizer: Any) -> None:
    # SmolLM2's template then inserts its default system prompt: not the caller's, not cached.
    messages = [{"role": "user", "content": "Hi"}]
    assert system_prefix_length(tokenizer, messages, encode_chat(tokenizer, messages)) is None


def test_a_system_only_conversation_has_no_boundary_inside_it(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Only this."}]
    prompt = encode_chat(tokenizer, messages)
    n = system_prefix_length(tokenizer, messages, prompt)
    assert n is not None  # the generation prompt follows the system part
    assert n < len(prompt)
    assert system_prefix_length(tokenizer, messages, prompt[:n]) is None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    system=st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=2),
    user=st.text(min_size=0, max_size=40),
)
def test_the_one_pass_boundary_matches_tokenizing_the_system_part_alone(
    tokenizer: Any, system: list[str], user: str
) -> None:
    messages = [{"role": "system", "content": text} for text in system]
    messages.append({"role": "user", "content": user})
    prompt = chat_prompt(tokenizer, messages, find_system_prefix=True)
    assert prompt.tokens == encode_chat(tokenizer, messages)
    assert prompt.system_prefix == system_prefix_length(tokenizer, messages, prompt.tokens)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    system=st.text(min_size=0, max_size=60),
    users=st.lists(
        st.text(min_size=0, max_size=30) | st.sampled_from(["<|im_start|>", " <|im_end|>\n"]),
        min_size=2,
        max_size=4,
    ),
)
def test_a_known_system_prompt_is_not_tokenized_again_and_nothing_changes(
    tokenizer: Any, system: str, users: list[str]
) -> None:
    known = SystemPromptTokens(tokenizer)
    for text in users:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        fast = chat_prompt(tokenizer, messages, find_system_prefix=True, known_systems=known)
        plain = chat_prompt(tokenizer, messages, find_system_prefix=True)
        assert (fast.tokens, fast.system_prefix) == (plain.tokens, plain.system_prefix)
    assert not known.disabled
    assert known.hits == len(users) - 1  # every request after the first


def test_a_tokenizer_that_does_not_split_cleanly_is_not_split_again() -> None:
    class Merging:
        """Tokens are characters, except that "AB" is one token: no split between A and B."""

        chat_template = "|"

        def get_added_vocab(self) -> dict[str, int]:
            return {"B": 1}

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            return "".join(m["content"] for m in messages)

        @property
        def backend_tokenizer(self) -> Any:
            return self

        def encode(self, text: str, add_special_tokens: bool = False) -> Any:
            ids, offsets, i = [], [], 0
            while i < len(text):
                step = 2 if text.startswith("AB", i) else 1
                ids.append(hash(text[i : i + step]) % 1000)
                offsets.append((i, i + step))
                i += step
            return SimpleNamespace(ids=ids, offsets=offsets)

    tokenizer = Merging()
    known = SystemPromptTokens(tokenizer)
    messages = [{"role": "system", "content": "xA"}, {"role": "user", "content": "By"}]
    first = chat_prompt(tokenizer, messages, find_system_prefix=True, known_systems=known)
    assert first.system_prefix is None  # "AB" straddles the boundary
    messages = [{"role": "system", "content": "xy"}, {"role": "user", "content": "Bz"}]
    assert chat_prompt(tokenizer, messages, find_system_prefix=True, known_systems=known)
    assert not known.disabled and known.hits == 0
    known.offer("xA", [1, 2, 3], 2, [9])  # a check that fails
    assert known.disabled and not known.splits_before("B")


def test_without_character_offsets_the_boundary_comes_from_a_second_tokenization() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    same = chat_prompt(_Template(mark_alone=False), messages, find_system_prefix=True)
    assert same.tokens == [ord(ch) for ch in "s|u"] and same.system_prefix == 1
    differs = chat_prompt(_Template(), messages, find_system_prefix=True)
    assert differs.system_prefix is None
    assert chat_prompt(_Template(mark_alone=False), messages).system_prefix is None


class _Template:
    """A tokenizer stand-in (no character offsets) whose template renders the system part
    differently when alone (`mark_alone`)."""

    chat_template = "|"

    def __init__(self, fail: bool = False, mark_alone: bool = True) -> None:
        self.fail = fail
        self.mark_alone = mark_alone

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        if self.fail:
            raise ValueError("a user message is required")
        alone = self.mark_alone and len(messages) == 1
        return "|".join(m["content"] for m in messages) + ("!" if alone else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]


def test_a_template_that_renders_the_system_part_differently_gives_none() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    prompt = _Template().encode("s|u")
    assert system_prefix_length(_Template(), messages, prompt) is None


def test_a_template_that_refuses_system_only_messages_gives_none() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert system_prefix_length(_Template(fail=True), messages, [1, 2, 3]) is None
