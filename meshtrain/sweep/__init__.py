"""`python -m meshtrain.sweep`: hyperparameter search in which every trial is an ordinary meshtrain run.

An Optuna study (TPE sampler, seeded with --seed plus the number of trials already in the study, so
that a rerun draws new values) minimizes the final `eval_loss` of runs started as
`python -m meshtrain.train --config CFG --set <user's --set> --set <sampled keys> --out <out>/trial-<n>`.
The sweep reads each run's metrics.jsonl as it trains, reports every eval_loss to the pruner (median
or Hyperband) and stops a pruned run with SIGTERM (meshtrain checkpoints it and exits 0).

The study lives in a database (SQLite <out>/study.db by default, or any --storage URL), so:
- `--trials N` is the study's total (complete, pruned and failed trials), not this process's share:
  the same command rerun after a kill runs only the remainder, and `--trials` may be raised later.
- A trial this process is running heartbeats into the database. One a killed sweep left RUNNING goes
  stale after 2 x --heartbeat seconds and is retried (Optuna's RetryHeartbeatStaleTrialCallback) in
  its original run folder, so its meshtrain run resumes from its checkpoint; complete, pruned and
  failed trials are never rerun. A lock file beside each run folder keeps a retry from starting while
  the old run still writes there (a trial's run gets SIGTERM when its sweep dies, on Linux).
- Several sweep processes may work on one study (same --storage, --study and --out on a shared
  filesystem). They may start up to --parallel trials more than N between them.

With --parallel K, K trials run at once, each on its own 1/K of the devices: the visible GPUs are split
through CUDA_VISIBLE_DEVICES, and `--devices D` (simulated CPU devices) gives each trial --devices D/K.

- __main__.py: the command: flags, the checks before anything is written, the run, the results.
- space.py: the search space file, checked as configs; sampled values as --set items.
- devices.py: one device slot per concurrent trial.
- folder.py: a sweep folder belongs to one study; the study database checked; killed sweeps' trials.
- study.py: the Optuna study (storage, sampler, pruner, the experiment it records, trials counted).
- trial.py: `TrialRun`, one trial's train process and the eval losses it reports.
- scheduler.py: `Sweep`, the loop that runs trials in the slots and tells the study how they ended.
- summary.py: the table of trials and best.json.
"""
