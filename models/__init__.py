"""Model definitions. meshtrain relies on the small protocol in `models.transformer.LanguageModel`."""
from models.transformer import LanguageModel, Transformer

__all__ = ["LanguageModel", "Transformer"]
