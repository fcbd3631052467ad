"""`Engine`: the public face of a running engine, handed out by `open_engine`.

A request goes through three stages, each of which can refuse it before anything is generated:
1. `prepare_generate_async` / `prepare_chat_async` (inherited from `engine_prepare.PrepareStage`,
   see there): tokenize (and render the chat template) on the preparation worker, one request at
   a time in arrival order (`prepare_queue`), after a length check on the caller's thread that
   refuses a text too long for the context without tokenizing it; validate the sampling
   parameters, check the prompt against the context (`InvalidRequest`, `PromptTooLong`).
   `prepare_generate` / `prepare_chat` are the same work, synchronous, on the calling thread
   (prefer the async forms);
2. `open_stream` (async context manager) or `start_request`: admission (`EngineBusy`,
   `EngineClosed`), then the job goes to the runner and a `RequestStream` comes back;
3. iterating the stream: `GenerationOutput`s until one has `finished=True`.

`start_chat` / `start_generate` are stages 1 and 2 in one call, and what every surface uses (the
convenience API, the HTTP routes): the request enters admission, and if admitted goes to
the runner, on the Trio thread the moment the worker has prepared it, in the worker's order, so
requests are admitted in the order they arrived, whatever order the Trio scheduler wakes their
callers in afterwards. A caller that goes away meanwhile leaves nothing: its preparation never
starts, or its result is dropped, or its admission is undone.

Leaving `open_stream`'s block for any reason (done, cancelled, an exception, `break`) aborts the
runner's work for the request at its next step boundary and frees the admission slot, both with
synchronous calls in `finally`, so it also happens inside a cancelled scope (`ActiveRequest.close`
likewise).

Bursts: from the moment a request is known to be on its way (`arriving()`: the HTTP layer notes
one as soon as its body has arrived; `start_*` notes its own otherwise) until it enters
admission, the runner knows it is coming (`Runner.arriving`), and an idle batch lets the first
arrivals of a burst wait, prefilled, for the rest before they decode (`batch_loop`), as they
would had they all arrived at once.

`generate`, `stream_generate`, `chat` and `stream_chat` are the convenience API on top (the
vllm-mlx `SimpleEngine` surface), inherited from `engine_convenience.ConvenienceAPI`. Sampling
defaults are `DEFAULT_TEMPERATURE` / `DEFAULT_TOP_P` (OpenAI's 1.0 / 1.0), the same on every
surface.

Each entry point bundles its keyword arguments once, into a `GenerateArgs` / `ChatArgs`
(`preparation`), and every layer below it (`_start_chat`, `_prepare_chat_async`,
`RequestPreparer.chat`, ...) passes that one object on.

Prefix KV cache: requests whose prompt starts with tokens already computed (a shared system
prompt, the previous turn of a conversation, a retry) prefill only the new tokens; see
`kv_cache_manager` and the runner. `get_cache_stats()` and `clear_runtime_caches()` expose it.

Statistics (`get_stats()`, `get_cache_stats()`) are assembled by `engine_stats`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Unpack

import trio

from trio_mlx.actors.admission import AdmissionController, Lease, Waiter
from trio_mlx.actors.engine_convenience import ConvenienceAPI
from trio_mlx.actors.engine_prepare import PrepareStage
from trio_mlx.actors.engine_stats import FinishedRequests, cache_stats, engine_stats
from trio_mlx.actors.kv_cache_manager import KVCacheManager
from trio_mlx.actors.model_info import ModelInfo
from trio_mlx.actors.request import ActiveRequest
from trio_mlx.actors.runner import Runner
from trio_mlx.actors.stream import RequestStream, TokenSink
from trio_mlx.config import EngineConfig
from trio_mlx.engine.decode import GenerationJob
from trio_mlx.engine.scheduling import kv_bytes_at_limit
from trio_mlx.errors import EngineClosed, EngineCrashed
from trio_mlx.multimodal.job import MultimodalJob
from trio_mlx.multimodal.parts import has_media
from trio_mlx.multimodal.prepare import MultimodalRequest
from trio_mlx.preparation import (
    ChatArgs,
    GenerateArgs,
    PreparedRequest,
    ReasoningTags,
    SamplingArgs,
    SamplingOptions,
)
from trio_mlx.text.detokenizer import decoder_for
from trio_mlx.text.reasoning import ReasoningSplitter
from trio_mlx.tools.registry import MARKUP_TOKENS
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P


class Engine(PrepareStage, ConvenienceAPI):
    """A loaded model behind admission control and the runner thread. Safe to share between
    tasks of the Trio run that opened it. Stage 1 (`prepare_*`, `count_chat_tokens_async`) is
    inherited from `PrepareStage` (`engine_prepare`), the convenience API (`generate`,
    `stream_generate`, `chat`, `stream_chat`) from `ConvenienceAPI` (`engine_convenience`)."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        admission: AdmissionController,
        info: ModelInfo,
        kv_cache: KVCacheManager,
    ) -> None:
        super().__init__(config, info, kv_cache)
        self._runner = runner
        self._admission = admission
        self._decode = decoder_for(info.tokenizer, keep=MARKUP_TOKENS)
        self._request_ids = itertools.count(1)
        self._closed = False
        self._started_at = time.monotonic()
        self._finished = FinishedRequests()

    # ---- facts -----------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.info.name

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (mlx-lm's `TokenizerWrapper` around the Hugging Face one)."""
        return self.info.tokenizer

    @property
    def context_length(self) -> int:
        return self.info.context_length

    @property
    def crash(self) -> BaseException | None:
        """What killed the runner thread, if it died."""
        return self._runner.crash

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._runner.crash is None

    # ---- stage 2: admit and run -------------------------------------------------------------

    @asynccontextmanager
    async def open_stream(self, request: PreparedRequest) -> AsyncIterator[RequestStream]:
        """Admit `request` and start it; yield its `RequestStream`. Leaving the block aborts the
        request if it is still running and frees its slot.

        Raises `EngineBusy` (admission refused), `EngineClosed`, `EngineCrashed` before yielding.
        """
        active = await self.start_request(request)
        try:
            yield active.stream
        finally:
            active.close()

    async def start_request(self, request: PreparedRequest) -> ActiveRequest:
        """Admit `request` and hand it to the runner. The caller must `close()` the result."""
        await trio.lowlevel.checkpoint()
        return await self._admitted(self._enter(request))

    async def start_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        arrival: Arrival | None = None,
        **options: Unpack[SamplingOptions],
    ) -> ActiveRequest:
        """`prepare_chat_async` then `start_request`, with admission in arrival order: the
        request enters admission, and if admitted goes to the runner, on the Trio thread the
        moment its preparation is done, before any request that arrived after it (media are
        fetched first, so a chat with media enters when they are processed). The caller must
        `close()` the result. Raises what either step raises."""
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        args = ChatArgs(messages, sampling, tools, chat_template_kwargs, images, videos)
        return await self._start_chat(args, arrival)

    async def start_generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        arrival: Arrival | None = None,
        **options: Unpack[SamplingOptions],
    ) -> ActiveRequest:
        """`prepare_generate_async` then `start_request`, with admission in arrival order (see
        `start_chat`). The caller must `close()` the result."""
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        return await self._start_generate(GenerateArgs(prompt, sampling), arrival)

    async def _start_chat(self, args: ChatArgs, arrival: Arrival | None = None) -> ActiveRequest:
        """`start_chat` for a request already bundled (also `ConvenienceAPI`'s hook)."""
        self._check_alive()
        if args.images or args.videos or has_media(args.messages):
            try:
                request = await self._prepare_chat_async(args)
            finally:
                if arrival is not None:
                    arrival.done()
            return await self.start_request(request)
        self._preparer.check_chat_length(args.messages)
        return await self._start_in_order(partial(self._prepare_chat, args), arrival)

    async def _start_generate(
        self, args: GenerateArgs, arrival: Arrival | None = None
    ) -> ActiveRequest:
        """`start_generate` for a request already bundled (also `ConvenienceAPI`'s hook)."""
        self._check_alive()
        if isinstance(args.prompt, str):
            self._preparer.check_text_length(len(args.prompt), "prompt")
        return await self._start_in_order(partial(self._prepare_generate, args), arrival)

    def arriving(self) -> Arrival:
        """Note a request on its way (from the moment it is known, e.g. an HTTP request's
        first byte, to `Arrival.done()`): while requests are on their way, an idle runner lets
        the first arrivals of a burst wait for the others before they decode (`batch_loop`)."""
        return Arrival(self._runner)

    async def _start_in_order(
        self, prepare: Callable[[], PreparedRequest], arrival: Arrival | None = None
    ) -> ActiveRequest:
        """Prepare on the preparation worker, then enter admission on the Trio thread in the
        worker's (arrival) order, and wait for a slot if queued."""
        arrival = arrival or self.arriving()

        def enter(request: PreparedRequest) -> ActiveRequest | _Queued:
            assert arrival is not None
            arrival.done()
            return self._enter(request)

        try:
            entry = await self._preparing.run(prepare, then=enter, discard=_give_up)
        finally:
            arrival.done()
        return await self._admitted(entry)

    def _enter(self, request: PreparedRequest) -> ActiveRequest | _Queued:
        """Synchronously: admit `request` and hand it to the runner, or queue it for a slot.
        Raises `EngineBusy`, `EngineClosed`, `EngineCrashed`."""
        self._check_alive()
        submitted_at = time.monotonic()
        request_id = next(self._request_ids)
        book = self._admission.book
        kv_bytes = 0
        if book.kv_budget:
            kv_bytes = kv_bytes_at_limit(
                len(request.prompt_tokens),
                request.params.max_tokens,
                book.kv_bytes_per_token,
                self.config.max_kv_size,
            )
        entry = self._admission.enter(request_id, kv_bytes)
        if isinstance(entry, Lease):
            return self._launch(request, request_id, entry, submitted_at)
        return _Queued(request, request_id, entry, submitted_at, self._admission)

    async def _admitted(self, entry: ActiveRequest | _Queued) -> ActiveRequest:
        """The admitted request: at once, or once its slot is granted."""
        if isinstance(entry, ActiveRequest):
            return entry
        lease = await self._admission.wait(entry.request_id, entry.waiter)
        return self._launch(entry.request, entry.request_id, lease, entry.submitted_at)

    def _launch(
        self, request: PreparedRequest, request_id: int, lease: Lease, submitted_at: float
    ) -> ActiveRequest:
        """Hand an admitted request to the runner; its `ActiveRequest`."""
        try:
            self._check_alive()
            sink = TokenSink()
            stream = RequestStream(
                request_id=request_id,
                sink=sink,
                decode=self._decode,
                params=request.params,
                prompt_tokens=len(request.prompt_tokens),
                submitted_at=submitted_at,
                on_done=lambda: self._runner.abort(request_id),
                reasoning=_splitter(request.reasoning),
            )
            job: GenerationJob
            if isinstance(request, MultimodalRequest):
                job = MultimodalJob(
                    request_id,
                    request.prompt_tokens,
                    request.params,
                    request.logits_processors,
                    vision=request.vision,
                    cache_key=request.cache_key,
                    grammar=request.grammar,
                )
            else:
                job = GenerationJob(
                    request_id,
                    request.prompt_tokens,
                    request.params,
                    request.logits_processors,
                    store_points=self._kv_cache.store_points(
                        len(request.prompt_tokens), request.system_prefix
                    ),
                    grammar=request.grammar,
                )
            self._runner.submit(job, sink)
        except BaseException:
            lease.release()
            raise

        def close(stream: RequestStream) -> None:
            sink.close()
            self._runner.abort(request_id)
            lease.release()
            self._finished.record(stream)

        return ActiveRequest(stream, close)

    def _check_alive(self) -> None:
        if self._runner.crash is not None:
            raise EngineCrashed(f"the engine crashed: {self._runner.crash}")
        if self._closed:
            raise EngineClosed("the engine is closed")

    # ---- statistics ---------------------------------------------------------------------------

    def get_cache_stats(self) -> dict[str, Any]:
        """The prefix KV cache, JSON-serialisable: whether it is `enabled` and `supported` (the
        load-time probe: `cache_types`, `support_reason`), `entries` (and `entries_by_kind`:
        system prompts, prompts, conversations), `bytes`, `budget_bytes`,
        `hits`, `misses`, `hit_ratio`, `tokens_saved` (prompt tokens not prefilled), `stores`,
        `refreshes`, `refused`, `evictions`, `superseded`, `bypassed` (prompts too long for an
        exact reuse under `max_kv_size`), and the runner's side: `snapshots_held`,
        `snapshots_taken`, `snapshot_seconds`, `restores` (assembled by `engine_stats`)."""
        return cache_stats(self._kv_cache, self._runner)

    async def clear_runtime_caches(self) -> dict[str, Any]:
        """Drop every cached prefix (the snapshots on the runner thread and the book) and free
        MLX's buffer cache, between two steps of whatever is running. Returns what was freed:
        `entries` and `bytes` (per the book), `snapshots` and `snapshot_bytes` (per the runner;
        the two agree). Counters are kept. When the runner no longer serves, only the book is
        emptied (its snapshots went with the thread)."""
        freed = await self._runner.clear_snapshots()
        if freed is None:
            entries, nbytes = self._kv_cache.clear()
            freed = {"entries": entries, "bytes": nbytes, "snapshots": 0, "snapshot_bytes": 0}
        return freed

    def get_stats(self) -> dict[str, Any]:
        """A snapshot of the engine: admission, the runner's counters, finished requests, the
        prefix cache under `"cache"` (see `get_cache_stats`), and speculative decoding under
        `"speculative"` (None without a draft model: `speculative_steps`, `drafted_tokens`,
        `accepted_tokens`, `acceptance_rate`, `tokens_per_step` per verification, `plain_steps`,
        `catch_up_tokens`), its `acceptance_rate` also at the top level, and SpecPrefill under
        `"specprefill"` (None without a scoring model: its settings, `requests`, `prompt_tokens`,
        `kept_tokens`, `skipped_tokens`, `kept_fraction`, `scoring_s`, `sparse_prefill_s`).
        Assembled by `engine_stats`."""
        return engine_stats(
            config=self.config,
            info=self.info,
            runner=self._runner,
            admission=self._admission,
            kv_cache=self._kv_cache,
            finished=self._finished,
            alive=self.is_alive,
            started_at=self._started_at,
            preparing=len(self._preparing),
        )

    # ---- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Refuse new requests and end every request in flight with `finish_reason="abort"`.
        Synchronous and idempotent; `open_engine` calls it on exit."""
        if self._closed:
            return
        self._closed = True
        self._admission.book.close()
        self._runner.fail_all("abort", None)


def _splitter(tags: ReasoningTags | None) -> ReasoningSplitter | None:
    if tags is None:
        return None
    return ReasoningSplitter(tags.start, tags.end, thinking=tags.open_in_prompt)


@dataclass(frozen=True)
class _Queued:
    """A prepared request waiting in the admission queue for a slot."""

    request: PreparedRequest
    request_id: int
    waiter: Waiter
    submitted_at: float
    admission: AdmissionController


def _give_up(entry: ActiveRequest | _Queued) -> None:
    """Undo an admission whose caller has gone (cancelled before it took the result)."""
    if isinstance(entry, ActiveRequest):
        entry.close()
    else:
        entry.admission.leave(entry.request_id, entry.waiter)


class Arrival:
    """A request on its way to the runner (`Engine.arriving`); `done()` is idempotent."""

    __slots__ = ("_runner",)

    def __init__(self, runner: Runner) -> None:
        self._runner: Runner | None = runner
        runner.expect(1)

    def done(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.expect(-1)
