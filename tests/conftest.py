"""Shared fixtures: the tiny random model (built once per run) and an engine over it."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The suite checks bit-exact equalities (a cached prefix against a fresh prefill of another
# length), which MLX's reference BLAS keeps and OpenBLAS's shape-dependent blocking does not.
# tests/test_cpu_path.py runs the OpenBLAS path in subprocesses without this.
os.environ.setdefault("TRIO_MLX_BLAS", "reference")

import trio_mlx
from tiny_model import build_tiny_model
from tiny_vlm import build_tiny_vlm
from trio_mlx.engine import sampling


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="run the reliability suite at full size (minutes) instead of its bounded CI form",
    )


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under `--long`: reliability tests scale their counts up."""
    return bool(request.config.getoption("--long"))


@pytest.fixture(autouse=True)
def unseeded_draws_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that name no seed draw from seeds 1, 2, 3, ... (in the order their samplers are
    made) instead of fresh random ones, in every test. A request sampled at temperature > 0
    without a seed (the Anthropic route's default: temperature 1.0) otherwise draws differently
    on each run, and a test whose outcome rests on the random model's sampled choices passes
    or fails with luck (the forced-call test fixed in 10bec54 failed ~1 run in 20, with or
    without CPU load). Pinned, such a test fails or passes every time. docs/determinism.md."""
    counter = itertools.count(1)
    monkeypatch.setattr(sampling, "fresh_seed", lambda: next(counter))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL (tests/tiny_vlm.py), built once per run."""
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")


@pytest.fixture(params=["pipelined", "read-at-once"])
def batch_pipeline(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways the batched route steps (`engine.batch_step.pipelining_pays`): the next step queued
    before the last is read (a GPU's), or each step read as soon as it is queued (the CPU's).
    Tests that take this fixture run in each; True where pipelined."""
    monkeypatch.setenv("TRIO_MLX_BATCH_PIPELINE", "on" if request.param == "pipelined" else "off")
    return bool(request.param == "pipelined")


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[trio_mlx.Engine]:
    async with trio_mlx.open_engine(tiny_model_dir) as engine:
        yield engine
