"""The Python API: `Trainer(config).fit()` builds mesh, model, sharded state, data and the
compiled step, trains, and returns the metric history. The CLI is a thin layer over it."""
from __future__ import annotations

import contextlib
import copy
import functools
import shutil
import sys
import time
import weakref
from pathlib import Path

import jax

from meshtrain import objectives
from meshtrain.config.loader import Config, UserError, to_dict
from meshtrain.config.validate import check_train_size
from meshtrain.core import compile_cache
from meshtrain.core.console import NOTICE, default_console
from meshtrain.core.console import log as console
from meshtrain.core.metrics import LOW_PEAK_NAMES, run_peaks, throughput_fields
from meshtrain.data import mixture, tasks
from meshtrain.data import tokenizer as tokenizer_lib
from meshtrain.data.prefetch import Prefetcher
from meshtrain.engine import scoring
from meshtrain.engine.program import TrainProgram
from meshtrain.engine.rollout import Rollouts
from meshtrain.ops.recipes import low_peak
from meshtrain.parallel.mesh import describe
from meshtrain.run import dashboards, goodput, loggers, run_dir
from meshtrain.run.actions import (
    Checkpointing,
    Evaluation,
    Guard,
    Report,
    StepClock,
    TaskScoring,
    preemption_signals,
)
from meshtrain.run.checkpoint import resolve_resume
from meshtrain.run.lock import LOCK_FILE, FolderLock
from meshtrain.run.multihost import agree_with_process_0
from meshtrain.run.state_store import StateStore
from meshtrain.run.watchdog import StepWatchdog


class Trainer:
    """Training run for one config on one mesh: it has a program (meshtrain/engine/program.py: the model,
    plan and optimizer compiled for the mesh) and adds data, state, checkpoints and the loop.

    `devices` restricts the mesh to a subset of jax.devices() (e.g. one device for a reference run).
    It owns `cfg.out` (run.lock) from construction to the end of `fit()`, or until `close()`;
    `allow_change` continues a run whose data, seed or schedule horizon this config changes.
    """

    def __init__(self, cfg: Config, devices=None, allow_change: bool = False):
        self._begun = goodput.start_time()  # the first fit()'s start-up runs from here (or the process's start)
        default_console()  # its notices print unless the user configured logging
        self.out = run_dir.checked(cfg.out)  # before anything is built: a bad --out costs no compile
        self.profile_window = loggers.check(cfg.logging, cfg.train.steps)  # and no bad --profile either
        if cfg.logging.tensorboard and jax.process_index() == 0 and "tensorboardX" not in sys.modules:
            dashboards.preload_tensorboard()  # meanwhile
        self.lock, created = FolderLock(self.out), not self.out.exists()
        weakref.finalize(self, self.lock.release)  # a Trainer dropped without fit() or close()
        self._own_folder()  # a second run on this --out stops here, at once
        try:
            self._build(copy.deepcopy(cfg), devices, allow_change)
        except BaseException:
            self.close()
            if created and self.out.is_dir() and [p.name for p in self.out.iterdir()] == [LOCK_FILE]:  # nothing else
                shutil.rmtree(self.out, ignore_errors=True)
            raise

    def _build(self, cfg: Config, devices, allow_change: bool):
        t = cfg.train
        compile_cache.use(cfg.compile_cache, cfg.compile_cache_max_gb)  # before the first compile
        run_dir.set_horizon(self.out, cfg)  # the schedule's, as the run recorded it
        self.cfg = cfg
        load_mixture = lambda: mixture.load(cfg.data, cfg.model.vocab_size)  # memory-mapped where prepared
        # data.document_mask splits documents at the data's own tokenizer's EOS unless data.eos_id names one
        # and under grpo the log-probabilities mask the ids past the prompts' tokenizer's, as its sampler does
        rolls_out = objectives.objective(t.objective).rolls_out
        early = load_mixture() if (cfg.data.document_mask and cfg.data.eos_id < 0) or rolls_out else None
        eos = None if early is None or early.tokenizer is None else early.tokenizer.eos_id
        vocab = early.tokenizer.vocab_size if rolls_out and early.tokenizer is not None else None
        self.program = program = TrainProgram.from_config(cfg, devices, tokenizer_eos=eos, tokenizer_vocab=vocab)
        check_train_size(program)  # before any compile: an absurd size is an error, not an OOM or a hang
        self.mixture = load_mixture() if early is None else early
        objectives.check_data(cfg.train.objective, self.mixture)  # SFT on preference pairs, DPO on chat: refused
        self.tasks = tasks.load(cfg.eval.tasks, self.mixture.tokenizer)  # now: a bad task file costs no compile
        # What defines the run, checked against the folder's record.
        self.identity, self.changes = run_dir.continued(
            self.out, cfg, run_dir.mixture_fingerprint(self.mixture), allow_change,
            earlier=lambda: run_dir.mixture_fingerprint(self.mixture, run_dir.windows_fingerprint))
        if t.steps > cfg.optim.schedule_steps:
            console.log(NOTICE, f"train.steps={t.steps} runs past the schedule's horizon (optim.schedule_steps="
                                f"{cfg.optim.schedule_steps}): lr stays at the schedule's last value from there; to "
                                f"decay over a new horizon, pass --set optim.schedule_steps={t.steps} --allow-change")
        # The objective's batches (the mixture's, or preference pairs), each with its held-out tail. val_sets:
        # {source name: its validation batches}; shares: batch index -> each source's share of it ({}: one source)
        self.train_batches, self.val_sets = program.objective.batches(self.mixture, cfg.data, t,
                                                                      program.batch_sharding, cfg.model.vocab_size)
        self.shares = self.train_batches.shares
        # grpo: each step's prompts become its batch by sampling from the step's parameters
        self.rollouts = Rollouts(program, cfg.rl, self.mixture.tokenizer, t.seed) if rolls_out else None
        if self.rollouts is not None:  # every row holds what the rewards read, before any compile
            self.rollouts.check_rows(self.train_batches.prompts, *self.val_sets.values())

        self.store = StateStore(cfg, program, self.out)  # both checkpoint tiers
        self.checkpointer = self.store.checkpointer
        self.resumed_from, self.state = None, None
        self.skip_batches: list[int] = []  # batch indices the nonfinite guard skips (see batch_index)
        self.guard = Guard(self)  # its loss-spike detector is part of a checkpoint
        self.watchdog = StepWatchdog(-1, self.out)  # fit() arms its own
        with program.context():
            resume_root, resume_steps = resolve_resume(cfg.checkpoint.resume, self.out)
            resuming = cfg.checkpoint.resume != "never"
            self.state = (self.restore(resume_root, resume_steps) if resume_steps or (resuming and self.store.local())
                          else None)  # None: neither tier holds one
            if self.state is None and cfg.checkpoint.init_from:
                params = run_dir.initial_params(cfg.checkpoint.init_from, program.model,
                                                program.state_shardings["params"], t.seed)
                self.state = jax.jit(program.state_from_params, out_shardings=program.state_shardings,
                                     donate_argnums=0)(params)  # the loaded copy becomes the state's
                console.info(f"initialised from {cfg.checkpoint.init_from}")
            elif self.state is None:
                # Parameters are created already sharded: no device ever holds the full model.
                self.state = jax.jit(program.init_state, out_shardings=program.state_shardings)(jax.random.key(t.seed))
            self.store.record_base(self.state["params"])  # a LoRA run's frozen base, by pointer and hash
            # Compiled once, ahead of time: a shape or layout change is an error, never a recompile.
            primary = jax.process_index() == 0
            compiling, cached = time.perf_counter(), compile_cache.Outcome()
            with loggers.Ticker("compiling the train step", lambda: cached.verb("the train step"), enabled=primary):
                self.compiled_step = program.lower().compile()
                # GRPO's later updates of a rollout: the step without the scoring passes
                self.reuse_step = program.lower(reuse=True).compile() if program.reuse_step_fn else None
            self._compile_s, self.step_from_cache = time.perf_counter() - compiling, bool(cached.loaded)
            self.eval_step = None if rolls_out else program.eval_step()  # rollouts score their held-out prompts
            self.scorer = scoring.for_program(program, self.tasks) if self.tasks else None
        self.peak, self.peak_fp8 = run_peaks(program.mesh.devices.flat[0].device_kind, low_peak(program.plan.precision))
        self.low_peak_name = LOW_PEAK_NAMES.get(low_peak(program.plan.precision), "fp8")
        self.local_devices = program.mesh.local_devices

    def _own_folder(self) -> None:
        """Lock --out for this run (process 0 holds the lock for every process of a multi-host run)."""
        error = None
        if jax.process_index() == 0:
            try:
                self.lock.acquire()
            except UserError as e:
                error = e
        if not agree_with_process_0(error is None):
            raise error or UserError(f"--out {self.out} is in use by another run (process 0 could not lock it); "
                                     f"pick another --out")
        notice = self.lock.stale_notice()
        if notice:
            console.log(NOTICE, notice)

    def close(self) -> None:
        """End the checkpoint manager a restore opened (its threads) and give --out back (fit() does at its
        end; a Trainer that never trains should be closed)."""
        if getattr(self, "checkpointer", None) is not None:
            with contextlib.suppress(Exception):  # closing after an error: the first error is the one said
                self.checkpointer.close()
        self.lock.release()

    def restore(self, root: Path | None, steps: list[int], verb: str = "resumed from"):
        """The newest intact state among `steps` in `root`, or the local tier's newer one (StateStore
        `read`: elastic, any saved mesh), with its record taken back: the skipped batches and the
        loss-spike detector; None when neither tier holds one."""
        found = self.store.read(root, steps, None if self.state is None else self.state["params"])
        if found is None:
            return None
        meta, self.resumed_from = found.meta, found.where
        self.skip(meta.get("skip_batches", []))
        if self.guard.spikes is not None:
            same_data = meta["config"].get("data") == to_dict(self.cfg)["data"]
            self.guard.spikes.resume(meta.get("spike_detector"), same_data)
        console.info(f"{verb} step {found.step} ({found.tier}{found.where}, saved on mesh {meta['mesh']})")
        return found.state

    def unpermuted_params(self):
        """The parameters as a single device holds them, on the host."""
        return self.program.in_model_order(jax.device_get(self.state["params"]))

    def skip(self, batches) -> None:
        """Add batch indices to those the run skips (`skip_batches`: sorted, each once)."""
        self.skip_batches = sorted(set(self.skip_batches) | set(batches))

    def batch_index(self, step: int) -> int:
        """The data batch of `step`: the step-th batch index, counting from 0, that is not skipped."""
        index = step
        for skipped in self.skip_batches:  # sorted
            if skipped > index:
                break
            index += 1
        return index

    def metadata(self) -> dict:
        """What a checkpoint records beside the state (either tier, with a LoRA run's base record):
        the resume needs all of it."""
        p = self.program
        return {"config": to_dict(self.cfg), "mesh": describe(p.sizes), "devices": p.mesh.size,
                "skip_batches": self.skip_batches, "layer_order": p.layer_order.tolist(),
                "spike_detector": self.guard.spikes.state() if self.guard.spikes else None}

    def save_checkpoint(self, wait: bool = False) -> Path:
        return self.store.save(self.state, self.metadata(), wait)

    def save_local(self) -> None:
        """Save to the local tier; returns once this process's shards are on the host."""
        self.store.save_local(self.state, self.metadata())

    def evaluate(self) -> float | None:
        return self.evaluation().get("eval_loss")

    def evaluation(self) -> dict:
        """{'eval_loss': the mean loss of train.eval_batches validation batches}, {} without validation
        (the objective's `validation`, meshtrain/objectives/). A mixture adds each source's
        `eval_loss_<name>` on its own held-out windows; eval_loss is their mean weighted by the sources'
        shares. Under DPO: the held-out pairs' eval_loss, eval_reward_accuracy and eval_reward_margin; under
        GRPO the held-out prompts' eval_reward (meshtrain/engine/rollout.py `Rollouts.evaluation`)."""
        with self.program.context():
            if self.rollouts is not None:
                return self.rollouts.evaluation(self.state["params"], self.val_sets, self.cfg.train.eval_batches)
            return self.program.objective.validation(self.eval_step, self.state["params"], self.val_sets,
                                                     self.program.eval_inputs(self.state), self.mixture.sources,
                                                     self.cfg.train.eval_batches)

    def task_evaluation(self) -> dict:
        """{eval_acc_<task>, eval_acc_norm_<task>} of eval.tasks (meshtrain/engine/scoring.py), {} without."""
        return scoring.task_metrics(self.scorer, self.state["params"], self.tasks) if self.tasks else {}

    def fit(self, steps: int | None = None, log: loggers.MetricsLog | None = None) -> list[dict]:
        """Train until `steps` (default train.steps) and return the logged records. `log`: where
        records go (default: the sinks of the config's logging section, on process 0 only)."""
        cfg, t = self.cfg, self.cfg.train
        steps = steps or t.steps
        primary = jax.process_index() == 0
        first = int(self.state["step"])
        if first >= steps:
            console.info(f"already at step {first} of {steps}: nothing to train (raise --steps, or use a new --out)")
            self.close()
            return []
        self.preempted = self.fitted = False  # fitted: ran to its end, its saves durable (train.py's handler)
        self._own_folder()  # held since __init__, or again for a second fit()
        # This start's goodput account (meshtrain/run/goodput.py); a second fit() starts at its call.
        fresh = self._begun is not None
        account = goodput.Goodput(self._begun if fresh else time.perf_counter(), self._compile_s if fresh else 0.0,
                                  first)
        self._begun = None
        # From before the first write to the summary a signal finishes the step, checkpoints and exits 0:
        # one that lands while the last save is made durable, or after, leaves the finished run as it is.
        with preemption_signals() as signalled:
            try:
                if primary:  # only a run that trains writes into --out
                    run_dir.write_config(self.out, cfg, self.program.mesh)
                    earlier = run_dir.read_record(self.out)
                    run_dir.record_start(self.out, self.identity, cfg, first, self.changes,
                                         run_dir.data_files(self.out, self.mixture))
                    self.changes = []
                    account.replay_until = goodput.furthest(earlier["starts"] if earlier else [])
                    account.write = functools.partial(run_dir.record_goodput, self.out)
                    tokenizer_lib.record(self.out, self.mixture.tokenizer)  # so the run's tokens can be decoded
                console.info(f"meshtrain: {self.program.num_params / 1e6:.2f}M params, mesh "
                             f"{describe(self.program.sizes)} ({jax.device_count()} {jax.default_backend()} devices), "
                             f"zero={cfg.parallel.zero}, precision={cfg.parallel.precision}, out={self.out}")
                console.info(loggers.where(self.out, cfg.logging.tensorboard))
                log = log or loggers.for_run(self.out, cfg, primary, first, steps)
                started = time.perf_counter()
                self.watchdog = StepWatchdog(t.step_timeout, self.out, jax.process_index(), jax.process_count(), first)
                with self.watchdog:
                    self._loop(first, steps, log, signalled, account)
                # Every save is durable (the last one waited for): Orbax's manager and its thread end here,
                # on every process alike, before --out is given back (a second fit() makes a new one). Not
                # on an error: a peer may be gone.
                closing = time.perf_counter()
                self.checkpointer.close()
                account.spend("checkpoint", time.perf_counter() - closing)
                if self.store.local_tier is not None:
                    self.store.local_tier.report_failures()
            except UserError:  # a full disk, say: the saves already started still become durable
                if jax.process_count() == 1:
                    with contextlib.suppress(Exception):
                        self.checkpointer.wait()
                raise
            finally:
                with contextlib.suppress(Exception):  # written at its last change; after an error, as far as it got
                    account.flush()
                if log is not None:
                    # After an error (a full disk) closing the sinks may fail alike: the first error is the one said
                    with contextlib.suppress(UserError) if sys.exc_info()[1] is not None else contextlib.nullcontext():
                        log.close()
                self.close()
            if primary:
                saved = self.checkpointer.steps()
                newest = str(self.checkpointer.path(max(saved))) if saved else None
                record = run_dir.read_record(self.out)  # the run's starts, this one's account last
                accounts = [s["goodput"] for s in record["starts"] if "goodput" in s] if record else [account.account()]
                console.info(loggers.summary_line(log.history, first, int(self.state["step"]), steps,
                                                  time.perf_counter() - started, newest, log.locations())
                             + "; " + goodput.line(goodput.total(accounts)))
            self.fitted = True  # before the handlers go back: a signal from here on finds the run finished
        return log.history

    def _loop(self, first, steps, log, signalled, account):
        """The step driver: dispatch a step, then judge the one before it (the host never waits for the step
        it just dispatched), then run the periodic actions that are due (meshtrain/run/actions.py)."""
        depth, dog = self.cfg.data.prefetch, self.watchdog
        prefetch = Prefetcher(self.train_batches, depth)
        trace = loggers.ProfileWindow(self.profile_window, self.out / "profile", jax.process_index() == 0,
                                      state=lambda: self.state)
        clock = StepClock(first, steps, prefetch, dog, account)
        periodic = [Report(self, log), Evaluation(self, log), TaskScoring(self, log),
                    Checkpointing(self, log, signalled)]
        k, pending = first, None  # pending: (step, metrics) not yet judged by the guard
        with self.program.context(), contextlib.closing(prefetch), trace:
            if self.rollouts is not None and first == 0 and periodic[1].every:
                periodic[1].run(0, {}, clock)  # grpo: the starting policy's held-out reward, step 0's record
            while k < steps:
                dog.doing(f"getting the batch of step {k + 1}")
                batch = prefetch.get(self.batch_index(k), [self.batch_index(k + j) for j in range(1, depth + 1)])
                sampled = {}
                if self.rollouts is not None:  # grpo: the prompts' completions from the current parameters
                    dog.doing(f"sampling the rollout of step {k + 1}")
                    batch, sampled = self.rollouts(self.state, batch, k)
                clock.exclude(trace.before(k + 1))  # tracing's own time is no step's
                dog.doing(f"dispatching step {k + 1}")
                scores = self.reuse_step is None or self.program.objective.scores_at(k)
                self.state, metrics = (self.compiled_step if scores else self.reuse_step)(self.state, batch)
                metrics = {**metrics, **sampled}
                if (back := self.guard.judge(pending, clock, log)) is not None:
                    k, pending = back, None  # rolled back (the clock too): the step in flight is dropped
                    continue
                k = done = k + 1
                clock.exclude(trace.after(done))
                pending = (done, metrics)
                for action in periodic:
                    if not action.due(done, clock):
                        continue
                    if action.judged:  # the guard judges the step first (it may roll back)
                        judged, pending = pending, None
                        if (back := self.guard.judge(judged, clock, log)) is not None:
                            k = back
                            break
                    if action.run(done, metrics, clock):
                        return  # preempted

    def record(self, step, metrics, tokens_per_sec, step_time, data_wait) -> dict:
        """A step's metric record. `data_wait_s`: host seconds per step spent getting the batch (~0 when
        prefetching keeps up)."""
        record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(metrics["lr"]), "skipped_steps": int(metrics["skipped_steps"]),
                  "tokens_per_sec": tokens_per_sec, "step_time_s": step_time, "data_wait_s": data_wait}
        if self.guard.spikes is not None:
            record["loss_spikes"] = self.guard.loss_spikes
        record.update({k: float(v) for k, v in metrics.items()
                       if k not in record and k not in ("finite", "grad_norms", "expert_load")})  # the model's
        if "trained_tokens" in record:  # a loss mask: the step's trained (assistant) tokens per second
            record["trained_tokens_per_sec"] = record["trained_tokens"] / step_time
        record.update(self.shares(self.batch_index(step - 1)))  # a mixture's sources' shares
        record.update(throughput_fields(tokens_per_sec, self.program.flops_per_token, self.program.mesh.size,
                                        self.peak, self.peak_fp8, self.low_peak_name))
        record.update(loggers.device_memory(self.local_devices))  # where the backend reports it
        return record
