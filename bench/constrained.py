"""The cost of constrained decoding: per-token mask computation and application beside a plain
decode step, and the grammar compile time of a 20-field JSON schema.

Three measurements, on one model (`--model tiny | smollm2 | synthetic:<shape>-<kind> | <dir>`,
see bench/models.py; synthetic models carry the SmolLM2 tokenizer, 49,152 tokens):

1. compile: `GrammarCompiler.compile` of a 20-field schema (strings with maxLength, integers,
   booleans, an enum, a nested object, an array), a fresh compiler each repeat so nothing is
   cached; the tokenizer's one-off conversion is timed apart. outlines-core's index for the same
   schema is timed too when it is importable (`--outlines-path` adds a directory to sys.path).
2. per token, in isolation: along the tokens of a generated answer, the matcher's mask
   computation on the CPU (`allowed_words`) and `consume`, and on the device, on logits of the
   model's width and dtype, four choices, each timed as building its graph, queuing it
   (`mx.async_eval`: the host's dispatch) and waiting for it: the masked choice in plain
   operations (`apply_token_mask` + argmax: how it was chosen before `masked_choice`), the fused
   masked argmax (`masked_choice.masked_argmax`), the choice as the engine makes it for a greedy
   row (the token the mask forces when it allows one, no device work; else the fused argmax),
   and the plain argmax. Also how many of the answer's masks force a token;
3. end to end: the engine's decode time per token (the first token left out: it carries the
   prefill) for a request under the schema, the same request unconstrained with as many tokens
   (EOS ignored), and the constrained request with the masked choice in plain operations and
   no forced-token shortcut, as it was made before `masked_choice` ("before"), interleaved
   `--repeats` times, each repeat starting one further.

    python -m bench.constrained --model tiny --out docs/benchmarks/2026-12-04-cpu-constrained-tiny
    python -m bench.constrained --model synthetic:llama-1b-bf16 --repeats 5 \\
        --out docs/benchmarks/2026-12-04-h200-constrained-llama-1b-bf16

Writes OUT.json (every row, the machine, versions, the command) and OUT.md (the table);
`--render OUT.json` writes the table again from an earlier run (runs from before the fused
choice render without its rows).
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio
from bench.models import resolve_subject

import trio_mlx
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.structured import GrammarCompiler, OutputFormat, masked_choice
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


def plain_masked_argmax(logits: Any, words: Any) -> Any:
    """The masked choice in plain operations: how it was made before `masked_choice`."""
    import mlx.core as mx

    return mx.argmax(apply_token_mask(logits, words), -1)


def plain_argmax(logits: Any) -> Any:
    """An unconstrained greedy choice."""
    import mlx.core as mx

    return mx.argmax(logits, -1)


def engine_greedy_choice(logits: Any, words: Any) -> Any:
    """A greedy row's choice as the engine makes it: the forced token, else the fused argmax."""
    return masked_choice.greedy_choice(logits, words)[0]


@contextlib.contextmanager
def plain_operations() -> Iterator[None]:
    """The engine's masked choice in plain operations, without the forced-token shortcut, while
    inside (the runner thread looks the functions up at every step)."""
    saved = {
        name: getattr(masked_choice, name)
        for name in ("forced_tokens", "masked_argmax", "masked_logits")
    }
    masked_choice.forced_tokens = lambda words, width: [None] * len(words)  # type: ignore[assignment]
    masked_choice.masked_argmax = plain_masked_argmax  # type: ignore[assignment]
    masked_choice.masked_logits = apply_token_mask  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(masked_choice, name, value)


#: the choices timed per token: (name in the report, function of (logits, words (1, n)))
CHOICES: tuple[tuple[str, Any], ...] = (
    ("plain_ops", plain_masked_argmax),
    ("fused", masked_choice.masked_argmax),
    ("engine", engine_greedy_choice),
    ("argmax", lambda logits, words: plain_argmax(logits)),
)


def measure_masks(
    tokenizer: Any, schema: dict[str, Any], tokens: list[int], width: int, dtype: Any
) -> dict[str, Any]:
    """Per token along `tokens`: CPU mask + consume; on the device each of `CHOICES`, its host
    time to build and queue it and its time evaluated alone."""
    import mlx.core as mx

    compiled = GrammarCompiler(tokenizer).compile(OutputFormat.json_schema(schema))
    matcher = compiled.matcher()
    logits = mx.random.normal((1, width)).astype(dtype)
    mx.eval(logits)
    mask_s, consume_s = [], []
    build: dict[str, list[float]] = {name: [] for name, _ in CHOICES}
    queue: dict[str, list[float]] = {name: [] for name, _ in CHOICES}
    alone: dict[str, list[float]] = {name: [] for name, _ in CHOICES}
    forced = 0
    warm = matcher.allowed_words()[None]
    for _ in range(3):  # warm the device kernels (and trace the fused ones)
        for _, choose in CHOICES:
            mx.eval(choose(logits, warm))
    for token in tokens:
        began = time.perf_counter()
        words = matcher.allowed_words()[None]
        mask_s.append(time.perf_counter() - began)
        forced += masked_choice.forced_tokens(words, width)[0] is not None
        for name, choose in CHOICES:
            began = time.perf_counter()
            chosen = choose(logits, words)
            built = time.perf_counter()
            mx.async_eval(chosen)
            queued = time.perf_counter()
            mx.eval(chosen)
            done = time.perf_counter()
            build[name].append(built - began)
            queue[name].append(queued - built)
            alone[name].append(done - began)
        began = time.perf_counter()
        matcher.consume(token)
        consume_s.append(time.perf_counter() - began)
        if matcher.done:
            break
    return {
        "tokens": len(mask_s),
        "forced_tokens": forced,
        "mask_us": [s * 1e6 for s in mask_s],
        "consume_us": [s * 1e6 for s in consume_s],
        "masked_choice_us": [s * 1e6 for s in alone["plain_ops"]],
        "plain_choice_us": [s * 1e6 for s in alone["argmax"]],
        "choices": {
            name: {
                "build_us": [s * 1e6 for s in build[name]],
                "queue_us": [s * 1e6 for s in queue[name]],
                "alone_us": [s * 1e6 for s in alone[name]],
            }
            for name, _ in CHOICES
        },
    }


#: run in every repeat (each repeat starting one further along): unconstrained; under the schema;
#: under it with the masked choice in plain operations and no forced-token shortcut
#: (`plain_operations`)
SYSTEMS = ("plain", "constrained", "before")


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
            turn = repeat % len(SYSTEMS)  # each system goes first in turn
            for system in SYSTEMS[turn:] + SYSTEMS[:turn]:
                with plain_operations() if system == "before" else contextlib.nullcontext():
                    row = await decode_run(engine, messages, n, None if system == "plain" else fmt)
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


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def repeat_ratios(rows: list[dict[str, Any]], system: str, base: str) -> list[float]:
    """Per repeat, `system`'s decode time per token over `base`'s (runs interleaved)."""
    by_repeat: dict[int, dict[str, float]] = {}
    for row in rows:
        by_repeat.setdefault(row["repeat"], {})[row["system"]] = row["per_token_ms"]
    return [
        times[system] / times[base]
        for times in by_repeat.values()
        if system in times and base in times
    ]


#: the per-token choices of `measure_masks`, as the report names them
CHOICE_LABELS = {
    "plain_ops": "masked choice in plain operations (before: unpack, where, argmax)",
    "fused": "fused masked argmax (`masked_choice.masked_argmax`)",
    "engine": "a greedy row's choice as the engine makes it (forced token, else fused)",
    "argmax": "plain argmax (unconstrained)",
}


def render(report: dict[str, Any]) -> str:
    rows = report["decode_rows"]
    plain = [r["per_token_ms"] for r in rows if r["system"] == "plain"]
    constrained = [r["per_token_ms"] for r in rows if r["system"] == "constrained"]
    before = [r["per_token_ms"] for r in rows if r["system"] == "before"]
    ratios = repeat_ratios(rows, "constrained", "plain")
    masks = report["masks"]
    comp = report["compile"]
    step_ms = median(plain)
    mask_us, consume_us = median(masks["mask_us"]), median(masks["consume_us"])
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
        f"| constrained / plain, interleaved (median of {len(ratios)}) | {median(ratios):.3f} |",
    ]
    if before:
        before_ratios = repeat_ratios(rows, "before", "plain")
        gains = repeat_ratios(rows, "constrained", "before")
        lines += [
            f"| constrained decode step before (plain operations, no forced tokens) "
            f"| {median(before):.3f} ms |",
            f"| before / plain, interleaved (median of {len(before_ratios)}) "
            f"| {median(before_ratios):.3f} |",
            f"| constrained / before, interleaved (median of {len(gains)}) | {median(gains):.3f} |",
        ]
    lines += [
        f"| mask computation on the CPU (llguidance) | {mask_us:.1f} µs |",
        f"| advancing the matcher (consume) | {consume_us:.1f} µs |",
        f"| host work a token (mask + consume) / plain step "
        f"| {host_us / 1e3 / step_ms * 100:.2f} % |",
    ]
    choices = masks.get("choices")
    if choices is None:  # a run from before the fused choice
        lines += [
            f"| masked choice, evaluated alone (unpack + where + argmax) "
            f"| {median(masks['masked_choice_us']):.1f} µs |",
            f"| plain argmax, evaluated alone | {median(masks['plain_choice_us']):.1f} µs |",
        ]
    else:
        engine = choices["engine"]
        engine_host = mean(engine["build_us"]) + mean(engine["queue_us"])
        lines += [
            f"| masks that force a token (one allowed: no device work for a greedy row) "
            f"| {masks['forced_tokens']} of {masks['tokens']} |",
            f"| host work a token with the engine's choice (mask + consume + its build and "
            f"queue, mean) / plain step | {(host_us + engine_host) / 1e3 / step_ms * 100:.2f} % |",
            "",
            "The choice on the device, per token along the answer (µs, median / mean): building "
            "its graph and queuing it (`mx.async_eval`: MLX's dispatch) are host time, which "
            "is what a host-bound decode step pays; evaluated alone adds the wait for the "
            "device.",
            "",
            "| choice | build | queue | evaluated alone |",
            "| --- | --- | --- | --- |",
        ]
        for name, label in CHOICE_LABELS.items():
            c = choices[name]
            cells = " | ".join(
                f"{median(c[key]):.1f} / {mean(c[key]):.1f}"
                for key in ("build_us", "queue_us", "alone_us")
            )
            lines.append(f"| {label} | {cells} |")
    lines += [
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
