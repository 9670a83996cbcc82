"""The XLA options a step is compiled with, by the platform it runs on: one dict for GPUs, none
elsewhere. `TrainProgram` jits its train, reuse and eval steps with them, so `python -m meshtrain.train`
runs and `python -m meshtrain.plan` prices the same program (the planner compiles TrainProgram's
lowering for its compile-only GPUs).

A flag the user names in `XLA_FLAGS` wins: its option is left out here, and XLA reads the user's value
(XLA_FLAGS sets the defaults of every compile in the process; an explicit compile option would
override it). The planner's process reads the same environment, so a flag set there is planned too.

Why these (docs/speed.md "XLA options on GPUs" has each pod's figures, planned with benchmarks/gpu_step.py):
- `xla_gpu_enable_latency_hiding_scheduler`: XLA's default GPU schedule waits on an async collective
  right after starting it in the MoE layers (the dispatch's all-to-alls, the fsdp gathers beside
  them), so nothing hides it; the latency-hiding scheduler moves kernels between each start and its
  done. NVIDIA's JAX container sets it by default (docs.nvidia.com/jax-toolbox/environment-variables).
  On 64 H100s qwen3_30b_a3b's expert-parallel layout (fsdp=8,expert=8, 4 microbatches) plans 4.94 -> 4.59 s.
Not set: XLA's collective pipeliner (`xla_gpu_enable_pipelined_all_gather`, `_reduce_scatter`,
`_all_reduce`) plans every shipped pod 0.3-7% faster but raises their train peaks: llama3_8b's 33.29 ->
59.78 GB, gemma3_4b's 37.77 -> 60.11 GB (over its 54 GB budget).
"""
from __future__ import annotations

import os

from meshtrain.ops.platform import GPU_PLATFORMS

GPU_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}


def flag_name(flag: str) -> str:
    """`--xla_name=value` -> `xla_name`."""
    return flag.lstrip("-").split("=")[0]


def named_xla_flags(environ=os.environ) -> set[str]:
    """The flags `XLA_FLAGS` names, without their leading dashes or values."""
    return {flag_name(flag) for flag in environ.get("XLA_FLAGS", "").split()}


def compiler_options(platform: str, environ=os.environ) -> dict | None:
    """The options a step for `platform`'s devices is compiled with, less those XLA_FLAGS names;
    None where there are none (XLA's defaults)."""
    if platform not in GPU_PLATFORMS:
        return None
    named = named_xla_flags(environ)
    return {name: value for name, value in GPU_OPTIONS.items() if name not in named} or None
