"""The sweep's loop: asks the study for trials while slots are free and the study wants more, runs
each as a `TrialRun`, tells the study how it ended, retries trials that a killed sweep left (at once
when its process lock is free, else after a stale heartbeat), and stops every run on SIGINT/SIGTERM."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from meshtrain.config.loader import load_config
from meshtrain.core.console import NOTICE, log
from meshtrain.core.errors import UserError
from meshtrain.core.exits import EXIT_TERMINATED
from meshtrain.sweep import folder
from meshtrain.sweep.devices import Slot
from meshtrain.sweep.folder import shown_path
from meshtrain.sweep.space import param_sets, suggest, train_args
from meshtrain.sweep.study import counted
from meshtrain.sweep.trial import TrialRun

POLL_S = 0.25


class Sweep:
    def __init__(self, args, space: dict, slots: list[Slot], storage, study):
        self.args, self.space, self.storage, self.study = args, space, storage, study
        self.out = Path(args.out).absolute()
        self.free = list(slots)
        self.running: list[TrialRun] = []
        self.stopping = False
        self.last_stale_check = 0.0
        self.process = folder.ProcessLock(self.out)  # named in the trials it runs

    def retry_orphans(self) -> None:
        """Trials a killed sweep process left RUNNING: failed, and queued to resume in their folders."""
        for t in folder.orphans(self.study.get_trials(deepcopy=False), self.out):
            self.fail_for_retry(t.number, t._trial_id)
            log.log(NOTICE, f"trial {t.number} was left RUNNING by a sweep that is gone; failed, and queued to "
                            f"resume in {shown_path(t.user_attrs.get('run_dir', self.out / f'trial-{t.number}'))}")

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
                    log.info(f"waiting for trial(s) {', '.join(map(str, others))}, running elsewhere (one that "
                             f"a killed sweep left is retried here once its heartbeat is {2 * self.args.heartbeat} "
                             f"s old)")
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
        trial.set_user_attr(folder.PROCESS_ATTR, self.process.name)
        params = {key: suggest(trial, key, dist) for key, dist in self.space.items()}
        chosen = param_sets(params)
        shown, sets = " ".join(chosen), [*self.args.set, *chosen]
        try:
            cfg = load_config(self.args.config, sets)
        except UserError as e:  # this combination of values is not a valid config
            trial.set_user_attr("error", f"error: {e}")
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.info(f"trial {trial.number} failed: {shown}: error: {e}")
            self.free.append(slot)
            return
        command = [sys.executable, "-m", "meshtrain.train", *train_args(self.args.config, sets, run_dir), *slot.args]
        trial.set_user_attr("devices", slot.label)
        note = f"retry of trial {retry_of}, resuming {shown_path(run_dir)}" if retry_of is not None else \
            shown_path(run_dir)
        run = TrialRun(trial, run_dir, cfg.train.steps, command, slot, beat=time.monotonic())  # recorded at ask
        self.running.append(run)
        log.info(f"trial {trial.number} started: {shown} -> {note} ({slot.label})")
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
            elif code in (EXIT_TERMINATED, -signal.SIGTERM) and self.stopping:  # this sweep's stop, at its start-up
                self.fail_for_retry(run.number, run.trial._trial_id)
                log.info(f"trial {run.number} stopped while starting; it starts again when the sweep runs again")
            elif code != 0 or run.error:
                error = run.error or run.error_line()
                run.trial.set_user_attr("error", error)
                self.study.tell(run.trial, state=state.FAIL)
                log.info(f"trial {run.number} failed (exit {code}): {error} (log {shown_path(run.logs('err'))})")
            elif run.last is not None and run.last[0] >= run.steps:
                self.study.tell(run.trial, run.last[1])
                log.info(f"trial {run.number} complete: eval_loss {run.last[1]:.4f} at step {run.last[0]}")
            else:  # stopped before its last step (this sweep's stop, or a SIGTERM from outside): resume later
                self.fail_for_retry(run.number, run.trial._trial_id)
                log.info(f"trial {run.number} stopped at step {run.step}; it resumes from its checkpoint when the "
                         f"sweep runs again")
        except optuna.exceptions.UpdateFinishedTrialError:
            log.warning(f"trial {run.number} was retried by another sweep process (its heartbeat was late)")

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

