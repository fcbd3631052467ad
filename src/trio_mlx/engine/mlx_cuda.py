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
