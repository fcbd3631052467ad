"""The cost of constrained decoding: per-token mask computation and application beside a plain
decode step, and the grammar compile time of a 20-field JSON schema.

Three measurements, on one model (`--model tiny | smollm2 | synthetic:<shape>-<kind> | <dir>`,
see bench/models.py; synthetic models carry the SmolLM2 tokenizer, 49,152 tokens):

1. compile: `GrammarCompiler.compile` of a 20-field schema (strings with maxLength, integers,
   booleans, an enum, a nested object, an array), a fresh compiler each repeat so nothing is
   cached; the tokenizer's one-off conversion is timed apart. outlines-core's index for the same
   schema is timed too when it is importable (`--outlines-path` adds a directory to sys.path).
2. per token, in isolation: along the tokens of a generated answer, the matcher's mask
   computation on the CPU (`allowed_words`) and `consume`, and on the device the masked choice
   (`apply_token_mask` + argmax, evaluated) against the plain argmax, on logits of the model's
   width and dtype;
3. end to end: the engine's decode time per token for a request under the schema against the
   same request unconstrained, with the same number of tokens (EOS ignored), interleaved,
   `--repeats` times; the first token is left out (it carries the prefill).

    python -m bench.constrained --model tiny --out docs/benchmarks/2026-12-04-cpu-constrained-tiny
    python -m bench.constrained --model synthetic:llama-1b-bf16 --repeats 5 \\
        --out docs/benchmarks/2026-12-04-h200-constrained-llama-1b-bf16

Writes OUT.json (every row, the machine, versions, the command) and OUT.md (the table);
`--render OUT.json` writes the table again from an earlier run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
from bench.models import resolve_subject

import trio_mlx
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.structured import GrammarCompiler, OutputFormat
from trio_mlx.structured.matcher import apply_token_mask


def twenty_field_schema() -> dict[str, Any]:
    """A 20-field object of the kinds real schemas have."""
    props: dict[str, Any] = {}
    for i in range(20):
        kind = i % 5
        if kind == 0:
            props[f"name_{i}"] = {"type": "string", "maxLength": 24}
        elif kind == 1:
            props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 100000}
        elif kind == 2:
            props[f"flag_{i}"] = {"type": "boolean"}
        elif kind == 3:
            props[f"level_{i}"] = {"enum": ["low", "medium", "high"]}
        else:
            props[f"item_{i}"] = {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 12},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 8},
                        "maxItems": 3,
                    },
                },
                "required": ["label", "tags"],
                "additionalProperties": False,
            }
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def no_eos_loader(spec: str | Path | None) -> LoadedModel:
    """EOS ignored: a plain request runs to max_tokens."""
    return dataclasses.replace(load_model(spec), eos_token_ids=frozenset())


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure_compile(
    tokenizer: Any, schema: dict[str, Any], repeats: int, outlines: bool
) -> dict[str, Any]:
    fmt = OutputFormat.json_schema(schema)
    convert, compile_s = [], []
    for _ in range(repeats):
        compiler = GrammarCompiler(tokenizer)
        began = time.perf_counter()
        compiler.compile(OutputFormat.regex("x"))  # converts the tokenizer (once per compiler)
        convert.append(time.perf_counter() - began)
        began = time.perf_counter()
        compiler.compile(fmt)
        compile_s.append(time.perf_counter() - began)
    out: dict[str, Any] = {
        "llguidance_compile_ms": [s * 1e3 for s in compile_s],
        "llguidance_tokenizer_conversion_ms": [s * 1e3 for s in convert],
    }
    if outlines:
        out["outlines_core"] = measure_outlines(tokenizer, schema)
    return out


def measure_outlines(tokenizer: Any, schema: dict[str, Any]) -> dict[str, Any]:
    try:
        from outlines_core import Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError as exc:
        return {"skipped": f"outlines-core not importable: {exc}"}
    from importlib import metadata

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = hf.eos_token_id
    words: dict[str, list[int]] = {}
    for text, token in hf.get_vocab().items():
        if token != eos:
            words.setdefault(text, []).append(token)
    began = time.perf_counter()
    vocabulary = Vocabulary(eos, words)
    vocab_s = time.perf_counter() - began
    began = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(schema))
    regex_s = time.perf_counter() - began
    began = time.perf_counter()
    Index(regex, vocabulary)
    index_s = time.perf_counter() - began
    return {
        "version": metadata.version("outlines-core"),
        "vocabulary_ms": vocab_s * 1e3,
        "regex_ms": regex_s * 1e3,
        "index_ms": index_s * 1e3,
    }


def measure_masks(
    tokenizer: Any, schema: dict[str, Any], tokens: list[int], width: int, dtype: Any
) -> dict[str, Any]:
    """Per token along `tokens`: CPU mask + consume, device masked choice vs plain argmax."""
    import mlx.core as mx

    compiled = GrammarCompiler(tokenizer).compile(OutputFormat.json_schema(schema))
    matcher = compiled.matcher()
    logits = mx.random.normal((1, width)).astype(dtype)
    mx.eval(logits)
    mask_s, consume_s, masked_s, plain_s = [], [], [], []
    for _ in range(3):  # warm the device kernels
        mx.eval(mx.argmax(apply_token_mask(logits, matcher.allowed_words()[None]), -1))
    for token in tokens:
        began = time.perf_counter()
        words = matcher.allowed_words()
        mask_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        mx.eval(mx.argmax(apply_token_mask(logits, words[None]), -1))
        masked_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        mx.eval(mx.argmax(logits, -1))
        plain_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        matcher.consume(token)
        consume_s.append(time.perf_counter() - began)
        if matcher.done:
            break
    return {
        "tokens": len(mask_s),
        "mask_us": [s * 1e6 for s in mask_s],
        "consume_us": [s * 1e6 for s in consume_s],
        "masked_choice_us": [s * 1e6 for s in masked_s],
        "plain_choice_us": [s * 1e6 for s in plain_s],
    }


async def decode_run(
    engine: trio_mlx.Engine, messages: Any, max_tokens: int, fmt: OutputFormat | None
) -> dict[str, Any]:
    stamps: list[float] = []
    final = None
    options: dict[str, Any] = {"output_format": fmt} if fmt is not None else {}
    async for out in engine.stream_chat(
        messages, max_tokens=max_tokens, temperature=0.0, **options
    ):
        stamps.extend(time.perf_counter() for _ in out.new_tokens)
        final = out
    assert final is not None
    n = len(final.tokens)
    per_token = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else float("nan")
    return {
        "tokens": n,
        "per_token_ms": per_token * 1e3,
        "finish": final.finish_reason,
        "text": final.text,
    }


async def main(args: argparse.Namespace) -> None:
    import mlx.core as mx

    subject = resolve_subject(args.model, Path(args.workdir))
    schema = twenty_field_schema()
    fmt = OutputFormat.json_schema(schema)
    messages = [{"role": "user", "content": "Fill in the form as JSON."}]
    options: dict[str, Any] = {}
    if args.max_num_seqs is not None:
        options["max_num_seqs"] = args.max_num_seqs
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    async with trio_mlx.open_engine(subject.path, loader=no_eos_loader, **options) as engine:
        route = "batched" if engine.get_stats()["runner"].get("batching") else "serialized"
        compile_report = measure_compile(engine.tokenizer, schema, args.repeats, args.outlines)
        warm = await decode_run(engine, messages, args.max_tokens, fmt)  # also warms the engine
        n = warm["tokens"]
        await decode_run(engine, messages, n, None)
        for repeat in range(args.repeats):
            for system in ("plain", "constrained"):
                row = await decode_run(
                    engine, messages, n, fmt if system == "constrained" else None
                )
                row.update(system=system, repeat=repeat)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
        answer = engine.tokenizer.encode(warm["text"], add_special_tokens=False)
        width = engine.info.vocab_size
        dtype = (
            mx.bfloat16
            if "bf16" in args.model
            else mx.float16
            if "fp16" in args.model
            else mx.float32
        )
        masks = measure_masks(engine.tokenizer, schema, answer, width, dtype)
    report = {
        "command": "python -m bench.constrained " + " ".join(sys.argv[1:]),
        "subject": {
            "spec": subject.spec,
            "description": subject.description,
            "synthetic": subject.synthetic,
        },
        "route": route,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mlx_device": str(mx.default_device()),
            "load_average_1min": [load_before[0], os.getloadavg()[0]],
        },
        "versions": versions(),
        "schema": schema,
        "answer_tokens": n,
        "answer_finish": warm["finish"],
        "compile": compile_report,
        "masks": masks,
        "decode_rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(report) + "\n")
    print(render(report))


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in ("mlx", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "mlx-lm", "llguidance", "trio-mlx"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def render(report: dict[str, Any]) -> str:
    rows = report["decode_rows"]
    plain = [r["per_token_ms"] for r in rows if r["system"] == "plain"]
    constrained = [r["per_token_ms"] for r in rows if r["system"] == "constrained"]
    ratios = [
        c["per_token_ms"] / p["per_token_ms"] for p, c in zip(rows[0::2], rows[1::2], strict=True)
    ]
    masks = report["masks"]
    comp = report["compile"]
    step_ms = median(plain)
    mask_us, consume_us = median(masks["mask_us"]), median(masks["consume_us"])
    masked_us, plain_us = median(masks["masked_choice_us"]), median(masks["plain_choice_us"])
    host_us = mask_us + consume_us
    machine = report["machine"]
    lines = [
        f"# Constrained decoding: {report['subject']['description']}, {report['route']} route",
        "",
        f"`{report['command']}` on {machine['platform']} ({machine['mlx_device']}, "
        f"{machine['cpus']} CPUs; 1-minute load average {machine['load_average_1min'][0]:.1f} "
        f"at the start, {machine['load_average_1min'][1]:.1f} at the end). "
        + (
            "Random weights of a real shape (the SmolLM2 tokenizer, 49,152 tokens): speed does "
            "not depend on weight values. "
            if report["subject"]["synthetic"]
            else ""
        )
        + f"The answer under the 20-field schema: {report['answer_tokens']} tokens "
        f"({report['answer_finish']}).",
        "",
        "| per token | median |",
        "| --- | --- |",
        f"| plain decode step (engine, greedy) | {step_ms:.3f} ms |",
        f"| constrained decode step (engine, same tokens count) | {median(constrained):.3f} ms |",
        f"| constrained / plain, interleaved pairs (median of {len(ratios)}) "
        f"| {median(ratios):.3f} |",
        f"| mask computation on the CPU (llguidance) | {mask_us:.1f} µs |",
        f"| advancing the matcher (consume) | {consume_us:.1f} µs |",
        f"| masked choice, evaluated alone (unpack + where + argmax) | {masked_us:.1f} µs |",
        f"| plain argmax, evaluated alone | {plain_us:.1f} µs |",
        f"| host work a token (mask + consume) / plain step "
        f"| {host_us / 1e3 / step_ms * 100:.2f} % |",
        "",
        "Grammar compile, 20-field schema (median of "
        f"{len(comp['llguidance_compile_ms'])}): llguidance "
        f"{median(comp['llguidance_compile_ms']):.2f} ms (the tokenizer's one-off conversion "
        f"{median(comp['llguidance_tokenizer_conversion_ms']):.0f} ms, once per engine)",
    ]
    oc = comp.get("outlines_core")
    if oc and "index_ms" in oc:
        lines[-1] += (
            f"; outlines-core {oc['version']} {oc['index_ms']:.0f} ms for its index "
            f"(+ {oc['vocabulary_ms']:.0f} ms vocabulary, {oc['regex_ms']:.1f} ms regex)."
        )
    else:
        lines[-1] += "."
    lines += [
        "",
        "In the engine the mask is computed while the device runs the step's forward pass (the "
        "pass is queued before the previous token is read), so the constrained/plain ratio is "
        "what a client sees; the isolated figures bound its parts.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny, smollm2, synthetic:<shape>-<kind> or a directory"
    )
    parser.add_argument("--max-tokens", type=int, default=600, help="cap on the schema's answer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="the engine's (default: its own)"
    )
    parser.add_argument("--outlines", action="store_true", help="also time outlines-core's index")
    parser.add_argument("--outlines-path", default=None, help="a directory holding outlines_core")
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--out", help="OUT.json and OUT.md are written")
    parser.add_argument("--render", help="only write the .md of this earlier run's .json")
    parsed = parser.parse_args()
    if parsed.render:
        source = Path(parsed.render)
        source.with_suffix(".md").write_text(render(json.loads(source.read_text())) + "\n")
        sys.exit(0)
    if not parsed.out:
        parser.error("--out is required")
    if parsed.outlines_path:
        sys.path.insert(0, parsed.outlines_path)
    trio.run(main, parsed)
    sys.exit(0)
