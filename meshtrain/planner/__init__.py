"""The ahead-of-time planner: what a config will need on a target mesh, before paying for it.

- aot.py: compile the train, eval and generation programs for the target devices (simulated), read
  their memory, and give the verdict; budget.py: the memory a device can give, with headroom.
- hlo.py: collectives and buffers read from compiled HLO, with the CPU backend's corrections.
- traffic.py: bytes each axis sends per step, by formula and from the HLO; roofline.py: step time.
- fit.py: the search for a layout that fits; drawing.py: timelines and figures.
"""
