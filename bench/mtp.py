"""Native MTP speculative decoding (`--mtp`): decode speed with the model's own MTP head drafting.

    # on the H200 (random weights, a dense DeepSeek-V3 shape of ~8B parameters, bf16):
    python -m bench.mtp --shape 8b --k 4 --json $OUT/mtp-8b.json
    # on the CPU, a smoke run:
    python -m bench.mtp --shape tiny --tokens 32 --repeats 1

Greedy decoding, one request at a time on the engine's serialized route, each variant repeated
(`--repeats`, median reported), on one in-memory `deepseek_v3` model with an MTP layer:
- `plain`: the model decoding without `--mtp` (the MTP layer loaded, unused);
- `mtp_random`: `--mtp` with the random MTP layer: its drafts are almost never accepted, so this
  is the cost of drafting K tokens and verifying K+1 for ~1 token a step (the lower bound);
- `mtp_always_right`: the same shapes with the main layers' output projections zeroed, the head
  tied to the embedding and an "echo" MTP layer (as in tests/tiny_mtp_model.py), so that the
  target repeats its input token and every draft is accepted; zeroed weights cost the same
  FLOPs, so this is the speed at acceptance 1 (the upper bound a real MTP head approaches);
  `plain_always_right` is its own baseline.
Random weights make acceptance meaningless as a quality figure: report the two bounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from bench.models import write_tokenizer
from mlx.utils import tree_flatten, tree_unflatten

from trio_mlx.engine.loading import LoadedModel

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the weather, the sea and what the message says."
)

_BASE = {
    "model_type": "deepseek_v3",
    "vocab_size": 49152,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": None,
    "n_shared_experts": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": 768,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
    },
}


def build(shape: str, workdir: Path, *, always_right: bool, dtype: Any) -> LoadedModel:
    """An in-memory deepseek_v3 with its MTP module, random (or "always right") weights."""
    from mlx_lm.models import deepseek_v3
    from mlx_lm.utils import load_tokenizer

    from trio_mlx.engine.mtp import DeepseekV3WithMtp

    config = {**_BASE, **SHAPES[shape]}
    args = deepseek_v3.ModelArgs.from_dict(config)
    mx.random.seed(0)
    model = DeepseekV3WithMtp(args)
    params = dict(tree_flatten(model.parameters()))
    if always_right:
        width = args.hidden_size
        for key in list(params):
            if key.endswith(("o_proj.weight", "down_proj.weight")):
                params[key] = mx.zeros_like(params[key])
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
        eye = mx.concatenate([mx.zeros((width, width)), mx.eye(width)], axis=1)
        params["mtp.eh_proj.weight"] = eye
    model.update(tree_unflatten([(k, v.astype(dtype)) for k, v in params.items()]))
    mx.eval(model.parameters())
    tokenizer_dir = workdir / "mtp-tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        tokenizer_dir.mkdir(parents=True, exist_ok=True)
        write_tokenizer(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir, eos_token_ids=2)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"synthetic-deepseek_v3-{shape}",
        path=tokenizer_dir,
        config=config,
        context_length=8192,
        eos_token_ids=frozenset(int(t) for t in tokenizer.eos_token_ids),
    )


async def engine_decode(loaded: LoadedModel, mtp: bool, k: int, tokens: int) -> dict[str, float]:
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS

    options: dict[str, Any] = {**SERVER_PROCESS_SETTINGS, "max_num_seqs": 1}
    options["cache_memory_bytes"] = 0
    if mtp:
        options.update(mtp=True, mtp_num_draft_tokens=k)

    def loader(spec: Any, **_: Any) -> LoadedModel:
        return loaded

    async with trio_mlx.open_engine("target", loader=loader, **options) as engine:
        await engine.generate(PROMPT, max_tokens=8, temperature=0.0)  # warm-up
        out = await engine.generate(PROMPT, max_tokens=tokens, temperature=0.0)
        stats = engine.get_stats()["speculative"] or {}
    figures = {"decode_tok_s": out.generation_tps or 0.0, "tokens": float(out.completion_tokens)}
    if stats:
        figures["acceptance_rate"] = float(stats["acceptance_rate"])
        figures["tokens_per_step"] = float(stats["tokens_per_step"])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--k", type=int, default=4, help="MTP draft tokens per step")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    results: dict[str, Any] = {"shape": args.shape, "k": args.k, "dtype": args.dtype}
    for always_right in (False, True):
        loaded = build(args.shape, args.workdir, always_right=always_right, dtype=dtype)
        suffix = "always_right" if always_right else "random"
        for name, mtp in ((f"plain_{suffix}", False), (f"mtp_{suffix}", True)):
            runs = [
                trio.run(engine_decode, loaded, mtp, args.k, args.tokens)
                for _ in range(args.repeats)
            ]
            results[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(name, json.dumps(results[name]), file=sys.stderr)
        del loaded
        mx.clear_cache()
    for suffix in ("random", "always_right"):
        plain = results[f"plain_{suffix}"]["decode_tok_s"]
        results[f"speedup_{suffix}"] = results[f"mtp_{suffix}"]["decode_tok_s"] / plain
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
