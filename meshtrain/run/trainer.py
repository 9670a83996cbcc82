"""The Python API: `Trainer(config).fit()` builds mesh, model, sharded state, data and the
compiled step, trains, and returns the metric history. The CLI is a thin layer over it."""
from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.config.loader import Config, UserError, to_dict
from meshtrain.config.validate import check_train_size
from meshtrain.core.metrics import mfu, run_peaks
from meshtrain.data import mixture, tasks
from meshtrain.data import tokenizer as tokenizer_lib
from meshtrain.data.prefetch import Prefetcher
from meshtrain.engine import scoring
from meshtrain.engine.program import TrainProgram
from meshtrain.models import make_spec
from meshtrain.ops.optimizers import map_param_states
from meshtrain.parallel.mesh import describe
from meshtrain.run import loggers, run_dir
from meshtrain.run.checkpoint import Checkpointer, abstract_like, resolve_resume
from meshtrain.run.health import CollectiveTimer, SpikeDetector, Stragglers, grad_norm_fields
from meshtrain.run.lock import LOCK_FILE, FolderLock
from meshtrain.run.multihost import agree_with_process_0, preemption_reached
from meshtrain.run.watchdog import StepWatchdog


class Trainer:
    """Training run for one config on one mesh: it has a program (meshtrain/engine/program.py: the model,
    plan and optimizer compiled for the mesh) and adds data, state, checkpoints and the loop.

    `devices` restricts the mesh to a subset of jax.devices() (e.g. one device for a reference run).
    It owns `cfg.out` (run.lock) from construction to the end of `fit()`, or until `close()`;
    `allow_change` continues a run whose data, seed or schedule horizon this config changes.
    """

    def __init__(self, cfg: Config, devices=None, allow_change: bool = False):
        self.out = run_dir.checked(cfg.out)  # before anything is built: a bad --out costs no compile
        self.profile_window = loggers.check(cfg.logging, cfg.train.steps)  # and no bad --profile either
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
        run_dir.set_horizon(self.out, cfg)  # the schedule's, as the run recorded it
        self.cfg = cfg
        load_mixture = lambda: mixture.load(cfg.data, cfg.model.vocab_size)  # memory-mapped where prepared
        # data.document_mask splits documents at the data's own tokenizer's EOS unless data.eos_id names one
        early = load_mixture() if cfg.data.document_mask and cfg.data.eos_id < 0 else None
        eos = None if early is None else getattr(early.tokenizer, "eos_id", None)
        self.program = program = TrainProgram.from_config(cfg, devices, tokenizer_eos=eos)
        check_train_size(program)  # before any compile: an absurd size is an error, not an OOM or a hang
        self.mixture = load_mixture() if early is None else early
        self.tasks = tasks.load(cfg.eval.tasks, self.mixture.tokenizer)  # now: a bad task file costs no compile
        # What defines the run, checked against the folder's record.
        self.identity, self.changes = run_dir.continued(self.out, cfg, run_dir.mixture_fingerprint(self.mixture),
                                                        allow_change)
        if t.steps > cfg.optim.schedule_steps and jax.process_index() == 0:
            print(f"notice: train.steps={t.steps} runs past the schedule's horizon (optim.schedule_steps="
                  f"{cfg.optim.schedule_steps}): lr stays at the schedule's last value from there; to decay over a new "
                  f"horizon, pass --set optim.schedule_steps={t.steps} --allow-change", flush=True)
        # val_sets: {source name: its validation batches}; shares: batch index -> each source's share of it
        self.train_batches, self.val_sets = mixture.batches(self.mixture, cfg.data.val_fraction, t.batch_size,
                                                            t.seq_len, t.seed, program.batch_sharding,
                                                            cfg.model.vocab_size)
        self.shares = getattr(self.train_batches, "shares", None)  # a mixture's

        self.checkpointer = Checkpointer(self.out / "checkpoints", cfg.checkpoint.keep, owner=True)
        self.resumed_from = None
        self.skip_batches: list[int] = []  # batch indices the nonfinite guard skips (see batch_index)
        self.bad_batches: list[int] = []  # the current run of nonfinite steps' batch indices
        self.rollbacks = 0
        g = cfg.guard
        self.spikes = SpikeDetector(g.spike_factor, g.spike_window) if g.spike_factor else None
        self.loss_spikes = 0  # rolled back, this process's run
        self.comm_timer = None  # built at the first grad_norms_every step
        self.watchdog = StepWatchdog(-1, self.out)  # fit() arms its own
        with program.context():
            resume_root, resume_steps = resolve_resume(cfg.checkpoint.resume, self.out)
            if resume_steps:
                self.state = self._restore(resume_root, resume_steps)
            elif cfg.checkpoint.init_from:
                params = run_dir.initial_params(cfg.checkpoint.init_from, program.model,
                                                program.state_shardings["params"])
                self.state = jax.jit(program.state_from_params, out_shardings=program.state_shardings,
                                     donate_argnums=0)(params)  # the loaded copy becomes the state's
                if jax.process_index() == 0:
                    print(f"initialised from {cfg.checkpoint.init_from}", flush=True)
            else:
                # Parameters are created already sharded: no device ever holds the full model.
                self.state = jax.jit(program.init_state, out_shardings=program.state_shardings)(jax.random.key(t.seed))
            # Compiled once, ahead of time: a shape or layout change is an error, never a recompile.
            primary = jax.process_index() == 0
            with loggers.Ticker("compiling the train step", "compiled the train step", enabled=primary):
                self.compiled_step = program.lower().compile()
            self.eval_step = program.eval_step()
            self.scorer = scoring.for_program(program, self.tasks) if self.tasks else None
        self.peak, self.peak_fp8 = run_peaks(program.mesh.devices.flat[0].device_kind, program.plan.precision)
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
            print(notice, flush=True)

    def close(self) -> None:
        """Give --out back (fit() does at its end; a Trainer that never trains should be closed)."""
        self.lock.release()

    def _restore(self, root: Path, steps: list[int], verb: str = "resumed from"):
        """Read the newest intact checkpoint among `steps` straight into this mesh's shardings
        (elastic: any saved mesh works)."""
        reader = self.checkpointer if root == self.checkpointer.directory else Checkpointer(root, keep=1000)
        step, state, meta = reader.restore_latest_intact(
            steps, abstract_like(self.program.abstract_state, self.program.state_shardings),
            self._check_same_model, self.program.optional_state())
        saved_order = np.asarray(meta.get("layer_order", range(self.cfg.model.num_layers)))
        if not np.array_equal(saved_order, self.program.layer_order):
            state = self._reorder_layers(state, saved_order)
        self.resumed_from = reader.path(step)
        self._skip(meta.get("skip_batches", []))
        if self.spikes is not None:
            self.spikes.resume(meta.get("spike_detector"), meta["config"].get("data") == to_dict(self.cfg)["data"])
        if jax.process_index() == 0:
            print(f"{verb} step {step} ({self.resumed_from}, saved on mesh {meta['mesh']})", flush=True)
        return state

    def _check_same_model(self, meta, folder) -> None:
        """Resume needs the same weights' definition (architecture, resolved); everything about how the
        run executes or learns may change."""
        saved = make_spec(meta["config"]["model"])
        differ = self.cfg.model.architecture_difference(saved, "this run", f"checkpoint {folder}")
        own = Path(folder).parent == self.checkpointer.directory  # --resume never refuses those
        fresh = "use a new --out for a new run" if own else "pass --resume never to start fresh in --out"
        if differ:
            raise UserError(f"{differ}; {fresh}, or use the checkpoint's model config")
        optimizer = meta["config"].get("optim", {}).get("optimizer", "adamw")  # earlier versions: AdamW
        if optimizer != self.cfg.optim.optimizer:  # another state layout
            raise UserError(f"checkpoint {folder} holds the state of optim.optimizer={optimizer}, this run has "
                            f"{self.cfg.optim.optimizer}; resume with optim.optimizer={optimizer}, or {fresh} "
                            f"(checkpoint.init_from takes a run's weights with a fresh optimizer)")

    def _reorder_layers(self, state, saved_order):
        """Move stacked layers from a checkpoint's storage order (interleaved pipelines store each
        device's chunks together) into this run's."""
        p = self.program
        rows = np.argsort(saved_order)[p.layer_order]
        move = lambda x, names: x[rows] if names and names[0] == "layers" else x
        is_names = lambda n: isinstance(n, tuple)

        def reorder(state):
            params = jax.tree.map(move, state["params"], p.logical_axes, is_leaf=is_names)
            opt_state = map_param_states(lambda x, _, names: move(x, names), state["opt_state"], state["params"],
                                         p.logical_axes)
            return {**state, "params": params, "opt_state": opt_state}

        state = jax.jit(reorder, out_shardings=p.state_shardings)(state)
        if "grad_error" in state:  # compression residuals of the old order: they start fresh
            state["grad_error"] = p.optional_state()["grad_error"]()
        return state

    def unpermuted_params(self):
        """The parameters as a single device holds them, on the host."""
        return self.program.in_model_order(jax.device_get(self.state["params"]))

    def _skip(self, batches) -> None:
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

    def save_checkpoint(self, wait: bool = False) -> Path:
        p = self.program
        self.checkpointer.save(self.state, {"config": to_dict(self.cfg), "mesh": describe(p.sizes),
                                            "devices": p.mesh.size, "skip_batches": self.skip_batches,
                                            "layer_order": p.layer_order.tolist(),
                                            "spike_detector": self.spikes.state() if self.spikes else None})
        self.last_save = time.monotonic()
        if wait:
            self.checkpointer.wait()
        return self.checkpointer.path(int(self.state["step"]))

    def evaluate(self) -> float | None:
        return self.evaluation().get("eval_loss")

    def evaluation(self) -> dict:
        """{'eval_loss': the mean loss of train.eval_batches validation batches}, {} without validation.
        A mixture adds each source's `eval_loss_<name>` on its own held-out windows; eval_loss is their
        mean weighted by the sources' shares."""
        with self.program.context():
            return validation(self.eval_step, self.state["params"], self.val_sets, self.mixture.sources,
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
            if primary:
                print(f"already at step {first} of {steps}: nothing to train (raise --steps, or use a new --out)",
                      flush=True)
            self.close()
            return []
        # From before the first write on, a signal finishes the step, checkpoints and exits 0.
        signalled = threading.Event()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            if jax.process_count() == 1:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    handlers[sig] = signal.signal(sig, lambda *_: signalled.set())
            else:  # JAX's runtime notes SIGTERM for the preemption sync point; Ctrl-C becomes one
                handlers[signal.SIGINT] = signal.signal(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        self.preempted = False
        self._own_folder()  # held since __init__, or again for a second fit()
        try:
            if primary:  # only a run that trains writes into --out
                run_dir.write_config(self.out, cfg, self.program.mesh)
                run_dir.record_start(self.out, self.identity, cfg, first, self.changes)
                self.changes = []
                tokenizer_lib.record(self.out, self.mixture.tokenizer)  # so the run's tokens can be decoded
            if primary:
                print(f"meshtrain: {self.program.num_params / 1e6:.2f}M params, mesh {describe(self.program.sizes)} "
                      f"({jax.device_count()} {jax.default_backend()} devices), zero={cfg.parallel.zero}, "
                      f"precision={cfg.parallel.precision}, out={self.out}", flush=True)
                print(loggers.where(self.out, cfg.logging.tensorboard), flush=True)
            log = log or loggers.for_run(self.out, cfg, primary, first, steps)
            started = time.perf_counter()
            self.watchdog = StepWatchdog(t.step_timeout, self.out, jax.process_index(), jax.process_count(), first)
            with self.watchdog:
                self._loop(first, steps, log, signalled)
            # Every save is durable (the last one waited for): Orbax's manager and its thread end here,
            # on every process alike, before --out is given back (a second fit() makes a new one). Not
            # on an error: a peer may be gone.
            self.checkpointer.close()
        except UserError:  # a full disk, say: the saves already started still become durable
            if jax.process_count() == 1:
                with contextlib.suppress(Exception):
                    self.checkpointer.wait()
            raise
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if log is not None:
                log.close()
            self.close()
        if primary:
            saved = self.checkpointer.steps()
            newest = str(self.checkpointer.path(max(saved))) if saved else None
            print(loggers.summary_line(log.history, first, int(self.state["step"]), steps,
                                       time.perf_counter() - started, newest, log.locations()), flush=True)
        return log.history

    def _loop(self, first, steps, log, signalled):
        t = self.cfg.train
        tokens_per_step = t.batch_size * t.seq_len
        last_time, last_step = time.perf_counter(), first
        self.last_save = time.monotonic()
        k, pending, save_owed = first, None, False  # pending: (step, metrics) not yet judged by the guard
        depth, data_wait = self.cfg.data.prefetch, 0.0  # data_wait: prefetch.waited at the last log
        self.device_wait, device_wait = 0.0, 0.0  # seconds the host waited for steps; its value at the last log
        dog, evaluated, scored, saved = self.watchdog, False, False, False
        stragglers = Stragglers(t.straggler_every, t.straggler_factor, jax.process_index(), jax.process_count())
        prefetch = Prefetcher(self.train_batches, depth)
        trace = loggers.ProfileWindow(self.profile_window, self.out / "profile", jax.process_index() == 0,
                                      state=lambda: self.state)
        with self.program.context(), contextlib.closing(prefetch), trace:
            while k < steps:
                dog.doing(f"getting the batch of step {k + 1}")
                batch = prefetch.get(self.batch_index(k), [self.batch_index(k + j) for j in range(1, depth + 1)])
                last_time += trace.before(k + 1)  # tracing's own time is no step's
                dog.doing(f"dispatching step {k + 1}")
                self.state, metrics = self.compiled_step(self.state, batch)
                # Judge the previous step only now, so the host never waits for the step it just dispatched.
                if pending is not None and (back := self._guard(*self._wait(*pending), log)) is not None:
                    k, pending = back, None  # rolled back: the step in flight is dropped
                    last_time, last_step, data_wait, device_wait = (time.perf_counter(), k, prefetch.waited,
                                                                    self.device_wait)
                    continue
                k = done = k + 1
                last_time += trace.after(done)
                pending = (done, metrics)
                if done % t.log_every == 0 or done == steps:
                    metrics = jax.device_get(self._wait(done, metrics)[1])
                    n = done - last_step
                    dt = (time.perf_counter() - last_time) / n
                    waited = (prefetch.waited - data_wait) / n
                    record = self._record(done, metrics, tokens_per_step / dt, dt, waited)
                    dog.observe(dt)
                    if stragglers.due(done):  # the host's own time per step: outside waiting for the devices
                        dog.doing(f"waiting for the other processes' step times at step {done}")
                        record |= stragglers.gather(done, dt, max(0.0, dt - (self.device_wait - device_wait) / n),
                                                    waited)
                    if t.grad_norms_every and done % t.grad_norms_every == 0:
                        record |= self._grad_norms(metrics, dt)
                    log.write(record)
                    last_time, last_step, data_wait, device_wait = (time.perf_counter(), done, prefetch.waited,
                                                                     self.device_wait)
                if t.eval_every and (done % t.eval_every == 0 or done == steps):
                    dog.doing(f"evaluating after step {done}")
                    dog.one_time, evaluated = not evaluated, True  # the first compiles the eval step
                    evaluation = self.evaluation()
                    if evaluation:
                        log.write({"step": done, **evaluation})
                    dog.beat(done)
                    last_time = time.perf_counter()
                every = self.cfg.eval.task_every or t.eval_every
                if self.tasks and (done % every == 0 or done == steps):  # downstream tasks (eval.tasks)
                    dog.doing(f"scoring the downstream tasks after step {done}")
                    dog.one_time, scored = not scored, True  # the first compiles the scorer
                    log.write({"step": done, **self.task_evaluation()})
                    dog.beat(done)
                    last_time = time.perf_counter()
                preempted = self._preempted(done, signalled)
                save_owed = save_owed or self._save_due(done)
                if not (save_owed or preempted or done == steps):
                    continue
                # A checkpoint never lands inside a NaN/Inf streak: judge this step before saving it.
                judged, pending = pending, None
                if (back := self._guard(*self._wait(*judged), log)) is not None:
                    k = back
                    last_time, last_step, data_wait, device_wait = (time.perf_counter(), k, prefetch.waited,
                                                                    self.device_wait)
                    continue
                final, path = preempted or done == steps, None
                if self.bad_batches:  # a periodic save waits for the streak to end
                    save_owed = True
                    if final:
                        self.checkpointer.wait()  # earlier async saves are durable before the run ends
                    if final and jax.process_index() == 0:
                        print(f"warning: step {done} is inside a NaN/Inf streak: not saved; the newest "
                              f"checkpoint is step {max(self.checkpointer.steps(), default=0)}",
                              file=sys.stderr, flush=True)
                else:
                    started = time.perf_counter()
                    dog.doing(f"saving step {done}")
                    dog.one_time, saved = not saved, True  # the first sets up the checkpointer
                    path = self.save_checkpoint(wait=final)
                    dog.beat(done)
                    if not final:  # async: the loop waited only for the device-to-host copy and checksums
                        log.write({"step": done, "checkpoint_blocking_s": time.perf_counter() - started})
                        last_time += time.perf_counter() - started
                    save_owed = False
                if preempted:
                    self.preempted = True
                    if jax.process_index() == 0:
                        print(f"preempted at step {done}: " + (f"checkpoint saved to {path}" if path else
                                                               "not saved (inside a NaN/Inf streak)"), flush=True)
                    return

    def _wait(self, step: int, metrics) -> tuple[int, dict]:
        """(step, metrics) once the step is done on the devices: the host's wait is timed (the straggler
        figures' device wait) and the watchdog sees the step complete."""
        self.watchdog.doing(f"waiting for step {step}")
        started = time.perf_counter()
        metrics = jax.block_until_ready(metrics)
        self.device_wait += time.perf_counter() - started
        self.watchdog.beat(step)
        return step, metrics

    def _grad_norms(self, metrics, step_time) -> dict:
        """train.grad_norms_every: each layer's and kind's gradient norm, and the timed communication
        share of the step (meshtrain/run/health.py)."""
        if self.comm_timer is None:
            self.comm_timer = CollectiveTimer(self.program.mesh, self.program.num_params)
        return grad_norm_fields(metrics["grad_norms"], self.program.layer_order) | self.comm_timer.share(step_time)

    def _record(self, step, metrics, tokens_per_sec, step_time, data_wait) -> dict:
        """`data_wait_s`: host seconds per step spent getting the batch (~0 when prefetching keeps up)."""
        record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(metrics["lr"]), "skipped_steps": int(metrics["skipped_steps"]),
                  "tokens_per_sec": tokens_per_sec, "step_time_s": step_time, "data_wait_s": data_wait}
        if self.spikes is not None:
            record["loss_spikes"] = self.loss_spikes
        record.update({k: float(v) for k, v in metrics.items()
                       if k not in record and k not in ("finite", "grad_norms")})  # the model's
        if self.shares is not None:  # a mixture: each source's share of the step's tokens
            record.update(self.shares(self.batch_index(step - 1)))
        flops, n = self.program.flops_per_token, self.program.mesh.size
        util = mfu(tokens_per_sec, flops, n, self.peak)
        if util is not None:
            record.update(mfu=util, tflops_per_device=tokens_per_sec * flops / n / 1e12)
            if self.peak_fp8:
                record["mfu_fp8"] = mfu(tokens_per_sec, flops, n, self.peak_fp8)
        record.update(loggers.device_memory(self.local_devices))  # where the backend reports it
        return record

    def _save_due(self, step: int) -> bool:
        """checkpoint.every steps, or checkpoint.every_minutes since the last save. With several
        processes, process 0's clock decides, at log steps only (one tiny broadcast there)."""
        c = self.cfg.checkpoint
        if c.every and step % c.every == 0:
            return True
        if not c.every_minutes or (jax.process_count() > 1 and step % self.cfg.train.log_every):
            return False
        return agree_with_process_0(time.monotonic() - self.last_save >= 60 * c.every_minutes)

    def _preempted(self, step: int, signalled: threading.Event) -> bool:
        """SIGTERM/SIGINT: at once with one process; with several, at the step all of them agree on."""
        return signalled.is_set() if jax.process_count() == 1 else preemption_reached(step)

    def _guard(self, step: int, metrics, log) -> int | None:
        """Count a nonfinite step (its update was already skipped inside the step); after
        guard.max_consecutive_bad in a row, roll back (`_roll_back`). The step rolled back to, or None."""
        if bool(metrics["finite"]):
            self.bad_batches = []
            return self._spike(step, float(metrics["loss"]), log) if self.spikes is not None else None
        self.bad_batches.append(self.batch_index(step - 1))
        bad = len(self.bad_batches)
        if jax.process_index() == 0:
            print(f"warning: step {step}: loss or gradients are NaN/Inf; update skipped ({bad} in a row)",
                  file=sys.stderr, flush=True)
        return self._roll_back(step, log) if bad >= self.cfg.guard.max_consecutive_bad else None

    def _spike(self, step: int, loss: float, log) -> int | None:
        """guard.spike_factor: a loss spike rolls back at once (its update was applied), skipping its
        batch; every process judges the same replicated loss, so all of them roll back together."""
        mean = self.spikes.check(loss)
        if mean is None:
            return None
        self.bad_batches, self.loss_spikes = [self.batch_index(step - 1)], self.loss_spikes + 1
        if jax.process_index() == 0:
            print(f"warning: step {step}: loss spike: {loss:.4f} is {loss / mean:.2f}x the running mean {mean:.4f} "
                  f"(guard.spike_factor={self.cfg.guard.spike_factor}); loss spikes so far: {self.loss_spikes}",
                  file=sys.stderr, flush=True)
        return self._roll_back(step, log, f"a loss spike at step {step}")

    def _roll_back(self, step: int, log, spike: str | None = None) -> int:
        """After a NaN/Inf streak ending at `step` (or `spike`, a loss spike's description): the state of
        the newest intact checkpoint, read as a resume reads it (`_restore`), the bad batches past it
        skipped from now on, and `log` rewound to it; returns that step, where the loop trains on. With
        no checkpoint, or after guard.max_rollbacks, the run stops with an error; after a NaN/Inf
        streak it first saves the state (no bad step changed it), after a spike it does not (the
        spike's update was applied)."""
        self.watchdog.doing(f"rolling back from step {step}")
        self.checkpointer.wait()
        steps, bad = self.checkpointer.steps(), len(self.bad_batches)
        what = spike or f"{bad} NaN/Inf steps in a row"
        if not steps or self.rollbacks >= self.cfg.guard.max_rollbacks:
            why = "no checkpoint to roll back to" if not steps else f"still diverging after {self.rollbacks} rollbacks"
            if spike:
                raise UserError(f"{what}, {why}; the newest checkpoint is step {max(steps, default=0)}; lower "
                                f"optim.lr, check the data or raise guard.spike_factor, then rerun to resume")
            path = self.save_checkpoint(wait=True)  # the parameters are intact: bad steps changed nothing
            raise UserError(f"{what} at step {step}, {why}; state saved to {path}; "
                            f"lower optim.lr or check the data, then rerun to resume")
        self.state = self._restore(self.checkpointer.directory, steps, verb=f"guard: {what}; rolled back to")
        back = int(self.state["step"])
        resume_index = self.batch_index(back)
        skipped = [b for b in self.bad_batches if b >= resume_index]  # earlier ones precede the checkpoint
        self._skip(skipped)
        if jax.process_index() == 0:
            print(f"guard: skipping batches {skipped}", flush=True)
        self.bad_batches, self.rollbacks = [], self.rollbacks + 1
        log.rewind(back)
        self.watchdog.beat(back)
        return back


def validation(eval_step, params, val_sets: dict, sources, batches: int) -> dict:
    """Trainer.evaluation's record for `params` (the eval step's layout): each validation set's mean
    loss over `batches` batches; with several sources, eval_loss is their mean weighted by the sources'
    shares and each adds its eval_loss_<name>. Call it under the program's context."""
    losses = {name: float(jnp.mean(jnp.stack([eval_step(params, val(i)) for i in range(batches)])))
              for name, val in val_sets.items()}
    if len(losses) < 2:
        return {"eval_loss": next(iter(losses.values()))} if losses else {}
    record = {"eval_loss": math.fsum(s.share * losses[s.name] for s in sources)}
    return record | {f"eval_loss_{name}": loss for name, loss in losses.items()}
