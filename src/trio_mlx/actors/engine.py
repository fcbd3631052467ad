"""`Engine`: the public face of a running engine, handed out by `open_engine`.

A request goes through three stages, each of which can refuse it before anything is generated:
1. `prepare_generate_async` / `prepare_chat_async`: tokenize (and render the chat template) on a
   worker thread behind a `CapacityLimiter(1)`, after a length check on the caller's thread
   that refuses a text too long for the context without tokenizing it; validate the sampling
   parameters, check the prompt against the context (`InvalidRequest`, `PromptTooLong`).
   `prepare_generate` / `prepare_chat` are the same work, synchronous, on the calling thread
   (a long prompt holds the event loop for its tokenization, and for any tokenization in
   progress on the worker, which the preparer's lock serializes: prefer the async forms);
2. `open_stream` (async context manager): admission (`EngineBusy`, `EngineClosed`), then the job
   goes to the runner and a `RequestStream` comes back;
3. iterating the stream: `GenerationOutput`s until one has `finished=True`.

Leaving `open_stream`'s block for any reason (done, cancelled, an exception, `break`) aborts the
runner's work for the request at its next step boundary and frees the admission slot, both with
synchronous calls in `finally`, so it also happens inside a cancelled scope.

`generate`, `stream_generate`, `chat` and `stream_chat` are the convenience API on top (the
vllm-mlx `SimpleEngine` surface); they prepare through the async forms. Sampling defaults are
`DEFAULT_TEMPERATURE` / `DEFAULT_TOP_P` (OpenAI's 1.0 / 1.0), the same on every surface.

Prefix KV cache: requests whose prompt starts with tokens already computed (a shared system
prompt, the previous turn of a conversation, a retry) prefill only the new tokens; see
`kv_cache_manager` and the runner. `get_cache_stats()` and `clear_runtime_caches()` expose it.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Unpack

import trio

from trio_mlx.actors.admission import AdmissionController
from trio_mlx.actors.kv_cache_manager import KVCacheManager
from trio_mlx.actors.model_info import ModelInfo
from trio_mlx.actors.request import ActiveRequest, GenerationStream
from trio_mlx.actors.runner import Runner
from trio_mlx.actors.stream import RequestStream, TokenSink
from trio_mlx.config import EngineConfig
from trio_mlx.engine.decode import GenerationJob
from trio_mlx.engine.scheduling import kv_bytes_at_limit
from trio_mlx.errors import EngineClosed, EngineCrashed, GenerationError, InvalidRequest
from trio_mlx.multimodal.job import MultimodalJob
from trio_mlx.multimodal.parts import first_media_param, has_media
from trio_mlx.multimodal.prepare import MultimodalRequest, prepare_multimodal_chat
from trio_mlx.preparation import PreparedRequest, ReasoningTags, RequestPreparer, SamplingOptions
from trio_mlx.text.detokenizer import decoder_for
from trio_mlx.text.reasoning import ReasoningSplitter
from trio_mlx.tools.registry import MARKUP_TOKENS
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, GenerationOutput


class Engine:
    """A loaded model behind admission control and the runner thread. Safe to share between
    tasks of the Trio run that opened it."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        admission: AdmissionController,
        info: ModelInfo,
        kv_cache: KVCacheManager,
    ) -> None:
        self.config = config
        self.info = info
        self._runner = runner
        self._admission = admission
        self._kv_cache = kv_cache
        self._decode = decoder_for(info.tokenizer, keep=MARKUP_TOKENS)
        self._preparer = RequestPreparer(
            info.tokenizer,
            vocab_size=info.vocab_size,
            context_length=info.context_length,
            default_max_tokens=config.default_max_tokens,
            max_tokens_limit=config.max_tokens_limit,
        )
        #: One tokenization at a time, off the event loop (see `prepare_chat_async`).
        self._tokenizing = trio.CapacityLimiter(1)
        self._request_ids = itertools.count(1)
        self._closed = False
        self._started_at = time.monotonic()
        self._finished: Counter[str] = Counter()
        self._last: GenerationOutput | None = None

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

    # ---- stage 1: prepare ------------------------------------------------------------------

    def prepare_generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> PreparedRequest:
        """A text prompt (BOS added as the tokenizer does) or the caller's token ids."""
        return self._preparer.text(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            options=options,
        )

    def prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> PreparedRequest:
        """Chat messages rendered through the model's chat template.

        With the prefix cache on, the rendered system prompt's boundary becomes a cache point:
        the runner snapshots the cache there, so other conversations with the same system prompt
        start from it. Messages with images or video need `prepare_chat_async` (their media are
        fetched).
        """
        if has_media(messages):
            self._refuse_media(messages)
            raise InvalidRequest(
                "messages with images or video are prepared by prepare_chat_async",
                param=first_media_param(messages),
            )
        return self._preparer.chat(
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            options=options,
            find_system_prefix=self._kv_cache.enabled,
        )

    async def prepare_generate_async(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> PreparedRequest:
        """`prepare_generate` with the tokenization on a worker thread: the event loop (every
        other stream, `/health`) never waits for it. A text that cannot fit the context is
        refused first, without tokenizing. Cancelling the caller abandons the tokenization
        (the worker finishes it and its result is dropped; the next one waits for it)."""
        if isinstance(prompt, str):
            self._preparer.check_text_length(len(prompt), "prompt")
        return await trio.to_thread.run_sync(
            partial(
                self.prepare_generate,
                prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                **options,
            ),
            limiter=self._tokenizing,
            abandon_on_cancel=True,
        )

    async def prepare_chat_async(
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
        **options: Unpack[SamplingOptions],
    ) -> PreparedRequest:
        """`prepare_chat` with the chat template and the tokenization on a worker thread (see
        `prepare_generate_async`).

        Images and video (content parts `image_url`, `input_image`, `video_url`, `image`,
        `video`, or vllm-mlx's `images=` / `videos=`: URLs, paths, bytes or PIL images, added to
        the last user message; these may name any local file, the caller's own) on a
        vision-language model: fetched under `EngineConfig.media`, processed off the event loop
        (`multimodal.prepare`). A text-only model refuses them (`InvalidRequest` naming the
        part)."""
        self._preparer.check_chat_length(messages)
        if images or videos or has_media(messages):
            if self.info.multimodal is None:
                self._refuse_media(messages, images, videos)
            return await prepare_multimodal_chat(
                self.info.multimodal,
                self._preparer,
                self._tokenizing,
                messages,
                self.config.media,
                images=images,
                videos=videos,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                options=options,
            )
        return await trio.to_thread.run_sync(
            partial(
                self.prepare_chat,
                messages,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                **options,
            ),
            limiter=self._tokenizing,
            abandon_on_cancel=True,
        )

    def _refuse_media(
        self,
        messages: Sequence[Mapping[str, Any]],
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
    ) -> None:
        if self.info.multimodal is not None:
            return
        param = "images" if images else "videos" if videos else first_media_param(messages)
        raise InvalidRequest(
            f"{self.model_name} is a text-only model: it cannot take images or video",
            param=param,
        )

    async def count_chat_tokens_async(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> int:
        """The length of the prompt `prepare_chat` would build for `messages`, whatever the
        context; rendered and tokenized on the worker thread tokenization uses. Raises
        `InvalidRequest` as `prepare_chat` does for messages the template refuses."""
        return await trio.to_thread.run_sync(
            partial(
                self._preparer.count_chat,
                messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            ),
            limiter=self._tokenizing,
            abandon_on_cancel=True,
        )

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
        lease = await self._admission.acquire(request_id, kv_bytes)
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
            self._record(stream)

        return ActiveRequest(stream, close)

    def _check_alive(self) -> None:
        if self._runner.crash is not None:
            raise EngineCrashed(f"the engine crashed: {self._runner.crash}")
        if self._closed:
            raise EngineClosed("the engine is closed")

    def _record(self, stream: RequestStream | None) -> None:
        if stream is None:
            return
        final = stream.final
        reason = final.finish_reason if final is not None else "abort"
        self._finished[reason or "abort"] += 1
        if final is not None:
            self._last = final

    # ---- the convenience API ---------------------------------------------------------------------

    def stream_generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> GenerationStream:
        """Stream a completion of `prompt` (text, or token ids): `async for out in ...`.

        Preparation (off the event loop) and admission happen on the first iteration, so
        validation errors and refusals raise there. Dropping the stream early (break,
        `aclose()`, cancellation) aborts the request.
        """

        async def start() -> ActiveRequest:
            request = await self.prepare_generate_async(
                prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                **options,
            )
            return await self.start_request(request)

        return GenerationStream(start)

    async def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> GenerationOutput:
        """The whole completion of `prompt`. Raises `GenerationError` if the model failed."""
        request = await self.prepare_generate_async(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            **options,
        )
        return await self._run_to_end(request)

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> GenerationStream:
        """Stream the assistant's reply to `messages` (see `stream_generate`; media: see
        `prepare_chat_async`)."""

        async def start() -> ActiveRequest:
            request = await self.prepare_chat_async(
                messages,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                images=images,
                videos=videos,
                **options,
            )
            return await self.start_request(request)

        return GenerationStream(start)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        stop: str | Sequence[str] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> GenerationOutput:
        """The assistant's whole reply. Raises `GenerationError` if the model failed."""
        request = await self.prepare_chat_async(
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            images=images,
            videos=videos,
            **options,
        )
        return await self._run_to_end(request)

    async def _run_to_end(self, request: PreparedRequest) -> GenerationOutput:
        async with self.open_stream(request) as stream:
            async for output in stream:
                if output.finished:
                    if output.finish_reason == "error":
                        raise GenerationError(output.error or "generation failed")
                    return output
        raise AssertionError("a request stream ended without a final output")  # pragma: no cover

    # ---- statistics ---------------------------------------------------------------------------

    def get_cache_stats(self) -> dict[str, Any]:
        """The prefix KV cache, JSON-serialisable: whether it is `enabled` and `supported` (the
        load-time probe: `cache_types`, `support_reason`), `entries` (and `entries_by_kind`:
        system prompts, prompts, conversations), `bytes`, `budget_bytes`,
        `hits`, `misses`, `hit_ratio`, `tokens_saved` (prompt tokens not prefilled), `stores`,
        `refreshes`, `refused`, `evictions`, `superseded`, `bypassed` (prompts too long for an
        exact reuse under `max_kv_size`), and the runner's side: `snapshots_held`,
        `snapshots_taken`, `snapshot_seconds`, `restores`."""
        stats = self._kv_cache.statistics()
        counters = self._runner.snapshot_counters
        stats.update(
            snapshots_held=counters.snapshots_held,
            snapshots_taken=counters.snapshots_taken,
            snapshot_seconds=counters.snapshot_seconds,
            snapshot_failures=counters.snapshot_failures,
            restores=counters.restores,
        )
        return stats

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
        `kept_tokens`, `skipped_tokens`, `kept_fraction`, `scoring_s`, `sparse_prefill_s`)."""
        admission = self._admission.book.statistics()
        counters = self._runner.counters
        last = self._last
        speculator = self._runner.speculator
        speculation = None
        if speculator is not None:
            speculation = {
                "draft_model": "mtp" if self.config.mtp else str(self.config.draft_model),
                "num_draft_tokens": speculator.num_draft_tokens,
                **speculator.counters.statistics(),
            }
        return {
            "model_name": self.model_name,
            "alive": self.is_alive,
            "uptime_s": time.monotonic() - self._started_at,
            "admission_mode": admission.mode,
            "running": admission.running,
            "waiting": admission.waiting,
            "max_waiting": admission.max_waiting,
            "admitted": admission.admitted,
            "busy_rejections": admission.busy_rejections,
            "wait_timeouts": admission.wait_timeouts,
            "slot_holders": [
                {"request_id": rid, "held_s": held} for rid, held in admission.holders.items()
            ],
            "max_num_seqs": admission.slots,
            "kv_reserved_bytes": admission.kv_reserved_bytes,
            "kv_budget_bytes": admission.kv_budget_bytes,
            "memory_waits": admission.memory_waits,
            "finished": dict(self._finished),
            "runner": {
                "batching": self._runner.batching,
                "decoding": counters.decoding,
                "prefilling": counters.prefilling,
                "batch_sizes": {str(k): v for k, v in sorted(counters.batch_sizes.items())},
                "tokens_per_step": (counters.prompt_tokens + counters.generated_tokens)
                / counters.steps
                if counters.steps
                else 0.0,
                "kv_bytes": counters.kv_bytes,
                "media_sequences": counters.media,
                "media_steps": counters.media_steps,
                "steps": counters.steps,
                "prefill_chunks": counters.prefill_chunks,
                "decode_steps": counters.decode_steps,
                "prompt_tokens": counters.prompt_tokens,
                "generated_tokens": counters.generated_tokens,
                "live_sequences": counters.live,
                "requests_in_flight": self._runner.in_flight,
                "started": counters.started,
                "aborted": counters.aborted,
                "failed": counters.failed,
                "busy_s": counters.busy_seconds,
            },
            "cache": self.get_cache_stats(),
            "vision_cache": self._runner.vision_cache.statistics(),
            "multimodal": self.info.multimodal is not None,
            "acceptance_rate": None if speculation is None else speculation["acceptance_rate"],
            "speculative": speculation,
            "specprefill": self._specprefill_stats(),
            "last_request": None
            if last is None
            else {
                "prompt_tokens": last.prompt_tokens,
                "completion_tokens": last.completion_tokens,
                "finish_reason": last.finish_reason,
                "time_to_first_token_s": last.time_to_first_token,
                "generation_tps": last.generation_tps,
            },
        }

    def _specprefill_stats(self) -> dict[str, Any] | None:
        """SpecPrefill's settings and counters (None when no scoring model is loaded)."""
        runner = self._runner
        if runner.scorer is None:
            return None
        settings = runner.specprefill
        return {
            "enabled": settings.enabled,
            "threshold": settings.threshold,
            "keep_pct": settings.keep_pct,
            "backbone_pct": settings.backbone_pct,
            "route": "batched: full prefill" if runner.batching else "serialized",
            **runner.specprefill_counters.statistics(),
        }

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
