"""The ahead-of-time planner: what a config will need on a target mesh, before paying for it.

- compilers.py: the compiler a plan runs on: XLA's GPU compiler on compile-only GPU devices (no GPU
  needed), or XLA:CPU on simulated devices, and the GPU targets.
- aot.py: compile the train, eval and generation programs for the target devices, read their
  memory, and give the verdict; text.py: what the command prints; budget.py: the memory a device can
  give, with headroom.
- hlo.py: collectives and buffers read from compiled HLO, with the CPU backend's corrections;
  kernels.py: a GPU program's kernels per step (GEMMs by operand type, fused attention, collectives).
- traffic.py: bytes each axis sends per step, by formula and from the HLO; roofline.py: step time by
  formula (a bound at datasheet peaks); kernel_time.py: a GPU program's step time, kernel by kernel.
- fit.py: the search for a layout that fits; drawing.py: timelines and figures.
"""
