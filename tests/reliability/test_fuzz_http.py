"""Hostile input against the real server: generated request bodies (hypothesis) and hand-made
malformed ones. Every answer must be a success that parses as its documented response model, or an
OpenAI-shaped 4xx error — never a 5xx — and the server keeps serving.

Bounded for CI (a fixed, derandomized set of examples); `pytest --long` explores many more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servers import running_server
from sse import chunks, named_events
from trio_mlx.http.objects import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
    ResponseObject,
    ResponseStreamEvent,
)

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
small_tokens = st.integers(min_value=1, max_value=6)
text_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.one_of(
            st.text(max_size=60),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)}),
                min_size=1,
                max_size=2,
            ),
        ),
    },
)
valid_sampling = {
    "model": st.sampled_from(["tiny", "tiny-alias"]),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "stop": st.one_of(
        st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)
    ),
    "seed": st.integers(min_value=0, max_value=2**31),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "top_k": st.integers(min_value=0, max_value=50),
    "min_p": st.floats(min_value=0, max_value=1),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "logit_bias": st.dictionaries(
        st.integers(min_value=0, max_value=1000).map(str),
        st.floats(min_value=-100, max_value=100),
        max_size=3,
    ),
    "user": st.text(max_size=10),
}
valid = {
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.lists(text_message, min_size=1, max_size=3), "max_tokens": small_tokens},
        optional={"logprobs": st.booleans(), "n": st.just(1), **valid_sampling},
    ),
    "/v1/completions": st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                st.text(min_size=1, max_size=40),
                st.lists(st.integers(min_value=0, max_value=40000), min_size=1, max_size=8),
            ),
            "max_tokens": small_tokens,
        },
        optional={
            "echo": st.booleans(),
            "logprobs": st.integers(min_value=0, max_value=5),
            **valid_sampling,
        },
    ),
    "/v1/responses": st.fixed_dictionaries(
        {
            "input": st.one_of(
                st.text(min_size=1, max_size=40), st.lists(text_message, min_size=1, max_size=3)
            ),
            "max_output_tokens": small_tokens,
        },
        optional={"instructions": st.text(max_size=20), **valid_sampling},
    ),
}
FIELDS = sorted(
    {
        *valid_sampling,
        "messages",
        "prompt",
        "input",
        "max_tokens",
        "max_output_tokens",
        "max_completion_tokens",
        "n",
        "logprobs",
        "top_logprobs",
        "echo",
        "tools",
        "instructions",
        "chat_template_kwargs",
        "stream_options",
    }
)
# A valid body with up to two fields replaced by anything at all.
mutations = st.dictionaries(
    st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), json_values, max_size=2
)
bodies = {
    route: st.tuples(strategy, mutations).map(lambda pair: {**pair[0], **pair[1]})
    for route, strategy in valid.items()
}


def check_answer(route: str, body: dict[str, Any], response: httpx.Response) -> None:
    assert response.status_code < 500, (route, body, response.status_code, response.text)
    if response.status_code != 200:
        ErrorResponse.model_validate(response.json())
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        if route == "/v1/responses":
            for name, data in named_events(response.text):
                assert ResponseStreamEvent.model_validate(data).type == name
            return
        for chunk in chunks(response.text):
            assert "error" not in chunk, chunk
            model = ChatCompletionChunk if route == "/v1/chat/completions" else Completion
            model.model_validate(chunk)
        return
    model = {
        "/v1/chat/completions": ChatCompletion,
        "/v1/completions": Completion,
        "/v1/responses": ResponseObject,
    }[route]
    model.model_validate(response.json())


def encode(body: dict[str, Any]) -> bytes:
    # Python's json writes NaN/Infinity (not JSON, but what a sloppy client sends).
    return json.dumps(body, allow_nan=True).encode()


async def test_generated_bodies_never_get_a_5xx(tiny_model_dir: Path, long_run: bool) -> None:
    examples = 1500 if long_run else 60
    async with running_server(tiny_model_dir, default_max_tokens=4) as server:
        statuses: list[int] = []

        def fuzz() -> int:
            seen = 0
            with httpx.Client(base_url=server.url, timeout=30) as http:

                @settings(
                    max_examples=examples,
                    deadline=None,
                    database=None,
                    derandomize=not long_run,
                    suppress_health_check=list(HealthCheck),
                )
                @given(
                    st.sampled_from(ROUTES).flatmap(
                        lambda route: st.tuples(st.just(route), bodies[route])
                    )
                )
                def one(case: tuple[str, dict[str, Any]]) -> None:
                    nonlocal seen
                    route, body = case
                    response = http.post(
                        route, content=encode(body), headers={"Content-Type": "application/json"}
                    )
                    check_answer(route, body, response)
                    statuses.append(response.status_code)
                    seen += 1

                one()
            return seen

        with trio.fail_after(1800 if long_run else 240):
            seen = await trio.to_thread.run_sync(fuzz)
        assert seen >= examples
        # The generator reaches both sides: served requests and refused ones.
        assert 200 in statuses and 400 in statuses, sorted(set(statuses))
        assert server.state.engine is not None and server.state.engine.is_alive


async def test_malformed_bodies(tiny_model_dir: Path) -> None:
    deep = "[" * 50_000 + "]" * 50_000
    parameters: dict[str, Any] = {}
    for _ in range(300):  # tool parameters nested 600 deep, rendered by the chat template
        parameters = {"type": "object", "properties": {"x": parameters}}
    nested_tools = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
    }
    cases: list[tuple[bytes, str]] = [
        (b"\xff\xfe\x00garbage", "application/json"),
        (b'{"messages": [{"role": "user", "content": "\xff"}]}', "application/json"),
        (deep.encode(), "application/json"),
        (b'{"messages": ' * 3000 + b"1" + b"}" * 3000, "application/json"),
        (b"", "application/json"),
        (b"null", "application/json"),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}
            ).encode(),
            "application/json",
        ),
        (json.dumps({"prompt": "hi", "stop": ["x"] * 10_000}).encode(), "application/json"),
        (json.dumps({"prompt": list(range(5000))}).encode(), "application/json"),
        (json.dumps(nested_tools).encode(), "application/json"),
        (b'{"prompt": "hi", "temperature": NaN}', "application/json"),
        (b'{"prompt": "hi", "max_tokens": Infinity}', "application/json"),
    ]
    async with (
        running_server(tiny_model_dir) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        for route in ROUTES:
            for raw, media in cases:
                response = await http.post(route, content=raw, headers={"Content-Type": media})
                assert 400 <= response.status_code < 500 or response.status_code == 200, (
                    route,
                    raw[:80],
                    response.status_code,
                    response.text[:300],
                )
                if response.status_code != 200:
                    ErrorResponse.model_validate(response.json())
        ok = await http.post(ROUTES[1], json={"prompt": "still here", "max_tokens": 2})
        assert ok.status_code == 200
