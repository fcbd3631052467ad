"""`reasoning_content` on /v1/chat/completions: in the answer, for a model whose tokenizer has
thinking tags, streaming and not; in an earlier assistant turn, rendered by a template that takes
it and refused (never dropped) by one that does not; `chat_template_kwargs` reaching the template
and `thinking_token_budget` validated."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx

from model_wrappers import ScriptedModel
from servers import running_server
from sse import chunks
from trio_mlx.engine.loading import LoadedModel, load_model

MESSAGES = [{"role": "user", "content": "Capital of France?"}]
SCRIPT_TEXT = "<think>Paris is in France.</think>It is Paris."


def thinking_loader(prompt_len: int, script: list[int]) -> Any:
    """The tiny model scripted to think then answer, its tokenizer declaring `<think>` tags."""

    def loader(spec: str | Path | None) -> LoadedModel:
        loaded = load_model(spec)
        tokenizer = loaded.tokenizer
        tokenizer._think_start, tokenizer._think_end = "<think>", "</think>"
        tokenizer._think_start_tokens = tuple(tokenizer.encode("<think>", add_special_tokens=False))
        tokenizer._think_end_tokens = tuple(tokenizer.encode("</think>", add_special_tokens=False))
        return dataclasses.replace(loaded, model=ScriptedModel(loaded.model, prompt_len, script))

    return loader


async def test_reasoning_content_streaming_and_not(tiny_model_dir: Path) -> None:
    probe = load_model(tiny_model_dir)
    script = probe.tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    prompt = probe.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    if isinstance(prompt, dict):
        prompt = prompt["input_ids"]
    loader = thinking_loader(len(prompt), script)
    body = {"messages": MESSAGES, "max_tokens": len(script), "temperature": 0}
    async with (
        running_server(tiny_model_dir, loader=loader) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        whole = (await http.post("/v1/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] == "Paris is in France."
        assert message["content"] == "It is Paris."
        streamed = chunks(
            (await http.post("/v1/chat/completions", json={**body, "stream": True})).text
        )
        deltas = [e["choices"][0]["delta"] for e in streamed]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris is in France."
        assert "".join(d.get("content", "") for d in deltas) == "It is Paris."
        assert all("<think>" not in d.get("content", "") for d in deltas)
        # The thinking options are validated and reach the engine.
        refused = await http.post(
            "/v1/chat/completions", json={**body, "thinking_token_budget": -1}
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "thinking_token_budget"


#: A chat template that renders earlier turns' reasoning and a `mood` keyword.
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if mood %}mood: {{ mood }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURNS = [
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "It is Paris, surely."},
    {"role": "user", "content": "And of Italy?"},
]


def template_loader(spec: str | Path | None) -> LoadedModel:
    loaded = load_model(spec)
    loaded.tokenizer._tokenizer.chat_template = REASONING_TEMPLATE
    return loaded


async def test_earlier_reasoning_is_refused_when_the_template_would_drop_it(
    tiny_model_dir: Path,
) -> None:
    async with (
        running_server(tiny_model_dir) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        reply = await http.post("/v1/chat/completions", json={"messages": TURNS, "max_tokens": 2})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "messages[1].reasoning_content"
        assert "does not render reasoning" in error["message"]


async def test_earlier_reasoning_and_template_kwargs_reach_a_template_that_takes_them(
    tiny_model_dir: Path,
) -> None:
    async def prompt_tokens(http: httpx.AsyncClient, messages: Any, **extra: Any) -> int:
        body = {"messages": messages, "max_tokens": 1, "temperature": 0, **extra}
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens"])

    probe = template_loader(tiny_model_dir).tokenizer
    reasoning = probe.encode("<think>It is Paris, surely.</think>", add_special_tokens=False)
    mood = probe.encode("mood: calm\n", add_special_tokens=False)
    plain = [dict(m) for m in TURNS]
    del plain[1]["reasoning_content"]
    async with (
        running_server(tiny_model_dir, loader=template_loader) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        without = await prompt_tokens(http, plain)
        assert await prompt_tokens(http, TURNS) == without + len(reasoning)
        calm = await prompt_tokens(http, plain, chat_template_kwargs={"mood": "calm"})
        assert calm == without + len(mood)
