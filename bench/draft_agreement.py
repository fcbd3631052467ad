"""How often a self-draft would be accepted: top-1 agreement of the target's own layers with the
whole target, on real weights (`engine/self_draft.py`, `--draft-layers`).

    python -m bench.draft_agreement --model smollm2-fp32 --draft-layers 8 --draft-layers 26 \\
        --draft-layers 0-12,17-29 --json docs/benchmarks/<name>.json

The target decodes greedily `--tokens` tokens after each of a few chat prompts; then the target
and each draft score every prompt and its continuation in one forward pass, and the figure is
the share of the continuation's positions where the draft's argmax is the target's token: the
acceptance rate of a first drafted token under greedy decoding (later drafts in a step see the
draft's own tokens, so a step's acceptance is at most this, compounding). A draft's cost on a
GPU bound by launching kernels is about its share of the layers. Random weights make this
meaningless: use a model with real weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from bench.models import resolve_subject
from mlx_lm.generate import generate_step

from trio_mlx.engine.loading import load_model
from trio_mlx.engine.self_draft import cut_model, describe_layers, layer_count, parse_layers

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the weather, the sea and what the message says.",
    "Explain how a hash table works and when you would use one instead of a sorted array.",
    "List five things to check before a long bicycle ride, with a sentence on each.",
]


def continuations(model: Any, tokenizer: Any, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation) for each prompt."""
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        generated = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=tokens)]
        out.append((list(ids), generated))
    return out


def agreement(draft: Any, texts: list[tuple[list[int], list[int]]]) -> float:
    """Share of continuation positions where `draft`'s argmax is the target's token."""
    agree = total = 0
    for ids, generated in texts:
        logits = draft(mx.array([ids + generated[:-1]], dtype=mx.uint32))
        predicted = mx.argmax(logits[0, len(ids) - 1 :], axis=-1).tolist()
        agree += sum(int(a == b) for a, b in zip(predicted, generated, strict=True))
        total += len(generated)
    return agree / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-fp32")
    parser.add_argument(
        "--draft-layers", type=parse_layers, action="append", required=True, help="repeatable"
    )
    parser.add_argument("--tokens", type=int, default=96, help="continuation tokens a prompt")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    subject = resolve_subject(args.model, args.workdir)
    loaded = load_model(subject.path)
    total = layer_count(loaded.model) or 0
    began = time.perf_counter()
    texts = continuations(loaded.model, loaded.tokenizer, args.tokens)
    rows = []
    for layers in args.draft_layers:
        draft = cut_model(loaded.model, layers)
        kept = len(draft.model.layers)
        row = {
            "draft_layers": describe_layers(layers),
            "layers_kept": kept,
            "share_of_layers": kept / total,
            "top1_agreement": agreement(draft, texts),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "model": subject.description,
        "layers": total,
        "prompts": len(PROMPTS),
        "tokens": args.tokens,
        "device": str(mx.default_device()),
        "seconds": time.perf_counter() - began,
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
