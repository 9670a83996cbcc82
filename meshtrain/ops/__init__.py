"""The numerics a model is built from, chosen by the plan rather than the model.

- attention.py: the backends (xla, blockwise, cudnn, ring) and what each computes.
- loss.py: the vocabulary-tiled cross-entropy (never the full fp32 logits).
- precision.py: compute dtypes and fp16 loss scaling; remat.py: the activation-saving policies.
"""
