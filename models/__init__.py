"""Model families behind one protocol (`models.transformer.LanguageModel`), by `model.family`."""
from models.moe import MoELanguageModel
from models.transformer import LanguageModel, Transformer

FAMILIES = {"llama": LanguageModel, "moe": MoELanguageModel}

__all__ = ["FAMILIES", "LanguageModel", "MoELanguageModel", "Transformer"]
