"""A run's settings: one declaration per key, loaded from YAML and `--set`, checked once.

- spec.py: the sections as dataclasses (`ModelSpec`, its family's: meshtrain/models/spec.py;
  `ParallelPlan`, `OptimSpec`, ...), each key with its default, help and bounds.
- loader.py: `Config`, `load_config` (YAML, `--set`, the defaults), commented YAML and the reference.
- validate.py: the checks across keys and against the mesh and the devices' memory.
"""
