"""The Optuna study: opened in its storage (the sweep folder's claim checked, a TPE sampler seeded by
--seed plus the trials already there), the pruner of --pruner, the experiment it records (base config
and space), and the trials that count towards --trials."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

from meshtrain.config.loader import to_dict
from meshtrain.core.errors import UserError
from meshtrain.sweep import folder

MAX_RETRIES = 5  # a trial stopped (killed sweep, preemption) is retried at most this often


def open_study(url: str, name: str, seed: int, pruner, heartbeat: int, out: Path | None = None):
    """The study `name` in `url`, created if new; with `out`, the study of that sweep folder
    (meshtrain/sweep/folder.py: a folder holds one study's trials, a database must be whole)."""
    import optuna
    import sqlalchemy

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    folder.check_database(url, out)  # before RDBStorage, which would make an empty file a new database
    try:
        storage = optuna.storages.RDBStorage(
            url, engine_kwargs=engine, heartbeat_interval=heartbeat,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES))
        create = lambda: optuna.create_study(storage=storage, study_name=name, direction="minimize", pruner=pruner,
                                             load_if_exists=True)
        if out is None:
            study = create()
        else:
            study = folder.claim(out, name, shown_url(url), lambda: name in optuna.get_all_study_names(storage),
                                       lambda: optuna.load_study(study_name=name, storage=storage, pruner=pruner),
                                       create)
    except (ImportError, ValueError, sqlalchemy.exc.SQLAlchemyError) as e:
        raise UserError(f"--storage {shown_url(url)}: {str(e).splitlines()[0]}") from None
    # Seeded by --seed and the trials already in the study: a fresh study samples the same trials
    # every time, and a rerun (or a second process) does not draw again the values drawn before it.
    study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.get_trials(deepcopy=False)))
    if study.direction != optuna.study.StudyDirection.MINIMIZE:
        raise UserError(f"study {name} in {shown_url(url)} maximizes; the sweep minimizes eval_loss; "
                        f"pass a new --study")
    return storage, study


def shown_url(url: str) -> str:
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL: show it as given
        return url


def adopt(study, config: str | None, base, space: dict, url: str) -> None:
    """A study runs one experiment: the first sweep records its --config, base config (config and
    --set, less out and devices) and space; a later one (a rerun, or a second process) must bring the same."""
    from optuna.distributions import distribution_to_json

    base_dict = to_dict(base)
    base_dict.pop("out")
    base_dict.pop("devices", None)
    settings = {"config": config, "base": base_dict,
                "space": {k: json.loads(distribution_to_json(d)) for k, d in space.items()}}
    recorded = study.user_attrs.get("meshtrain")
    if recorded is None:
        study.set_user_attr("meshtrain", settings)
        return
    for key, what in (("space", "--space"), ("base", "--config with --set")):
        if json.dumps(recorded[key], sort_keys=True) != json.dumps(settings[key], sort_keys=True):
            raise UserError(f"study {study.study_name} in {shown_url(url)} was started with another {what} "
                            f"({recorded['config']}); rerun with the same ones, or pass a new --study or --out")


def counted(trials) -> list:
    """The study's trials less those replaced by a retry (the retry stands for them)."""
    replaced = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    return [t for t in trials if t.number not in replaced]



def make_pruner(args, base, space: dict):
    """The pruner of --pruner: Optuna's median rule, Hyperband (Li et al. 2018) over the run's steps, or
    none."""
    import optuna

    if args.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=args.startup_trials, n_warmup_steps=args.warmup_steps)
    if args.pruner == "hyperband":
        steps = "auto" if "train.steps" in space else base.train.steps
        first = base.train.eval_every if steps == "auto" else min(base.train.eval_every, steps)
        return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=steps, reduction_factor=3)
    return optuna.pruners.NopPruner()

