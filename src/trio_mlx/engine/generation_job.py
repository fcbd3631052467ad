"""What a sequence is asked to run and what it hands back: the types every generation route
shares (the serialized route's `decode.ActiveSequence`; the speculative, SpecPrefill and
multimodal sequences with its interface; the batched route's rows). Plain values, but for
`PrefillPlan.choose` (it looks at MLX's default device) and the lazy arrays of a `PendingToken`.

- `GenerationJob`: one request as the runner gets it (prompt tokens, sampling parameters,
  `LogitsProcessor`s, prefix-cache store points, grammar).
- `PrefillPlan`: how a prompt is cut into forward passes (chunk size, the tail fused into the
  first token's pass, shape blocks), chosen for the device and cache by `PrefillPlan.choose`.
- `StepResult`: what one step of one sequence produced (new tokens and their logprobs, finish
  reason, prompt tokens prefilled, store points reached).
- `PendingToken`: a token still being computed on the device, with its lazy logprob arrays;
  `read_logprobs` turns them into a `TokenLogprob` once the token is read.

`decode` re-exports every name here: `from trio_mlx.engine.decode import GenerationJob, ...` keeps
working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from trio_mlx.structured.compiler import CompiledGrammar
from trio_mlx.types import SamplingParams, TokenLogprob

__all__ = [
    "CUDA_FUSED_TAIL_TOKENS",
    "CUDA_PREFILL_BLOCK",
    "GPU_FUSED_TAIL_TOKENS",
    "GenerationJob",
    "LogitsProcessor",
    "PendingToken",
    "PrefillPlan",
    "StepResult",
    "read_logprobs",
]

#: On a GPU, a prompt tail this short goes through the model together with the last prompt token
#: (whose logits give the first token) instead of as a chunk of its own: one forward pass fewer,
#: for computing the output layer on a few more positions.
GPU_FUSED_TAIL_TOKENS = 64
#: On MLX's CUDA backend, a prompt (or the rest of one) of up to this many tokens goes in that one
#: pass: there a pass of up to ~1,000 tokens costs about what a decode step costs (launch-bound),
#: and the pass saved, with its synchronisation, more than the output layer on the extra
#: positions (~1 TFLOP for a 128k vocabulary: ~2 ms on an H200; on a smaller GPU it would not
#: pay, hence CUDA only). H200, engine TTFT, tail 128 against 1024: synthetic Llama-3.2-1B bf16,
#: prompts of 138/300/500/1000 tokens: 17.9/18.5/19.2/20.0 ms against 8.6/9.5/7.5/11.2 ms;
#: Llama-3-8B bf16: 23.7/30.8/37.2/42.7 ms against 22.2/22.6/22.2/32.7 ms
#: (docs/benchmarks/README.md, "Fused prompt tail on the H200").
CUDA_FUSED_TAIL_TOKENS = 1024
#: On MLX's CUDA backend, prefill passes are cut in whole blocks of this many tokens.
CUDA_PREFILL_BLOCK = 64


@dataclass(frozen=True)
class PrefillPlan:
    """How a prompt is cut into forward passes.

    - `step`: at most this many prompt tokens per prefill chunk;
    - `tail`: a rest of at most this many prompt tokens goes through the model in the first
      token's forward pass (1: the last token alone, as mlx-lm does);
    - `block`: every prefill pass starts and ends on a multiple of this many tokens, the last one
      padded (1: no padding). Needs a cache that can be trimmed and `block <= tail`, and `block`
      divides `step`.
    """

    step: int = 2048
    tail: int = 1
    block: int = 1

    def __post_init__(self) -> None:
        if self.step < 1 or self.tail < 1 or self.block < 1:
            raise ValueError(f"prefill step, tail and block must be >= 1: {self}")
        if not _block_fits(self.block, self.step, self.tail):
            raise ValueError(f"a prefill block must divide the step and fit the tail: {self}")

    @classmethod
    def choose(
        cls, step: int, *, tail: int | None, block: int | None, trimmable: bool
    ) -> PrefillPlan:
        """The plan for this device and cache. `tail` None: `CUDA_FUSED_TAIL_TOKENS` on MLX's CUDA
        backend, `GPU_FUSED_TAIL_TOKENS` on another GPU, else 1 (on the CPU the output layer on
        extra positions costs more than the pass saved: +35% time to first token for a 40-token
        prompt on SmolLM2-135M). `block` None: `CUDA_PREFILL_BLOCK` on MLX's CUDA backend (a cuDNN
        attention graph is built for every new shape, 50-150 ms each), else 1. A default tail grows
        to two blocks; a block that cannot be used (see the class) falls back to 1."""
        on_gpu = mx.default_device() == mx.gpu
        on_cuda = on_gpu and mx.cuda.is_available()
        if block is None:
            block = CUDA_PREFILL_BLOCK if on_cuda else 1
        if tail is None:
            tail = CUDA_FUSED_TAIL_TOKENS if on_cuda else GPU_FUSED_TAIL_TOKENS if on_gpu else 1
            # With blocks, at least twice the block: a prefix-cache hit, cut back to a block
            # boundary, leaves up to a block more to prefill than the new tokens alone.
            tail = max(tail, 2 * block if block > 1 else 1)
        tail = min(tail, step)
        return cls(step, tail, block if trimmable and _block_fits(block, step, tail) else 1)


def _block_fits(block: int, step: int, tail: int) -> bool:
    """A block divides the prefill step and fits the fused tail (1 always fits)."""
    return block == 1 or (step % block == 0 and block <= min(tail, step))


class LogitsProcessor(Protocol):
    """mlx-lm's processor protocol: `(tokens, logits) -> logits`, where `tokens` holds the whole
    prompt and every token generated so far (shape (n,)) and `logits` has shape (1, vocab).

    A processor may also have a boolean `is_retired` attribute; once it is true the processor is
    no longer called for this sequence. Processors run on the runner thread.
    """

    def __call__(self, tokens: Any, logits: Any) -> Any: ...


@dataclass(frozen=True)
class GenerationJob:
    """What the runner needs to run one request. Plain values, except `logits_processors`
    (callables that will run on the runner thread).

    `max_tokens` in `params` is already capped to what fits in the model's context.
    `store_points`: prompt lengths worth a snapshot during prefill (a chat's system-prompt
    boundary, the prompt but its last token). Prefill chunks end exactly there only for a cache
    that cannot be cut afterwards (`ActiveSequence(split_at_store_points=True)`); otherwise they
    run past them and the runner snapshots the prefix. Only points past the restored
    `cached_tokens` and in `1..len(prompt_tokens) - 1` are used.
    `grammar`: the output format the tokens must follow (each sequence run from the job makes
    its own matcher), None for none.
    """

    request_id: int
    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    logits_processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)
    store_points: tuple[int, ...] = ()
    grammar: CompiledGrammar | None = field(default=None, compare=False)


@dataclass(frozen=True)
class StepResult:
    """What one step of one sequence produced.

    `tokens` are new completion tokens (EOS never included), with their `logprobs` when asked for.
    `finish` is `"stop"` (EOS) or `"length"` (max_tokens) when the sequence is done, else None.
    `prefilled` counts the prompt tokens processed by this step. `store_points`: the job's store
    points this prefill chunk reached (each at most `len(fed_tokens())`; with
    `split_at_store_points`, at most one, equal to it).
    """

    tokens: tuple[int, ...] = ()
    finish: str | None = None
    prefilled: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    store_points: tuple[int, ...] = ()


class PendingToken:
    """A token being computed, with its lazy logprob arrays."""

    __slots__ = ("chosen", "ids", "token", "values")

    def __init__(self, token: Any, chosen: Any = None, ids: Any = None, values: Any = None) -> None:
        self.token = token
        self.chosen = chosen
        self.ids = ids
        self.values = values

    def arrays(self) -> list[Any]:
        return [a for a in (self.token, self.chosen, self.ids, self.values) if a is not None]


def read_logprobs(token: int, pending: PendingToken) -> TokenLogprob:
    chosen = float(pending.chosen.item())
    top: Sequence[tuple[int, float]] = ()
    if pending.ids is not None:
        ids = pending.ids.reshape(-1).tolist()
        values = pending.values.reshape(-1).tolist()
        top = sorted(zip(ids, values, strict=True), key=lambda pair: -pair[1])
    return TokenLogprob(token=token, logprob=chosen, top=tuple(top))
