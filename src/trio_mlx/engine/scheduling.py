"""Scheduling policy of the runner, plain Python (no MLX): how big a prefill chunk may be, and what
a sequence's KV cache costs at its token limit.

`PrefillPacer` sizes prefill chunks by measured time rather than by a fixed token count, so that
one chunk takes about `target_seconds` on whatever backend runs it (a 2,048-token chunk is 50 ms on
an H200 and minutes on a 2-core CPU with the reference BLAS). Between two chunks the runner reads
its inbox, so an abort or a cancel frees the runner within about one chunk. While other sequences
are decoding, a chunk is further held to `decode_share` times their measured step time per
sequence waiting to join for each one decoding (at least one), so that a long prompt arriving
lengthens each of their inter-token gaps by a bounded factor (chunked prefill mixed with decode),
while a crowd arriving at a small batch joins it in one step instead of one step each.

The pacer learns the prefill rate (prompt tokens per second, an exponential moving average over
chunks) and the decode step time. Where a pass has a fixed cost whatever its size — on a GPU,
launch-bound, a pass of 64 tokens costs about what a pass of 500 does (the H200's 1B: 7-8 ms up
to ~1,000 tokens) — a rate learned from small chunks is far too low for large ones, and the
chunks stay small: so once its chunks have been of different sizes, the pacer fits a pass's
time as `overhead + tokens * per_token` over its last `FIT_WINDOW` chunks and sizes chunks by
that line (at least `OVERHEAD_SLACK` of the fixed cost's worth of tokens: below that, a chunk
costs its fixed cost all the same and only takes longer to finish the prompt). While sequences
decode, the line is not trusted: a chunk grows from the largest recent one that kept within the
budget, scaled along its own line to the budget and at most doubled (`_proven`).

The runner gives it a first rate at load, from one short timed pass
(`model_probe.CALIBRATION_TOKENS`; on a GPU two, of two sizes, for the line); without one it
starts with `first_tokens`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

#: The prefill chunk's target duration in seconds (an abort waits at most about this long).
DEFAULT_CHUNK_SECONDS = 0.25

#: Chunks the pass-time line is fitted over, and the fewest for a fit (two sizes 2x apart at
#: least: on a GPU the runner times two at load, `model_probe`).
FIT_WINDOW = 16
FIT_MIN = 2

#: While sequences decode, a chunk grows at most to twice the largest of this many last chunks
#: that kept within the budget (`PrefillPacer._proven`).
PROVEN_WINDOW = 4

#: A chunk may take this much more than a pass's fixed cost even when the budget is smaller.
OVERHEAD_SLACK = 0.25

#: A chunk takes the rest of the prompt along when that rest is at most this share of it
#: (`with_the_rest`); a chunk then takes at most this much longer than its budget.
REST_SHARE = 0.5

#: While sequences decode, a chunk's budget in their step times (`PrefillPacer.decode_share`).
DEFAULT_DECODE_SHARE = 2.0

#: The same for a chunk in the decode step's own pass (`PrefillPacer.mixed_share`): what it may
#: add to the step. Below `DEFAULT_DECODE_SHARE`: such a chunk pays no pass's fixed cost, so it
#: needs less to make headway, and the running streams' gap is aimed at 2.25x a plain step, not
#: at issue 16's 3x bound for its p99 (on the H100's 8B the gaps of a plain batch already have a
#: p99 of ~2.1x their median).
DEFAULT_MIXED_SHARE = 1.25

#: Chunks in the decode step's pass whose cost sizes the next one (`PrefillPacer.mixed_tokens`).
MIXED_WINDOW = 4

#: The first chunk in a decode step's pass, before any has been measured, aims at this share of
#: its budget: its cost there is only estimated, from chunks of their own (on the CPU, the tiny
#: model's first such chunk, sized as a chunk of its own, added 12.7 ms to a 3.5 ms step)...
MIXED_FIRST_SHARE = 0.5
#: ... and takes at most this many tokens: in the pass a chunk costs more a token than apart
#: (an H100's 8B: ~16 µs against ~8, and ~6 ms whatever its size), so the slope of chunks of
#: their own let a first 512-token chunk make a 44-75 ms step among 16 rows stepping in 9 ms.
#: The next ones grow from its measured cost, at most twice the largest a step.
MIXED_FIRST_TOKENS = 128


@dataclass
class PrefillPacer:
    """Chooses prefill chunk sizes from measured times. Owned by the runner thread.

    - `max_tokens`: the largest chunk (`prefill_step_size`);
    - `block`: chunks are whole multiples of this (the prefill plan's shape block);
    - `target_seconds`: a chunk's target duration when nothing else decodes;
    - `decode_share`: while sequences decode, a chunk takes at most this many of their step times
      per waiting sequence for each decoding one (at least one: with as many waiting as decoding
      or fewer, their inter-token gap grows at most to `1 + decode_share` times a plain step);
    - `mixed_share`: the same for a chunk in the decode step's pass, by what it adds to a step
      (`mixed_tokens`);
    - `first_tokens`: the first chunk before anything has been measured.
    """

    max_tokens: int = 2048
    block: int = 1
    target_seconds: float = DEFAULT_CHUNK_SECONDS
    decode_share: float = field(default_factory=lambda: DEFAULT_DECODE_SHARE)
    mixed_share: float = field(default_factory=lambda: DEFAULT_MIXED_SHARE)
    first_tokens: int = 16
    smoothing: float = 0.5
    #: prompt tokens per second, learned (None: nothing measured yet)
    rate: float | None = None
    #: seconds of one batched decode step, learned (None: nothing measured yet)
    decode_step: float | None = None
    #: a pass's time as `overhead + tokens * per_token` (None: not fitted, the rate alone)
    overhead: float = 0.0
    per_token: float | None = None
    _chunks: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=FIT_WINDOW), repr=False
    )
    #: the last chunks that rode in a decode step's pass (`mixed_step`): their tokens and what
    #: the step took past a plain one
    _mixed: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=MIXED_WINDOW), repr=False
    )

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.block < 1 or self.target_seconds <= 0:
            raise ValueError("a pacer needs max_tokens >= 1, block >= 1, target_seconds > 0")

    def budget_seconds(
        self, decoding: int = 0, waiting: int = 1, *, share: float | None = None
    ) -> float:
        """How long the next prefill chunk should take, with `decoding` sequences decoding and
        `waiting` ones waiting to join (`share`: in decode steps, `decode_share` unless given)."""
        if decoding and self.decode_step is not None:
            crowd = max(1.0, waiting / decoding)
            share = self.decode_share if share is None else share
            return min(self.target_seconds, share * self.decode_step * crowd)
        return self.target_seconds

    def chunk_tokens(self, decoding: int = 0, waiting: int = 1) -> int:
        """Prompt tokens for the next chunk: a whole number of blocks, 1 block at least."""
        if self.rate is None:
            tokens = self.first_tokens
        elif self.per_token is not None:
            budget = self.budget_seconds(decoding, waiting)
            usable = max(budget, self.overhead * (1 + OVERHEAD_SLACK)) - self.overhead
            tokens = int(usable / self.per_token)
        else:
            tokens = int(self.rate * self.budget_seconds(decoding, waiting))
        if decoding and self._chunks:
            allowed = max(
                self.budget_seconds(decoding, waiting), self.overhead * (1 + OVERHEAD_SLACK)
            )
            tokens = min(tokens, self._proven(allowed))
        return self._whole_blocks(tokens)

    def _whole_blocks(self, tokens: int) -> int:
        tokens = max(1, min(tokens, self.max_tokens))
        if self.block > 1:
            tokens = max(self.block, tokens - tokens % self.block)
        return tokens

    def mixed_tokens(self, decoding: int, waiting: int = 1) -> int:
        """Prompt tokens for a chunk that rides in the decode step's forward pass (`mixed_step`):
        its cost is what it adds to the step, its own arithmetic, with no pass's fixed cost of
        its own. Under `mixed_share` step times (`budget_seconds`), at the highest cost per
        token of the last `MIXED_WINDOW` such chunks (a prompt's chunks cost more as its keys
        grow, and a step's time is noisy: one that happened to add little must not double the
        next), at most twice the largest of them (a cost hidden in a launch-bound pass is no
        measure). Before any: `MIXED_FIRST_SHARE` of the budget at the cost per token of chunks
        of their own (the fitted line's slope, without its fixed cost, else the rate), at most
        `MIXED_FIRST_TOKENS`, or `first_tokens` when nothing has been measured."""
        budget = self.budget_seconds(decoding, waiting, share=self.mixed_share)
        if not self._mixed:
            if self.rate is None:
                return self._whole_blocks(self.first_tokens)
            per_token = self.per_token if self.per_token is not None else 1 / self.rate
            first = int(MIXED_FIRST_SHARE * budget / per_token)
            return self._whole_blocks(min(first, MIXED_FIRST_TOKENS))
        largest = max(tokens for tokens, _ in self._mixed)
        costs = [seconds / tokens for tokens, seconds in self._mixed if seconds > 0]
        grown = 2 * largest if not costs else min(2 * largest, int(budget / max(costs)))
        return self._whole_blocks(grown)

    def observe_mixed(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` rode in a decode step, which took `seconds` longer than a plain
        one (`decode_step`)."""
        if tokens > 0:
            self._mixed.append((tokens, seconds))

    def _proven(self, allowed: float) -> int:
        """The most tokens a chunk may take while sequences decode, from the largest of the last
        `PROVEN_WINDOW` chunks that took at most `allowed` seconds, and came after every one
        that took longer: that chunk's tokens scaled to `allowed` along its own line from the
        fixed cost (`_along`), at most twice them. If the last chunk took longer than `allowed`,
        from that one instead, cut along its line: a prompt's chunks cost more as its keys
        grow, so what fitted before a chunk that did not no longer vouches. The last few,
        since a chunk costs more as its prompt's keys grow; not the fitted line, which spans
        chunks of different key lengths and can promise far more than a chunk gives: on an
        H100's 8B with 16 rows decoding it let a 1,472-token chunk go in a 24 ms budget, and
        that step took 134 ms."""
        recent = list(self._chunks)[-PROVEN_WINDOW:]
        last_tokens, last_seconds = recent[-1]
        if last_seconds > allowed:
            # The last chunk took too long (its keys grew, or the budget shrank): the next one
            # is cut along that chunk's own line, whatever fitted before it.
            return self._along(last_tokens, last_seconds, allowed)
        # the chunks since the last one that took too long
        over = [i for i, (_, s) in enumerate(recent) if s > allowed]
        tokens, seconds = max(recent[over[-1] + 1 :] if over else recent)
        return max(tokens, self._along(tokens, seconds, allowed))

    def _along(self, tokens: int, seconds: float, allowed: float) -> int:
        """A chunk of `tokens` took `seconds`: the tokens that take `allowed`, scaled along its
        line from the fixed cost (the time past `overhead` grows with the tokens), at most
        twice them."""
        variable = seconds - self.overhead
        if variable <= 0:
            return 2 * tokens
        return max(1, min(2 * tokens, int(tokens * (allowed - self.overhead) / variable)))

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        """A prefill chunk of `tokens` took `seconds`."""
        if tokens <= 0:
            return
        rate = tokens / max(seconds, 1e-6)
        self.rate = rate if self.rate is None else _blend(self.rate, rate, self.smoothing)
        self._chunks.append((tokens, seconds))
        self._fit()

    def _fit(self) -> None:
        """Fit the pass-time line over the last chunks, once their sizes differ enough (2x);
        a fit whose slope is not positive leaves the last one (or the rate alone)."""
        if len(self._chunks) < FIT_MIN:
            return
        sizes = [t for t, _ in self._chunks]
        if max(sizes) < 2 * min(sizes):
            return
        times = [s for _, s in self._chunks]
        mean_t, mean_s = sum(sizes) / len(sizes), sum(times) / len(times)
        spread = sum((t - mean_t) ** 2 for t in sizes)
        slope = sum((t - mean_t) * (s - mean_s) for t, s in self._chunks) / spread
        if slope <= 0:
            return
        self.per_token = slope
        self.overhead = min(max(0.0, mean_s - slope * mean_t), min(times))

    def observe_decode(self, seconds: float) -> None:
        """A batched decode step took `seconds`."""
        if self.decode_step is None:
            self.decode_step = seconds
        else:
            self.decode_step = _blend(self.decode_step, seconds, 0.2)


def with_the_rest(limit: int, remaining: int) -> int:
    """A chunk of at most `limit` tokens, stretched to take the whole of a prompt's `remaining`
    tokens where the rest would be at most `REST_SHARE` of a chunk: a pass of a few tokens costs
    about a pass's fixed cost (on a 2-core CPU ~60-100 ms for SmolLM2-135M), so a prompt just
    over one chunk would otherwise take a second pass for its last few tokens, and the rate
    learned from that pass would shrink the next chunks."""
    return remaining if remaining <= limit * (1 + REST_SHARE) else limit


def _blend(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


def kv_tokens_limit(prompt_tokens: int, max_tokens: int, max_kv_size: int | None) -> int:
    """Positions a sequence's KV cache holds at most: its prompt and completion, bounded by a
    rotating cache's size."""
    total = prompt_tokens + max_tokens
    return total if max_kv_size is None else min(total, max_kv_size)


def kv_bytes_at_limit(
    prompt_tokens: int, max_tokens: int, bytes_per_token: int, max_kv_size: int | None
) -> int:
    """A sequence's KV memory at its token limit, rounded up to mlx-lm's 256-position steps."""
    positions = kv_tokens_limit(prompt_tokens, max_tokens, max_kv_size)
    return math.ceil(positions / 256) * 256 * bytes_per_token
