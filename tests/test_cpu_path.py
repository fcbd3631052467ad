"""The CPU fast path: MLX's BLAS slots pointed at OpenBLAS, quantized weights run as float32.

The BLAS arrangement is process-wide and one-way, and the rest of the suite keeps the reference
BLAS (see conftest.py), so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="not a Linux machine: the CPU path patches libmlx's Linux build (OpenBLAS in its GOT)",
)

PRODUCT = r"""
import json, numpy as np, mlx.core as mx
from trio_mlx.engine.cpu_blas import use_openblas
state = use_openblas()
rng = np.random.default_rng(0)
a, b = rng.standard_normal((300, 200), "float32"), rng.standard_normal((200, 100), "float32")
got = np.array(mx.matmul(mx.array(a), mx.array(b)))
print(json.dumps({"how": state.how, "optimized": state.optimized, "library": state.library,
                  "line": state.describe(), "again": use_openblas() is state,
                  "error": float(np.abs(got - a @ b).max())}))
"""

WEIGHTS = r"""
import json, sys
import mlx.core as mx, mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from trio_mlx.engine.cpu_path import prepare_cpu_model
mx.random.seed(0)
args = llama.ModelArgs.from_dict(dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
    vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True))
model = llama.Model(args)
nn.quantize(model, group_size=32, bits=4)
tokens = mx.array([[1, 5, 9, 42, 77]])
before = model(tokens)
model, path = prepare_cpu_model(model)
after = model(tokens)
quantized = [n for n, m in model.named_modules() if "scales" in m]
print(json.dumps({"stored": path.stored, "running": path.running, "line": path.log_line(),
    "dtypes": sorted({str(p.dtype) for _, p in tree_flatten(model.parameters())}),
    "quantized_left": len(quantized),
    "max_logit_diff": float(mx.abs(after - before).max())}))
"""


def run(script: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_MLX_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_mlx_float32_products_run_on_openblas_and_stay_correct() -> None:
    out = run(PRODUCT)
    assert (out["how"], out["optimized"]) == ("patched", True)
    assert "openblas" in out["library"] and out["again"]
    assert "OpenBLAS" in out["line"] and "thread" in out["line"]
    assert out["error"] < 1e-3


def test_the_reference_blas_opt_out_keeps_mlx_as_shipped() -> None:
    out = run(PRODUCT, TRIO_MLX_BLAS="reference")
    assert (out["how"], out["optimized"]) == ("opt-out", False)
    assert "openblas" not in out["library"].lower()
    assert "TRIO_MLX_BLAS=reference" in out["line"]
    assert out["error"] < 1e-3


def test_a_quantized_model_runs_as_float32_with_the_same_logits() -> None:
    out = run(WEIGHTS)
    assert (out["stored"], out["running"]) == ("4-bit", "float32")
    assert out["dtypes"] == ["mlx.core.float32"] and out["quantized_left"] == 0
    assert out["max_logit_diff"] < 1e-3  # the same weights, dequantized exactly
    assert out["line"].startswith("CPU backend: weights float32 (stored as 4-bit); ")


def test_without_openblas_the_weights_stay_quantized_and_the_log_says_what_is_faster() -> None:
    out = run(WEIGHTS, TRIO_MLX_BLAS="reference")
    assert (out["stored"], out["running"]) == ("4-bit", "4-bit")
    assert out["quantized_left"] > 0 and out["max_logit_diff"] == 0.0
    assert "float32 through OpenBLAS would be ~20x faster" in out["line"]


def test_as_stored_keeps_the_quantized_weights_even_with_openblas() -> None:
    out = run(WEIGHTS, TRIO_MLX_CPU_WEIGHTS="as-stored")
    assert out["running"] == "4-bit" and out["quantized_left"] > 0
    assert "float32 would be faster" in out["line"]
