"""Settings of MLX's CUDA backend that a server wants, applied before MLX first needs them."""

from __future__ import annotations

import os

#: cuDNN attention graphs MLX keeps (its own default keeps far fewer).
SDPA_GRAPH_CACHE = 1024


def keep_attention_graphs(count: int = SDPA_GRAPH_CACHE) -> None:
    """Keep up to `count` cuDNN attention graphs on MLX's CUDA backend (an environment variable:
    process-wide; the engine calls this only when `EngineConfig.cuda_sdpa_graph_cache` asks).

    MLX builds a graph for every new (query length, key length) of a prefill pass, 50-150 ms
    each on the H200, and keeps them in an LRU (`MLX_CUDA_SDPA_CACHE_SIZE`). With prefill shape
    blocks of 64 (`decode.PrefillPlan`) a cache this size holds every shape of a short new suffix
    (one or two blocks, as prefix-cache hits mostly prefill) over contexts up to ~32k tokens, and
    every whole prompt of up to 1,024 tokens; a rarer shape evicted would be built again.
    A value already in the environment wins. MLX reads the setting once, at the first prefill
    attention of the process, so this runs before the model is loaded; elsewhere than CUDA it
    has no effect.
    """
    os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", str(count))


#: MLX's switch for its CUDA graphs (read once per process; MLX's default: on).
GRAPHS_VARIABLE = "MLX_USE_CUDA_GRAPHS"


def use_cuda_graphs(enabled: bool) -> None:
    """Whether MLX's CUDA backend records the kernels it launches into CUDA graphs and replays
    them (`MLX_USE_CUDA_GRAPHS`, on by MLX's default; an environment variable: process-wide,
    the engine calls this only when `EngineConfig.cuda_graphs` asks). A value already in the
    environment wins; elsewhere than CUDA it has no effect.

    Graphs help one stream and cost a batch. MLX captures every ~100 kernels into a graph and
    keeps the graphs by their topology: a graph seen before is updated in place, another built
    anew. A lone stream's step repeats, and replaying saves a launch per kernel; a batched
    step's graphs change with its rows, their lengths and the prefill chunks in its pass, and
    building and updating them cost the host more than the launches they save. Measured on an
    H100 (`bench.compare`, engine in-process, 128-token prompts, 256 tokens, graphs on and off
    alternated in four processes): at 16 streams the 1B bf16 shape's aggregate was 1,984 and
    2,640 tok/s without graphs against 1,571 and 1,901 with them (8B bf16, one process each:
    1,218 against 944); one stream decoded at 248-259 tok/s without against 306-426 with
    (8B: 139 against 162). An 8,000-token prompt admitted beside 16 decoding streams on the 8B
    (`bench.long_arrival`): the running streams' ITL p99 over their plain median was 3.0-3.1
    without graphs in the repeats after the first, 5.4-7.4 with them.

    MLX reads the setting once, at the process's first graph (any evaluation on the GPU): so
    this runs before the model is loaded, and a process that used MLX's GPU before opening the
    engine keeps what it had.
    """
    os.environ.setdefault(GRAPHS_VARIABLE, "1" if enabled else "0")
