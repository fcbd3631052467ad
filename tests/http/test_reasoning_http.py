"""`reasoning_content` on /v1/chat/completions for a model whose tokenizer has thinking tags,
streaming and not, and `chat_template_kwargs` / `thinking_token_budget` reaching the engine."""

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
        kwargs = await http.post(
            "/v1/chat/completions",
            json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert kwargs.status_code == 200
