"""Prompt-cache snapshots: exactness on tiny random models, greedy, token for token.

Two references are used. "From scratch" is a fresh cache fed the whole prompt (what an uncached
request computes); greedy tokens must match it. "Same boundaries" is a fresh cache fed the
snapshotted prefix and then the rest, exactly the computation the restored path repeats; its
logits must match bit for bit, which shows that the restored state *is* the original state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import lfm2, mamba
from mlx_lm.models import llama as llama_module
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import load_model

from tiny_model import TINY_CONFIG
from trio_mlx.engine.kv_snapshots import (
    KVSnapshot,
    SnapshotUnsupported,
    cache_support,
    probe_snapshot_support,
    restore,
    snapshot,
    snapshot_prefix,
)

VOCAB = 49152


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Path) -> Any:
    model, _config = load_model(tiny_model_dir)
    return model


@pytest.fixture(scope="module")
def swa_llama() -> Any:
    """The tiny llama with a sliding-window second layer: its own cache is
    [KVCache, RotatingKVCache(max_size=16)]."""
    mx.random.seed(3)
    config = {**TINY_CONFIG, "layer_types": ["full_attention", "sliding_attention"]}
    return _spread(
        llama_module.Model(llama_module.ModelArgs.from_dict(config | {"sliding_window": 16}))
    )


@pytest.fixture(scope="module")
def mamba_model() -> Any:
    mx.random.seed(1)
    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    return _spread(mamba.Model(args))


@pytest.fixture(scope="module")
def lfm2_model() -> Any:
    """A hybrid: short-convolution layers (ArraysCache) around an attention layer (KVCache)."""
    mx.random.seed(2)
    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=32,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        intermediate_size=64,
        layer_types=["conv", "full_attention", "conv"],
    )
    return _spread(lfm2.Model(args))


def _spread(model: Any) -> Any:
    """Scale the random weights up so logits are spread out and greedy choices are stable."""
    model.update(tree_map(lambda v: v * 3.0 if v.ndim == 2 else v, model.parameters()))
    mx.eval(model.parameters())
    return model


def _tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _feed(model: Any, cache: list[Any], tokens: Sequence[int]) -> Any:
    """Run `tokens` through the model as one chunk; the last position's logits, evaluated."""
    logits = model(mx.array(list(tokens))[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def _greedy(model: Any, cache: list[Any], prompt: Sequence[int], n: int) -> tuple[list[int], Any]:
    """Like the engine: all prompt tokens but the last as one chunk, the last alone gives the first
    logits, then `n` greedy tokens. Returns the tokens and every step's logits, stacked."""
    if len(prompt) > 1:
        _feed(model, cache, prompt[:-1])
    logits = _feed(model, cache, prompt[-1:])
    out, seen = [], []
    for _ in range(n):
        seen.append(logits)
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = _feed(model, cache, [token])
    return out, mx.concatenate(seen)


def _prefilled(model: Any, tokens: Sequence[int], cache: list[Any] | None = None) -> list[Any]:
    cache = make_prompt_cache(model) if cache is None else cache
    _feed(model, cache, tokens)
    return cache


def _windowed(model: Any, size: int) -> list[Any]:
    """What `make_prompt_cache(model, max_kv_size=size)` builds for a model without its own
    `make_cache` (mlx-lm's llama has one, which ignores `max_kv_size`)."""
    return [RotatingKVCache(max_size=size, keep=4) for _ in model.layers]


def _host_copy(snap: KVSnapshot) -> list[np.ndarray]:
    """Every array of the snapshot copied to NumPy (to compare before/after)."""
    return [np.array(a) for _, a in tree_flatten([vars(layer) for layer in snap.layers])]


def _assert_unchanged(before: list[np.ndarray], snap: KVSnapshot) -> None:
    after = _host_copy(snap)
    assert len(before) == len(after)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)


# ---- key/value caches (KVCache) ----------------------------------------------------------------


def test_snapshot_records_length_and_holds_exactly_the_cached_positions(llama: Any) -> None:
    cache = _prefilled(llama, _tokens(40, seed=1))
    snap = snapshot(cache)
    assert snap.length == 40
    assert snap.trimmable
    # 2 layers x (keys + values) x 2 kv heads x 40 positions x head dim 16 x float32
    assert snap.nbytes == 2 * 2 * 2 * 40 * 16 * 4
    assert snap.nbytes < sum(c.nbytes for c in cache)  # the live cache has spare capacity


def test_snapshot_is_not_changed_by_decoding_on_the_original(llama: Any) -> None:
    cache = _prefilled(llama, _tokens(40, seed=2))
    snap = snapshot(cache)
    before = _host_copy(snap)
    _greedy(llama, cache, _tokens(5, seed=3), 20)
    assert cache[0].offset == 40 + 5 + 20
    _assert_unchanged(before, snap)


def test_snapshot_of_a_full_buffer_is_not_changed_by_decoding_on_the_original(llama: Any) -> None:
    # 256 positions fill KVCache's first buffer exactly: the snapshot shares it, uncopied.
    cache = _prefilled(llama, _tokens(256, seed=4))
    assert cache[0].keys.shape[2] == 256
    snap = snapshot(cache)
    before = _host_copy(snap)
    _greedy(llama, cache, _tokens(3, seed=5), 10)
    _assert_unchanged(before, snap)


@pytest.mark.parametrize("length", [40, 256])
def test_a_snapshot_read_only_after_decoding_on_the_original_holds_the_old_state(
    llama: Any, length: int
) -> None:
    # A snapshot's copies are only queued when it is taken: decoding on the live cache (in
    # place where MLX can) before they are read must not reach them.
    cache = _prefilled(llama, _tokens(length, seed=21))
    expected = [np.array(a[..., :length, :]) for c in cache for a in (c.keys, c.values)]
    snap = snapshot(cache)
    _greedy(llama, cache, _tokens(3, seed=22), 10)
    mx.eval([c.state for c in cache])
    held = [np.array(a) for layer in snap.layers for a in (layer.keys, layer.values)]
    assert len(held) == len(expected)
    for x, y in zip(expected, held, strict=True):
        np.testing.assert_array_equal(x, y)


def test_two_restores_are_independent_of_each_other_and_of_the_snapshot(llama: Any) -> None:
    snap = snapshot(_prefilled(llama, _tokens(48, seed=6)))
    before = _host_copy(snap)
    first, second = restore(snap, length=30), restore(snap, length=30)
    tail = _tokens(6, seed=7)
    _greedy(llama, second, _tokens(9, seed=8), 15)  # decode something else into the second
    expected, expected_logits = _greedy(llama, restore(snap, length=30), tail, 12)
    got, got_logits = _greedy(llama, first, tail, 12)
    assert got == expected
    assert mx.array_equal(got_logits, expected_logits).item()
    _assert_unchanged(before, snap)


def test_exact_length_restore_continues_like_generation_from_scratch(llama: Any) -> None:
    system, user = _tokens(24, seed=10), _tokens(9, seed=11)
    snap = snapshot(_prefilled(llama, system))

    got, got_logits = _greedy(llama, restore(snap), user, 24)

    scratch, _ = _greedy(llama, make_prompt_cache(llama), system + user, 24)
    assert got == scratch
    _same, same_logits = _greedy(llama, _prefilled(llama, system), user, 24)
    assert mx.array_equal(got_logits, same_logits).item()


def test_a_longer_entry_trimmed_to_the_common_prefix_continues_like_scratch(llama: Any) -> None:
    # Turn one of a conversation is cached with its reply; turn two shares only the system part
    # and the first 5 tokens of the user message (a cut inside the first prefill chunk).
    system, user_one = _tokens(24, seed=12), _tokens(10, seed=13)
    cache = make_prompt_cache(llama)
    _greedy(llama, cache, system + user_one, 8)  # turn one and its reply
    snap = snapshot(cache)
    assert snap.length == 24 + 10 + 8
    user_two = user_one[:5] + _tokens(7, seed=14)
    shared = len(system) + 5

    got, got_logits = _greedy(llama, restore(snap, length=shared), user_two[5:], 24)

    scratch, _ = _greedy(llama, make_prompt_cache(llama), system + user_two, 24)
    assert got == scratch
    _same, same_logits = _greedy(llama, _prefilled(llama, system + user_two[:5]), user_two[5:], 24)
    np.testing.assert_allclose(np.array(got_logits), np.array(same_logits), atol=1e-4)


def test_a_prefix_snapshot_equals_a_snapshot_taken_when_the_cache_held_that_prefix(
    llama: Any,
) -> None:
    # One prefill chunk past the system prompt; the snapshot of its first 24 tokens is taken
    # afterwards, and must be what a snapshot at 24 tokens would have been.
    system, user = _tokens(24, seed=40), _tokens(9, seed=41)
    cache = _prefilled(llama, system + user)
    cut = snapshot_prefix(cache, 24)
    at_24 = snapshot(_prefilled(llama, system))
    assert (cut.length, cut.nbytes, cut.trimmable) == (24, at_24.nbytes, True)
    for got, want in zip(_host_copy(cut), _host_copy(at_24), strict=True):
        np.testing.assert_array_equal(got, want)
    before = _host_copy(cut)
    _greedy(llama, cache, _tokens(3, seed=42), 8)  # the live cache goes on
    _assert_unchanged(before, cut)
    other = _tokens(6, seed=43)
    got, _ = _greedy(llama, restore(cut), other, 16)
    assert got == _greedy(llama, make_prompt_cache(llama), system + other, 16)[0]


def test_a_prefix_snapshot_refuses_what_cannot_be_cut(llama: Any, mamba_model: Any) -> None:
    cache = _prefilled(llama, _tokens(10, seed=44))
    assert snapshot_prefix(cache, 10).length == 10
    for bad in (0, 11):
        with pytest.raises(ValueError, match="cannot take the first"):
            snapshot_prefix(cache, bad)
    wrapped = _windowed(llama, 16)
    _greedy(llama, wrapped, _tokens(4, seed=45), 20)
    with pytest.raises(SnapshotUnsupported, match="dropped tokens"):
        snapshot_prefix(wrapped, 8)
    recurrent = _prefilled(mamba_model, _tokens(12, seed=46, vocab=256))
    with pytest.raises(SnapshotUnsupported, match="cannot be cut"):
        snapshot_prefix(recurrent, 6)


def test_restore_to_the_same_length_twice_gives_equal_generations(llama: Any) -> None:
    prompt = _tokens(30, seed=15)
    snap = snapshot(_prefilled(llama, prompt[:-1]))
    a, _ = _greedy(llama, restore(snap), prompt[-1:], 16)
    b, _ = _greedy(llama, restore(snap), prompt[-1:], 16)
    assert a == b == _greedy(llama, make_prompt_cache(llama), prompt, 16)[0]


def test_restore_refuses_lengths_outside_the_snapshot(llama: Any) -> None:
    snap = snapshot(_prefilled(llama, _tokens(10, seed=16)))
    for bad in (0, -1, 11):
        with pytest.raises(ValueError, match="length must be in"):
            restore(snap, length=bad)


def test_snapshot_checks_the_given_length_against_the_cache(llama: Any) -> None:
    cache = _prefilled(llama, _tokens(10, seed=17))
    assert snapshot(cache, length=10).length == 10
    with pytest.raises(ValueError, match="not length=9"):
        snapshot(cache, length=9)


# ---- rotating window (RotatingKVCache) ---------------------------------------------------------


def test_rotating_cache_before_wrapping_trims_and_continues_like_scratch(llama: Any) -> None:
    prefix = _tokens(20, seed=20)
    snap = snapshot(_prefilled(llama, prefix, _windowed(llama, 32)))
    assert snap.trimmable
    rest = _tokens(6, seed=21)

    # 12 + 6 prompt tokens, then 40 generated: the window of 32 wraps during decode.
    got, got_logits = _greedy(llama, restore(snap, length=12), rest, 40)

    scratch, _ = _greedy(llama, _windowed(llama, 32), prefix[:12] + rest, 40)
    assert got == scratch
    _same, same_logits = _greedy(
        llama, _prefilled(llama, prefix[:12], _windowed(llama, 32)), rest, 40
    )
    np.testing.assert_allclose(np.array(got_logits), np.array(same_logits), atol=1e-4)


def test_sliding_window_model_snapshot_trims_before_wrapping(swa_llama: Any) -> None:
    prefix, rest = _tokens(14, seed=24), _tokens(3, seed=25)
    snap = snapshot(_prefilled(swa_llama, prefix))
    assert snap.trimmable

    got, _ = _greedy(swa_llama, restore(snap, length=9), rest, 30)  # wraps the window of 16

    assert got == _greedy(swa_llama, make_prompt_cache(swa_llama), prefix[:9] + rest, 30)[0]


def test_sliding_window_after_wrapping_restores_its_position_state_exactly(swa_llama: Any) -> None:
    cache = make_prompt_cache(swa_llama)
    _greedy(swa_llama, cache, _tokens(10, seed=22), 30)  # 40 positions through a window of 16
    window = cache[1]
    assert isinstance(window, RotatingKVCache)
    assert window.offset > window.max_size
    snap = snapshot(cache)
    assert snap.length == 40
    assert not snap.trimmable
    before = _host_copy(snap)
    restored = restore(snap)
    back = restored[1]
    assert (back.offset, back._idx, back.keep, back.max_size) == (
        window.offset,
        window._idx,
        window.keep,
        window.max_size,
    )

    # Both continue from the same state, bit for bit; the restored window is written in place.
    got, got_logits = _greedy(swa_llama, restored, [7], 20)
    expected, expected_logits = _greedy(swa_llama, cache, [7], 20)
    assert got == expected
    assert mx.array_equal(got_logits, expected_logits).item()
    _assert_unchanged(before, snap)


def test_a_wrapped_rotating_snapshot_cannot_be_trimmed(llama: Any) -> None:
    cache = _windowed(llama, 16)
    _greedy(llama, cache, _tokens(4, seed=23), 20)
    snap = snapshot(cache)
    assert not snap.trimmable
    with pytest.raises(SnapshotUnsupported, match="full length"):
        restore(snap, length=10)
    assert restore(snap)[0].offset == 24


# ---- recurrent state (ArraysCache) -------------------------------------------------------------


def test_recurrent_snapshot_restores_exactly_at_its_length(mamba_model: Any) -> None:
    prefix, rest = _tokens(20, seed=30, vocab=256), _tokens(5, seed=31, vocab=256)
    cache = _prefilled(mamba_model, prefix)
    with pytest.raises(ValueError, match="pass length="):
        snapshot(cache)  # recurrent state records no token count
    snap = snapshot(cache, length=20)
    assert not snap.trimmable
    before = _host_copy(snap)

    got, got_logits = _greedy(mamba_model, restore(snap), rest, 20)

    scratch, _ = _greedy(mamba_model, make_prompt_cache(mamba_model), prefix + rest, 20)
    assert got == scratch
    _same, same_logits = _greedy(mamba_model, cache, rest, 20)  # the original, continued
    assert mx.array_equal(got_logits, same_logits).item()
    _assert_unchanged(before, snap)
    with pytest.raises(SnapshotUnsupported):
        restore(snap, length=10)


def test_hybrid_snapshot_reads_its_length_from_the_attention_layers(lfm2_model: Any) -> None:
    prefix, rest = _tokens(16, seed=32, vocab=256), _tokens(4, seed=33, vocab=256)
    snap = snapshot(_prefilled(lfm2_model, prefix))
    assert snap.length == 16
    assert not snap.trimmable

    got, got_logits = _greedy(lfm2_model, restore(snap), rest, 20)

    scratch, _ = _greedy(lfm2_model, make_prompt_cache(lfm2_model), prefix + rest, 20)
    assert got == scratch
    _same, same_logits = _greedy(lfm2_model, _prefilled(lfm2_model, prefix), rest, 20)
    assert mx.array_equal(got_logits, same_logits).item()


# ---- layer classes without a model -------------------------------------------------------------


def _kv(n: int, head_dim: int = 32) -> tuple[Any, Any]:
    return mx.random.normal((1, 2, n, head_dim)), mx.random.normal((1, 2, n, head_dim))


def test_quantized_cache_round_trips_and_trims() -> None:
    live = QuantizedKVCache(group_size=32, bits=8)
    live.update_and_fetch(*_kv(10))
    live.update_and_fetch(*_kv(1))
    snap = snapshot([live])
    assert snap.length == 11
    assert snap.trimmable
    expected_keys, expected_values = live.keys_and_values()
    whole, trimmed = restore(snap)[0], restore(snap, length=7)[0]
    for got, want in zip(whole.keys_and_values(), (expected_keys, expected_values), strict=True):
        for g, w in zip(got, want, strict=True):
            assert mx.array_equal(g, w).item()
    assert trimmed.offset == 7
    for g, w in zip(trimmed.keys_and_values()[0], expected_keys, strict=True):
        assert mx.array_equal(g, w[..., :7, :]).item()
    assert (trimmed.group_size, trimmed.bits) == (32, 8)


def test_cache_list_round_trips_each_member() -> None:
    kv, rotating = KVCache(), RotatingKVCache(max_size=8, keep=2)
    keys, values = _kv(5)
    kv.update_and_fetch(keys, values)
    rotating.update_and_fetch(keys, values)
    snap = snapshot([CacheList(kv, rotating)])
    assert snap.length == 5
    assert snap.trimmable
    restored = restore(snap, length=3)[0]
    assert isinstance(restored, CacheList)
    assert [type(c) for c in restored.caches] == [KVCache, RotatingKVCache]
    for member in restored.caches:
        assert member.offset == 3
        assert mx.array_equal(member.keys_and_values()[0], keys[..., :3, :]).item()


def test_an_empty_cache_snapshots_to_length_zero() -> None:
    snap = snapshot([KVCache(), KVCache()])
    assert (snap.length, snap.nbytes) == (0, 0)
    assert all(c.empty() for c in restore(snap))


# ---- support probe -----------------------------------------------------------------------------


def test_probe_accepts_llama_with_plain_and_windowed_caches(llama: Any) -> None:
    plain = probe_snapshot_support(llama)
    assert (plain.supported, plain.trimmable) == (True, True)
    assert plain.layer_types == ("KVCache", "KVCache")
    rotating = cache_support(_windowed(llama, 64))
    assert (rotating.supported, rotating.trimmable) == (True, True)
    assert "wraps" in rotating.reason


def test_probe_accepts_a_sliding_window_model(swa_llama: Any) -> None:
    support = probe_snapshot_support(swa_llama)
    assert (support.supported, support.trimmable) == (True, True)
    assert support.layer_types == ("KVCache", "RotatingKVCache")


def test_probe_accepts_recurrent_models_untrimmable(mamba_model: Any, lfm2_model: Any) -> None:
    for model in (mamba_model, lfm2_model):
        support = probe_snapshot_support(model)
        assert (support.supported, support.trimmable) == (True, False)
        assert "ArraysCache" in support.reason
    assert probe_snapshot_support(lfm2_model).layer_types == (
        "ArraysCache",
        "KVCache",
        "ArraysCache",
    )


class _SubclassedCache(KVCache):
    def __init__(self) -> None:
        super().__init__()
        self.extra_state = 0


@pytest.mark.parametrize(
    ("layer", "reason"),
    [
        (ChunkedKVCache(chunk_size=8), "ChunkedKVCache is not"),
        (ConcatenateKVCache(), "ConcatenateKVCache is not"),
        (_SubclassedCache(), "_SubclassedCache is not"),
        (CacheList(KVCache(), ChunkedKVCache(8)), "CacheList: ChunkedKVCache"),
    ],
)
def test_unknown_cache_classes_are_refused(layer: Any, reason: str) -> None:
    support = cache_support([KVCache(), layer])
    assert not support.supported
    assert reason in support.reason
    assert support.reason.startswith("layer 1:")
    with pytest.raises(SnapshotUnsupported, match=reason):
        snapshot([KVCache(), layer])


def test_a_known_class_carrying_unknown_state_is_refused() -> None:
    layer = KVCache()
    layer.step = 64  # an instance attribute the restore would not reproduce
    support = cache_support([layer])
    assert not support.supported
    assert "['step']" in support.reason


def test_an_array_cache_subclass_is_refused_too() -> None:
    class Custom(ArraysCache):
        pass

    assert not cache_support([Custom(2)]).supported


def test_an_in_place_write_into_restored_recurrent_state_stays_in_that_cache() -> None:
    live = ArraysCache(2)
    live[0], live[1] = mx.zeros((1, 3, 4)), mx.ones((1, 4, 2))
    snap = snapshot([live], length=5)
    first = restore(snap)[0]
    first[0][..., 0:1, :] = mx.full((1, 1, 4), 9.0)  # writes into the array object in place
    live[1][..., 0:1] = mx.full((1, 4, 1), 7.0)
    again = restore(snap)[0]
    assert mx.array_equal(again[0], mx.zeros((1, 3, 4))).item()
    assert mx.array_equal(again[1], mx.ones((1, 4, 2))).item()
    assert first[0].sum().item() == 36.0
