"""Speculative decoding over HTTP: the official client sees the target's output, /v1/status
reports the acceptance rate and /metrics the drafted and accepted tokens."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai

from servers import running_server


def sample(text: str, name: str) -> float:
    match = re.search(rf"^trio_mlx:{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


async def test_a_self_draft_serves_the_same_completion_and_reports_its_acceptance(
    tiny_model_dir: Path,
) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    answers = []
    for draft in (None, tiny_model_dir):
        options = {} if draft is None else {"draft_model": draft, "num_draft_tokens": 3}
        async with running_server(tiny_model_dir, served_model_names=("tiny",), **options) as srv:
            async with openai.AsyncOpenAI(
                base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30
            ) as client:
                reply = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=20,
                    temperature=0,  # type: ignore[arg-type]
                )
                answers.append(reply.choices[0].message.content)
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                status = (await http.get("/v1/status")).json()
                metrics = (await http.get("/metrics")).text
        if draft is None:
            assert status["acceptance_rate"] is None
            assert "spec_decode" not in metrics
        else:
            assert status["acceptance_rate"] == 1.0
            assert status["speculative"]["num_draft_tokens"] == 3
            drafted = sample(metrics, "spec_decode_num_draft_tokens_total")
            assert drafted > 0
            assert sample(metrics, "spec_decode_num_accepted_tokens_total") == drafted
            assert sample(metrics, "spec_decode_acceptance_rate") == 1.0
    assert answers[0] == answers[1] and answers[0]
