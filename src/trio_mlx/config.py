"""Engine configuration, fixed at engine creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trio_mlx.actors.admission import AdmissionMode
from trio_mlx.engine.mlx_cuda import SDPA_GRAPH_CACHE
from trio_mlx.multimodal.media import MediaPolicy

#: The drafter kinds of mlx-vlm's speculative loop (`mllm_draft_kind`;
#: `multimodal.drafted.DRAFT_KINDS`, kept apart so that the config imports no MLX code).
MLLM_DRAFT_KINDS = ("dflash", "eagle3", "mtp")

#: The process-wide settings a server process turns on (`EngineConfig` fields): a short GIL
#: switch interval (measured on the tiny model: first-token delivery 1.8 ms -> 0.2 ms) and a
#: large cuDNN attention-graph cache.
SERVER_PROCESS_SETTINGS: dict[str, float | int] = {
    "gil_switch_interval": 0.0005,
    "cuda_sdpa_graph_cache": SDPA_GRAPH_CACHE,
    "freeze_gc": True,
}


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is built.

    - `model`: an mlx-lm directory, a Hugging Face repo id in the local cache, a `.gguf` file, or
      None for the bundled default (SmolLM2-135M-Instruct).
    - `admission`: `"fail-fast"` refuses a request at once with `EngineBusy` while another one
      generates (the default); `"wait"` queues up to `max_waiting` requests, each for at most
      `max_wait` seconds. None picks `"wait"` when `max_waiting > 0`, else `"fail-fast"`.
    - `prefill_step_size`: at most this many prompt tokens per prefill chunk (chunks are sized
      by `prefill_chunk_seconds`); aborts take effect between chunks.
    - `fused_tail_tokens`: a prompt rest of at most this many tokens goes through the model in
      the first token's forward pass (1: the last token alone, as mlx-lm). None: 1,024 on MLX's
      CUDA backend, 64 on another GPU, 1 on the CPU (`decode.PrefillPlan.choose` says why).
    - `prefill_block`: prefill forward passes start and end on multiples of this many tokens (the
      last one padded, the padding cut off the cache again), so that the attention kernels see few
      distinct shapes. None: 64 on MLX's CUDA backend, which builds a cuDNN graph for each new
      shape, and 1 (off) elsewhere.
    - `default_max_tokens`: completion budget when a request names none.
    - `max_tokens_limit`: a server-wide cap; a request asking for more is refused.
    - `max_kv_size`: bound each sequence's KV cache to this many tokens (a rotating cache that
      keeps the first tokens and the most recent ones), for long generations in bounded memory.
    - `cache_memory_bytes`: memory budget of the prefix KV cache (snapshots of computed prompts
      reused by later requests that start with the same tokens). None: half the size of the
      model's weights, between 256 MiB and 8 GiB; 0 disables the cache.
    - `max_num_seqs`: up to this many sequences decode together, one forward pass per step
      (continuous batching); 1 is the serialized route, one generation at a time. None:
      `batch_sizing.GPU_MAX_NUM_SEQS` (64) on a GPU, `batch_sizing.CPU_MAX_NUM_SEQS` (8) on the
      CPU (where the aggregate stops growing much past 8 while each stream slows).
    - `kv_memory_bytes`: memory budget for the running sequences' KV caches, each counted at its
      token limit (prompt + max_tokens, bounded by `max_kv_size`); admission queues or refuses a
      request that would exceed it. None: half of the device's memory left after the weights
      (the machine's memory on the CPU); 0: no accounting.
    - `prefill_chunk_seconds`: a prefill chunk is sized to take about this long (measured), so
      an abort or a cancel frees the runner within about that time on any backend.
    - `force_mllm`: load the model through mlx-vlm even if its config does not say it is a
      vision-language model (vllm-mlx's `force_mllm`; `--mllm`).
    - `mllm_draft_model`: on a vision-language model, an mlx-vlm drafter (a DFlash, EAGLE-3 or
      MTP checkpoint mlx-vlm loads, e.g. `qwen3_dflash` or `qwen3_5_mtp` for a Qwen3.5 target;
      vllm-mlx's `mllm_draft_model`) that decodes its requests with media through mlx-vlm's
      speculative loop (`multimodal.drafted`: lossless for greedy requests; no prefix cache for
      them; requests asking for logprobs, penalties, logit bias, logits processors or a grammar
      decode without it). Checked against the target at load (`ModelLoadError` when mlx-vlm
      cannot pair them; so is a text model). Text-only requests never use it.
      `mllm_draft_kind`: `"dflash"`, `"eagle3"` or `"mtp"`; None (the default) lets mlx-vlm
      resolve it from the drafter's config (mlx-vlm also overrides a kind the drafter's model
      type contradicts). `mllm_draft_block_size`: tokens drafted a round (None: the drafter's).
    - `media`: what requests with images or video may make the engine fetch and decode
      (`multimodal.media.MediaPolicy`: local files only under `allowed_local_dir`, private and
      loopback URLs only with `allow_private_urls`, size, time and redirect limits, the number
      of media, video frame sampling).
    - `draft_model`: a smaller model with the same tokenizer (any spec `model` takes) that drafts
      `num_draft_tokens` tokens per step for the target to verify in one forward pass
      (speculative decoding, lossless: `engine/speculative.py`). On the batched route it drafts
      only while one sequence decodes. Cannot be combined with `max_kv_size` (a rotating cache
      cannot be cut back after a refused draft). None: no draft.
    - `draft_layers`: self-speculative decoding: the target's own first `draft_layers` layers
      (or, a tuple, the indices of the layers kept, ascending), then its final norm and head,
      draft `num_draft_tokens` tokens a step (no second model,
      no copied weights; a KV cache of those layers of its own: `engine/self_draft.py`), verified
      as a draft model's are. How often they agree depends on the checkpoint. Not with
      `draft_model`, `mtp` or `max_kv_size`. None: no self-draft.
    - `mtp`: native multi-token prediction: the model's own MTP head (checkpoints of DeepSeek-V3,
      GLM-4.5/4.6 MoE, GLM-4.7-Flash or MiMo that carry `num_nextn_predict_layers` weights,
      which mlx-lm drops and this engine keeps: `engine/mtp.py`) drafts `mtp_num_draft_tokens`
      tokens per step for the model to verify, with the same lossless acceptance as
      `draft_model`. Refused at start-up for a model without MTP weights; not with `draft_model`
      or `max_kv_size`. On the batched route it drafts only while one sequence decodes (several
      decode plainly).
    - `specprefill_enabled`: SpecPrefill (`engine/specprefill.py`, approximate): a prompt of at
      least `specprefill_threshold` tokens is scored by the attention of a small model
      (`specprefill_draft_model`; else the model's own layers, `specprefill_draft_layers`, as
      GemFilter scores with a model's early layers; else `draft_model`; else the self-draft's
      layers, `draft_layers`: one is needed) and the target prefills only
      `specprefill_keep_pct` of it (always the last tokens and the first
      `specprefill_backbone_pct`) at their true positions. Requests may override it
      (`specprefill`, `specprefill_keep_pct`). Both routes: on the batched one a long prompt is
      scored and sparsely prefilled on a cache of its own while it waits to join the batch, a
      chunk a loop pass, then decodes in the batch at its true positions
      (`engine/batch_specprefill.py`). Cannot be combined with `max_kv_size`.
    - `compiled_decode`: fuse each layer's q/k/v and gate/up projections at load, and decode
      through a step traced once per KV length bucket and replayed (the serialized route; the
      batched route with `TRIO_MLX_COMPILED_BATCH=on`, `engine/fast_decode.py` says why); llama,
      qwen2 and qwen3 models with an unbounded KV cache and no draft model, else the plain path.
      None: off. Measured on the H200 (`bench.compiled_decode`, docs/benchmarks/README.md,
      "Compiled decode"): the traced step's replay dispatches more slowly than the plain step
      builds and dispatches, 0.60–0.93x its tok/s; it stays an experiment.
    - `traced_batch_rows`: on the batched route, batches of 2 to this many rows decode through
      a step traced once per (rows, KV bucket) at load and replayed (`engine/fast_decode.py`):
      there the plain step is bound by the host building it. A lone row, larger batches and
      passes that carry prompt chunks take the plain step. None: 0 (off). On an H100, 1.24-1.79x
      the plain step at 2-8 rows on the 1B bf16 shape (2 streams through HTTP: 1.42x the
      aggregate), mixed on the 8B; each (rows, bucket) is traced and run at load, which costs
      start-up time. Logits differ from the plain step's by rounding.
    - `fused_projections`: fuse each layer's q/k/v and gate/up projections at load
      (`engine/fused.py`: two matrix products a layer where there were five), the plain decode
      step otherwise; also the draft model's. None: on where MLX runs on a GPU and the
      projections are not quantized (H200, the same bench: 1.07–1.44x the plain step on the
      bf16 shapes, 0.93–1.01x on 4-bit), off on the CPU (where arithmetic, not kernel
      launches, sets a step's time).
    - `lean_decode`: a lone sequence's one-token steps (either route) go through the lean step
      (`engine/lean_step.py`: the model's own arithmetic, for mlx-lm's llama, qwen2 and qwen3,
      in ~40% fewer graph nodes: on a GPU a batch-1 step costs the host per node). None: on
      where MLX runs on a GPU, off on the CPU. Ignored where `compiled_decode` serves.
    - `dequantize_from_rows`: a quantized layer multiplies an input of at least this many rows
      (the sequences of a decode batch, the tokens of a prefill chunk) by its weight dequantized
      for the one product, a dense matrix product, instead of MLX's quantized kernel, whose cost
      on CUDA grows with every row (`engine/quantized_rows.py` says why); fewer rows take the
      quantized kernel with the rows folded into one matrix. Also the draft and SpecPrefill
      scoring models. None: 128 on MLX's CUDA backend (`quantized_rows.CUDA_DEQUANTIZE_FROM_ROWS`),
      off elsewhere; 0: off.
    Process-wide settings, changed only when asked (an engine opened inside someone else's
    program leaves the process as it found it); `trio-mlx serve` and the benchmarks ask for them
    (`SERVER_PROCESS_SETTINGS`):
    - `gil_switch_interval`: while the engine runs, lower `sys.setswitchinterval` to this (seconds)
      so that tokens reach the event loop without waiting for the runner thread's GIL slice
      (put back on exit). None (the default) leaves the interpreter's setting alone.
    - `cuda_sdpa_graph_cache`: before the model loads, set `MLX_CUDA_SDPA_CACHE_SIZE` to this
      unless the environment already sets it: how many cuDNN attention graphs MLX's CUDA
      backend keeps (`engine/mlx_cuda.py` says why 1,024). None (the default): left alone.
    - `cuda_graphs`: before the model loads, set `MLX_USE_CUDA_GRAPHS` (1 or 0) unless the
      environment already sets it: MLX's CUDA graphs make one stream faster and a batch of
      many slower (`mlx_cuda.use_cuda_graphs` has the figures). None (the default, also for
      `trio-mlx serve`): left alone, MLX's default (on).
    - `freeze_gc`: once the model is loaded, collect and then freeze the objects alive then
      (`gc.freeze`: the model's modules, the tokenizer, the libraries), so that the cyclic
      collector's full passes scan only what requests create. A full pass over an engine
      process's ~92,000 objects took 30 ms on a 2-core CPU (0.0 ms once frozen), and it stops
      every thread, the runner's included: a step that long, whenever the objects that survive
      collections reach a quarter of the long-lived ones. Put back (`gc.unfreeze`) when the
      engine closes. False (the default): left alone.
    """

    model: str | Path | None = None
    admission: AdmissionMode | None = None
    max_waiting: int = 0
    max_wait: float = 30.0
    prefill_step_size: int = 2048
    prefill_block: int | None = None
    fused_tail_tokens: int | None = None
    default_max_tokens: int = 256
    max_tokens_limit: int | None = None
    max_kv_size: int | None = None
    cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None
    kv_memory_bytes: int | None = None
    prefill_chunk_seconds: float = 0.25
    compiled_decode: bool | None = None
    traced_batch_rows: int | None = None
    fused_projections: bool | None = None
    lean_decode: bool | None = None
    dequantize_from_rows: int | None = None
    gil_switch_interval: float | None = None
    cuda_sdpa_graph_cache: int | None = None
    cuda_graphs: bool | None = None
    freeze_gc: bool = False
    force_mllm: bool = False
    mllm_draft_model: str | Path | None = None
    mllm_draft_kind: str | None = None
    mllm_draft_block_size: int | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    draft_model: str | Path | None = None
    draft_layers: int | tuple[int, ...] | None = None
    num_draft_tokens: int = 4
    mtp: bool = False
    mtp_num_draft_tokens: int = 4
    specprefill_enabled: bool = False
    specprefill_threshold: int = 8192
    specprefill_keep_pct: float = 0.3
    specprefill_backbone_pct: float = 0.05
    specprefill_draft_model: str | Path | None = None
    specprefill_draft_layers: int | tuple[int, ...] | None = None

    @property
    def specprefill_scorer(self) -> str | Path | None:
        """The model SpecPrefill scores prompts with (None when SpecPrefill is off, or when the
        model's own layers score: `specprefill_scorer_layers`)."""
        if not self.specprefill_enabled:
            return None
        if self.specprefill_draft_model is not None or self.specprefill_draft_layers is not None:
            return self.specprefill_draft_model
        return self.draft_model

    @property
    def specprefill_scorer_layers(self) -> int | tuple[int, ...] | None:
        """The model's own layers SpecPrefill scores with, where no scoring model is named:
        `specprefill_draft_layers`, else the self-draft's (`draft_layers`)."""
        if not self.specprefill_enabled or self.specprefill_scorer is not None:
            return None
        if self.specprefill_draft_layers is not None:
            return self.specprefill_draft_layers
        return self.draft_layers

    @property
    def admission_mode(self) -> AdmissionMode:
        if self.admission is not None:
            return self.admission
        return "wait" if self.max_waiting > 0 else "fail-fast"

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        if self.prefill_block is not None and self.prefill_block < 1:
            raise ValueError("prefill_block must be >= 1")
        if self.fused_tail_tokens is not None and self.fused_tail_tokens < 1:
            raise ValueError("fused_tail_tokens must be >= 1")
        if self.max_wait <= 0:
            raise ValueError("max_wait must be > 0")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1")
        if self.max_kv_size is not None and self.max_kv_size < 8:
            raise ValueError("max_kv_size must be >= 8")
        if self.cache_memory_bytes is not None and (
            isinstance(self.cache_memory_bytes, bool)
            or not isinstance(self.cache_memory_bytes, int)
            or self.cache_memory_bytes < 0
        ):
            raise ValueError("cache_memory_bytes must be an integer >= 0 (0 disables the cache)")
        if self.gil_switch_interval is not None and not self.gil_switch_interval > 0:
            raise ValueError("gil_switch_interval must be > 0 seconds (or None)")
        if self.dequantize_from_rows is not None and (
            isinstance(self.dequantize_from_rows, bool)
            or not isinstance(self.dequantize_from_rows, int)
            or self.dequantize_from_rows < 0
        ):
            raise ValueError("dequantize_from_rows must be an integer >= 0 (0: off) or None")
        if self.cuda_sdpa_graph_cache is not None and self.cuda_sdpa_graph_cache < 1:
            raise ValueError("cuda_sdpa_graph_cache must be >= 1 (or None)")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None, not {self.cuda_graphs!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 0:
            raise ValueError("kv_memory_bytes must be >= 0 (0: no accounting)")
        if self.prefill_chunk_seconds <= 0:
            raise ValueError("prefill_chunk_seconds must be > 0")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.traced_batch_rows is not None and self.traced_batch_rows < 0:
            raise ValueError("traced_batch_rows must be >= 0 (0: off)")
        if self.num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be >= 1")
        if self.mtp_num_draft_tokens < 1:
            raise ValueError("mtp_num_draft_tokens must be >= 1")
        if self.mtp and self.draft_model is not None:
            raise ValueError("mtp cannot be combined with draft_model: one drafter at a time")
        _check_layers("draft_layers", self.draft_layers)
        if self.draft_layers is not None and (self.draft_model is not None or self.mtp):
            raise ValueError(
                "draft_layers cannot be combined with draft_model or mtp: one drafter at a time"
            )
        drafters = {
            "mtp": self.mtp,
            "draft_model": self.draft_model is not None,
            "draft_layers": self.draft_layers is not None,
        }
        drafter = next((name for name, on in drafters.items() if on), None)
        if drafter is not None and self.max_kv_size is not None:
            raise ValueError(
                f"{drafter} cannot be combined with max_kv_size: speculative decoding cuts the "
                "KV cache back after refused drafts, which a rotating cache cannot do"
            )
        if self.mllm_draft_kind is not None and self.mllm_draft_kind not in MLLM_DRAFT_KINDS:
            raise ValueError(f"mllm_draft_kind must be one of {', '.join(MLLM_DRAFT_KINDS)}")
        if self.mllm_draft_block_size is not None and self.mllm_draft_block_size < 1:
            raise ValueError("mllm_draft_block_size must be >= 1")
        if self.mllm_draft_model is None and (
            self.mllm_draft_kind is not None or self.mllm_draft_block_size is not None
        ):
            raise ValueError("mllm_draft_kind and mllm_draft_block_size need mllm_draft_model")
        if self.specprefill_threshold < 1:
            raise ValueError("specprefill_threshold must be >= 1")
        if not 0.0 < self.specprefill_keep_pct <= 1.0:
            raise ValueError("specprefill_keep_pct must be greater than 0 and at most 1")
        if not 0.0 <= self.specprefill_backbone_pct <= 1.0:
            raise ValueError("specprefill_backbone_pct must be from 0 to 1")
        _check_layers("specprefill_draft_layers", self.specprefill_draft_layers)
        if self.specprefill_draft_layers is not None and self.specprefill_draft_model is not None:
            raise ValueError(
                "specprefill_draft_model and specprefill_draft_layers cannot be combined: "
                "one scoring model"
            )
        if (
            self.specprefill_enabled
            and self.specprefill_scorer is None
            and self.specprefill_scorer_layers is None
        ):
            raise ValueError(
                "specprefill needs a scoring model: specprefill_draft_model, "
                "specprefill_draft_layers, draft_model or draft_layers"
            )
        if self.specprefill_enabled and self.max_kv_size is not None:
            raise ValueError("specprefill cannot be combined with max_kv_size")
        if self.admission == "wait" and self.max_waiting == 0:
            raise ValueError("admission='wait' needs max_waiting > 0")


def _check_layers(name: str, layers: int | tuple[int, ...] | None) -> None:
    """A model's own layers as a drafter or scorer (`engine/self_draft.py`) keep at least one:
    N >= 1, or a non-empty tuple of indices (which of them the model has is checked at load)."""
    if layers is not None and (layers == () or (isinstance(layers, int) and layers < 1)):
        raise ValueError(f"{name} must keep at least one layer (N >= 1)")
