"""Operations routes: /metrics, the prefix-cache routes, and cached tokens in usage."""

from __future__ import annotations

import re

import httpx

from servers import eventually
from trio_mlx.http.server import RunningServer

CHAT = "/v1/chat/completions"
SYSTEM = "You are a careful assistant. " * 20


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^trio_mlx:{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, f"{name} {labels} not in /metrics"
    return float(match.group(1))


async def test_metrics_count_requests(http: httpx.AsyncClient) -> None:
    before = (await http.get("/metrics")).text
    assert sample(before, "num_requests_running") == 0
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    await http.post(CHAT, json=body)
    await http.post(CHAT, json={**body, "stream": True})
    response = await http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert sample(text, "generation_tokens_total") - sample(before, "generation_tokens_total") == 10
    assert sample(text, "request_success_total", 'finished_reason="length"') >= 2
    assert 'request_success_total{model_name="tiny",finished_reason="abort"' not in text
    assert sample(text, "request_aborted_total") == sample(before, "request_aborted_total")
    assert sample(text, "e2e_request_latency_seconds_count") >= 2
    assert sample(text, "time_to_first_token_seconds_bucket", 'le="+Inf"') >= 2
    assert "# TYPE trio_mlx:inter_token_latency_seconds histogram" in text


async def test_cached_prefix_is_reported_and_clearable(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    first = (await http.post(CHAT, json=body)).json()
    again = (await http.post(CHAT, json=body)).json()
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["usage"]["prompt_tokens"]
    stats = (await http.get("/v1/cache/stats")).json()
    assert stats["enabled"] and stats["hits"] >= 1 and stats["entries"] >= 1
    metrics = (await http.get("/metrics")).text
    assert sample(metrics, "prefix_cache_hits_total") >= 1
    cleared = await http.delete("/v1/cache")
    assert cleared.status_code == 200 and cleared.json()["entries"] >= 1
    assert (await http.get("/v1/cache/stats")).json()["entries"] == 0
    cold = (await http.post(CHAT, json=body)).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


async def test_an_aborted_request_is_counted_as_aborted_not_as_a_success(
    http: httpx.AsyncClient,
) -> None:
    before = (await http.get("/metrics")).text
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
    async with http.stream("POST", CHAT, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break  # the client goes away after the first chunk

    async def counted() -> bool:
        text = (await http.get("/metrics")).text
        return sample(text, "request_aborted_total") == sample(before, "request_aborted_total") + 1

    await eventually(counted)
    text = (await http.get("/metrics")).text
    assert 'finished_reason="abort"' not in text
    assert sample(text, "request_failed_total") == 0
