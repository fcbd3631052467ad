"""`Engine`'s convenience API: `generate`, `stream_generate`, `chat` and `stream_chat`, the vllm-mlx
`SimpleEngine` surface. `Engine` inherits it (`ConvenienceAPI`), so these are the engine's own
public methods.

Contract: each is all three stages of a request (see `engine`) in one call, and nothing more.
Its arguments are bundled once into a `GenerateArgs` / `ChatArgs` (`preparation`) and handed to
`Engine._start_generate` / `_start_chat`, the same path as `start_generate` / `start_chat`
(preparation off the event loop, admission in arrival order), so they refuse, validate and
sample exactly as those do; sampling defaults are `DEFAULT_TEMPERATURE` / `DEFAULT_TOP_P`
(OpenAI's 1.0 / 1.0), the same on every surface.

- `generate` / `chat` await the final output and return it (raising `GenerationError` if the
  model failed); the request is closed however that ends.
- `stream_generate` / `stream_chat` return a `GenerationStream` (`request`) at once: preparation
  and admission happen on its first iteration, so refusals raise there; dropping it early
  (break, `aclose()`, cancellation) aborts the request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Unpack

from trio_mlx.actors.request import ActiveRequest, GenerationStream
from trio_mlx.errors import GenerationError
from trio_mlx.preparation import ChatArgs, GenerateArgs, SamplingArgs, SamplingOptions
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, GenerationOutput


class ConvenienceAPI:
    """Mixin for `Engine`: the convenience methods, on top of the two hooks below (stages one
    and two for one bundled request), which `Engine` provides."""

    async def _start_generate(self, args: GenerateArgs) -> ActiveRequest:
        """Prepare and admit `args`; the caller must `close()` the result (`Engine`'s)."""
        raise NotImplementedError

    async def _start_chat(self, args: ChatArgs) -> ActiveRequest:
        """Prepare and admit `args`; the caller must `close()` the result (`Engine`'s)."""
        raise NotImplementedError

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
        args = GenerateArgs(prompt, SamplingArgs(max_tokens, temperature, top_p, stop, options))
        return GenerationStream(partial(self._start_generate, args))

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
        args = GenerateArgs(prompt, SamplingArgs(max_tokens, temperature, top_p, stop, options))
        return await _run_to_end(await self._start_generate(args))

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
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        args = ChatArgs(messages, sampling, tools, chat_template_kwargs, images, videos)
        return GenerationStream(partial(self._start_chat, args))

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
        sampling = SamplingArgs(max_tokens, temperature, top_p, stop, options)
        args = ChatArgs(messages, sampling, tools, chat_template_kwargs, images, videos)
        return await _run_to_end(await self._start_chat(args))


async def _run_to_end(active: ActiveRequest) -> GenerationOutput:
    """Iterate an admitted request to its final output, then close it (however that ends)."""
    try:
        async for output in active.stream:
            if output.finished:
                if output.finish_reason == "error":
                    raise GenerationError(output.error or "generation failed")
                return output
    finally:
        active.close()
    raise AssertionError("a request stream ended without a final output")  # pragma: no cover
