"""The foundation every layer may import; it imports nothing of meshtrain's.

- errors.py: `UserError`, the one-line `error:` a command prints; exits.py: the exit statuses and the one
  line for a Ctrl-C or SIGTERM at start-up.
- bounds.py: a setting's allowed range; cli.py: the commands' parser, flags (`--devices` and its preamble)
  and `@command` wrapper; console.py: the `meshtrain` logger everything the library says goes through,
  the commands' console handler and `duration`; ray_cluster.py: `connected`, a Ray cluster for a block
  (ray_launch, prepare --ray).
- folders.py: whole writes (write-then-rename), new-folder checks, full-disk errors; jsonl.py: append-only
  logs that tolerate a torn tail.
- formulas.py: the closed forms (ZeRO bytes, activation terms, ring traffic, KV cache) that the
  runtime checks and the planner both cite; metrics.py: device profiles, model FLOPs, MFU.
"""
