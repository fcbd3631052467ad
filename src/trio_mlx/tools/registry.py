"""Which tool-call format a model writes: picked from its chat template (the markup the template
renders for calls is the markup the model was trained to emit), or named by the operator.

`detect_format(template)` reads the template text; `format_class(name)` resolves a
`--tool-call-parser` name ("auto" included). A template that names no known markup gives None:
the model's text stays content (unless it knows no tools at all, see `template_knows_tools`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_mlx.tools.deepseek import DeepSeekFormat
from trio_mlx.tools.format import ToolFormat
from trio_mlx.tools.gemma3 import Gemma3Format
from trio_mlx.tools.glm45 import GLM45Format
from trio_mlx.tools.harmony import HarmonyFormat
from trio_mlx.tools.hermes import HermesFormat
from trio_mlx.tools.kimi_k2 import KimiK2Format
from trio_mlx.tools.llama3 import Llama3JsonFormat
from trio_mlx.tools.mistral import MistralFormat
from trio_mlx.tools.qwen3_coder import Qwen3CoderFormat

FORMATS: dict[str, type[ToolFormat]] = {
    f.name: f
    for f in (
        HermesFormat,
        Qwen3CoderFormat,
        Llama3JsonFormat,
        MistralFormat,
        DeepSeekFormat,
        GLM45Format,
        KimiK2Format,
        HarmonyFormat,
        Gemma3Format,
    )
}
#: Other names people know these formats by (vLLM's parser names among them).
ALIASES = {
    "qwen": "hermes",
    "qwen2_5": "hermes",
    "qwen3": "hermes",
    "llama3": "llama3_json",
    "llama": "llama3_json",
    "deepseek": "deepseek_v3",
    "deepseek_r1": "deepseek_v3",
    "deepseek_v31": "deepseek_v3",
    "glm4_moe": "glm45",
    "glm47": "glm45",
    "kimi": "kimi_k2",
    "gpt_oss": "harmony",
    "openai": "harmony",
    "gemma": "gemma3",
    "pythonic": "gemma3",
}
#: Tool-call markup some tokenizers hold as special tokens: the detokenizer keeps these in the
#: text (`text.detokenizer.decoder_for`) so that the parsers see them.
MARKUP_TOKENS = frozenset(
    {
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "<|python_tag|>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_section_begin|>",
        "<|tool_call_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|constrain|>",
        "<|end|>",
        "<|call|>",
    }
)
AUTO = "auto"
#: What `--tool-call-parser` accepts.
PARSER_CHOICES = (AUTO, *FORMATS)

# Markup a template renders for calls, most specific first (several templates use `<tool_call>`).
_SIGNATURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"), "kimi_k2"),
    (("<｜tool▁calls▁begin｜>", "tool▁calls▁begin"), "deepseek_v3"),
    (("<|channel|>", "to=functions."), "harmony"),
    (("<arg_key>",), "glm45"),
    (("<function=", "<parameter="), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>", "<|eom_id|>", "<|start_header_id|>ipython"), "llama3_json"),
)


def template_text(chat_template: Any) -> str:
    """A tokenizer's `chat_template` as one text (some tokenizers keep several, by name)."""
    if isinstance(chat_template, Mapping):
        return "\n".join(str(v) for v in chat_template.values())
    return str(chat_template or "")


def detect_format(template: str) -> str | None:
    """The format whose markup `template` renders, or None."""
    for markers, name in _SIGNATURES:
        if any(marker in template for marker in markers):
            return name
    return None


def template_knows_tools(template: str) -> bool:
    """Whether the template does anything with the `tools` it is given."""
    return "tools" in template


def format_class(name: str, template: str) -> type[ToolFormat] | None:
    """The format `--tool-call-parser NAME` means for a model with this template: "auto"
    detects it (None when the template shows none); an unknown name raises `ValueError`."""
    if name == AUTO:
        detected = detect_format(template)
        return None if detected is None else FORMATS[detected]
    canonical = ALIASES.get(name, name)
    if canonical not in FORMATS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_CHOICES)}"
        )
    return FORMATS[canonical]
