"""SpecPrefill over HTTP: the `trio-mlx serve` flags reach the engine's settings, and the
per-request `specprefill` / `specprefill_keep_pct` extra body fields of the official client
decide which requests are sparsely prefilled (counted in the engine's statistics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from servers import running_server
from tiny_model import build_tiny_model
from trio_mlx.cli import build_parser
from trio_mlx.http.server import RunningServer, settings_from_args


def specprefill_of(srv: RunningServer) -> Any:
    engine = srv.state.engine
    assert engine is not None
    return engine.get_stats()["specprefill"]


def test_the_serve_flags_set_the_engine_options(tiny_model_dir: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            str(tiny_model_dir),
            "--specprefill",
            "--specprefill-threshold",
            "100",
            "--specprefill-keep-pct",
            "0.4",
            "--specprefill-backbone-pct",
            "0.1",
            "--specprefill-draft-model",
            str(tiny_model_dir),
        ]
    )
    options = settings_from_args(args).engine_options
    assert options["specprefill_enabled"] is True
    assert options["specprefill_threshold"] == 100
    assert options["specprefill_keep_pct"] == 0.4
    assert options["specprefill_backbone_pct"] == 0.1
    assert options["specprefill_draft_model"] == tiny_model_dir


async def test_the_extra_body_fields_choose_specprefill_per_request(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    scorer = build_tiny_model(tmp_path / "scorer", seed=7, hidden_size=32, intermediate_size=64)
    words = " ".join(f"item{i}" for i in range(200))
    options = {
        "specprefill_enabled": True,
        "specprefill_threshold": 128,
        "specprefill_draft_model": scorer,
        "max_num_seqs": 1,
    }
    async with running_server(tiny_model_dir, served_model_names=("tiny",), **options) as srv:
        async with openai.AsyncOpenAI(
            base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60
        ) as client:
            await client.completions.create(model="tiny", prompt=words, max_tokens=4)
            stats = specprefill_of(srv)
            assert stats["requests"] == 1
            first_kept = stats["kept_tokens"]
            await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": words}],
                max_tokens=4,
                extra_body={"specprefill": False},
            )
            assert specprefill_of(srv)["requests"] == 1
            await client.completions.create(
                model="tiny",
                prompt=words,
                max_tokens=4,
                extra_body={"specprefill_keep_pct": 1.0},
            )
            stats = specprefill_of(srv)
            assert stats["requests"] == 2
            assert stats["kept_tokens"] - first_kept > first_kept
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(
                    model="tiny",
                    prompt=words,
                    max_tokens=4,
                    extra_body={"specprefill_keep_pct": 2.0},
                )
            assert "specprefill_keep_pct" in str(info.value)
