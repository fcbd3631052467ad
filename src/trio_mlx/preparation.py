"""Stage one of a request: from what a caller asked for to a validated `PreparedRequest`.

Tokenizes the prompt (text, token ids, or chat messages through the chat template), validates
every sampling option (`InvalidRequest` names the parameter), checks the prompt against the
model's context (`PromptTooLong`), caps `max_tokens` to the room left, and sets up the logits
processors (the caller's, plus the thinking budget) and reasoning separation. Tokenizer work only:
no MLX, nothing is admitted or generated yet.

What a caller asked for travels from the engine's entry points to here as one object:
`GenerateArgs` (a prompt) or `ChatArgs` (messages), each with its `SamplingArgs`, as given,
unvalidated; `RequestPreparer` validates them.

Where it runs: tokenizing and rendering a chat template cost time in proportion to the prompt
(seconds for a body of a few MiB), so the engine runs them on a worker thread
(`Engine.prepare_*_async`); before that, `check_text_length` refuses on the calling thread, in
time proportional to nothing but the number of strings, a text that cannot fit the context
whatever its tokens. One `RequestPreparer` is used by one thread at a time (a lock: its
system-prompt cache is shared state, and a Hugging Face tokenizer is not promised to be
re-entrant).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from trio_mlx.engine.decode import LogitsProcessor
from trio_mlx.engine.prompts import (
    SystemPromptTokens,
    chat_prompt,
    check_token_ids,
    encode_text,
)
from trio_mlx.engine.thinking import ThinkingBudget
from trio_mlx.errors import InvalidRequest, PromptTooLong
from trio_mlx.structured.compiler import CompiledGrammar, GrammarCompiler
from trio_mlx.structured.formats import OutputFormat
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, SamplingParams

DEFAULT_THINK_TAGS = ("<think>", "</think>")


class SamplingOptions(TypedDict, total=False):
    """Keyword options every generation call accepts besides max_tokens/temperature/top_p/stop.

    `logits_processors` run on the runner thread (mlx-lm's `(tokens, logits) -> logits`
    protocol; an `is_retired` attribute lets one drop out). `reasoning`: separate `<think>…`
    into `GenerationOutput.reasoning` (None: when the tokenizer has thinking tags).
    `thinking_token_budget`: at most this many thinking tokens, then the think-end is forced.
    `output_format`: constrain the output to a JSON schema, any JSON object, a regex or a Lark
    grammar (`trio_mlx.structured.OutputFormat`); compiled while the request is prepared (an
    uncompilable one is an `InvalidRequest` naming the format's `param`).
    """

    seed: int | None
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int | str, float] | None
    logprobs: bool
    top_logprobs: int
    logits_processors: Sequence[LogitsProcessor]
    reasoning: bool | None
    thinking_token_budget: int | None
    output_format: OutputFormat | None
    specprefill: bool | None
    specprefill_keep_pct: float | None


@dataclass(frozen=True)
class SamplingArgs:
    """How a caller asked a request to be sampled, exactly as given to an `Engine` entry point
    (`generate`, `start_chat`, `prepare_chat_async`, ...): nothing is validated or defaulted
    here beyond the public defaults, so a bad value is refused where it always was, by
    `RequestPreparer` (`max_tokens=None`: the engine's default; `options`: the keyword
    options, unknown ones included, which `RequestPreparer` refuses with a `TypeError`)."""

    max_tokens: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    stop: str | Sequence[str] | None = None
    options: SamplingOptions = field(default_factory=SamplingOptions)


@dataclass(frozen=True)
class GenerateArgs:
    """A completion request as a caller asked for it: the prompt (text, or token ids) and how
    to sample it. What each layer from `Engine.generate` down to `RequestPreparer.text` passes
    on, unvalidated."""

    prompt: str | Sequence[int]
    sampling: SamplingArgs


@dataclass(frozen=True)
class ChatArgs:
    """A chat request as a caller asked for it: the messages, how to sample the reply, the
    tools and chat-template keywords for the template, and vllm-mlx's `images=` / `videos=`
    (media added to the last user message; only the async preparation takes media). What each
    layer from `Engine.chat` down to `RequestPreparer.chat` (or `multimodal.prepare`) passes
    on, unvalidated."""

    messages: Sequence[Mapping[str, Any]]
    sampling: SamplingArgs
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    images: Sequence[Any] | None = None
    videos: Sequence[Any] | None = None


@dataclass(frozen=True)
class ReasoningTags:
    """How to separate thinking from the answer: the tags, and whether the prompt opened it."""

    start: str
    end: str
    open_in_prompt: bool


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: its prompt as token ids and everything about how to continue it.

    `params.max_tokens` is already capped to the room the context leaves after the prompt.
    Logits processors carry state: prepare a request again rather than running it twice.
    `system_prefix`: how many leading prompt tokens render the chat's system prompt (a prefix
    cache point; set by the engine when its prefix cache is on).
    `grammar`: the compiled output format (immutable, shared; each run of the request gets its
    own matcher on the runner thread), None when unconstrained.
    """

    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    logits_processors: tuple[LogitsProcessor, ...] = ()
    reasoning: ReasoningTags | None = None
    system_prefix: int | None = None
    grammar: CompiledGrammar | None = None


class RequestPreparer:
    """Prepares requests for one model (its tokenizer, vocabulary and context)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        context_length: int,
        default_max_tokens: int,
        max_tokens_limit: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.known_systems = SystemPromptTokens(tokenizer)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.longest_token_chars = longest_token_chars(tokenizer)
        #: output formats compiled for this tokenizer (cached)
        self.grammars = GrammarCompiler(tokenizer)
        self._lock = threading.Lock()

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text of `chars` characters that cannot fit the context:
        no token covers more than `longest_token_chars` characters, so such a text has more
        than `context_length` tokens whatever they are. Cheap: no tokenizer call."""
        if chars > self.longest_token_chars * self.context_length:
            raise PromptTooLong(
                f"the prompt has {chars} characters, more than this model's context of "
                f"{self.context_length} tokens can hold (at most {self.longest_token_chars} "
                "characters a token)",
                param=param,
            )

    def check_chat_length(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """`check_text_length` for chat messages: their text contents, summed (the rendered
        prompt contains them all)."""
        chars = 0
        if isinstance(messages, Sequence) and not isinstance(messages, str | bytes):
            for message in messages:
                if isinstance(message, Mapping):
                    chars += _content_chars(message.get("content"))
        self.check_text_length(chars, "messages")

    def text(self, args: GenerateArgs) -> PreparedRequest:
        """A text prompt (BOS added as the tokenizer does) or the caller's token ids."""
        prompt = args.prompt
        if isinstance(prompt, str):
            self.check_text_length(len(prompt), "prompt")
        with self._lock:
            if isinstance(prompt, str):
                tokens = encode_text(self.tokenizer, prompt)
            else:
                tokens = check_token_ids(prompt, self.vocab_size)
            return self._prepare(tokens, "prompt", args.sampling)

    def chat(self, args: ChatArgs, *, find_system_prefix: bool = False) -> PreparedRequest:
        """The messages through the chat template (`args.images` / `args.videos` are not looked
        at: media are `multimodal.prepare`'s). With `find_system_prefix`, the request also
        carries `system_prefix` (see there)."""
        self.check_chat_length(args.messages)
        with self._lock:
            prompt = chat_prompt(
                self.tokenizer,
                args.messages,
                tools=args.tools,
                chat_template_kwargs=args.chat_template_kwargs,
                find_system_prefix=find_system_prefix,
                known_systems=self.known_systems if find_system_prefix else None,
            )
            request = self._prepare(prompt.tokens, "messages", args.sampling)
        if prompt.system_prefix is None:
            return request
        return dataclasses.replace(request, system_prefix=prompt.system_prefix)

    def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> int:
        """How many tokens `messages` render to, as `chat` would prompt the model with them.
        Not checked against the context: a count is an answer for a prompt of any length."""
        with self._lock:
            prompt = chat_prompt(
                self.tokenizer, messages, tools=tools, chat_template_kwargs=chat_template_kwargs
            )
        return len(prompt.tokens)

    def _prepare(
        self, tokens: list[int], prompt_param: str, sampling: SamplingArgs
    ) -> PreparedRequest:
        """Validate `sampling` and check `tokens` (the prompt, named `prompt_param` in a
        refusal) against the context. The caller holds `_lock`."""
        max_tokens, temperature, top_p = sampling.max_tokens, sampling.temperature, sampling.top_p
        stop, options = sampling.stop, sampling.options
        unknown = set(options) - set(SamplingOptions.__annotations__)
        if unknown:
            raise TypeError(f"unknown generation options: {sorted(unknown)}")
        stops_ok = isinstance(stop, str | None) or (
            isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop)
        )
        if not stops_ok:
            raise InvalidRequest("stop must be a string or a list of strings", param="stop")
        requested = self._max_tokens(max_tokens)
        params = SamplingParams(
            max_tokens=requested,
            temperature=temperature,
            top_p=top_p,
            stop=SamplingParams.normalize_stop(stop),
            seed=options.get("seed"),
            top_k=options.get("top_k", 0),
            min_p=options.get("min_p", 0.0),
            repetition_penalty=options.get("repetition_penalty", 1.0),
            presence_penalty=options.get("presence_penalty", 0.0),
            frequency_penalty=options.get("frequency_penalty", 0.0),
            logit_bias=SamplingParams.normalize_logit_bias(options.get("logit_bias")),
            logprobs=options.get("logprobs", False),
            top_logprobs=options.get("top_logprobs", 0),
            specprefill=options.get("specprefill"),
            specprefill_keep_pct=options.get("specprefill_keep_pct"),
        )
        for token, _ in params.logit_bias:
            if not 0 <= token < self.vocab_size:
                raise InvalidRequest(
                    f"logit_bias names token {token}, outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    param="logit_bias",
                )
        if not tokens:
            raise PromptTooLong("the prompt is empty", param=prompt_param)
        room = self.context_length - len(tokens)
        if room < 1:
            raise PromptTooLong(
                f"the prompt has {len(tokens)} tokens; this model's context is "
                f"{self.context_length} tokens, which leaves no room for a completion",
                param=prompt_param,
            )
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        processors = list(options.get("logits_processors", ()))
        reasoning = self._reasoning_tags(tokens, options.get("reasoning"))
        budget = options.get("thinking_token_budget")
        if budget is not None:
            processors.append(self._thinking_budget(budget, tokens, reasoning))
        return PreparedRequest(
            prompt_tokens=tuple(tokens),
            params=params,
            logits_processors=tuple(processors),
            reasoning=reasoning,
            grammar=self._grammar(options.get("output_format")),
        )

    def _grammar(self, fmt: OutputFormat | None) -> CompiledGrammar | None:
        if fmt is None:
            return None
        if not isinstance(fmt, OutputFormat):
            raise InvalidRequest(
                "output_format must be a trio_mlx.structured.OutputFormat", param="output_format"
            )
        return self.grammars.compile(fmt)

    def _max_tokens(self, max_tokens: int | None) -> int:
        limit = self.max_tokens_limit
        if max_tokens is None:
            default = self.default_max_tokens
            return min(default, limit) if limit is not None else default
        if limit is not None and isinstance(max_tokens, int) and max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}; this server allows at most {limit}",
                param="max_tokens",
            )
        return max_tokens

    def _think_tags(self) -> tuple[str, str] | None:
        tok = self.tokenizer
        if getattr(tok, "has_thinking", False) and tok.think_start and tok.think_end:
            return str(tok.think_start), str(tok.think_end)
        return None

    def _reasoning_tags(self, tokens: list[int], wanted: bool | None) -> ReasoningTags | None:
        tags = self._think_tags()
        if wanted is False or (wanted is None and tags is None):
            return None
        start, end = tags or DEFAULT_THINK_TAGS
        tail = self.tokenizer.decode(tokens[-32:])
        return ReasoningTags(start, end, open_in_prompt=tail.rfind(start) > tail.rfind(end))

    def _thinking_budget(
        self, budget: int, tokens: list[int], reasoning: ReasoningTags | None
    ) -> ThinkingBudget:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise InvalidRequest(
                "thinking_token_budget must be a non-negative integer",
                param="thinking_token_budget",
            )
        tags = reasoning or self._reasoning_tags(tokens, True)
        assert tags is not None
        return ThinkingBudget(
            budget,
            self.tokenizer.encode(tags.start, add_special_tokens=False),
            self.tokenizer.encode(tags.end, add_special_tokens=False),
            prompt_length=len(tokens),
            open_in_prompt=tags.open_in_prompt,
        )


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters any one token of `tokenizer` stands for: the longest entry of its
    vocabulary (a byte-level BPE entry has a character per byte, at least as many as the text it
    covers; a SentencePiece piece one per character). At least 1; 64 when the vocabulary cannot
    be read (a bound no real tokenizer's words reach, but a large one)."""
    vocab = getattr(tokenizer, "get_vocab", None)
    try:
        words = vocab() if callable(vocab) else None
    except Exception:
        words = None
    if not words:
        return 64
    return max(1, max(len(word) for word in words if isinstance(word, str)))


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        total = 0
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    return 0
