"""Decode speed of the plain, fused and compiled decode steps beside raw mlx-lm, step by step.

    python -m bench.compiled_decode --out docs/benchmarks/2026-12-04-h200-compiled-decode
    python -m bench.compiled_decode --models tiny --tokens 64 --repeats 1 --out /tmp/cd   # CPU

Models (`--models`, comma-separated): `synthetic:llama-1b-bf16`, `synthetic:llama-8b-bf16`,
`synthetic:llama-8b-q4` (the default, in that order), `tiny`, or anything `bench.models` resolves.
Synthetic shapes are built in memory (random weights, nothing written to disk, no tokenizer: the
prompts are random token ids), the others loaded from their directories.

Variants, each a greedy decode of `--tokens` tokens after a prompt of `--prompt-tokens`, the loop
queuing step k+1 before reading token k (as the engine does):
- `mlx_lm`: mlx-lm's `generate_step` (the reference; it also computes log-probabilities);
- `plain`: the engine's plain step (the model's forward pass over mlx-lm's `KVCache`, argmax);
- `fused`: the same on the model with fused q/k/v and gate/up projections (`engine/fused.py`);
- `compiled`: the traced step (`engine/compiled_step.py`) on the unfused model;
- `compiled+fused`: the traced step on the fused model (what `compiled_decode` serves);
- `kernel`: `compiled+fused` with attention in one custom CUDA kernel (`engine/decode_attention.py`,
  experimental: what `TRIO_MLX_DECODE_ATTENTION=kernel` serves), on MLX's CUDA backend only, after
  a numeric check of the kernel against the same arithmetic in MLX ops (`kernel_check`);
- `engine`: `decode.ActiveSequence` with the traced step on the fused model, stepped as the
  runner steps it (the real per-step code, total time only);
- `engine_fused`: the same without the traced step;
- `lean`, `lean+fused`: the lean one-token step (`engine/lean_step.py`: the model's arithmetic in
  fewer graph nodes) on the unfused and the fused model; on a 4-bit model on MLX's CUDA backend
  their quantized products go through our one-row kernel (`engine/quantized_gemv.py`);
- `lean+mlx_qmv`: `lean+fused` with MLX's own quantized kernels (the same as `lean+fused` on an
  unquantized model);
- `lean+rows`: `lean+fused` with each block's products, its norms, SwiGLU and residual adds as
  four kernels of our own (`engine/row_product.py`; MLX's CUDA backend only, else `lean+fused`);
- `lean+split`: `lean+fused` with each step's dispatch on a second thread (`split_decode`,
  experimental): this thread builds step k+1 while the other queues step k (`mx.async_eval`,
  which releases the GIL) and reads token k-1, the two sharing one MLX stream; `lean+stream`:
  `lean+fused`'s one-thread loop on such a stream (`mx.new_thread_unsafe_stream`);
- `engine_lean`: `decode.ActiveSequence` with the lean step on the fused model (what the
  serialized route serves on a GPU); `engine_rows`: the same with `lean+rows`; `engine_bias`: the
  same with the EOS ids' logit bias of `bench.compare`'s requests (the logits read out of the
  step, biased, then the argmax);
- `engine_batch`: the batched route's lone row (`batch.BatchDecoder`, what a GPU serves by
  default: one request alone, on its own cache, through the lean step), with that logit bias,
  stepped as the runner steps it; `engine_defer`: the same with `TRIO_MLX_DEFER_DISPATCH=auto`'s
  order (`engine/dispatch_order.py`: each step queued after the previous one's tokens are read;
  here nothing else runs, so this is what the order costs where it gains nothing).
Per variant and token: decode tok/s, and for the loop variants the host's time building the step
(`build_ms`: Python, or the traced step's replay), queuing it (`dispatch_ms`: `mx.async_eval`,
MLX's C++ dispatch and kernel launches), waiting for the token (`wait_ms`: the device behind the
host) and the loop thread's CPU time. `agree`: how many leading greedy tokens equal `plain`'s, or
`lean+fused`'s where `plain` is not run (GPU rounding may split a near-tie). The weights' bytes
over `--hbm-tb-s` give each model's bandwidth ceiling in tok/s.

Bounded: every cell stops after `--cell-seconds` of decoding; no new cell starts after
`--deadline-s` (reported as skipped). Variants alternate within each repeat, order rotated;
repeat 0 warms every variant up (traces, kernel compilation) and is reported apart
(`first_use_s`). Summary: the median over repeats. Writes OUT.json (every row) and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from bench.models import BASE_CONFIG, SHAPES, resolve_subject, structural_copy
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.compiled_step import CompiledDecode
from trio_mlx.engine.decode import ActiveSequence, GenerationJob, PrefillPlan
from trio_mlx.engine.dispatch_order import DispatchOrder
from trio_mlx.engine.fused import fuse_projections
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.types import SamplingParams

VARIANTS = (
    "mlx_lm",
    "plain",
    "fused",
    "compiled",
    "compiled+fused",
    "kernel",
    "engine",
    "engine_fused",
    "lean",
    "lean+fused",
    "lean+mlx_qmv",
    "lean+rows",
    "lean+split",
    "lean+stream",
    "engine_lean",
    "engine_rows",
    "engine_bias",
    "engine_batch",
    "engine_defer",
)
DEFAULT_MODELS = "synthetic:llama-1b-bf16,synthetic:llama-8b-bf16,synthetic:llama-8b-q4"


def log(message: str) -> None:
    print(message, flush=True)


def build_synthetic(name: str) -> Any:
    """A random-weight llama of a `bench.models` shape, in memory: `llama-1b-bf16`, `-q4`, ..."""
    import mlx.nn as nn
    from mlx_lm.models import llama

    shape, _, kind = name.rpartition("-")
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}: {sorted(SHAPES)}")
    dtypes = {"bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}
    bits = int(kind[1:]) if kind.startswith("q") and kind[1:].isdigit() else None
    dtype = dtypes.get(kind, mx.bfloat16 if bits else None)
    if dtype is None:
        raise SystemExit(f"unknown kind {kind!r}: bf16, fp16, fp32 or q<bits>")
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict({**BASE_CONFIG, **SHAPES[shape]}))
    # Cast layer by layer, so the float32 initialisation is never whole in memory.
    for module in [model.model.embed_tokens, model.model.norm, *model.model.layers]:
        module.update(_cast(module.parameters(), dtype))
        mx.eval(module.parameters())
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        mx.eval(model.parameters())
    return model


def _cast(tree: Any, dtype: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cast(v, dtype) for v in tree]
    return tree.astype(dtype)


def load_subject(spec: str, workdir: Path) -> tuple[Any, str]:
    if spec.startswith("synthetic:"):
        return build_synthetic(spec.split(":", 1)[1]), f"random llama {spec[10:]}, in memory"
    from trio_mlx.engine.loading import load_model

    subject = resolve_subject(spec, workdir)  # loaded as the engine loads it (the CPU path too)
    return load_model(subject.path).model, subject.description


def weights_bytes(model: Any) -> int:
    return sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))


class Cell:
    """One variant's decode of one prompt: tokens, and the loop's time split."""

    def __init__(self, n: int, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds
        self.n = n
        self.tokens: list[int] = []
        self.build = self.dispatch = self.wait = 0.0
        #: `lean+split`'s dispatcher thread: its wait for each token (`.item()`)
        self.read = 0.0

    def decoding(self) -> None:
        """The first token is out: the cell's time bound counts from here."""
        self.deadline = time.perf_counter() + self.seconds

    def figures(self, elapsed: float, cpu: float) -> dict[str, Any]:
        n = max(len(self.tokens) - 1, 1)  # tokens after the first
        per = 1000 / n
        row: dict[str, Any] = {"tokens": len(self.tokens), "tps": n / elapsed}
        if self.build or self.dispatch or self.wait:
            row |= {
                "build_ms": self.build * per,
                "dispatch_ms": self.dispatch * per,
                "wait_ms": self.wait * per,
            }
        if self.read:
            row["read_ms"] = self.read * per
        row["cpu_ms"] = cpu * per
        return row


def first_token(model: Any, prompt: Any) -> tuple[list[Any], Any]:
    """A fresh cache holding `prompt`, and the greedy first token after it (evaluated)."""
    cache = make_prompt_cache(model)
    token = mx.argmax(model(prompt[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(token)
    return cache, token


def loop_decode(
    model: Any, prompt: Any, cell: Cell, step: Callable[[Any, list[Any]], Any]
) -> tuple[float, float]:
    """Greedy decode, step k+1 queued before token k is read; returns (seconds, cpu seconds)
    from the first token on."""
    cache, token = first_token(model, prompt)
    cell.decoding()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while len(cell.tokens) < cell.n:
        last = len(cell.tokens) + 1 >= cell.n or time.perf_counter() > cell.deadline
        nxt = None
        if not last:
            t = time.perf_counter()
            nxt = step(token, cache)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            cell.build += t1 - t
            cell.dispatch += t2 - t1
        t = time.perf_counter()
        cell.tokens.append(int(token.item()))
        cell.wait += time.perf_counter() - t
        if nxt is None:
            break
        token = nxt
    return time.perf_counter() - t0, time.thread_time() - cpu0


def split_decode(
    model: Any, prompt: Any, cell: Cell, step: Callable[[Any, list[Any]], Any]
) -> tuple[float, float]:
    """Greedy decode with the dispatch on a second thread: this thread builds step k+1 (Python,
    the GIL held) while the dispatcher queues step k (`mx.async_eval`, the GIL released) and then
    reads token k-1. The two threads share one stream (`mx.new_thread_unsafe_stream`); this one
    builds at most two steps ahead of the tokens read. Returns (seconds, this thread's CPU
    seconds) from the first token on; `build_ms` is this thread's, `wait_ms` its wait for tokens,
    `dispatch_ms` and `read_ms` the dispatcher's `mx.async_eval` and its wait for each token."""
    cache, token = first_token(model, prompt)
    stream = mx.new_thread_unsafe_stream(mx.default_device())
    todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
    done: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()

    def dispatcher() -> None:
        mx.set_default_stream(stream)
        previous = token
        try:
            while (queued := todo.get()) is not None:
                t = time.perf_counter()
                mx.async_eval(queued)
                t1 = time.perf_counter()
                done.put(int(previous.item()))
                cell.dispatch += t1 - t
                cell.read += time.perf_counter() - t1
                previous = queued
            done.put(int(previous.item()))
        except BaseException as exc:  # reported by the building thread
            done.put(exc)

    worker = threading.Thread(target=dispatcher, name="split-dispatch", daemon=True)
    cell.decoding()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    worker.start()
    built, building, latest = 0, True, token
    try:
        with mx.stream(stream):
            while len(cell.tokens) < built + 1:
                if building and built - len(cell.tokens) < 2:
                    if built + 1 >= cell.n or time.perf_counter() > cell.deadline:
                        building = False
                        todo.put(None)
                        continue
                    t = time.perf_counter()
                    latest = step(latest, cache)
                    cell.build += time.perf_counter() - t
                    todo.put(latest)
                    built += 1
                    continue
                t = time.perf_counter()
                got = done.get()
                cell.wait += time.perf_counter() - t
                if isinstance(got, BaseException):
                    raise got
                cell.tokens.append(got)
    finally:
        if building:  # a failure: the dispatcher finishes what it has and stops
            todo.put(None)
        worker.join()
    return time.perf_counter() - t0, time.thread_time() - cpu0


def plain_step(model: Any) -> Callable[[Any, list[Any]], Any]:
    return lambda token, cache: mx.argmax(model(token[None], cache=cache)[:, -1, :], axis=-1)


def compiled_step(decoder: CompiledDecode | LeanStep) -> Callable[[Any, list[Any]], Any]:
    return lambda token, cache: decoder.step(token, cache, greedy=True)


def mlx_lm_decode(model: Any, prompt: Any, cell: Cell) -> tuple[float, float]:
    steps = generate_step(prompt, model, max_tokens=cell.n)
    first, _ = next(steps)
    cell.tokens.append(int(first))
    cell.decoding()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for token, _ in steps:
        cell.tokens.append(int(token))
        if time.perf_counter() > cell.deadline:
            break
    return time.perf_counter() - t0, time.thread_time() - cpu0


def engine_params(n: int, biased: bool, vocab: int) -> SamplingParams:
    """Greedy, `n` tokens; with `biased`, the logit bias `bench.compare` sends to ban EOS (here
    two ids of the vocabulary's top: a synthetic model has no EOS of its own)."""
    bias = tuple((vocab - 1 - i, -100.0) for i in range(2)) if biased else ()
    return SamplingParams(max_tokens=n, temperature=0.0, logit_bias=bias)


def engine_decode(
    model: Any,
    prompt: tuple[int, ...],
    cell: Cell,
    decoder: CompiledDecode | LeanStep | None,
    vocab: int,
    biased: bool = False,
) -> tuple[float, float]:
    job = GenerationJob(1, prompt, engine_params(cell.n, biased, vocab))
    seq = ActiveSequence(
        job, model, frozenset(), PrefillPlan(2048, tail=1), vocab_size=vocab, compiled=decoder
    )
    while not cell.tokens and not seq.finished:
        cell.tokens += seq.step().tokens
    cell.decoding()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while not seq.finished and time.perf_counter() <= cell.deadline:
        cell.tokens += seq.step().tokens
    return time.perf_counter() - t0, time.thread_time() - cpu0


def batch_decode(
    model: Any, prompt: tuple[int, ...], cell: Cell, lean: LeanStep, vocab: int, order: str
) -> tuple[float, float]:
    """The batched route's lone row: admitted, prefilled and joined as the runner does it, then
    `decode()` a step (the next step queued before the last is read, on a GPU), each step's
    dispatch in `order` (`dispatch_order`)."""
    batch = BatchDecoder(model, frozenset(), vocab_size=vocab, plan=PrefillPlan(2048), lean=lean)
    batch.dispatch_order = DispatchOrder(order if batch.pipelined else "off")
    batch.add(GenerationJob(1, prompt, engine_params(cell.n, True, vocab)), None, 0)
    while batch.waiting:
        batch.prefill(4096, 60.0)
        batch.join()

    def step() -> None:
        for result in batch.decode():
            if result.error is not None:
                raise RuntimeError(result.error)
            cell.tokens += result.tokens

    while not cell.tokens and batch.busy:
        step()
    cell.decoding()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while batch.busy and len(cell.tokens) < cell.n and time.perf_counter() <= cell.deadline:
        step()
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    batch.remove(1)
    while batch.busy:  # the row leaves at the next step, its cache with it
        batch.decode()
    return elapsed, cpu


def run_variant(
    variant: str,
    model: Any,
    fused: Any,
    decoders: dict[str, CompiledDecode | LeanStep],
    ids: Any,
    cell: Cell,
    vocab: int,
) -> tuple[float, float]:
    prompt = ids.astype(mx.uint32)
    if variant == "mlx_lm":
        return mlx_lm_decode(model, prompt, cell)
    ids_tuple = tuple(int(i) for i in ids.tolist())
    if variant in ("engine_batch", "engine_defer"):
        lean = decoders["lean+fused"]
        assert isinstance(lean, LeanStep)
        order = "auto" if variant == "engine_defer" else "off"
        return batch_decode(fused, ids_tuple, cell, lean, vocab, order)
    if variant in ("engine", "engine_fused", "engine_lean", "engine_rows", "engine_bias"):
        engine_step = {
            "engine": "compiled+fused",
            "engine_lean": "lean+fused",
            "engine_rows": "lean+rows",
            "engine_bias": "lean+fused",
        }
        decoder = decoders[engine_step[variant]] if variant in engine_step else None
        return engine_decode(fused, ids_tuple, cell, decoder, vocab, variant == "engine_bias")
    if variant == "lean+stream":
        stream = mx.new_thread_unsafe_stream(mx.default_device())
        with mx.stream(stream):
            return loop_decode(fused, prompt, cell, compiled_step(decoders["lean+fused"]))
    if variant == "lean+split":
        return split_decode(fused, prompt, cell, compiled_step(decoders["lean+fused"]))
    subject = model if variant in ("plain", "compiled", "lean") else fused
    decoder = decoders.get(variant)
    step = plain_step(subject) if decoder is None else compiled_step(decoder)
    return loop_decode(subject, prompt, cell, step)


def kernel_check(model: Any) -> dict[str, Any]:
    """The attention kernel against `reference_attention` on this model's head shapes (bucket of
    512, 300 valid positions): the largest absolute difference, or why it could not run."""
    from trio_mlx.engine import decode_attention

    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return {"skipped": "not MLX's CUDA backend"}
    args = model.args
    n_heads, n_kv = args.num_attention_heads, args.num_key_value_heads or args.num_attention_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // n_heads
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in (mx.bfloat16, mx.float16, mx.float32):
        dtype = mx.bfloat16  # a quantized embedding: its scales' dtype is the model's
    key = mx.random.key(5)
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((1, n_heads, 1, dim), key=k1).astype(dtype)
    k = mx.random.normal((1, n_kv, 512, dim), key=k2).astype(dtype)
    v = mx.random.normal((1, n_kv, 512, dim), key=k3).astype(dtype)
    offset = mx.array(299, dtype=mx.int32)
    scale = dim**-0.5
    try:
        out = decode_attention.decode_attention(q, k, v, offset, scale)
        ref = decode_attention.reference_attention(q, k, v, offset, scale)
        error = mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))).item()
        scale_of = mx.max(mx.abs(ref.astype(mx.float32))).item()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    result = {"max_abs_error": error, "max_abs_value": scale_of}
    if not error <= 0.02 * max(scale_of, 1e-6) + 1e-3:
        result["error"] = "the kernel's output differs from the reference"
    return result


def agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure_model(spec: str, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    began = time.perf_counter()
    model, description = load_subject(spec, Path(args.workdir))
    vocab = int(model.args.vocab_size)
    fused = structural_copy(model)  # the same arrays; fusing it leaves `model` as it was
    groups = fuse_projections(fused)
    mx.eval(fused.parameters())
    decoders: dict[str, CompiledDecode | LeanStep] = {
        "compiled": CompiledDecode(model, attention_kernel=False),
        "compiled+fused": CompiledDecode(fused, attention_kernel=False),
        "lean": LeanStep(model),
        "lean+fused": LeanStep(fused),
        "lean+mlx_qmv": LeanStep(fused, quantized_kernel=False),
        "lean+rows": LeanStep(fused, row_kernels=True),
    }
    check = kernel_check(model) if "kernel" in args.variants else {"skipped": "not asked"}
    if "error" not in check and "skipped" not in check:
        decoders["kernel"] = CompiledDecode(fused, attention_kernel=True)
    size = weights_bytes(model)
    report: dict[str, Any] = {
        "model": spec,
        "description": description,
        "weights_bytes": size,
        "hbm_limit_tps": args.hbm_tb_s * 1e12 / size,
        "fused_groups": groups,
        "setup_s": time.perf_counter() - began,
        "rows": [],
        "skipped": [],
        "first_use_s": {},
        "kernel_check": check,
        "errors": {},
    }
    variants = [v for v in args.variants if v in VARIANTS and (v != "kernel" or v in decoders)]
    # `agree` counts against `plain`, or against `lean+fused` where `plain` is not asked for
    reference_variant = "plain" if "plain" in variants else "lean+fused"
    log(f"[{spec}] {description}: {size / 1e9:.2f} GB, {groups} fused groups, "
        f"setup {report['setup_s']:.1f} s")  # fmt: skip
    for length in args.prompt_tokens:
        reference: list[int] | None = None
        for repeat in range(args.repeats + 1):  # repeat 0 warms up
            shift = repeat % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                if variant in report["errors"]:
                    continue
                if time.monotonic() > deadline:
                    report["skipped"].append({"prompt": length, "repeat": repeat, "v": variant})
                    continue
                ids = mx.random.randint(100, vocab - 100, (length,), key=mx.random.key(repeat))
                cell = Cell(args.tokens, args.cell_seconds)
                t = time.perf_counter()
                try:
                    seconds, cpu = run_variant(variant, model, fused, decoders, ids, cell, vocab)
                except Exception as exc:  # reported; the other variants go on
                    report["errors"][variant] = f"{type(exc).__name__}: {exc}"
                    log(f"[{spec}] {variant} failed: {report['errors'][variant]}")
                    continue
                if repeat == 0:
                    report["first_use_s"][f"{variant}/{length}"] = time.perf_counter() - t
                    if variant == reference_variant:
                        reference = cell.tokens
                    continue
                row = {"variant": variant, "prompt": length, "repeat": repeat}
                row |= cell.figures(seconds, cpu)
                report["rows"].append(row)
                log(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                for k, v in row.items()}))  # fmt: skip
                if repeat == 1:
                    row["_tokens"] = cell.tokens
        plain_tokens = next(
            (
                r["_tokens"]
                for r in report["rows"]
                if r["variant"] == reference_variant and r["prompt"] == length
            ),
            reference,
        )
        for r in report["rows"]:
            if r["prompt"] == length and "_tokens" in r:
                tokens = r.pop("_tokens")
                if plain_tokens:  # the reference variant not run: nothing to agree with
                    r["agree"] = agreement(tokens, plain_tokens)
    report["summary"] = summarize(report["rows"])
    del model, fused, decoders
    mx.clear_cache()
    return report


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    summary: dict[str, dict[str, float]] = {}
    keys = {(r["variant"], r["prompt"]) for r in rows}
    for key in sorted(keys, key=lambda k: (k[1], VARIANTS.index(k[0]))):
        mine = [r for r in rows if (r["variant"], r["prompt"]) == key]
        figures = {
            k: statistics.median(r[k] for r in mine if k in r)
            for k in ("tps", "build_ms", "dispatch_ms", "wait_ms", "cpu_ms", "agree", "tokens")
            if any(k in r for r in mine)
        }
        summary[f"{key[0]}/{key[1]}"] = figures
    return summary


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Compiled decode ({report['device']}, mlx {report['mlx']})",
        "",
        f"`{report['command']}`",
        "",
        "Greedy decode, batch 1; medians over repeats. `×mlx_lm`: tok/s over raw mlx-lm's in the "
        "same cell. `agree`: leading tokens equal to `plain`'s (of the tokens decoded). Limit: "
        f"weights read once per token at {report['settings']['hbm_tb_s']} TB/s.",
        "",
    ]
    for m in report["models"]:
        lines += [
            f"## {m['model']}: {m['description']}, {m['weights_bytes'] / 1e9:.2f} GB, limit "
            f"{m['hbm_limit_tps']:.0f} tok/s",
            "",
            "| prompt | variant | tok/s | ×mlx_lm | % limit | build ms | dispatch ms | wait ms "
            "| CPU ms | agree |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for key, f in m["summary"].items():
            variant, prompt = key.split("/")
            raw = m["summary"].get(f"mlx_lm/{prompt}", {}).get("tps")
            ratio = f"{f['tps'] / raw:.2f}" if raw else ""

            def cell(name: str, fig: dict[str, float] = f) -> str:
                return f"{fig[name]:.3f}" if name in fig else ""

            agree = f"{f['agree']:.0f}/{f['tokens']:.0f}" if "agree" in f else ""
            lines.append(
                f"| {prompt} | {variant} | {f['tps']:.1f} | {ratio} | "
                f"{100 * f['tps'] / m['hbm_limit_tps']:.0f} | {cell('build_ms')} | "
                f"{cell('dispatch_ms')} | {cell('wait_ms')} | {cell('cpu_ms')} | {agree} |"
            )
        first = ", ".join(f"{k} {v:.2f}" for k, v in m["first_use_s"].items())
        lines += ["", f"First use (warm-up cell, s): {first}", ""]
        lines += [f"Attention kernel check: {json.dumps(m['kernel_check'])}", ""]
        for variant, error in m["errors"].items():
            lines += [f"`{variant}` failed: {error}", ""]
        if m["skipped"]:
            lines += [f"Skipped at the deadline: {len(m['skipped'])} cells", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    report: dict[str, Any] = {
        "command": "python -m bench.compiled_decode " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "machine": platform.machine(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
        "settings": {k: v for k, v in vars(args).items()},
        "models": [],
    }
    for spec in args.models:
        if time.monotonic() > deadline:
            report["models"].append({"model": spec, "skipped": "deadline"})
            continue
        report["models"].append(measure_model(spec, args, deadline))
    report["models"] = [m for m in report["models"] if "summary" in m]
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
        log(f"wrote {out.with_suffix('.json')} and .md")
    print(markdown(report))
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(t) for t in text.split(",") if t]

    parser = argparse.ArgumentParser(
        prog="python -m bench.compiled_decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", default=DEFAULT_MODELS, type=lambda s: s.split(","))
    parser.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: s.split(","))
    parser.add_argument("--prompt-tokens", type=ints, default=[128, 1536])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cell-seconds", type=float, default=6.0)
    parser.add_argument("--deadline-s", type=float, default=420.0)
    parser.add_argument("--hbm-tb-s", type=float, default=4.3, help="bandwidth for the limit")
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--out", default=None, help="OUT.json and OUT.md")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
