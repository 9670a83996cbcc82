"""The named mesh and how arrays and collectives live on it.

- mesh.py: the axes (data, fsdp, tensor, pipeline, expert, context), `--mesh` parsing, simulated CPU
  devices; sharding.py: logical-axis rules, ZeRO shardings, activation constraints.
- data_parallel.py: the once-per-step gradient reduction; compression.py: its int8 form.
- batching.py: microbatches and accumulation; schedules.py: pipeline schedules (GPipe, 1F1B,
  interleaved, zero-bubble, DualPipeV), one `Schedule` entry each in `SCHEDULES`, their placements
  and timetables; tick_tables.py: the arrays the pipeline executor indexes by (tick, stage).
Ring attention, the `context` axis's executor, is an attention backend: meshtrain/ops/context_parallel.py.
"""
