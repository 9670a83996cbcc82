"""`python -m meshtrain.sweep`: the command. It parses the flags, checks everything before anything is
written (`prepare`), opens the study, runs the sweep until the study has --trials trials or a signal
stops it, then prints the table and writes best.json. What each part does: meshtrain/sweep/__init__.py.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

from meshtrain.config.loader import default_out
from meshtrain.core.cli import Parser, arguments, command, devices_flag, number
from meshtrain.core.console import log
from meshtrain.core.errors import UserError
from meshtrain.core.folders import full_disk_is_user_error, writable
from meshtrain.parallel.mesh import parse_mesh
from meshtrain.sweep.devices import device_slots, visible_gpus
from meshtrain.sweep.folder import shown_path
from meshtrain.sweep.scheduler import Sweep
from meshtrain.sweep.space import check_space, load_space, param_sets
from meshtrain.sweep.study import adopt, counted, make_pruner, open_study, shown_url
from meshtrain.sweep.summary import best_record, table, write_best


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.sweep",
               description="Hyperparameter search with Optuna; every trial is a meshtrain run.")
    p.add_argument("--config", help="YAML config every trial starts from")
    p.add_argument("--space", required=True, help="YAML file: config key -> {type: float|int|categorical, ...}")
    p.add_argument("--trials", type=int, required=True, help="trials in the study in total (complete, pruned and "
                                                             "failed); a rerun runs only the remainder")
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///<out>/study.db)")
    p.add_argument("--study", help="study name (default: the --out folder's name)")
    p.add_argument("--out", help="sweep folder: trial-<n>/ runs, logs/, best.json (default runs/<config>-sweep)")
    p.add_argument("--parallel", type=int, default=1, metavar="K", help="trials at once, each on 1/K of the devices")
    devices_flag(p, "simulated CPU devices in all; each trial gets devices/K")  # simulated by the trials' runs
    p.add_argument("--pruner", choices=("median", "hyperband", "none"), default="median")
    p.add_argument("--startup-trials", type=number(int, min=0), default=5,
                   help="median pruner: complete trials before any is pruned (default 5)")
    p.add_argument("--warmup-steps", type=number(int, min=0), default=0,
                   help="median pruner: no pruning before this step")
    p.add_argument("--seed", type=number(int, min=0), default=0,
                   help="TPE sampler seed (plus the number of trials already in the study)")
    p.add_argument("--heartbeat", type=int, default=10, metavar="SECONDS",
                   help="a running trial heartbeats this often; one silent for twice as long is retried")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every trial")
    return p


def prepare(args):
    """Every check before anything is written: the space, the config, the devices, the folder."""
    for flag, value in (("--trials", args.trials), ("--parallel", args.parallel), ("--heartbeat", args.heartbeat)):
        if value < 1:
            raise UserError(f"{flag} {value} must be >= 1")
    space = load_space(args.space)
    base = check_space(args.config, args.set, space, args.space)
    gpus = visible_gpus()
    slots = device_slots(args.parallel, args.devices, gpus)
    per_trial = (len(gpus) or args.devices or 0) // args.parallel
    if per_trial and "parallel.mesh" not in space:
        try:
            parse_mesh(base.parallel.mesh, per_trial)
        except UserError:
            raise UserError(f"mesh {base.parallel.mesh} does not fit the {per_trial} device(s) each trial gets "
                            f"(--parallel {args.parallel}); set parallel.mesh with --set") from None
    args.out = args.out or f"{default_out(args.config)}-sweep"
    writable(args.out, "--out")
    args.study = args.study or Path(args.out).absolute().name
    args.storage = args.storage or f"sqlite:///{Path(args.out).absolute() / 'study.db'}"
    return space, base, slots


@command
def main(argv=None) -> int:
    args = arguments(parser(), argv)
    space, base, slots = prepare(args)
    pruner = make_pruner(args, base, space)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    storage, study = open_study(args.storage, args.study, args.seed, pruner, args.heartbeat,
                                Path(args.out).absolute())
    adopt(study, args.config, base, space, args.storage)
    sweep = Sweep(args, space, slots, storage, study)
    finished = sum(t.state.is_finished() for t in counted(study.get_trials(deepcopy=False)))
    log.info(f"study {args.study} in {shown_url(args.storage)}: {finished} of {args.trials} trials finished; "
             f"{args.parallel} at a time, each on {slots[0].label}")

    def stop(signum, frame):
        sweep.stopping = True
        log.info(f"{signal.Signals(signum).name}: stopping the running trials at their next step")

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with full_disk_is_user_error(args.out, "the study's results", then="rerun the same command"):
            sweep.run()
    finally:
        sweep.process.release()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    trials = study.get_trials(deepcopy=False)
    print(table(trials), flush=True)
    best = best_record(study, args.storage, args.config, args.set)
    if sweep.stopping:
        log.info("stopped: rerun the same command to finish the study (stopped trials resume from their checkpoints)")
    if best is None:
        if not sweep.stopping:
            print(f"error: no trial of study {args.study} completed; see the table above", file=sys.stderr)
        return 0 if sweep.stopping else 1
    path = Path(args.out) / "best.json"
    write_best(path, best)
    params = " ".join(param_sets(best["params"]))
    print(f"best: trial {best['trial']}, eval_loss {best['eval_loss']:.4f}, {params}, run {shown_path(best['run'])} "
          f"(written to {shown_path(path)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
