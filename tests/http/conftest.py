"""Fixtures: an HTTP server over the tiny model, in the test's own Trio run, and clients."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from servers import running_server
from trio_mlx.http.server import RunningServer


@pytest.fixture
async def server(tiny_model_dir: Path) -> AsyncIterator[RunningServer]:
    async with running_server(tiny_model_dir, served_model_names=("tiny", "tiny-alias")) as srv:
        yield srv


@pytest.fixture
async def http(server: RunningServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30
    ) as client:
        yield client
