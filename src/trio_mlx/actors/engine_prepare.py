"""Stage one of a request through `Engine`: from what the caller asked for to a validated
`PreparedRequest`, without holding the event loop. `Engine` inherits it (`PrepareStage`), so
these are the engine's own public methods; nothing here admits or generates anything.

- `prepare_generate_async` / `prepare_chat_async` run the tokenization (and the chat template) on
  the preparation worker (`prepare_queue`): one at a time (the `RequestPreparer` has its own lock
  besides), in arrival order, back to back, so the event loop, every other stream and `/health`
  never wait for it and a burst's preparations do not wait for the event loop either. Before
  that, a length check on the caller's thread refuses a text that cannot fit the context
  without tokenizing it (`RequestPreparer.check_text_length` / `check_chat_length`). Cancelling
  the caller abandons the preparation: one still queued never runs; one running is finished and
  its result dropped.
- `prepare_generate` / `prepare_chat` are the same work, synchronous, on the calling thread (a
  long prompt holds the event loop for its tokenization, and for any tokenization in progress
  on the worker: prefer the async forms).
- Media (images, video) go through `prepare_chat_async` only: on a vision-language model they
  are fetched under `EngineConfig.media` and processed off the event loop
  (`multimodal.prepare`); a text-only model refuses them with an `InvalidRequest` naming the
  part, as does `prepare_chat` on any model.
- With the prefix cache on, `prepare_chat` finds the rendered system prompt's boundary, which
  becomes a store point of the job (`kv_cache_manager`).
- `count_chat_tokens_async`: the prompt's length as `prepare_chat` would build it, on the same
  worker.

Each public method bundles its arguments into one `GenerateArgs` / `ChatArgs` (`preparation`)
and hands it to its private twin (`_prepare_generate`, `_prepare_chat_async`, ...), which is
what the lower layers and `Engine.start_*` pass along; validation happens below, in
`RequestPreparer`, as before.

Refusals raise here, before admission: `InvalidRequest`, `PromptTooLong` (`preparation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Unpack

from trio_mlx.actors.kv_cache_manager import KVCacheManager
from trio_mlx.actors.model_info import ModelInfo
from trio_mlx.actors.prepare_queue import PreparationQueue
from trio_mlx.config import EngineConfig
from trio_mlx.errors import InvalidRequest
from trio_mlx.multimodal.parts import first_media_param, has_media
from trio_mlx.multimodal.prepare import prepare_multimodal_chat
from trio_mlx.preparation import (
    ChatArgs,
    GenerateArgs,
    PreparedRequest,
    RequestPreparer,
    SamplingArgs,
    SamplingOptions,
)
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P


class PrepareStage:
    """`Engine`'s first stage: the preparer for the model's tokenizer and context, and the
    worker that keeps tokenization off the event loop, one at a time (`prepare_queue`)."""

    def __init__(self, config: EngineConfig, info: ModelInfo, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.info = info
        self._kv_cache = kv_cache
        self._preparer = RequestPreparer(
            info.tokenizer,
            vocab_size=info.vocab_size,
            context_length=info.context_length,
            default_max_tokens=config.default_max_tokens,
            max_tokens_limit=config.max_tokens_limit,
        )
        #: One preparation at a time, off the event loop, in arrival order (`prepare_queue`).
        self._preparing = PreparationQueue()

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
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        return self._prepare_generate(GenerateArgs(prompt, sampling))

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
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        return self._prepare_chat(ChatArgs(messages, sampling, tools, chat_template_kwargs))

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
        refused first, without tokenizing. Preparations run one at a time, in the order they
        were asked for (`prepare_queue`). Cancelling the caller abandons the preparation: one
        not yet started never runs; one running is finished and its result dropped."""
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        return await self._prepare_generate_async(GenerateArgs(prompt, sampling))

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
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        args = ChatArgs(messages, sampling, tools, chat_template_kwargs, images, videos)
        return await self._prepare_chat_async(args)

    # ---- the same four, for a request already bundled (what `Engine.start_*` call) ----------

    def _prepare_generate(self, args: GenerateArgs) -> PreparedRequest:
        """`prepare_generate`, on the calling thread."""
        return self._preparer.text(args)

    def _prepare_chat(self, args: ChatArgs) -> PreparedRequest:
        """`prepare_chat`, on the calling thread (`args` without `images` / `videos`)."""
        if has_media(args.messages):
            self._refuse_media(args.messages)
            raise InvalidRequest(
                "messages with images or video are prepared by prepare_chat_async",
                param=first_media_param(args.messages),
            )
        return self._preparer.chat(args, find_system_prefix=self._kv_cache.enabled)

    async def _prepare_generate_async(self, args: GenerateArgs) -> PreparedRequest:
        """`prepare_generate_async`: the length check here, the rest on the worker."""
        if isinstance(args.prompt, str):
            self._preparer.check_text_length(len(args.prompt), "prompt")
        return await self._preparing.run(partial(self._prepare_generate, args))

    async def _prepare_chat_async(self, args: ChatArgs) -> PreparedRequest:
        """`prepare_chat_async`: the length check here, then the media path or the worker."""
        self._preparer.check_chat_length(args.messages)
        if args.images or args.videos or has_media(args.messages):
            if self.info.multimodal is None:
                self._refuse_media(args.messages, args.images, args.videos)
            return await prepare_multimodal_chat(
                self.info.multimodal,
                self._preparer,
                self._preparing,
                args,
                self.config.media,
            )
        return await self._preparing.run(partial(self._prepare_chat, args))

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
            f"{self.info.name} is a text-only model: it cannot take images or video",
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
        return await self._preparing.run(
            partial(
                self._preparer.count_chat,
                messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        )
