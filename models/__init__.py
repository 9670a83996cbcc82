"""Model families, imported as `meshtrain.models` (this folder is installed under that name).

One protocol (`meshtrain.models.transformer.LanguageModel`) for every family, chosen by `model.family`:
- transformer.py: the dense decoder (Llama), the protocol and the block scan.
- moe.py: mixture-of-experts MLPs (Mixtral/DeepSeek), expert-parallel dispatch.
"""
from meshtrain.models.moe import MoELanguageModel
from meshtrain.models.transformer import LanguageModel, Transformer

FAMILIES = {"llama": LanguageModel, "moe": MoELanguageModel}

__all__ = ["FAMILIES", "LanguageModel", "MoELanguageModel", "Transformer"]
