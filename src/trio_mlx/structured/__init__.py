"""Structured output: constraining generation to a JSON schema, a regex or a Lark grammar.

- `OutputFormat`: what the output must be (a hashable value; `json_schema`, `json_object`,
  `regex`, `lark`);
- `GrammarCompiler`: compiles a format for a tokenizer, cached (request preparation runs it);
- `GrammarMatcher`: one request's position in its grammar on the runner thread, and the token
  masks it gives at each decode step;
- `masked_choice`: a constrained row's token under its mask on the device, in as few kernels as
  MLX allows (`apply_token_mask` spells the same mask out in plain operations);
- `tool_choice`: the grammar that forces a tool call (`tool_choice: "required"` or a named
  function), and reading the calls back.
"""

from trio_mlx.structured.compiler import (
    CompiledGrammar,
    GrammarCacheInfo,
    GrammarCompiler,
    OutputFormatError,
)
from trio_mlx.structured.formats import OutputFormat
from trio_mlx.structured.matcher import (
    GrammarMatcher,
    GrammarViolation,
    allowed_words_of,
    apply_token_mask,
)
from trio_mlx.structured.tool_choice import forced_tool_calls_format, parse_forced_tool_calls

__all__ = [
    "CompiledGrammar",
    "GrammarCacheInfo",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarViolation",
    "OutputFormat",
    "OutputFormatError",
    "allowed_words_of",
    "apply_token_mask",
    "forced_tool_calls_format",
    "parse_forced_tool_calls",
]
