"""Token selection from a step's logits. Runs on the runner thread only.

`TokenSelector` is one sequence's sampler: it adjusts the raw logits (logit bias, repetition,
presence and frequency penalties), then picks a token greedily or by a seeded draw after
temperature, top-k, top-p and min-p. Its penalty state is updated with the chosen token as a lazy
MLX operation, so choosing never forces the device to synchronise and decode steps can be queued
ahead. A sampled sequence draws its n-th token at a uniform number computed on the host from its
seed and n (`row_sampling`: the same operations as a batch's sampled rows take together), so a
seeded request draws the same tokens whatever other requests run beside it and across restarts.
Speculative decoding's acceptance draws keep a PRNG key of their own (`next_key`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from trio_mlx.engine import row_sampling
from trio_mlx.types import SamplingParams


def fresh_seed() -> int:
    """The seed of a request that names none: a fresh random one, so that two such requests draw
    independently. (The test suite pins it, `tests/conftest.py`: a test's unseeded draws then
    repeat from run to run instead of varying with luck; docs/determinism.md.)"""
    return secrets.randbits(63)


class TokenSelector:
    """Chooses the next token for one sequence according to its `SamplingParams`."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt: Sequence[int]) -> None:
        self.params = params
        self._vocab = vocab_size
        self._bias: Any = None
        if params.logit_bias:
            ids = [t for t, _ in params.logit_bias]
            self._bias = _host_vector(vocab_size, ids, [b for _, b in params.logit_bias])
        self._seen: Any = None  # prompt + output tokens, for the repetition penalty
        if params.repetition_penalty != 1.0:
            self._seen = _host_vector(vocab_size, list(prompt), [1.0] * len(prompt))
        self._counts: Any = None  # output tokens only, for presence and frequency penalties
        if params.presence_penalty or params.frequency_penalty:
            self._counts = mx.zeros((vocab_size,), dtype=mx.float32)
        self._key: Any = None
        self._seed = 0
        self._draws = 0  # tokens drawn so far (`row_sampling.draw`)
        self._filters: row_sampling.RowParams | None = None
        if params.temperature > 0.0:
            seed = params.seed if params.seed is not None else fresh_seed()
            # Any integer is a seed (OpenAI's are signed 64-bit); MLX keys take 0..2**64-1.
            self._seed = seed % (1 << 64)
            self._key = mx.random.key(self._seed)

    @property
    def batch_greedy(self) -> bool:
        """Greedy with at most a logit bias: a batch may choose it with one argmax over
        `logits + bias` (no penalty state, no key to split)."""
        return self._key is None and self._seen is None and self._counts is None

    @property
    def batch_sampled(self) -> bool:
        """Sampled with at most a logit bias: a batch may draw it with its other such rows in
        one pass over `logits + bias` (`row_sampling.sample`; no penalty state)."""
        return self._key is not None and self._seen is None and self._counts is None

    @property
    def filters(self) -> tuple[float, int, float, float]:
        """Temperature, top-k, top-p and min-p, as `row_sampling.RowParams` takes them."""
        p = self.params
        return p.temperature, p.top_k or 0, p.top_p, p.min_p

    def next_uniform(self) -> float:
        """This sequence's uniform number for its next draw (`row_sampling.draw`), counted as
        drawn. Sampled only."""
        uniform = row_sampling.draw(self._seed, self._draws)
        self._draws += 1
        return uniform

    @property
    def bias(self) -> Any:
        """The logit bias vector (shape (vocab,), float32), or None."""
        return self._bias

    @property
    def adjusts_logits(self) -> bool:
        return self._bias is not None or self._seen is not None or self._counts is not None

    def adjust(self, logits: Any) -> Any:
        """The logits after bias and penalties (shape (1, width), float32).

        The logits may be wider than the vocabulary (an output layer padded past the tokenizer's
        ids): the bias and penalty arrays are widened with zeros once, so the extra entries get
        no bias and no count. Narrower logits cannot carry a bias or a penalty for every token
        of the vocabulary: `ValueError` (the request fails with that message)."""
        logits = logits.astype(mx.float32)
        width = logits.shape[-1]
        if width != self._vocab and self.adjusts_logits:
            self._widen(width)
        if self._bias is not None:
            logits = logits + self._bias
        if self._seen is not None:
            penalty = self.params.repetition_penalty
            penalised = mx.where(logits > 0, logits / penalty, logits * penalty)
            logits = mx.where(self._seen > 0, penalised, logits)
        if self._counts is not None:
            logits = (
                logits
                - self.params.frequency_penalty * self._counts
                - self.params.presence_penalty * (self._counts > 0).astype(mx.float32)
            )
        return logits

    def _widen(self, width: int) -> None:
        if width < self._vocab:
            raise ValueError(
                f"the model's logits have {width} entries, fewer than its vocabulary's "
                f"{self._vocab} tokens: logit_bias and the penalties cannot apply"
            )
        pad = mx.zeros((width - self._vocab,), dtype=mx.float32)
        if self._bias is not None:
            self._bias = mx.concatenate([self._bias, pad])
        if self._seen is not None:
            self._seen = mx.concatenate([self._seen, pad])
        if self._counts is not None:
            self._counts = mx.concatenate([self._counts, pad])
        self._vocab = width

    def choose(self, logits: Any) -> Any:
        """The chosen token (shape (1,), lazy) from adjusted logits; updates the penalty state."""
        if self._key is None:
            token = mx.argmax(logits, axis=-1)
        else:
            token = row_sampling.sample(logits, self._row_params(), [self.next_uniform()])
        self.observe(token)
        return token

    def observe(self, token: Any) -> None:
        """Record `token` (an MLX array of one id, possibly lazy) as generated: one added to its
        entry by comparing it with every id (`_host_vector` says why not a scatter)."""
        if self._seen is None and self._counts is None:
            return
        one = (_token_ids(self._vocab) == token.reshape(-1).astype(mx.uint32)).astype(mx.float32)
        if self._seen is not None:
            self._seen = self._seen + one
        if self._counts is not None:
            self._counts = self._counts + one

    # ---- for speculative decoding (`speculative.py`): the same choice, spelled out --------------

    @property
    def greedy(self) -> bool:
        """Temperature 0: the choice is the argmax of the adjusted logits."""
        return self._key is None

    def next_key(self) -> Any:
        """This sequence's PRNG key for one step (split off as `choose` does). Sampled only."""
        if self._key is None:
            raise ValueError("a greedy selector has no PRNG key")
        key, self._key = mx.random.split(self._key)
        return key

    def distribution(self, logits: Any) -> Any:
        """The probabilities `choose` draws from, for adjusted logits of shape (n, width):
        temperature, then top-k, top-p and min-p, row by row (float32). Sampled only."""
        return mx.softmax(row_sampling.filtered(logits, self._row_params()), -1)

    def fit_width(self, width: int) -> None:
        """Widen the bias and penalty arrays to logits of `width` entries now (as `adjust` does
        on first sight of them), so that `checkpoint`s taken afterwards all have that width."""
        if width != self._vocab and self.adjusts_logits:
            self._widen(width)

    @property
    def penalizes(self) -> bool:
        """Whether `adjust` depends on the tokens generated so far (repetition, presence or
        frequency penalty)."""
        return self._seen is not None or self._counts is not None

    def checkpoint(self) -> tuple[Any, Any]:
        """The penalty state, to `rewind` to (MLX arrays are immutable: this is a reference)."""
        return self._seen, self._counts

    def rewind(self, state: tuple[Any, Any]) -> None:
        """Put back a penalty state taken by `checkpoint` (drafted tokens that were refused)."""
        self._seen, self._counts = state

    def _row_params(self) -> row_sampling.RowParams:
        """Its filters as one row's parameters (made once)."""
        if self._filters is None:
            temperature, top_k, top_p, min_p = self.filters
            self._filters = row_sampling.RowParams([temperature], [top_k], [top_p], [min_p])
        return self._filters


def logprob_arrays(raw_logits: Any, token: Any, top: int) -> tuple[Any, Any, Any]:
    """Lazy arrays for a step's logprobs: the chosen token's, and the `top` best (ids, values)."""
    logprobs = raw_logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    if top <= 0:
        return chosen, None, None
    ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[..., :top]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    return chosen, ids, values


def _host_vector(size: int, ids: Sequence[int], values: Sequence[float]) -> Any:
    """A float32 vector of `size` zeros with `values` added at `ids` (repeats add up), built on
    the host and copied once. On the device this is a scatter, whose kernel MLX's CUDA backend
    compiles with NVRTC on first use: seconds inside the first request of a process that names
    a logit bias or a penalty (a 16-request burst on the H100 waited 2.6 s for it)."""
    vector = np.zeros(size, dtype=np.float32)
    if ids:
        np.add.at(vector, np.asarray(ids, dtype=np.int64), np.asarray(values, dtype=np.float32))
    return mx.array(vector)


_TOKEN_IDS: dict[int, Any] = {}


def _token_ids(size: int) -> Any:
    """0 .. size-1 (uint32), one array per vocabulary size shared by every selector: `observe`
    counts a lazy token by comparing it with each id."""
    ids = _TOKEN_IDS.get(size)
    if ids is None:
        ids = _TOKEN_IDS[size] = mx.arange(size, dtype=mx.uint32)
    return ids
