"""Tool calling: the calls a model makes, parsed from its output (one module per family)."""

from trio_mlx.tools.calls import ToolCall, new_call_id

__all__ = ["ToolCall", "new_call_id"]
