"""Decoding and hashing a request's media (multimodal/media.py, multimodal/prepare.py), without a
model: the frames a video gives, how they are read, and the media hashes the caches key on."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from media_samples import write_video
from trio_mlx.multimodal.media import SEQUENTIAL_GAP, MediaPolicy, decode_video, sample_indices
from trio_mlx.multimodal.prepare import media_hashes


def seek_each(path: Path, picks: Sequence[int]) -> np.ndarray:
    """The frames a seek to each pick gives (mlx-vlm's `load_video`, and `decode_video` before
    it read in order), as (frames, 3, height, width) RGB."""
    import cv2

    capture = cv2.VideoCapture(str(path))
    frames = []
    for index in picks:
        capture.set(cv2.CAP_PROP_POS_FRAMES, index)
        ok, frame = capture.read()
        assert ok
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    capture.release()
    return np.stack(frames).transpose(0, 3, 1, 2)


@pytest.fixture
def seeks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The frame positions OpenCV is asked to seek to while the test runs."""
    import cv2

    asked: list[int] = []
    real = cv2.VideoCapture

    class Counting:
        def __init__(self, *args: Any) -> None:
            self._capture = real(*args)

        def set(self, prop: int, value: float) -> bool:
            if prop == cv2.CAP_PROP_POS_FRAMES:
                asked.append(int(value))
            return bool(self._capture.set(prop, value))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._capture, name)

    monkeypatch.setattr(cv2, "VideoCapture", Counting)
    return asked


def test_a_dense_sample_is_read_in_order_without_a_seek(tmp_path: Path, seeks: list[int]) -> None:
    from mlx_vlm.utils import load_video

    clip = write_video(tmp_path / "clip.avi", frames=16, fps=2)
    frames = decode_video(clip.read_bytes(), "videos[0]", MediaPolicy(video_max_frames=16))
    assert seeks == []
    assert frames.shape == (16, 3, 56, 56) and frames.dtype == np.uint8
    assert np.array_equal(frames, seek_each(clip, range(16)))
    theirs, _metadata = load_video(str(clip), fps=2.0, max_frames=16)
    assert np.array_equal(frames, theirs)  # what mlx-vlm's own video path gives its processor


def test_picks_far_apart_are_reached_by_seeks_and_give_the_same_frames(
    tmp_path: Path, seeks: list[int]
) -> None:
    clip = write_video(tmp_path / "clip.avi", frames=120, size=(28, 28), fps=30)
    policy = MediaPolicy(video_max_frames=3, video_fps=2.0)
    picks = sample_indices(120, 30.0, policy)
    assert picks == [0, 60, 119]  # gaps of 59 frames: past SEQUENTIAL_GAP
    assert SEQUENTIAL_GAP < 59
    frames = decode_video(clip.read_bytes(), "videos[0]", policy)
    assert seeks == [60, 119]
    # an odd count: the last frame again (temporal patches of two)
    assert np.array_equal(frames, seek_each(clip, [*picks, picks[-1]]))


def test_picks_a_few_frames_apart_are_decoded_through(tmp_path: Path, seeks: list[int]) -> None:
    clip = write_video(tmp_path / "clip.avi", frames=120, size=(28, 28), fps=30)
    policy = MediaPolicy(video_max_frames=16, video_fps=2.0)
    picks = sample_indices(120, 30.0, policy)
    assert len(picks) == 8 and max(b - a for a, b in itertools.pairwise(picks)) <= SEQUENTIAL_GAP
    frames = decode_video(clip.read_bytes(), "videos[0]", policy)
    assert seeks == []
    assert np.array_equal(frames, seek_each(clip, picks))


def test_media_hashes_tell_media_apart() -> None:
    rng = np.random.RandomState(0)
    pixels = rng.rand(8, 6).astype(np.float32)
    grid = np.array([[1, 2, 2], [1, 2, 2]])  # two images of 4 patch rows each
    key, ids = media_hashes({"pixel_values": pixels, "image_grid_thw": grid})
    assert len(ids) == 2 and ids[0] != ids[1]
    twice = np.concatenate([pixels[:4], pixels[:4]])
    _key, same = media_hashes({"pixel_values": twice, "image_grid_thw": grid})
    assert same[0] == same[1] == ids[0]  # an image's id is its own pixels'
    changed = pixels.copy()
    changed[5, 0] += 1.0
    other_key, other = media_hashes({"pixel_values": changed, "image_grid_thw": grid})
    assert other[0] == ids[0] and other[1] != ids[1] and other_key != key
    # the grid names rows only: the media key covers everything else too
    with_extra = {"pixel_values": pixels, "image_grid_thw": grid, "extra": np.arange(3)}
    assert media_hashes(with_extra)[0] != key and media_hashes(with_extra)[1] == ids
    # a grid that does not name every row: one id for all, the media key's
    short = np.array([[1, 2, 2]])
    uncovered_key, uncovered = media_hashes({"pixel_values": pixels, "image_grid_thw": short})
    assert uncovered == [int(uncovered_key[:12], 16)]
