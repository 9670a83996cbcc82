"""A training run: the loop and everything that keeps its folder and its weights safe.

- trainer.py: `Trainer` (start-up, resume, the step driver); actions.py: what the loop does between steps
  (metric records, eval, task scoring, saving and preemption, the non-finite and spike guard with rollback).
- checkpoint.py: Orbax checkpoints with manifests and checksums (checksums.py); the one verified loader.
- run_dir.py: what defines a run (run.json) and what a folder may hold; lock.py: one run per folder.
- loggers.py: console, metrics.jsonl; dashboards.py: TensorBoard, W&B; multihost.py: process start-up and liveness.
- goodput.py: where each start's wall time went (productive steps and the losses), kept in run.json.
- watchdog.py: the step watchdog (a stalled run dumps its stacks and exits); health.py: stragglers,
  loss spikes, per-layer gradient norms, the communication share (docs/operating.md).
- int8_export.py: a run's weights quantized and evaluated (`convert --quantize int8`).
"""
