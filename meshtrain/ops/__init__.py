"""The numerics a model is built from, chosen by the plan rather than the model.

- attention.py: the backends (xla, blockwise, cudnn, ring) and what each computes.
- context_parallel.py: ring attention over the `context` axis; ring_schedule.py: its schedule (load-balanced
  order, pairs, exchanges).
- grouped_matmul.py: the dropless experts' grouped matmul (grouped_matmul_triton.py: its GPU kernels).
- ulysses.py: Ulysses and hybrid context parallelism (all-to-all to head-sharded, any local kernel).
- packing.py: the one mask rule (causal, sliding window, same document) and packed documents' segment ids.
- optimizers.py: optimizers and learning-rate schedules by name, with their state bytes.
- loss.py: the vocabulary-tiled cross-entropy (never the full fp32 logits).
- embedding.py: the vocab-parallel lookup, its gradient reduce-scattered onto the table's shards.
- precision.py: compute dtypes and fp16 loss scaling; remat.py: the activation-saving policies.
- offload.py: the optimizer state (and the layers' parameters and gradients) in host memory, streamed
  through the device a layer at a time (parallel.offload).
- fp8.py: the fp8 matmuls of precision=fp8 (per-tensor current scaling) and fp8_rowwise (a scale per row),
  fp8 operands into the GEMM.
- block_scaled.py: the block-scaled matmuls of precision=mxfp8 and nvfp4 (Blackwell: cuDNN's GEMM on GPUs)
  and fp8_blockwise (fp8_blockwise_triton.py: its Pallas Triton GEMM on GPUs), their definition elsewhere.
- recipes.py: the low-precision recipes by name (einsum, saved bytes, peak, the GPUs that have them).
"""
