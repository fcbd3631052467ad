"""The default model's fetch notices ("not installed; fetching it once", "saved ...") are said
once: through logging where a handler shows trio-mlx's INFO lines, else printed on stderr."""

from __future__ import annotations

import logging

import pytest


def test_the_fetch_notice_is_said_once_through_logging_where_it_shows(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from trio_mlx.engine import default_model

    with caplog.at_level(logging.INFO, logger="trio_mlx"):
        default_model._announce("trio-mlx: saved /x")
    assert [r.getMessage() for r in caplog.records] == ["saved /x"]
    assert capsys.readouterr().err == ""


def test_the_fetch_notice_is_printed_once_where_logging_would_hide_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trio_mlx.engine import default_model

    logger = logging.getLogger("trio_mlx.engine.default_model")
    before = logger.level
    logger.setLevel(logging.WARNING)  # as in a program that never configured logging
    try:
        default_model._announce("trio-mlx: saved /x")
    finally:
        logger.setLevel(before)
    assert capsys.readouterr().err == "trio-mlx: saved /x\n"
