"""trio-mlx: an LLM inference engine and OpenAI-compatible server on MLX, built as Trio actors.

async with trio_mlx.open_engine() as engine:
    async for out in engine.stream_chat([{"role": "user", "content": "Hi"}], max_tokens=32):
        print(out.new_text, end="")
"""

from trio_mlx.actors.engine import Engine
from trio_mlx.actors.stream import RequestStream
from trio_mlx.actors.supervisor import open_engine, serve_engine
from trio_mlx.config import EngineConfig
from trio_mlx.engine.decode import LogitsProcessor
from trio_mlx.errors import (
    EngineBusy,
    EngineClosed,
    EngineCrashed,
    GenerationError,
    InvalidRequest,
    ModelLoadError,
    PromptTooLong,
    TrioMLXError,
)
from trio_mlx.preparation import PreparedRequest, SamplingOptions
from trio_mlx.structured import OutputFormat
from trio_mlx.types import GenerationOutput, SamplingParams, TokenLogprob

__all__ = [
    "Engine",
    "EngineBusy",
    "EngineClosed",
    "EngineConfig",
    "EngineCrashed",
    "GenerationError",
    "GenerationOutput",
    "InvalidRequest",
    "LogitsProcessor",
    "ModelLoadError",
    "OutputFormat",
    "PreparedRequest",
    "PromptTooLong",
    "RequestStream",
    "SamplingOptions",
    "SamplingParams",
    "TokenLogprob",
    "TrioMLXError",
    "open_engine",
    "serve_engine",
]
