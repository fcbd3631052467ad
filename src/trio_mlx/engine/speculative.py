"""Draft-model speculative decoding. Runs on the runner thread only.

A small draft model that shares the target's tokenizer proposes up to K tokens, one cheap forward
pass each; the target scores all of them, and the token before them, in one forward pass
(`Speculator.step`). Acceptance is lossless:
- greedy (temperature 0): a drafted token is kept while it equals the target's argmax at its
  position; the first one that differs is replaced by the target's argmax. The output is the
  target's greedy decoding, token for token (up to the rounding of a K+1-token forward pass
  against a 1-token one, which on the reference CPU backend is exact);
- sampled: drafted token d_i, drawn from the draft's distribution q_i, is kept with probability
  min(1, p_i(d_i) / q_i(d_i)) (p_i the target's); at the first refusal the next token is drawn
  from normalize(max(0, p_i - q_i)), and when all K are kept one more is drawn from p_{K+1}
  (`accept_drafts`). Each emitted token is distributed exactly as the target's own sampling
  would draw it (Leviathan et al., 2023; Chen et al., 2023). A seeded request is reproducible
  with the same draft, but draws other tokens than the same seed without a draft.
Both distributions go through the request's whole sampling pipeline (logit bias, repetition,
presence and frequency penalties, temperature, top-k, top-p, min-p: `TokenSelector`), the
penalties counting each drafted token at the positions after it, as plain decoding would.
Logprobs are the target's, of the raw logits, as without a draft. Requests with logits processors
(a grammar, forced tool calls) decode without the draft: a processor's state cannot be rewound.

After a step, both KV caches are cut back (`trim`) to the tokens actually kept, so caches must be
trimmable: plain `KVCache` layers. A rotating cache (`max_kv_size`, or a model's own sliding
window) is refused when the engine starts (`check_draft`).

The draft keeps its own cache per sequence (`DraftCache`) and catches up lazily: it holds some
prefix of the sequence's tokens, and each step first feeds it what it lacks. A prompt restored
from the prefix cache (only the target's cache is snapshotted), a row that decoded in a batch
with others (speculation runs only for a lone row: `batch.BatchDecoder.speculate`), or a fresh
prompt are all caught up the same way: at most `catch_up_tokens` per step, while the target
emits one plain token in that step, so a long prompt never stalls the stream or an abort.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from trio_mlx.engine.loading import LoadedModel
from trio_mlx.engine.padded_attention import padded_attention_default, padded_forward
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.engine.sampling import TokenSelector, logprob_arrays
from trio_mlx.errors import ModelLoadError
from trio_mlx.types import SamplingParams, TokenLogprob

_T = TypeVar("_T")

#: Tokens drafted per step when none is configured.
DEFAULT_NUM_DRAFT_TOKENS = 4


@dataclass
class SpeculationCounters:
    """Written by the runner thread only; read by anyone (plain ints)."""

    #: verification passes that scored at least one drafted token
    steps: int = 0
    #: target steps without a draft (the draft catching up, or one token left to generate)
    plain_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: history tokens fed to the draft outside a drafting pass (prompts, batched stretches)
    catch_up_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def statistics(self) -> dict[str, Any]:
        return {
            "speculative_steps": self.steps,
            "plain_steps": self.plain_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": (self.accepted_tokens + self.steps) / self.steps
            if self.steps
            else 0.0,
            "catch_up_tokens": self.catch_up_tokens,
        }


class DraftCache:
    """One sequence's draft side: the draft model's KV cache, holding the first `length` tokens
    of the sequence's history."""

    __slots__ = ("cache", "length")

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.length = 0

    def trim_to(self, length: int) -> None:
        if length < self.length:
            for layer in self.cache:
                layer.trim(self.length - length)
            self.length = length


@dataclass(frozen=True)
class Speculation:
    """What one `Speculator.step` produced for its sequence.

    `tokens`: the new completion tokens (accepted drafts, then the target's own; EOS never
    included), with their `logprobs` when asked for; `finish`: "stop" (EOS) or "length". `fed`:
    the tokens the target's cache now holds beyond the step's `history` (the pending token
    first); `pending`: the token to feed next (the last of `tokens`), None once finished.
    `drafted` / `accepted`: drafted tokens this step, and how many the target kept.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish: str | None
    fed: tuple[int, ...]
    pending: int | None
    drafted: int
    accepted: int


def check_draft(target: LoadedModel, draft: LoadedModel, max_kv_size: int | None) -> None:
    """Refuse (`ModelLoadError`) a draft that cannot speculate for `target`: a vocabulary that
    differs from the target's, or a KV cache of either model that cannot be cut back."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differ = sum(1 for t, i in draft_vocab.items() if target_vocab.get(t) != i)
        raise ModelLoadError(
            f"draft model {draft.path}: its tokenizer differs from the target's "
            f"({len(draft_vocab)} tokens against {len(target_vocab)}, {differ} that differ): "
            "a draft model must share the target's tokenizer"
        )
    for role, loaded in (("target", target), ("draft", draft)):
        cache = make_cache(loaded.model, max_kv_size)
        refused = sorted(
            {
                type(c).__name__
                for c in cache
                if isinstance(c, RotatingKVCache) or not c.is_trimmable()
            }
        )
        if refused:
            raise ModelLoadError(
                f"{role} model {loaded.path}: speculative decoding cuts the KV cache back after "
                f"refused drafts, which its {', '.join(refused)} layers cannot do"
                + (" (--max-kv-size makes rotating caches)" if max_kv_size else "")
            )


def output_width(model: Any) -> int:
    """Entries in `model`'s logits (can exceed the tokenizer's vocabulary: padded heads)."""
    logits = model(mx.array([[0]], dtype=mx.uint32), cache=make_cache(model))
    mx.eval(logits)
    return int(logits.shape[-1])


Forward = Callable[[Any, Any, list[Any]], Any]


@runtime_checkable
class Drafter(Protocol):
    """What proposes the drafted tokens (a draft model: `ModelDrafter`; a model's own MTP head:
    `mtp.MtpDrafter`), with one state per sequence (`open`)."""

    def open(self) -> Any:
        """A fresh state for a new sequence."""
        ...

    def during_prefill(self, state: Any, run: Callable[[], _T], fed: Callable[[], Any]) -> _T:
        """Run `run`, one prefill chunk (or the first token) of the sequence whose target cache
        holds `fed()`, taking from it what the drafter needs (or nothing)."""
        ...

    def prepare(self, state: Any, history: Sequence[int]) -> tuple[bool, int]:
        """Before drafting: (whether this step may draft, history tokens fed outside drafting)."""
        ...

    def start(self, state: Any, history: Sequence[int], pending: int) -> Any:
        """Logits (1, V) for the token after `pending` (the state catching up as needed)."""
        ...

    def extend(self, state: Any, token: Any) -> Any:
        """Logits (1, V) for the token after the drafted `token` (shape (1,))."""
        ...

    def verify(self, forward: Forward, tokens: Any, cache: list[Any]) -> tuple[Any, Any]:
        """The target's pass over `tokens` (1, k + 1): its logits (k + 1, V) and anything the
        drafter needs from it (given to `settle`)."""
        ...

    def settle(self, state: Any, history: Sequence[int], fed: int, extra: Any) -> None:
        """After verification: the target's cache holds `history` and `fed` more tokens."""
        ...


class ModelDrafter:
    """A draft model sharing the target's tokenizer, with a `DraftCache` per sequence that
    catches up lazily, at most `catch_up_tokens` per step (see the module)."""

    def __init__(self, target: Any, draft: Any, catch_up_tokens: int, forward: Forward) -> None:
        self._target = target
        self._draft = draft
        self.catch_up_tokens = catch_up_tokens
        self._forward = forward

    def open(self) -> DraftCache:
        return DraftCache(make_cache(self._draft))

    def during_prefill(
        self, state: DraftCache, run: Callable[[], _T], fed: Callable[[], Any]
    ) -> _T:
        return run()  # the draft catches up on its own, in `prepare`

    def prepare(self, state: DraftCache, history: Sequence[int]) -> tuple[bool, int]:
        lag = len(history) - state.length
        if lag > self.catch_up_tokens:
            chunk = mx.array(list(history[state.length : state.length + self.catch_up_tokens]))
            self._forward(self._draft, chunk[None].astype(mx.uint32), state.cache)
            mx.async_eval([c.state for c in state.cache])
            state.length += int(chunk.size)
            return False, int(chunk.size)
        return True, lag

    def start(self, state: DraftCache, history: Sequence[int], pending: int) -> Any:
        feed = mx.array([*history[state.length :], pending], dtype=mx.uint32)
        out = self._forward(self._draft, feed[None], state.cache)
        state.length = len(history) + 1
        return out[:, -1, :]

    def extend(self, state: DraftCache, token: Any) -> Any:
        out = self._forward(self._draft, token[None], state.cache)
        state.length += 1
        return out[:, -1, :]

    def verify(self, forward: Forward, tokens: Any, cache: list[Any]) -> tuple[Any, Any]:
        return forward(self._target, tokens, cache)[0], None

    def settle(self, state: DraftCache, history: Sequence[int], fed: int, extra: Any) -> None:
        state.trim_to(len(history) + fed)


class Speculator:
    """The target model and its drafter (a draft model, or a `Drafter` such as the model's own
    MTP head) and how many tokens to draft: `step` advances one sequence (whose caches and
    sampler are passed in) by one speculative step."""

    def __init__(
        self,
        target: Any,
        draft: Any,
        *,
        num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        catch_up_tokens: int = 2048,
        pad_attention: bool | None = None,
    ) -> None:
        if num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be >= 1")
        if catch_up_tokens < 1:
            raise ValueError("catch_up_tokens must be >= 1")
        self._target = target
        self.num_draft_tokens = num_draft_tokens
        self.catch_up_tokens = catch_up_tokens
        self._width = output_width(target)
        #: multi-token passes attend over whole cache buffers (`padded_attention`): CUDA only
        self.pad_attention = padded_attention_default() if pad_attention is None else pad_attention
        self.drafter: Drafter = (
            draft
            if isinstance(draft, Drafter)
            else ModelDrafter(target, draft, catch_up_tokens, self._forward)
        )
        self.counters = SpeculationCounters()

    def _forward(self, model: Any, tokens: Any, cache: list[Any]) -> Any:
        if self.pad_attention:
            return padded_forward(model, tokens, cache)
        return model(tokens, cache=cache)

    def open_draft(self) -> Any:
        """A fresh drafter state for a new sequence."""
        return self.drafter.open()

    def step(
        self,
        target_cache: list[Any],
        draft: Any,
        history: Sequence[int],
        pending: int,
        selector: TokenSelector,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        generated: int,
    ) -> Speculation:
        """One step: draft up to K tokens after `history` + `pending`, verify them with the
        target, keep the accepted ones and the target's next token.

        `target_cache` holds exactly `history` (prompt and generated tokens fed so far);
        `pending` is the last generated token, not yet fed; `draft` is the sequence's drafter
        state (`open_draft`). `generated` tokens were emitted before (at least `pending`). Both
        caches are trimmed to what was kept and the selector's penalty state counts the emitted
        tokens. Raises whatever the models raise."""
        remaining = params.max_tokens - generated
        if remaining < 1:
            raise ValueError("no tokens left to generate")
        counters = self.counters
        drafter = self.drafter
        k = min(self.num_draft_tokens, remaining - 1)
        may_draft, caught_up = drafter.prepare(draft, history)
        if not may_draft:
            k = 0
            counters.catch_up_tokens += caught_up
        elif k:
            counters.catch_up_tokens += caught_up
        selector.fit_width(self._width)
        greedy = selector.greedy
        keys: Any = None if greedy else mx.random.split(selector.next_key(), k + 2)
        base = selector.checkpoint()
        states = [base]
        drafted: list[Any] = []
        draft_probs: list[Any] = []
        for i in range(k):
            out = (
                drafter.start(draft, history, pending)
                if i == 0
                else drafter.extend(draft, drafted[-1])
            )
            logits = _fit_width(out, self._width)
            logits = selector.adjust(logits) if selector.adjusts_logits else logits
            if greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                q = selector.distribution(logits)
                token = mx.random.categorical(mx.log(q), key=keys[i])
                draft_probs.append(q)
            token = token.astype(mx.uint32)
            selector.observe(token)
            states.append(selector.checkpoint())
            drafted.append(token)
            mx.async_eval(token)
        verify = mx.concatenate([mx.array([pending], dtype=mx.uint32), *drafted])
        raw, extra = drafter.verify(self._forward, verify[None], target_cache)  # (k + 1, width)
        adjusted = _adjust_rows(selector, raw, states)
        selector.rewind(base)
        proposals = mx.concatenate(drafted) if drafted else None
        if greedy:
            choices = mx.argmax(adjusted, axis=-1).astype(mx.uint32)
            accepted = _greedy_accepted(proposals, choices)
            final = mx.take(choices, accepted)
        else:
            target_probs = selector.distribution(adjusted)
            accepted, final = accept_drafts(
                target_probs,
                mx.concatenate(draft_probs) if draft_probs else None,
                proposals,
                keys[k],
                keys[k + 1],
            )
        positions = mx.arange(k + 1)
        padded = final[None] if proposals is None else mx.concatenate([proposals, final[None]])
        emitted_all = mx.where(positions < accepted, padded, final).astype(mx.uint32)
        logprob_parts: tuple[Any, ...] = ()
        if params.logprobs:
            chosen, ids, values = logprob_arrays(raw, emitted_all, params.top_logprobs)
            logprob_parts = (chosen, ids, values)
        mx.eval(accepted, emitted_all, *(a for a in logprob_parts if a is not None))
        n_accepted = int(accepted.item())
        emitted = [int(t) for t in cast(list[int], emitted_all.tolist())[: n_accepted + 1]]
        tokens: list[int] = []
        finish: str | None = None
        for token_id in emitted:
            if token_id in eos_token_ids:
                finish = "stop"
                break
            tokens.append(token_id)
            if generated + len(tokens) >= params.max_tokens:
                finish = "length"
                break
        for token_id in emitted[: len(tokens) + (1 if finish == "stop" else 0)]:
            selector.observe(mx.array([token_id], dtype=mx.uint32))
        fed = [pending, *(tokens if finish == "stop" else tokens[:-1])]
        for layer in target_cache:
            layer.trim(k + 1 - len(fed))
        drafter.settle(draft, history, len(fed), extra)
        if k:
            counters.steps += 1
            counters.drafted_tokens += k
            counters.accepted_tokens += n_accepted
        else:
            counters.plain_steps += 1
        return Speculation(
            tokens=tuple(tokens),
            logprobs=_read_logprobs(tokens, logprob_parts),
            finish=finish,
            fed=tuple(fed),
            pending=tokens[-1] if finish is None else None,
            drafted=k,
            accepted=n_accepted,
        )


def accept_drafts(
    target_probs: Any,
    draft_probs: Any | None,
    drafted: Any | None,
    accept_key: Any,
    residual_key: Any,
) -> tuple[Any, Any]:
    """The rejection-sampling step (lazy MLX arrays): of `k` drafted tokens (shape (k,), drawn
    from `draft_probs`, shape (k, V)), how many are accepted against `target_probs` (shape
    (k + 1, V)), and the token that follows them: drawn from normalize(max(0, p_i - q_i)) at
    the first refusal i, or from p_(k+1) when all are kept. Returns (accepted, token), scalars.
    With k = 0 (`drafted` None) it is a plain draw from `target_probs[0]`."""
    if drafted is None or draft_probs is None:
        token = mx.random.categorical(mx.log(target_probs[0]), key=residual_key)
        return mx.array(0, dtype=mx.int32), token.astype(mx.uint32)
    k = int(drafted.shape[0])
    rows = mx.arange(k)
    p = target_probs[rows, drafted]
    q = draft_probs[rows, drafted]
    u = mx.random.uniform(shape=(k,), key=accept_key)
    kept = (u * q < p).astype(mx.int32)
    accepted = mx.sum(mx.cumprod(kept))
    residuals = mx.concatenate(
        [mx.maximum(target_probs[:k] - draft_probs, 0.0), target_probs[k:]], axis=0
    )
    row = mx.take(residuals, accepted, axis=0)
    # p_i == q_i to rounding leaves nothing: then a refusal had probability ~0; draw from p_i.
    row = mx.where(mx.sum(row) > 0, row, mx.take(target_probs, accepted, axis=0))
    token = mx.random.categorical(mx.log(row), key=residual_key)
    return accepted.astype(mx.int32), token.astype(mx.uint32)


def _greedy_accepted(drafted: Any | None, choices: Any) -> Any:
    """Drafted tokens equal to the target's argmax, counted up to the first that is not."""
    if drafted is None:
        return mx.array(0, dtype=mx.int32)
    same = (drafted == choices[: drafted.shape[0]]).astype(mx.int32)
    return mx.sum(mx.cumprod(same)).astype(mx.int32)


def _adjust_rows(selector: TokenSelector, raw: Any, states: list[tuple[Any, Any]]) -> Any:
    """The target's logits at each verified position after the selector's adjustments, row i
    with the penalty state after the first i drafted tokens."""
    if not selector.adjusts_logits:
        return raw.astype(mx.float32)
    if not selector.penalizes:
        return selector.adjust(raw)  # a bias alone: the same for every row
    rows = []
    for i in range(raw.shape[0]):
        selector.rewind(states[i])
        rows.append(selector.adjust(raw[i : i + 1]))
    return mx.concatenate(rows, axis=0)


def _fit_width(logits: Any, width: int) -> Any:
    """The draft's logits cut or padded (with -inf: never drafted) to the target's width."""
    have = int(logits.shape[-1])
    if have == width:
        return logits
    if have > width:
        return logits[..., :width]
    pad = mx.full((*logits.shape[:-1], width - have), float("-inf"), dtype=logits.dtype)
    return mx.concatenate([logits, pad], axis=-1)


def _read_logprobs(tokens: list[int], parts: tuple[Any, ...]) -> tuple[TokenLogprob, ...]:
    if not parts or not tokens:
        return ()
    chosen, ids, values = parts
    chosen_list = chosen.tolist()
    ids_list = ids.tolist() if ids is not None else None
    values_list = values.tolist() if values is not None else None
    out = []
    for i, token in enumerate(tokens):
        top: tuple[tuple[int, float], ...] = ()
        if ids_list is not None and values_list is not None:
            top = tuple(
                sorted(zip(ids_list[i], values_list[i], strict=True), key=lambda pair: -pair[1])
            )
        out.append(TokenLogprob(token=token, logprob=float(chosen_list[i]), top=top))
    return tuple(out)
