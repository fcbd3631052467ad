"""The openai SDK's structured-output helpers against `trio-mlx serve` on the real bundled
SmolLM2: `chat.completions.parse` and `responses.parse` with a pydantic model come back parsed
into that model (the SDK sends the model's strict JSON schema; the grammar enforces it)."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from servers import serve_process
from trio_mlx.engine.default_model import default_gguf_path


class Capital(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)


@pytest.mark.slow
def test_chat_completions_parse_and_responses_parse_on_the_bundled_model() -> None:
    with serve_process(default_gguf_path()) as (_process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        question = "What is the capital of France? Answer in JSON."
        completion = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": question}],
            response_format=Capital,
            max_tokens=80,
            temperature=0,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Capital)
        assert message.parsed.city  # valid under the schema (length, range) by construction

        response = client.responses.parse(
            model=model,
            input=question,
            text_format=Capital,
            max_output_tokens=80,
            temperature=0,
        )
        assert response.status == "completed"
        assert isinstance(response.output_parsed, Capital)
        assert response.output_parsed == message.parsed  # same prompt, greedy: the same answer
