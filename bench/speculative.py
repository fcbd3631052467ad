"""Draft-model speculative decoding: decode speed, acceptance, and what a step costs.

    # on the H200 (random weights, the shapes other benches use):
    python -m bench.speculative --target synthetic:llama-8b-bf16 --draft synthetic:llama-1b-bf16 \\
        --json $OUT/speculative-8b-1b.json
    # on the CPU, real weights (the bundled 4-bit SmolLM2 drafting for its dense copy):
    python -m bench.speculative --target smollm2-fp32 --draft smollm2 --tokens 64 --repeats 1 \\
        --no-raw --no-oracle

Greedy decoding, one request at a time, each variant interleaved with the others and repeated
(`--repeats`), the median reported:
- `verify`: one target forward pass over 1 token and over K+1 tokens of a `--context`-token cache,
  and one draft step: the cost structure that sets the speed-up; and the K+1-token pass at a key
  length one longer each time, as decoding sees them (`_new_length_ms`: on MLX's CUDA backend a
  new (query, key) length pair of a multi-token attention can cost a cuDNN graph build);
  `_padded_ms`: the same through `padded_attention` (the engine's way on CUDA);
- `engine`: the trio-mlx engine (serialized route; `_batched`: the batched route, max_num_seqs
  64, the GPU default, where the lone row speculates) without a draft, with the draft, with the
  target drafting for itself (acceptance 1, each drafted token costs a target step: the
  overhead's upper bound) and (unless `--no-oracle`) with the draft and a target wrapped so that
  it always agrees with the draft
  (acceptance 1 at the draft's cost: the ceiling a perfect draft of that size reaches; the
  target's forward pass is the real one, a bias on the drafted token is added to its logits);
  with `--draft-layers N` (repeatable; `N` or a list such as `0-11,16-29`, as `trio-mlx serve`
  takes it), also the self-draft (`engine/self_draft.py`: the target's own layers) at its
  measured acceptance (`engine_layersN_draft`) and with the agreeing target
  (`engine_layersN_oracle`: the ceiling of that draft), and its one-token step in `verify`;
- `raw`: mlx-lm's own `generate_step` and `speculative_generate_step` on the same models
  (mlx-lm's acceptance counts tokens flagged as coming from the draft);
- `server` (`--servers`): `mlx_lm.server` without and with `--draft-model` (`--num-draft-tokens
  K`) and `trio-mlx serve` with `--draft-model`, one streaming chat completion each run over
  loopback HTTP, decode tok/s from the client's side (completion tokens after the first over the
  time from the first content to the end); each server started once, kept for the repeats;
- `projection`: decode speed the measured step costs give at acceptance rates 0.5 .. 0.9
  ((1 - a^(K+1)) / (1 - a) tokens per K draft steps and one verification).
With random weights a 1B draft agrees with an 8B target on almost nothing: report speed at the
measured acceptance, the oracle ceiling and the projection, never a random-weight acceptance as
a quality figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from bench.models import resolve_subject

from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.engine.padded_attention import padded_forward
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.engine.self_draft import describe_layers, parse_layers, self_draft

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the weather, the sea and what the message says."
)


class AgreeingTarget:
    """The target, its logits at each position but the last biased towards the next input
    token: during verification every drafted token is the target's choice."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        logits = self._inner(tokens, cache=cache)
        length = tokens.shape[1]
        if 1 < length <= 16:
            width = logits.shape[-1]
            nxt = tokens[:, 1:, None].astype(mx.int32)
            bias = (mx.arange(width)[None, None, :] == nxt).astype(logits.dtype) * 1e4
            zero = mx.zeros((logits.shape[0], 1, width), dtype=logits.dtype)
            logits = logits + mx.concatenate([bias, zero], axis=1)
        return logits


def timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up: kernels and shapes
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def verify_costs(target: Any, draft: Any, k: int, context: int, repeats: int) -> dict[str, float]:
    """Milliseconds: a target pass of 1 and of K+1 tokens, a draft pass of 1, at `context`."""

    def cache_of(model: Any) -> list[Any]:
        cache = make_cache(model)
        model(mx.zeros((1, context), dtype=mx.uint32), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def one_pass(model: Any, cache: list[Any], n: int) -> None:
        mx.eval(model(mx.ones((1, n), dtype=mx.uint32), cache=cache))
        for layer in cache:
            layer.trim(n)

    def growing_pass(model: Any, cache: list[Any], n: int, padded: bool = False) -> None:
        # As in decoding: each verification sees a key length it has not seen before (on MLX's
        # CUDA backend a new attention shape may build a cuDNN graph).
        tokens = mx.ones((1, n), dtype=mx.uint32)
        mx.eval(padded_forward(model, tokens, cache) if padded else model(tokens, cache=cache))
        for layer in cache:
            layer.trim(n - 1)

    t_cache, d_cache = cache_of(target), cache_of(draft)
    g_cache, p_cache = cache_of(target), cache_of(target)
    out = {
        f"target_{k + 1}_new_length_padded_ms": 1e3
        * timed(lambda: growing_pass(target, p_cache, k + 1, True), repeats * 10),
        f"target_{k + 1}_new_length_ms": 1e3
        * timed(lambda: growing_pass(target, g_cache, k + 1), repeats * 10),
        "target_1_ms": 1e3 * timed(lambda: one_pass(target, t_cache, 1), repeats * 10),
        f"target_{k + 1}_ms": 1e3 * timed(lambda: one_pass(target, t_cache, k + 1), repeats * 10),
        "draft_1_ms": 1e3 * timed(lambda: one_pass(draft, d_cache, 1), repeats * 10),
    }
    out["verify_over_step"] = out[f"target_{k + 1}_ms"] / out["target_1_ms"]
    return out


def projection(costs: dict[str, float], k: int, rates: list[float]) -> dict[str, float]:
    """Decode tok/s at each acceptance rate, and plain decoding's, from the step costs."""
    plain = 1e3 / costs["target_1_ms"]
    step_ms = k * costs["draft_1_ms"] + costs[f"target_{k + 1}_ms"]
    out = {"plain_tok_s": plain}
    for a in rates:
        tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
        out[f"a={a:g}_tok_s"] = 1e3 * tokens / step_ms
    out["a=1_tok_s"] = 1e3 * (k + 1) / step_ms
    return out


async def engine_decode(
    target: LoadedModel,
    draft: LoadedModel | None,
    k: int,
    tokens: int,
    temperature: float,
    max_num_seqs: int = 1,
) -> dict[str, float]:
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS

    options: dict[str, Any] = {
        **SERVER_PROCESS_SETTINGS,
        "max_num_seqs": max_num_seqs,
        "cache_memory_bytes": 0,
    }
    if draft is not None:
        options.update(draft_model="draft", num_draft_tokens=k)

    def loader(spec: Any) -> LoadedModel:
        return draft if spec == "draft" and draft is not None else target

    async with trio_mlx.open_engine("target", loader=loader, **options) as engine:
        messages = [{"role": "user", "content": PROMPT}]
        await engine.chat(messages, max_tokens=8, temperature=0)  # warm-up
        out = await engine.chat(messages, max_tokens=tokens, temperature=temperature, seed=0)
        stats = engine.get_stats()["speculative"] or {}
    return {
        "decode_tok_s": out.generation_tps or 0.0,
        "ttft_ms": 1e3 * (out.time_to_first_token or 0.0),
        "tokens": out.completion_tokens,
        "acceptance_rate": stats.get("acceptance_rate", float("nan")),
        "tokens_per_step": stats.get("tokens_per_step", float("nan")),
    }


def raw_decode(
    target: Any, draft: Any | None, tokenizer: Any, k: int, tokens: int
) -> dict[str, float]:
    from mlx_lm.generate import generate_step, speculative_generate_step

    prompt = mx.array(tokenizer.encode(PROMPT), dtype=mx.uint32)
    steps: Any
    if draft is None:
        steps = generate_step(prompt, target, max_tokens=tokens)
    else:
        steps = speculative_generate_step(
            prompt, target, draft, num_draft_tokens=k, max_tokens=tokens
        )
    began = None
    n = drafted = 0
    for item in steps:
        if began is None:
            began = time.perf_counter()  # after the first token: decode only
            continue
        n += 1
        if draft is not None and item[2]:
            drafted += 1
    elapsed = time.perf_counter() - (began or time.perf_counter())
    return {
        "decode_tok_s": n / elapsed if elapsed > 0 else 0.0,
        "tokens": n + 1,
        "from_draft": drafted / n if n and draft is not None else float("nan"),
    }


class ServerSide:
    """One OpenAI-compatible server on the target (with the draft where `argv` says), started on
    first use and kept until `close`."""

    def __init__(self, name: str, system: str, argv: list[str], workdir: Path) -> None:
        from bench.compare import Server, free_port

        port = free_port()
        host = ["--host", "127.0.0.1", "--port", str(port)]
        # `system`: bench.compare's name of the server kind (how it is asked its model's name)
        self.server = Server(system, [*argv, *host], port, workdir / f"{name}.log", "model")
        self.name = name
        self.model: str | None = None

    def decode(self, tokens: int) -> dict[str, float]:
        from bench.compare import served_name, server_env, wait_ready

        if self.model is None:
            self.server.start(server_env())
            try:
                trio.run(wait_ready, self.server, 300.0)
            except BaseException:
                self.server.stop()
                raise
            self.model = trio.run(served_name, self.server)
            self._chat(8)  # warm-up
        return self._chat(tokens)

    def _chat(self, tokens: int) -> dict[str, float]:
        import httpx

        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        began = time.perf_counter()
        first = None
        chunks = 0
        usage = None
        url = self.server.base_url + "/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{self.name}: {response.status_code}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
        end = time.perf_counter()
        count = int(usage["completion_tokens"]) if usage else chunks
        if first is None or count < 2:
            raise RuntimeError(f"{self.name}: no text")
        return {
            "decode_tok_s": (count - 1) / (end - first),
            "ttft_ms": 1e3 * (first - began),
            "tokens": count,
        }

    def close(self) -> None:
        self.server.stop()


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="synthetic:llama-8b-bf16")
    parser.add_argument("--draft", default="synthetic:llama-1b-bf16")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--tokens", type=int, default=256, help="tokens to generate per run")
    parser.add_argument("--context", type=int, default=512, help="cache length for `verify`")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="the engine's sampling (mlx-lm's: greedy)"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--no-raw", action="store_true", help="skip mlx-lm's own loops")
    parser.add_argument("--no-oracle", action="store_true", help="skip the agreeing target")
    parser.add_argument("--no-self", action="store_true", help="skip the self-draft")
    parser.add_argument(
        "--draft-layers",
        type=parse_layers,
        action="append",
        default=[],
        help="also the target's own layers as its draft: its first N, or a list such as "
        "0-11,16-29 (engine/self_draft.py); repeatable",
    )
    parser.add_argument(
        "--no-batched", action="store_true", help="skip the batched route (max_num_seqs 64)"
    )
    parser.add_argument(
        "--servers",
        action="store_true",
        help="also mlx_lm.server without and with --draft-model, and trio-mlx serve with it",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    target_dir = resolve_subject(args.target, args.workdir)
    draft_dir = resolve_subject(args.draft, args.workdir)
    target = load_model(target_dir.path)
    draft = load_model(draft_dir.path)
    agreeing = LoadedModel(**{**target.__dict__, "model": AgreeingTarget(target.model)})
    k = args.k
    report: dict[str, Any] = {
        "target": target_dir.description,
        "draft": draft_dir.description,
        "k": k,
        "tokens": args.tokens,
        "temperature": args.temperature,
        "device": str(mx.default_device()),
    }
    costs = verify_costs(target.model, draft.model, k, args.context, args.repeats)
    cuts: dict[str, LoadedModel] = {}
    for layers in args.draft_layers:
        n = describe_layers(layers)
        cuts[n] = self_draft(target, layers)
        costs[f"draft_layers{n}_1_ms"] = verify_costs(
            target.model, cuts[n].model, k, args.context, args.repeats
        )["draft_1_ms"]
    report["draft_layers"] = list(cuts)
    report["verify"] = costs
    report["projection"] = projection(costs, k, [0.5, 0.6, 0.7, 0.8, 0.9])
    print(json.dumps({"verify": costs, "projection": report["projection"]}, indent=1), flush=True)

    variants: dict[str, Any] = {
        "engine_plain": lambda: trio.run(
            engine_decode, target, None, k, args.tokens, args.temperature
        ),
        "engine_draft": lambda: trio.run(
            engine_decode, target, draft, k, args.tokens, args.temperature
        ),
    }
    if not args.no_batched:  # the GPU default route: a lone row of the batch speculates
        variants["engine_plain_batched"] = lambda: trio.run(
            engine_decode, target, None, k, args.tokens, args.temperature, 64
        )
        variants["engine_draft_batched"] = lambda: trio.run(
            engine_decode, target, draft, k, args.tokens, args.temperature, 64
        )
    if not args.no_self:
        variants["engine_self_draft"] = lambda: trio.run(
            engine_decode, target, target, k, args.tokens, args.temperature
        )
    if not args.no_oracle:
        variants["engine_oracle_draft"] = lambda: trio.run(
            engine_decode, agreeing, draft, k, args.tokens, args.temperature
        )
    for n, cut in cuts.items():
        variants[f"engine_layers{n}_draft"] = lambda cut=cut: trio.run(
            engine_decode, target, cut, k, args.tokens, args.temperature
        )
        variants[f"engine_layers{n}_oracle"] = lambda cut=cut: trio.run(
            engine_decode, agreeing, cut, k, args.tokens, args.temperature
        )
    if not args.no_raw:
        tok = target.tokenizer
        variants["mlx_lm_plain"] = lambda: raw_decode(target.model, None, tok, k, args.tokens)
        variants["mlx_lm_draft"] = lambda: raw_decode(
            target.model, draft.model, tok, k, args.tokens
        )
        if not args.no_oracle:
            variants["mlx_lm_oracle_draft"] = lambda: raw_decode(
                agreeing.model, draft.model, tok, k, args.tokens
            )
    servers: list[ServerSide] = []
    if args.servers:
        target_path, draft_path = str(target_dir.path), str(draft_dir.path)
        draft_args = ["--draft-model", draft_path, "--num-draft-tokens", str(k)]
        mlx_lm = [sys.executable, "-m", "mlx_lm.server", "--model", target_path]
        trio_mlx = [sys.executable, "-m", "trio_mlx", "serve", target_path]
        for name, system, argv_ in (
            ("mlx_lm_server_plain", "mlx_lm_server", mlx_lm),
            ("mlx_lm_server_draft", "mlx_lm_server", [*mlx_lm, *draft_args]),
            ("trio_mlx_serve_draft", "http", [*trio_mlx, *draft_args]),
        ):
            side = ServerSide(name, system, argv_, args.workdir)
            servers.append(side)
            variants[name] = lambda side=side: side.decode(args.tokens)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    names = list(variants)
    try:
        for repeat in range(args.repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in order:
                runs[name].append(variants[name]())
                print(name, json.dumps(runs[name][-1]), flush=True)
    finally:
        for side in servers:
            side.close()
    results = {name: median_of(r) for name, r in runs.items()}
    plain = results["engine_plain"]["decode_tok_s"]
    for r in results.values():
        r["speedup_vs_engine_plain"] = r["decode_tok_s"] / plain if plain else float("nan")
    report["results"] = results
    text = json.dumps(report, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
