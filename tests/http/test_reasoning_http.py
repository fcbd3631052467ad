"""`reasoning_content` on /v1/chat/completions: in the answer, for a model whose tokenizer has
thinking tags, streaming and not; in an earlier assistant turn, rendered by a template that takes
it and refused (never dropped) by one that does not; `chat_template_kwargs` reaching the template
and `thinking_token_budget` validated."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from model_wrappers import ScriptedModel
from servers import eventually, running_server
from sse import chunks, named_events
from tool_fixtures import scripted_server
from trio_mlx.engine.loading import LoadedModel, load_model

MESSAGES = [{"role": "user", "content": "Capital of France?"}]
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
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


# ---- the Responses API: reasoning items ---------------------------------------------------------

THOUGHT = "<think>Paris is in France.</think>"
ANSWER = "It is Paris."


async def test_responses_reasoning_item_whole_and_streamed(tiny_model_dir: Path) -> None:
    # The reasoning was dropped: the output held the answer's message only.
    async with scripted_server(tiny_model_dir, think_tags=True) as scripted:
        scripted.will_reply(THOUGHT + ANSWER, THOUGHT + ANSWER)
        thought_tokens = len(scripted.tokenizer.encode(THOUGHT, add_special_tokens=False))
        request: Any = {
            "model": "tiny",
            "input": "Capital of France?",
            "include": ["message.output_text.logprobs"],
        }
        async with scripted.openai_client() as client:
            whole = await client.responses.create(**request)
            async with client.responses.stream(**request) as stream:
                events = [event async for event in stream]
                streamed = await stream.get_final_response()
    assert whole.status == "completed" and whole.output_text == ANSWER
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.status == "completed"
    assert reasoning.summary == [] and reasoning.content is not None
    assert [(p.type, p.text) for p in reasoning.content] == [
        ("reasoning_text", "Paris is in France.")
    ]
    assert message.type == "message"
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs is not None
    assert [t.token for t in part.logprobs] == ["It", " is", " Paris", "."]  # no tag's
    assert whole.usage is not None
    assert whole.usage.output_tokens_details.reasoning_tokens == thought_tokens
    assert whole.usage.output_tokens == thought_tokens + len(part.logprobs)

    kinds = [event.type for event in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[first_text - 5 : first_text] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Paris is in France."
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    assert [item.type for item in streamed.output] == ["reasoning", "message"]
    assert streamed.output[0].content == reasoning.content  # type: ignore[union-attr]
    streamed_part = streamed.output[1].content[0]  # type: ignore[union-attr]
    assert streamed_part.text == ANSWER  # type: ignore[union-attr]
    assert streamed_part.logprobs == part.logprobs  # type: ignore[union-attr]
    assert streamed.usage == whole.usage


REASONING_ITEM = {
    "type": "reasoning",
    "id": "rs-1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "It is Paris, surely."}],
}
ITEMS: Any = [
    {"role": "user", "content": "Capital of France?"},
    REASONING_ITEM,
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


async def test_responses_reasoning_items_sent_back(tiny_model_dir: Path) -> None:
    async def prompt_tokens(http: httpx.AsyncClient, route: str, body: Any) -> int:
        reply = await http.post(route, json={**body, "temperature": 0})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        return int(usage.get("prompt_tokens", usage.get("input_tokens")))

    without = [item for item in ITEMS if item is not REASONING_ITEM]
    chat = {"messages": TURNS, "max_tokens": 1}
    # A template that renders reasoning: the item is the next assistant turn's, as chat's
    # `reasoning_content` is.
    async with (
        running_server(tiny_model_dir, loader=template_loader) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        plain = await prompt_tokens(http, RESPONSES, {"input": without, "max_output_tokens": 1})
        kept = await prompt_tokens(http, RESPONSES, {"input": ITEMS, "max_output_tokens": 1})
        assert kept > plain and kept == await prompt_tokens(http, CHAT, chat)
    # One that does not: left out, as the template leaves earlier reasoning out (chat's
    # `reasoning_content` is refused there, but the Responses API hands reasoning items back
    # to be sent again); a malformed one is still a 400 naming it.
    async with (
        running_server(tiny_model_dir) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        plain = await prompt_tokens(http, RESPONSES, {"input": without, "max_output_tokens": 1})
        assert plain == await prompt_tokens(
            http, RESPONSES, {"input": ITEMS, "max_output_tokens": 1}
        )
        for content, param in (
            ([{"type": "input_text", "text": "x"}], "input[1].content[0]"),
            ([{"type": "reasoning_text"}], "input[1].content[0]"),
            ("x", "input[1].content"),
        ):
            bad = [ITEMS[0], {**REASONING_ITEM, "content": content}, *ITEMS[2:]]
            reply = await http.post(RESPONSES, json={"input": bad})
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == param


async def test_responses_output_sent_back_as_input(tiny_model_dir: Path) -> None:
    # What the official client hands back (the output items as they are) is served.
    async with scripted_server(tiny_model_dir, think_tags=True) as scripted:
        scripted.will_reply(THOUGHT + ANSWER, ANSWER)
        async with scripted.openai_client() as client:
            first = await client.responses.create(model="tiny", input="Capital of France?")
            assert [item.type for item in first.output] == ["reasoning", "message"]
            second = await client.responses.create(
                model="tiny",
                input=[
                    {"role": "user", "content": "Capital of France?"},
                    *[item.model_dump(exclude_none=True) for item in first.output],  # type: ignore[misc]
                    {"role": "user", "content": "And of Italy?"},
                ],
            )
    assert second.output_text == ANSWER
    assert "Paris is in France" not in scripted.prompt()  # the template renders no reasoning
    assert "<|im_start|>assistant\nIt is Paris.<|im_end|>" in scripted.prompt()


async def test_responses_reasoning_told_apart_in_outputs_of_many_tokens(
    tiny_model_dir: Path,
) -> None:
    # A reader that falls behind gets many tokens in one output (the runner goes on while the
    # event loop is held): tokens of the reasoning, its end tag and the text come together, and
    # are told apart all the same.
    body = {"input": "Capital of France?", "include": ["message.output_text.logprobs"]}
    async with scripted_server(tiny_model_dir, think_tags=True) as scripted:
        thought_tokens = len(scripted.tokenizer.encode(THOUGHT, add_special_tokens=False))
        url = scripted.server.url

        def post(stream: bool) -> httpx.Response:
            with httpx.Client(base_url=url, timeout=30) as http:
                return http.post(RESPONSES, json={**body, "stream": stream})

        def generated() -> int:
            return int(scripted.engine.get_stats()["runner"]["generated_tokens"])

        script = len(scripted.tokenizer.encode(THOUGHT + ANSWER, add_special_tokens=False))
        replies = []
        for stream in (False, True):
            scripted.will_reply(THOUGHT + ANSWER)
            before = generated()
            async with trio.open_nursery() as nursery:

                async def call(stream: bool = stream) -> None:
                    replies.append(await trio.to_thread.run_sync(post, stream))

                nursery.start_soon(call)
                stats = scripted.engine.get_stats
                await eventually(lambda: stats()["runner"]["requests_in_flight"] == 1)  # noqa: B023
                # The event loop held (a blocking wait) while the runner writes the reply.
                deadline = time.monotonic() + 30
                while generated() < before + script and time.monotonic() < deadline:
                    time.sleep(0.01)
    whole, streamed = replies
    events = named_events(streamed.text)
    pieces = [d for n, d in events if n.endswith("_text.delta")]
    assert len(pieces) < script / 2  # outputs of many tokens
    final = events[-1][1]["response"]
    for response in (whole.json(), final):
        reasoning, message = response["output"]
        assert reasoning["content"][0]["text"] == "Paris is in France."
        part = message["content"][0]
        assert part["text"] == ANSWER
        assert [t["token"] for t in part["logprobs"]] == ["It", " is", " Paris", "."]
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == thought_tokens
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    assert [t["token"] for d in deltas for t in d["logprobs"]] == ["It", " is", " Paris", "."]
