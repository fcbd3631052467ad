"""Opening an engine leaves the host process as it found it unless the caller asks: the GIL
switch interval, MLX's CUDA attention-graph cache and CUDA-graph variables and the garbage
collector's frozen objects are process-wide, so only an explicit `EngineConfig` option (which
`trio-mlx serve` sets, or its user) changes them."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

import trio_mlx
from trio_mlx.config import SERVER_PROCESS_SETTINGS
from trio_mlx.http.server import settings_from_args

VARIABLE = "MLX_CUDA_SDPA_CACHE_SIZE"
GRAPHS = "MLX_USE_CUDA_GRAPHS"


async def test_opening_an_engine_changes_nothing_process_wide_by_default(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.delenv(GRAPHS, raising=False)
    interval = sys.getswitchinterval()
    frozen = gc.get_freeze_count()
    async with trio_mlx.open_engine(tiny_model_dir) as engine:
        await engine.generate("Once", max_tokens=2, temperature=0)
        assert VARIABLE not in os.environ
        assert GRAPHS not in os.environ
        assert sys.getswitchinterval() == interval
        assert gc.get_freeze_count() == frozen


async def test_the_process_settings_apply_when_asked_and_the_interval_is_put_back(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    interval = sys.getswitchinterval()
    assert interval > 0.0005
    async with trio_mlx.open_engine(
        tiny_model_dir, gil_switch_interval=0.0005, cuda_sdpa_graph_cache=1024
    ):
        assert os.environ[VARIABLE] == "1024"
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == interval
    monkeypatch.setenv(VARIABLE, "7")  # a value the environment sets wins
    async with trio_mlx.open_engine(tiny_model_dir, cuda_sdpa_graph_cache=1024):
        assert os.environ[VARIABLE] == "7"


async def test_a_frozen_collector_scans_only_what_requests_create_and_is_thawed_on_close(
    tiny_model_dir: Path,
) -> None:
    """With `freeze_gc` the objects alive once the model is loaded (its modules, the tokenizer)
    are in the permanent generation while the engine serves: a full collection no longer
    scans them, and a request still runs; a second such engine closing first leaves them
    frozen for the first; the last one closing thaws them."""
    assert gc.get_freeze_count() == 0
    async with trio_mlx.open_engine(tiny_model_dir, freeze_gc=True) as engine:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the libraries, the model, the tokenizer
        out = await engine.generate("Once", max_tokens=3, temperature=0)
        assert len(out.tokens) == 3
        async with trio_mlx.open_engine(tiny_model_dir, freeze_gc=True):
            assert gc.get_freeze_count() > 10_000
        # the first still serves: still frozen (but for the few objects freed since)
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0


def test_the_server_asks_for_them() -> None:
    from trio_mlx.cli import build_parser

    args = build_parser().parse_args(["serve"])
    options = settings_from_args(args).engine_options
    assert {k: options[k] for k in SERVER_PROCESS_SETTINGS} == SERVER_PROCESS_SETTINGS


async def test_cuda_graphs_are_set_only_when_asked_and_the_environment_wins(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cuda_graphs` sets MLX's variable before the model loads (MLX reads it once, at its
    first graph); the server leaves it alone unless `--cuda-graphs` / `--no-cuda-graphs`."""
    from trio_mlx.cli import build_parser

    monkeypatch.delenv(GRAPHS, raising=False)
    async with trio_mlx.open_engine(tiny_model_dir, cuda_graphs=False) as engine:
        assert os.environ[GRAPHS] == "0"
        out = await engine.generate("Once", max_tokens=2, temperature=0)
        assert len(out.tokens) == 2
    monkeypatch.setenv(GRAPHS, "1")  # a value the environment sets wins
    async with trio_mlx.open_engine(tiny_model_dir, cuda_graphs=False):
        assert os.environ[GRAPHS] == "1"
    with pytest.raises(ValueError, match="cuda_graphs"):
        async with trio_mlx.open_engine(tiny_model_dir, cuda_graphs="off"):
            pass
    parser = build_parser()
    assert settings_from_args(parser.parse_args(["serve"])).engine_options["cuda_graphs"] is None
    off = parser.parse_args(["serve", "--no-cuda-graphs"])
    assert settings_from_args(off).engine_options["cuda_graphs"] is False
    on = parser.parse_args(["serve", "--cuda-graphs"])
    assert settings_from_args(on).engine_options["cuda_graphs"] is True
