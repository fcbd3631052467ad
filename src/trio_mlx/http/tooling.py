"""Function tools on the generation routes: what the prompt offers, how the reply is read.

`plan_tools` decides, before anything is admitted, how one request's tools reach the model and
how its reply is read (a `ToolPlan`):

- `tool_choice: "none"` (or no tools): nothing is offered and nothing is parsed (but gpt-oss's
  harmony channels, which every reply of that model has); earlier calls and results in the
  conversation are still rendered.
- a chat template that renders tools (it uses `tools`): the tools go to the template, and the
  reply is read by the parser of the template's format (`--tool-call-parser auto`) or the one the
  operator named; a format the registry does not know leaves the reply as content.
- a template that knows no tools (the bundled SmolLM2's): the tools are described in a system
  prompt (`trio_mlx.tools.fallback`, the Hermes `<tool_call>` format or the named format's own
  `fallback_syntax`), earlier calls and results are written in the Hermes format, and the reply
  is read by the Hermes parser (or the named one).
- `tool_choice: "required"` or a named function: checked against the tools (an unknown name is a
  400 on `tool_choice`), stated in the prompt, and ENFORCED: the plan's options carry the
  grammar of `forced_tool_calls_format` as the request's `output_format`, so the model can only
  write a call of an allowed function (`{"name": ..., "arguments": {...}}`, an array of them when
  `parallel_tool_calls` is not false) whose arguments are valid against that function's
  parameters schema. That JSON is never content: the plan's reader is a `ForcedCallReader`.

`CallReader` reads one reply, whole or streamed, and keeps only the first call when
`parallel_tool_calls` is false; `ForcedCallReader` is the same interface over the forced JSON
(`tools.forced`). The routes (chat completions, Responses, Anthropic messages) use either one
the same way, through `ToolPlan.reader()`.

A forced reply cut short by `max_tokens` ends with finish reason "length" (Responses:
`incomplete`). Whole, it carries only the calls whose JSON is complete (none for a single call):
no call with broken arguments. Streamed, the call deltas sent before the cut stay sent (the
arguments of the last one then do not parse: the finish reason says why), as OpenAI does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trio_mlx.errors import InvalidRequest
from trio_mlx.http.errors import APIError, required_text
from trio_mlx.http.objects import ChatDelta, FunctionCallDelta, ToolCallDelta
from trio_mlx.structured.tool_choice import forced_tool_calls_format as structured_forced_format
from trio_mlx.tools import (
    ArgumentsAppended,
    CallStarted,
    Content,
    ParsedOutput,
    Reasoning,
    ToolCall,
    ToolEvent,
    ToolFormat,
    collect,
    format_class,
    template_knows_tools,
    template_text,
)
from trio_mlx.tools.fallback import (
    HERMES_SYNTAX,
    calls_as_text,
    result_as_text,
    tools_system_prompt,
)
from trio_mlx.tools.forced import ForcedCallStream
from trio_mlx.tools.harmony import HarmonyFormat
from trio_mlx.tools.hermes import HermesFormat


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(tool["function"]["name"]) for tool in tools]


def forced_function(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    *,
    param: str = "tool_choice",
    nested: bool = True,
) -> str | None:
    """What `tool_choice` demands: None ("auto", "none", absent), "required", or the name of
    the function it names (which must be one of `tools`: else a 400 naming `param`). `nested`:
    chat's shape (`{"type": "function", "function": {"name": ...}}`); else the Responses API's
    (`{"type": "function", "name": ...}`)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param=param)
        return "required"
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function") if nested else tool_choice
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            shape = (
                '{"type": "function", "function": {"name": ...}}'
                if nested
                else '{"type": "function", "name": ...}'
            )
            raise APIError(
                400, f"tool_choice must be 'none', 'auto', 'required' or {shape}", param=param
            )
        if name not in tool_names(tools or ()):
            raise APIError(
                400,
                f"tool_choice names the function {name!r}, which is not among the tools",
                param=param,
                code="invalid_value",
            )
        return name
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or an object", param=param)


def forced_tool_calls_format(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    forced: str,
    *,
    parallel: bool,
    call_format: ToolFormat | None = None,
) -> dict[str, Any]:
    """Generation options that make the reply a call of the tools `forced` demands ("required":
    any of them; else the function of that name), with arguments that match the function's JSON
    Schema: the one place where `tool_choice` "required" and named reach the sampler. The
    options are `{"output_format": ...}`, the grammar of `structured.forced_tool_calls_format`
    (one call, or with `parallel` a non-empty array of calls); the model writes the call as that
    JSON whatever `call_format` its template uses, and `ForcedCallReader` reads it. A tool whose
    parameters are not a schema object is a 400 naming it (`tools[i].function.parameters`).
    `tokenizer` and `call_format` are not needed by the grammar (it is compiled per tokenizer
    when the request is prepared)."""
    try:
        grammar = structured_forced_format(tools, forced, parallel, param="tool_choice")
    except InvalidRequest as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from exc
    return {"output_format": grammar}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools reach the model and how its reply is read."""

    #: The conversation as the chat template takes it.
    messages: list[dict[str, Any]]
    #: Tools for the template's `tools` (None: not offered through the template).
    template_tools: list[dict[str, Any]] | None = None
    #: The reply's format (None: the reply is content, nothing is parsed).
    call_format: ToolFormat | None = None
    parallel: bool = True
    #: "required", a function name, or None (see `forced_function`).
    forced: str | None = None
    #: Extra generation options (from `forced_tool_calls_format`).
    options: dict[str, Any] = field(default_factory=dict)

    def reader(self) -> CallReader | None:
        """A fresh reader of one reply (None: the reply is all content). A forced call (the
        grammar in `options`) is read as the forced JSON, whatever `call_format` is."""
        if self.forced is not None and "output_format" in self.options:
            return ForcedCallReader(self.parallel)
        return None if self.call_format is None else CallReader(self.call_format, self.parallel)


def plan_tools(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    *,
    tokenizer: Any,
    parser: str,
    param: str = "tool_choice",
    nested_choice: bool = True,
) -> ToolPlan:
    """The `ToolPlan` of a request (see the module); raises `APIError` for a bad `tool_choice`.
    `messages` are template messages (`chat.template_messages`); `tools` are in the chat shape
    (`{"type": "function", "function": {...}}`)."""
    forced = forced_function(tools, tool_choice, param=param, nested=nested_choice)
    template = template_text(getattr(tokenizer, "chat_template", None))
    knows_tools = template_knows_tools(template)
    conversation = _history(messages, knows_tools)
    if not tools or tool_choice == "none":
        # gpt-oss writes every reply in channels (its thinking in `analysis`): read it so,
        # with or without tools.
        harmony = format_class(parser, template) if parser in ("auto", "harmony") else None
        if harmony is HarmonyFormat:
            return ToolPlan(conversation, call_format=HarmonyFormat())
        return ToolPlan(conversation)
    parallel = parallel_tool_calls is not False
    instruction = _instruction(forced, parallel)
    try:
        named = format_class(parser, template)
    except ValueError as exc:  # the server's setting is checked at start-up; a library caller's
        raise APIError(500, str(exc)) from exc
    if knows_tools:
        if instruction:
            conversation = _with_system_text(conversation, instruction)
        call_format = named(tools) if named is not None else None
        plan_tools_list: list[dict[str, Any]] | None = tools
    else:
        chosen = named if parser != "auto" and named is not None else HermesFormat
        syntax = chosen.fallback_syntax or HERMES_SYNTAX
        prompt = tools_system_prompt(tools, instruction, syntax)
        conversation = _with_system_text(conversation, prompt)
        call_format = chosen(tools)
        plan_tools_list = None
    options: dict[str, Any] = {}
    if forced is not None:
        options = forced_tool_calls_format(
            tokenizer, tools, forced, parallel=parallel, call_format=call_format
        )
    return ToolPlan(conversation, plan_tools_list, call_format, parallel, forced, options)


def _instruction(forced: str | None, parallel: bool) -> str | None:
    if forced == "required":
        text = "You must answer with a call of one of the functions"
    elif forced is not None:
        text = f"You must answer with a call of the function {forced}"
    else:
        return "Call at most one function at a time." if not parallel else None
    return text + (", one call only." if not parallel else ".")


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _history(messages: list[dict[str, Any]], knows_tools: bool) -> list[dict[str, Any]]:
    """Earlier calls and results as the template takes them: call arguments as objects (what
    templates written for Hugging Face's convention expect), or, for a template that knows no
    tools, written out in the fallback format."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:  # checked on any message; only an assistant's are calls
            parsed = _calls(calls, f"messages[{i}].tool_calls")
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            if message["role"] == "assistant" and knows_tools:
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": _arguments_object(call)},
                    }
                    for call in parsed
                ]
            elif message["role"] == "assistant":
                text = calls_as_text(parsed)
                message["content"] = f"{message['content']}\n{text}" if message["content"] else text
        if message["role"] == "tool" and not knows_tools:
            content = message["content"]
            if isinstance(content, list):  # media parts (chat.template_messages keeps a list)
                j = next(j for j, part in enumerate(content) if part.get("type") != "text")
                raise APIError(
                    400,
                    "this model's chat template does not render tool messages, so a tool "
                    "result can hold text only (it is written into the prompt as text)",
                    param=f"messages[{i}].content[{j}]",
                    code="unsupported_value",
                )
            message = {"role": "user", "content": result_as_text(content)}
        out.append(message)
    return out


def _calls(calls: Any, param: str) -> list[ToolCall]:
    if not isinstance(calls, list):
        raise APIError(400, "tool_calls must be a list", param=param)
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, Mapping):
            raise APIError(400, "a tool call must be an object", param=where)
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise APIError(
                400,
                "a tool call needs function",
                param=f"{where}.function",
                code="missing_required_parameter",
            )
        name = required_text(
            function, "name", "a tool call needs function.name", f"{where}.function.name"
        )
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise APIError(
                400,
                "function.arguments must be a string (JSON text)",
                param=f"{where}.function.arguments",
            )
        call_id = call.get("id", f"call_{j}")
        if not isinstance(call_id, str):
            raise APIError(400, "a tool call's id must be a string", param=f"{where}.id")
        if call.get("type", "function") != "function":
            raise APIError(400, "a tool call's type must be 'function'", param=f"{where}.type")
        out.append(ToolCall(name, arguments, call_id))
    return out


def _arguments_object(call: ToolCall) -> Any:
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return call.arguments
    return value if isinstance(value, dict) else call.arguments


class CallReader:
    """Reads one reply in a format: `feed`/`finish` for a stream, `parse` for a whole text.
    With `parallel` false, calls after the first are dropped."""

    def __init__(self, call_format: ToolFormat, parallel: bool) -> None:
        self._stream = call_format.stream()
        self._parallel = parallel
        self.calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        return self._keep(self._stream.feed(text)) if text else []

    def finish(self) -> list[ToolEvent]:
        return self._keep(self._stream.finish())

    def parse(self, text: str) -> ParsedOutput:
        return collect([*self.feed(text), *self.finish()])

    def _keep(self, events: list[ToolEvent]) -> list[ToolEvent]:
        kept = []
        for event in events:
            if isinstance(event, CallStarted | ArgumentsAppended):
                if not self._parallel and event.index > 0:
                    continue
                if isinstance(event, CallStarted):
                    self.calls += 1
            kept.append(event)
        return kept


class ForcedCallReader(CallReader):
    """`CallReader` for a reply generated under the forced tool-call grammar
    (`forced_tool_calls_format`): the reply is calls only, never content. `calls` counts the
    complete calls (their JSON closed), so a reply cut inside its first call made none; `parse`
    leaves a call cut short out."""

    def __init__(self, parallel: bool) -> None:
        self._forced = ForcedCallStream()
        self._stream = self._forced
        self._parallel = parallel
        self.calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        events = self._keep(self._forced.feed(text)) if text else []
        self.calls = self._forced.complete if self._parallel else min(self._forced.complete, 1)
        return events

    def parse(self, text: str) -> ParsedOutput:
        parsed = collect([*self.feed(text), *self.finish()])
        return ParsedOutput("", parsed.calls[: self.calls], parsed.reasoning)


def chat_deltas(events: Sequence[ToolEvent]) -> list[ChatDelta]:
    """Stream events as chat chunk deltas: content and reasoning text, a call's first delta
    (index, id, type, name, empty arguments), then its argument pieces; consecutive pieces of
    one kind are joined into one delta."""
    deltas: list[ChatDelta] = []
    for event in events:
        last = deltas[-1] if deltas else None
        if isinstance(event, Content):
            if last is not None and last.content is not None and last.tool_calls is None:
                last.content += event.text
            else:
                deltas.append(ChatDelta(content=event.text))
        elif isinstance(event, Reasoning):
            if last is not None and last.reasoning_content is not None:
                last.reasoning_content += event.text
            else:
                deltas.append(ChatDelta(reasoning_content=event.text))
        elif isinstance(event, CallStarted):
            function = FunctionCallDelta(name=event.name, arguments="")
            call = ToolCallDelta(index=event.index, id=event.id, type="function", function=function)
            deltas.append(ChatDelta(tool_calls=[call]))
        else:
            previous = last.tool_calls[-1] if last is not None and last.tool_calls else None
            if (
                previous is not None
                and previous.id is None  # a call's first delta carries no arguments
                and previous.index == event.index
                and previous.function is not None
            ):
                previous.function.arguments = (previous.function.arguments or "") + event.text
            else:
                piece = FunctionCallDelta(arguments=event.text)
                deltas.append(
                    ChatDelta(tool_calls=[ToolCallDelta(index=event.index, function=piece)])
                )
    return deltas
