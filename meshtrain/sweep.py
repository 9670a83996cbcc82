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
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from meshtrain import sweep_folder
from meshtrain.core import jsonl
from meshtrain.config.loader import default_out, load_config, parse_yaml, split_override, to_dict
from meshtrain.core.cli import Parser, command, number
from meshtrain.core.errors import UserError
from meshtrain.core.bounds import Bounds
from meshtrain.core.folders import full_disk_is_user_error, replace_file
from meshtrain.config.spec import MAX_SIMULATED_DEVICES
from meshtrain.run.multihost import die_with_parent, last_error

FIELDS = {"float": ("low", "high", "log", "step"), "int": ("low", "high", "log", "step"), "categorical": ("choices",)}
SWEEP_KEYS = {"out": "--out", "devices": "--devices", "checkpoint.resume": "(trials resume automatically)"}
MAX_RETRIES = 5  # a trial stopped (killed sweep, preemption) is retried at most this often
POLL_S = 0.25


# ---- the search space ----
def load_space(path: str) -> dict:
    """{config key: Optuna distribution} from a YAML mapping such as
    `optim.lr: {type: float, low: 1e-4, high: 1e-2, log: true}`."""
    if not Path(path).is_file():
        raise UserError(f"--space {path} not found")
    data = parse_yaml(Path(path).read_text(), f"--space {path}")
    if not isinstance(data, dict) or not data:
        raise UserError(f"--space {path} must map config keys to distributions, e.g. "
                        f"optim.lr: {{type: float, low: 1e-4, high: 1e-2, log: true}}")
    return {str(key): distribution(f"--space {path}: {key}", spec) for key, spec in data.items()}


def distribution(where: str, spec):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not isinstance(spec, dict) or "type" not in spec:
        raise UserError(f"{where}: expected a mapping with a type (float, int or categorical), got {spec!r}")
    kind = spec["type"]
    if kind not in FIELDS:
        raise UserError(f"{where}: type {kind!r} is not one of float, int, categorical")
    unknown = [f for f in spec if f != "type" and f not in FIELDS[kind]]
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]!r}; {kind} takes {', '.join(FIELDS[kind])}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise UserError(f"{where}: choices must be a non-empty list, got {choices!r}")
        for c in choices:
            if not isinstance(c, (bool, int, float, str)):
                raise UserError(f"{where}: choice {c!r} is not a number, string or boolean")
        if len({json.dumps(c) for c in choices}) < len(choices):
            raise UserError(f"{where}: choices repeat a value: {choices}")
        return CategoricalDistribution(choices)
    if "low" not in spec or "high" not in spec:
        raise UserError(f"{where}: {kind} needs low and high")
    number, noun = ((int,), "an integer") if kind == "int" else ((int, float), "a number")
    for name in ("low", "high", "step"):
        value = spec.get(name)
        if name in spec and (isinstance(value, bool) or not isinstance(value, number)):
            raise UserError(f"{where}: {name}={value!r} is not {noun}")
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), spec.get("log", False)
    for name in ("low", "high", "step"):
        if name in spec:
            Bounds().check(f"{where}: {name}", spec[name])  # finite (and an integer within int32)
    if not isinstance(log, bool):
        raise UserError(f"{where}: log={log!r} must be true or false")
    if low > high:
        raise UserError(f"{where}: low={low} is above high={high}")
    if log and low <= 0:
        raise UserError(f"{where}: log needs low > 0, got {low}")
    if log and step is not None:
        raise UserError(f"{where}: log and step cannot be combined")
    if step is not None and step <= 0:
        raise UserError(f"{where}: step={step} must be > 0")
    if kind == "int":
        return IntDistribution(low, high, log=log, step=step or 1)
    return FloatDistribution(float(low), float(high), log=log, step=None if step is None else float(step))


def as_set(value) -> str:
    """A sampled value as meshtrain's --set reads it (YAML scalars; text settings take it verbatim)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def param_sets(params: dict) -> list[str]:
    """Sampled values as --set items: `optim.lr=0.003 train.seed=2`."""
    return [f"{key}={as_set(value)}" for key, value in params.items()]


def train_args(config: str | None, sets: list[str], out) -> list[str]:
    """The arguments of `python -m meshtrain.train` for one trial's run."""
    return [*(["--config", config] if config else []), *(a for item in sets for a in ("--set", item)),
            "--out", str(out)]


def suggest(trial, key: str, dist):
    from optuna.distributions import FloatDistribution, IntDistribution

    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(key, dist.low, dist.high, log=dist.log, step=dist.step)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high, log=dist.log, step=dist.step)
    return trial.suggest_categorical(key, dist.choices)


def check_space(config: str | None, sets: list[str], space: dict, space_path: str):
    """The base config (config + --set), once every bound and choice of the space gives a valid config
    by itself; unknown keys and bad values are found here, before any trial starts."""
    set_keys = [split_override(item)[0] for item in sets]
    for key, flag in SWEEP_KEYS.items():
        if key in space or key in set_keys:
            raise UserError(f"{key} is set by the sweep for each trial; use {flag} of python -m meshtrain.sweep")
    both = [key for key in space if key in set_keys]
    if both:
        raise UserError(f"{both[0]} is in --space {space_path} and in --set; keep it in one of them")
    base = load_config(config, sets)
    for key, dist in space.items():
        for value in getattr(dist, "choices", None) or (dist.low, dist.high):
            try:
                load_config(config, [*sets, f"{key}={as_set(value)}"])
            except UserError as e:
                raise UserError(f"--space {space_path}: {e}") from None
    if not base.train.eval_every:
        raise UserError("the sweep minimizes eval_loss, but train.eval_every is 0; set it, e.g. "
                        "--set train.eval_every=50")
    return base


# ---- devices: one slot per concurrent trial ----
@dataclass
class Slot:
    env: dict
    args: list
    label: str


def visible_gpus() -> list[str]:
    """The GPUs a trial could use, found without starting JAX (which would take their memory)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return found.stdout.split() if found.returncode == 0 else []


def device_slots(parallel: int, devices: int | None, gpus: list[str]) -> list[Slot]:
    if gpus and len(gpus) % parallel:
        raise UserError(f"--parallel {parallel} does not divide the {len(gpus)} visible GPUs; "
                        f"pick a divisor of {len(gpus)}")
    if devices and devices % parallel:
        raise UserError(f"--parallel {parallel} does not divide --devices {devices}; each trial gets devices/K")
    slots = []
    for s in range(parallel):
        env, args, label = {}, [], []
        if gpus:
            share = gpus[s * len(gpus) // parallel:(s + 1) * len(gpus) // parallel]
            if parallel > 1:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(share)
            label.append(f"GPU {','.join(share)}")
        if devices:
            args = ["--devices", str(devices // parallel)]
            if not gpus:
                label.append(f"{devices // parallel} CPU device(s)")
        slots.append(Slot(env, args, " ".join(label) or "the machine's devices"))
    return slots


# ---- the study ----
def open_study(url: str, name: str, seed: int, pruner, heartbeat: int, out: Path | None = None):
    """The study `name` in `url`, created if new; with `out`, the study of that sweep folder
    (meshtrain/sweep_folder.py: a folder holds one study's trials, a database must be whole)."""
    import optuna
    import sqlalchemy

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    sweep_folder.check_database(url, out)  # before RDBStorage, which would make an empty file a new database
    try:
        storage = optuna.storages.RDBStorage(
            url, engine_kwargs=engine, heartbeat_interval=heartbeat,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES))
        create = lambda: optuna.create_study(storage=storage, study_name=name, direction="minimize", pruner=pruner,
                                             load_if_exists=True)
        if out is None:
            study = create()
        else:
            study = sweep_folder.claim(out, name, shown_url(url), lambda: name in optuna.get_all_study_names(storage),
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


def adopt(study, settings: dict, url: str) -> None:
    """A study runs one experiment: the first sweep records its base config and space; a later one
    (a rerun, or a second process) must bring the same."""
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


# ---- one trial's run ----
@dataclass
class TrialRun:
    trial: object  # optuna.Trial
    run_dir: Path
    steps: int
    command: list
    slot: Slot
    lock: int | None = None
    proc: subprocess.Popen | None = None
    reported: set = field(default_factory=set)
    last: tuple | None = None  # (step, eval_loss) of the newest eval record
    step: int = 0  # the newest record's step
    pruned_at: int | None = None
    offset: int = 0  # metrics.jsonl read up to here (whole lines)
    lines: int = 0
    inode: int | None = None
    error: str | None = None  # its metrics.jsonl is damaged: the trial fails with this
    err_from: int = 0
    beat: float = 0.0  # when its heartbeat was last recorded
    taken: bool = False  # another sweep process failed it as stale and retries it: report nothing more

    @property
    def number(self) -> int:
        return self.trial.number

    def logs(self, suffix: str) -> Path:
        return self.run_dir.parent / "logs" / f"trial-{self.number}.{suffix}"

    def try_start(self) -> bool:
        """Start the run once no earlier attempt holds its folder's lock (a run of a killed sweep
        saving its checkpoint); False while it waits."""
        if self.lock is None:
            self.run_dir.parent.mkdir(parents=True, exist_ok=True)
            self.lock = os.open(self.run_dir.parent / f".{self.run_dir.name}.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.logs("out").parent.mkdir(exist_ok=True)
        with open(self.logs("out"), "a") as out, open(self.logs("err"), "a") as err:
            self.err_from = err.tell()
            self.proc = subprocess.Popen(
                self.command, env={**os.environ, **self.slot.env}, stdin=subprocess.DEVNULL, stdout=out,
                stderr=err, start_new_session=True, pass_fds=(self.lock,),
                preexec_fn=functools.partial(die_with_parent, os.getpid()))
        return True

    def read_evals(self) -> list[tuple[int, float]]:
        """New eval_loss records of metrics.jsonl (read incrementally; a resume rewrites the file)."""
        path = self.run_dir / "metrics.jsonl"
        try:
            st = path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:
            self.inode, self.offset, self.lines = st.st_ino, 0, 0
        with open(path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a record still being written is read next time
        records, _ = jsonl.parse(whole, path, self.lines + 1, tail_may_be_torn=False)
        self.offset, self.lines = self.offset + len(whole), self.lines + whole.count(b"\n")
        evals = []
        for record in records:
            self.step = record.get("step", self.step)
            if "eval_loss" in record:
                evals.append((int(record["step"]), float(record["eval_loss"])))
        return evals

    def watch(self) -> None:
        """Report new eval losses; SIGTERM the run when the pruner says so."""
        import optuna

        try:
            evals = self.read_evals()
        except UserError as e:  # a damaged line: the run's results cannot be trusted
            if self.error is None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            self.error = self.error or f"error: {e}"
            return
        for step, value in evals:
            self.last = (step, value)
            if step in self.reported or self.taken or self.pruned_at is not None:
                continue
            self.reported.add(step)
            try:
                self.trial.report(value, step)
            except optuna.exceptions.UpdateFinishedTrialError:
                self.taken = True  # the run goes on; its retry will find it finished and read the result
                continue
            if step < self.steps and self.trial.should_prune():
                self.pruned_at = step
                self.proc.send_signal(signal.SIGTERM)
                print(f"trial {self.number} pruned at step {step} (eval_loss {value:.4f}); stopping its run",
                      flush=True)

    def error_line(self) -> str:
        with open(self.logs("err"), errors="replace") as f:
            f.seek(self.err_from)
            return last_error(f.read().splitlines(), "(no output on stderr)")

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)  # the flock is gone once the run, which shares it, has exited too
            self.lock = None


# ---- the sweep ----
class Sweep:
    def __init__(self, args, space: dict, slots: list[Slot], storage, study):
        self.args, self.space, self.storage, self.study = args, space, storage, study
        self.out = Path(args.out).absolute()
        self.free = list(slots)
        self.running: list[TrialRun] = []
        self.stopping = False
        self.last_stale_check = 0.0
        self.process = sweep_folder.ProcessLock(self.out)  # named in the trials it runs

    def retry_orphans(self) -> None:
        """Trials a killed sweep process left RUNNING: failed, and queued to resume in their folders."""
        for t in sweep_folder.orphans(self.study.get_trials(deepcopy=False), self.out):
            self.fail_for_retry(t.number, t._trial_id)
            print(f"notice: trial {t.number} was left RUNNING by a sweep that is gone; failed, and queued to "
                  f"resume in {shown_path(t.user_attrs.get('run_dir', self.out / f'trial-{t.number}'))}", flush=True)

    def run(self) -> None:
        import optuna

        waiting_note = None
        self.retry_orphans()
        while True:
            if self.stopping:
                self.stop_all()
                return
            if time.monotonic() - self.last_stale_check > self.args.heartbeat:
                optuna.storages.fail_stale_trials(self.study)  # stale RUNNING trials -> FAIL + a WAITING retry
                self.last_stale_check = time.monotonic()
            for run in list(self.running):
                self.poll(run)
            trials = self.study.get_trials(deepcopy=False)
            if self.free and self.want_more(trials):
                self.start(self.free.pop(0))
                continue
            if not self.running and not self.want_more(trials):
                others = [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
                if not others:
                    return
                if waiting_note != others:
                    waiting_note = others
                    print(f"waiting for trial(s) {', '.join(map(str, others))}, running elsewhere (one that a "
                          f"killed sweep left is retried here once its heartbeat is {2 * self.args.heartbeat} s old)",
                          flush=True)
            time.sleep(POLL_S)

    def want_more(self, trials) -> bool:
        import optuna

        waiting = any(t.state == optuna.trial.TrialState.WAITING for t in trials)
        return not self.stopping and (waiting or len(counted(trials)) < self.args.trials)

    def start(self, slot: Slot) -> None:
        import optuna

        trial = self.study.ask()  # a WAITING trial (enqueued, or a retry) first
        self.storage.record_heartbeat(trial._trial_id)
        retry_of = self.storage.get_trial(trial._trial_id).system_attrs.get("failed_trial")
        run_dir = Path(trial.user_attrs.get("run_dir") or self.out / f"trial-{trial.number}")  # a retry inherits it
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr(sweep_folder.PROCESS_ATTR, self.process.name)
        params = {key: suggest(trial, key, dist) for key, dist in self.space.items()}
        chosen = param_sets(params)
        shown, sets = " ".join(chosen), [*self.args.set, *chosen]
        try:
            cfg = load_config(self.args.config, sets)
        except UserError as e:  # this combination of values is not a valid config
            trial.set_user_attr("error", f"error: {e}")
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            print(f"trial {trial.number} failed: {shown}: error: {e}", flush=True)
            self.free.append(slot)
            return
        command = [sys.executable, "-m", "meshtrain.train", *train_args(self.args.config, sets, run_dir), *slot.args]
        trial.set_user_attr("devices", slot.label)
        note = f"retry of trial {retry_of}, resuming {shown_path(run_dir)}" if retry_of is not None else \
            shown_path(run_dir)
        run = TrialRun(trial, run_dir, cfg.train.steps, command, slot, beat=time.monotonic())  # recorded at ask
        self.running.append(run)
        print(f"trial {trial.number} started: {shown} -> {note} ({slot.label})", flush=True)
        self.poll(run)

    def poll(self, run: TrialRun) -> None:
        if time.monotonic() - run.beat > max(POLL_S, self.args.heartbeat / 4):
            self.storage.record_heartbeat(run.trial._trial_id)
            run.beat = time.monotonic()
        if run.proc is None:
            if self.stopping or not run.try_start():
                return
        run.watch()
        code = run.proc.poll()
        if code is not None:
            self.finish(run, code)

    def finish(self, run: TrialRun, code: int) -> None:
        import optuna

        run.watch()  # the records written before it exited
        run.release()
        self.running.remove(run)
        self.free.append(run.slot)
        state = optuna.trial.TrialState
        try:
            if run.taken:
                raise optuna.exceptions.UpdateFinishedTrialError
            if run.pruned_at is not None:
                self.study.tell(run.trial, state=state.PRUNED)
            elif code != 0 or run.error:
                error = run.error or run.error_line()
                run.trial.set_user_attr("error", error)
                self.study.tell(run.trial, state=state.FAIL)
                print(f"trial {run.number} failed (exit {code}): {error} (log {shown_path(run.logs('err'))})",
                      flush=True)
            elif run.last is not None and run.last[0] >= run.steps:
                self.study.tell(run.trial, run.last[1])
                print(f"trial {run.number} complete: eval_loss {run.last[1]:.4f} at step {run.last[0]}", flush=True)
            else:  # stopped before its last step (this sweep's stop, or a SIGTERM from outside): resume later
                self.fail_for_retry(run.number, run.trial._trial_id)
                print(f"trial {run.number} stopped at step {run.step}; it resumes from its checkpoint when the sweep "
                      f"runs again", flush=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            print(f"warning: trial {run.number} was retried by another sweep process (its heartbeat was late)",
                  file=sys.stderr, flush=True)

    def fail_for_retry(self, number: int, trial_id: int) -> None:
        """Fail the trial and queue its retry, as a stale heartbeat does (the storage's callback)."""
        import optuna

        self.study.tell(number, state=optuna.trial.TrialState.FAIL)
        self.storage.get_heartbeat_stale_trial_callback()(self.study, self.storage.get_trial(trial_id))

    def stop_all(self) -> None:
        """SIGINT/SIGTERM: stop every run (each checkpoints) and leave its trial to be retried."""
        for run in list(self.running):
            if run.proc is None:
                self.running.remove(run)
                run.release()
                self.fail_for_retry(run.number, run.trial._trial_id)
            else:
                run.proc.send_signal(signal.SIGTERM)
        while self.running:
            for run in list(self.running):
                self.poll(run)
            time.sleep(POLL_S)


def shown_path(path) -> str:
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


# ---- the report ----
def table(trials) -> str:
    replaced_by = {n: t.number for t in trials for n in t.system_attrs.get("retry_history", [])[-1:]}
    keys = sorted({k for t in trials for k in t.params})
    rows = [["trial", "state", "eval_loss", "step", *keys, "run", "note"]]
    for t in sorted(trials, key=lambda t: t.number):
        step = max(t.intermediate_values, default=None)
        value = t.value if t.value is not None else t.intermediate_values.get(step)
        note = t.user_attrs.get("error", "")
        if t.number in replaced_by:
            note = f"retried as trial {replaced_by[t.number]}"
        elif "failed_trial" in t.system_attrs:
            note = f"retry of trial {t.system_attrs['failed_trial']}"
        rows.append([str(t.number), t.state.name, "-" if value is None else f"{value:.4f}",
                     "-" if step is None else str(step), *(_short(t.params.get(k, "-")) for k in keys),
                     shown_path(t.user_attrs["run_dir"]) if "run_dir" in t.user_attrs else "-", note])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows)


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def best_record(study, url: str, config: str | None, sets: list[str]) -> dict | None:
    import optuna

    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        return None
    best = min(done, key=lambda t: (t.value, t.number))
    run = best.user_attrs["run_dir"]
    command = ["python", "-m", "meshtrain.train", *train_args(config, [*sets, *param_sets(best.params)], run)]
    return {"study": study.study_name, "storage": shown_url(url), "trial": best.number, "eval_loss": best.value,
            "step": max(best.intermediate_values, default=None), "params": best.params, "run": run,
            "command": " ".join(command)}


def write_best(path: Path, best: dict) -> None:
    """best.json, whole or as it was."""
    with full_disk_is_user_error(path, "best.json", then="rerun the same command (it reruns no trial)"):
        replace_file(path, json.dumps(best, indent=2) + "\n")


# ---- the CLI ----
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
    p.add_argument("--devices", type=number(int, min=1, max=MAX_SIMULATED_DEVICES),
                   help="simulated CPU devices in all; each trial gets devices/K")
    p.add_argument("--pruner", choices=("median", "hyperband", "none"), default="median")
    p.add_argument("--startup-trials", type=number(int, min=0), default=5,
                   help="median pruner: complete trials before any is pruned (default 5)")
    p.add_argument("--warmup-steps", type=number(int, min=0), default=0, help="median pruner: no pruning before this step")
    p.add_argument("--seed", type=number(int, min=0), default=0,
                   help="TPE sampler seed (plus the number of trials already in the study)")
    p.add_argument("--heartbeat", type=int, default=10, metavar="SECONDS",
                   help="a running trial heartbeats this often; one silent for twice as long is retried")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every trial")
    return p


def make_pruner(args, base, space: dict):
    import optuna

    if args.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=args.startup_trials, n_warmup_steps=args.warmup_steps)
    if args.pruner == "hyperband":
        steps = "auto" if "train.steps" in space else base.train.steps
        first = base.train.eval_every if steps == "auto" else min(base.train.eval_every, steps)
        return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=steps, reduction_factor=3)
    return optuna.pruners.NopPruner()


def prepare(args):
    """Every check before anything is written: the space, the config, the devices, the folder."""
    from meshtrain.core.folders import writable
    from meshtrain.parallel.mesh import parse_mesh

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
    writable(Path(args.out), "--out")
    args.study = args.study or Path(args.out).absolute().name
    args.storage = args.storage or f"sqlite:///{Path(args.out).absolute() / 'study.db'}"
    return space, base, slots


@command
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    space, base, slots = prepare(args)
    pruner = make_pruner(args, base, space)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    storage, study = open_study(args.storage, args.study, args.seed, pruner, args.heartbeat,
                                Path(args.out).absolute())
    from optuna.distributions import distribution_to_json

    base_dict = to_dict(base)
    base_dict.pop("out")
    base_dict.pop("devices", None)
    adopt(study, {"config": args.config, "base": base_dict,
                  "space": {k: json.loads(distribution_to_json(d)) for k, d in space.items()}}, args.storage)
    sweep = Sweep(args, space, slots, storage, study)
    finished = sum(t.state.is_finished() for t in counted(study.get_trials(deepcopy=False)))
    print(f"study {args.study} in {shown_url(args.storage)}: {finished} of {args.trials} trials finished; "
          f"{args.parallel} at a time, each on {slots[0].label}", flush=True)

    def stop(signum, frame):
        sweep.stopping = True
        print(f"{signal.Signals(signum).name}: stopping the running trials at their next step", flush=True)

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
        print("stopped: rerun the same command to finish the study (stopped trials resume from their checkpoints)")
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
