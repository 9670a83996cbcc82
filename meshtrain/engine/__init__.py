"""The compiled programs: a model, a plan and an optimizer become a lowered step; nothing is
materialised until the run asks.

- program.py: `TrainProgram` (mesh, shardings, the jitted train and eval steps).
- step.py: loss, gradients, accumulation, clipping, the non-finite guard and the optimizer update.
- pipeline.py: the SPMD pipeline executor (`shard_map` over `pipeline`, the schedules' tables).
- decode.py: generation with a KV cache (prefill, then a `while_loop` of one-token steps).
"""
