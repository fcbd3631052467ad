"""trio-mlx: an LLM inference engine and OpenAI-compatible server on MLX, built as Trio actors.

async with trio_mlx.open_engine() as engine:
    async for out in engine.stream_chat([{"role": "user", "content": "Hi"}], max_tokens=32):
        print(out.new_text, end="")
"""

from trio_mlx.actors.engine import Engine, PreparedRequest
from trio_mlx.actors.stream import RequestStream
from trio_mlx.actors.supervisor import open_engine, serve_engine
from trio_mlx.config import EngineConfig
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
from trio_mlx.types import GenerationOutput, SamplingParams

__all__ = [
    "Engine",
    "EngineBusy",
    "EngineClosed",
    "EngineConfig",
    "EngineCrashed",
    "GenerationError",
    "GenerationOutput",
    "InvalidRequest",
    "ModelLoadError",
    "PreparedRequest",
    "PromptTooLong",
    "RequestStream",
    "SamplingParams",
    "TrioMLXError",
    "open_engine",
    "serve_engine",
]
