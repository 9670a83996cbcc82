"""The logical axes of the shared blocks' weights, by parameter name (meshtrain/parallel/sharding.py
maps them to mesh axes), and which of a weight's axes its matmul contracts (INT8 channels, LoRA's
factors and Hugging Face layouts follow that). A family adds its own weights' axes to these
(models/base.py `PARAM_AXES` adds LoRA's adapters).
"""
from __future__ import annotations

from meshtrain.parallel.sharding import LAYER_AXES

# The shared blocks' weights, by name or by their module's (a norm's `scale` is `embed` unless its
# module is named in a family's table).
WEIGHT_AXES = {
    "embedding": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "scale": ("embed",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}


STACKED_AXES = (*LAYER_AXES, "experts")  # leading axes that stack independent weights



def contracted_axes(names: tuple) -> tuple[int, ...]:
    """Indices of the axes a weight's matmul contracts, from its logical axes: the first one that is
    not a stacking axis (layers, experts) or vocab, and head_dim after heads (wo [H, K, D] contracts
    H and K); () for a vector (a norm scale). INT8 channels and Hugging Face layouts follow it."""
    if sum(n not in STACKED_AXES for n in names) < 2:
        return ()
    first = next(i for i, n in enumerate(names) if n not in (*STACKED_AXES, "vocab"))
    heads = names[first] in ("heads", "kv_heads") and names[first + 1:first + 2] == ("head_dim",)
    return (first, first + 1) if heads else (first,)
