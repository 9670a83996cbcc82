"""`python -m meshtrain.eval --run RUN` (or `--hf DIR`): evaluate a checkpoint without training, on
any mesh: the validation loss on the run's held-out data (or `--data`) and the downstream
multiple-choice tasks (the run's eval.tasks, or `--task`), as the training loop logs them
(docs/evaluation.md). The weights are read verified (a run's newest intact checkpoint or `--step`:
meshtrain/run/run_dir.py `newest_params`; a Hugging Face folder: meshtrain/interop/hf.py) straight
into the mesh's shardings. A run's data is found where run.json says it was, from any working folder,
and must be what the run trained on (run_dir.py `run_mixture`). `harness_lm(...)` gives the same
model to lm-eval-harness (meshtrain/interop/harness.py).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from meshtrain.core.cli import Parser, arguments, command, compile_cache_flag, devices_flag, number, start_jax
from meshtrain.core.errors import UserError

HF_SEQ_LEN, HF_BATCH = 2048, 8  # --hf's window and rows unless --seq-len / --batch-size say otherwise


@dataclass
class Loaded:
    cfg: object  # the Config evaluated under (the run's, or one made for the Hugging Face folder)
    program: object  # meshtrain/engine/program.py TrainProgram: mesh, shardings, eval step
    params: dict  # in model order, in the program's parameter shardings
    tok: object  # None for a run on synthetic data that records none
    source: str  # what was read: "RUN step N" or "hf:DIR"
    data_of: str | None = None  # the run whose own data the validation loss reads (checked); None: --data, --hf
    reference: dict | None = None  # a DPO run's frozen reference parameters (model order), of the same checkpoint


def load(run: str | None = None, hf: str | None = None, *, mesh: str | None = None, step: int | None = None,
         seq_len: int | None = None, batch_size: int | None = None, data: str | None = None,
         tokenizer: str | None = None, devices=None) -> Loaded:
    """A run's checkpoint (the newest intact one, or `step`) or a Hugging Face folder, read onto `mesh`
    (default: the run's parallel.mesh; data=-1 for --hf). `data` replaces the run's data for the
    validation loss; `tokenizer` the recorded one; `devices` restricts the mesh to a subset of
    jax.devices(), as for Trainer."""
    from meshtrain.config.loader import Config, apply_overrides, check_config
    from meshtrain.data import tokenizer as tokenizer_lib
    from meshtrain.engine.program import TrainProgram
    from meshtrain.run import run_dir

    if (run is None) == (hf is None):
        raise UserError("pass one of --run RUN or --hf DIR")
    overrides = ["devices=0"]  # this process's devices (--devices simulates them), not the run's simulated count
    overrides += [f"parallel.mesh={mesh}"] if mesh else []
    overrides += [f"train.seq_len={seq_len}"] if seq_len else []
    overrides += [f"train.batch_size={batch_size}"] if batch_size else []
    overrides += ["data.sources=[]", f"data.path={data}", "data.kind=auto"] if data else []
    if run is not None:
        cfg = run_dir.run_config(run, overrides)  # its data where run.json says it is, unless --data
        synthetic = cfg.data.kind == "synthetic" and not cfg.data.sources  # its loss needs no tokenizer
        tok = (tokenizer_lib.load(tokenizer) if tokenizer else None if synthetic and not tokenizer_lib.recorded(run)
               else tokenizer_lib.for_run(run))
    else:
        from meshtrain.interop import hf as hf_lib

        if step is not None:
            raise UserError("--step chooses a run's checkpoint; --hf DIR has one set of weights")
        cfg = Config(model=hf_lib.read_spec(hf))
        tok_spec = tokenizer or (hf if (Path(hf) / tokenizer_lib.HF_FILE).is_file() else None)
        if tok_spec is None:
            raise UserError(f"{hf} holds no {tokenizer_lib.HF_FILE}; name the model's tokenizer with --tokenizer")
        cfg.data.tokenizer = str(tok_spec)
        apply_overrides(cfg, [f"train.seq_len={HF_SEQ_LEN}", f"train.batch_size={HF_BATCH}", *overrides])
        check_config(cfg)
        tok = tokenizer_lib.load(str(tok_spec))
    if tok is not None:
        tokenizer_lib.check_vocab(tok, cfg.model.vocab_size, "the tokenizer")
    program = TrainProgram.from_config(cfg, devices, tokenizer_eos=None if tok is None else tok.eos_id)  # document_mask
    shardings = program.state_shardings["params"]
    reference = None
    if run is not None:
        params, step = run_dir.newest_params(run, program.model, shardings, step)
        source = f"{run} step {step}"
        if "reference" in program.state_shardings:  # DPO's copy (under LoRA the base is the reference)
            reference, _ = run_dir.newest_params(run, program.model, shardings, step, part="reference")
    else:
        params, source = run_dir.initial_params(f"hf:{hf}", program.model, shardings), f"hf:{hf}"
    return Loaded(cfg, program, params, tok, source, run if run is not None and not data else None, reference)


def validation(loaded: Loaded, batches: int) -> dict:
    """{eval_loss[, eval_loss_<source>]} on `batches` validation batches of the config's data, as the
    training loop measures it (the objective's `validation`, meshtrain/objectives/); {} when the data
    holds none out. A DPO run's: the held-out pairs' DPO eval_loss, eval_reward_accuracy and
    eval_reward_margin, against the reference of the same checkpoint. A GRPO run's: the held-out
    prompts' eval_reward, as its loop scores them (meshtrain/engine/rollout.py `Rollouts.evaluation`)."""
    from meshtrain.data import mixture
    from meshtrain.run import run_dir

    cfg, program = loaded.cfg, loaded.program
    mix = (run_dir.run_mixture(loaded.data_of, cfg, "pass --data PATH to evaluate on other data") if loaded.data_of
           else mixture.load(cfg.data, cfg.model.vocab_size))
    objective = program.objective  # the data the run held out, as the trainer holds it out
    _, val_sets = objective.batches(mix, cfg.data, cfg.train, program.batch_sharding, cfg.model.vocab_size)
    storage = lambda params: {**params, "blocks": program.reorder_blocks(params["blocks"], program.layer_order)}
    reference = () if loaded.reference is None else (storage(loaded.reference),)
    if objective.rolls_out:
        from meshtrain.engine.rollout import Rollouts

        rollouts = Rollouts(program, cfg.rl, loaded.tok, cfg.train.seed)
        rollouts.check_rows(*val_sets.values())
        with program.context():
            return rollouts.evaluation(loaded.params, val_sets, batches)
    with program.context():
        return objective.validation(program.eval_step(), storage(loaded.params), val_sets, reference, mix.sources,
                                    batches)


def task_entries(flags: list[str], limit: int) -> list[dict]:
    """--task NAME=PATH or PATH (repeatable), each with --limit, as eval.tasks entries."""
    entries = []
    for flag in flags:
        name, eq, path = flag.partition("=")
        entry = {"name": name, "path": path} if eq else {"path": flag}
        entries.append({**entry, "limit": limit} if limit else entry)
    return entries


def needs_tokenizer(loaded: Loaded, what: str) -> None:
    """A run on synthetic data may record no tokenizer: its validation loss needs none, text does."""
    if loaded.tok is None:
        raise UserError(f"{loaded.source} trained on synthetic data and records no tokenizer, which {what} needs "
                        f"to encode text; name one: --tokenizer byte, or --tokenizer path/to/tokenizer.json")


def evaluate(loaded: Loaded, tasks_config: list, val_batches: int) -> dict:
    """The record a training step's evaluations would log: eval_loss (when val_batches > 0 and the data
    holds some out) and each task's eval_acc_<name>, eval_acc_norm_<name>."""
    from meshtrain.data import tasks as tasks_lib
    from meshtrain.engine import scoring

    if tasks_config:
        needs_tokenizer(loaded, "--task")
    tasks = tasks_lib.load(tasks_config, loaded.tok, "--task")  # read first: a bad file costs no compile
    record = validation(loaded, val_batches) if val_batches else {}
    if tasks:
        scorer = scoring.for_program(loaded.program, tasks, model_order=True)
        record.update(scoring.task_metrics(scorer, loaded.params, tasks))
    return record


def harness_lm(run: str | None = None, hf: str | None = None, **kwargs):
    """An lm-eval-harness model (meshtrain/interop/harness.py `HarnessLM`) of a run's checkpoint or a
    Hugging Face folder, read by `load` (same keywords); its window is train.seq_len (or --seq-len)."""
    from meshtrain.engine import scoring
    from meshtrain.interop.harness import HarnessLM

    loaded = load(run, hf, **kwargs)
    needs_tokenizer(loaded, "the lm-eval-harness model")
    scorer = scoring.for_program(loaded.program, model_order=True)
    return HarnessLM(scorer.model, loaded.params, loaded.tok, scorer, loaded.program.mesh, loaded.program.rules)


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.eval", description="Evaluate a checkpoint without training: validation "
                                                            "loss and downstream multiple-choice tasks.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", help="a training run's --out folder (its newest intact checkpoint)")
    which.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint folder (config.json + safetensors)")
    p.add_argument("--step", type=number(int, min=0), help="--run: read this checkpoint step")
    p.add_argument("--task", action="append", default=[], metavar="[NAME=]PATH",
                   help="a task file (JSON lines of {context, choices, label}; repeatable); default: the run's "
                        "eval.tasks")
    p.add_argument("--limit", type=number(int, min=0), default=0, help="score each --task's first N items (0 = all)")
    p.add_argument("--data", help="validation data in place of the run's (any data.path); --hf: none unless given")
    p.add_argument("--val-batches", type=number(int, min=0),
                   help="validation batches (default: the run's train.eval_batches; 0 = no validation loss)")
    p.add_argument("--mesh", help="evaluate on this mesh ('tensor=2', 'data=2,fsdp=2'); default: the run's "
                                  "parallel.mesh, data=-1 for --hf")
    devices_flag(p)
    compile_cache_flag(p)
    p.add_argument("--seq-len", type=number(int, min=1),
                   help=f"the window (default: the run's train.seq_len; {HF_SEQ_LEN} for --hf)")
    p.add_argument("--batch-size", type=number(int, min=1),
                   help=f"rows per batch (default: the run's train.batch_size; {HF_BATCH} for --hf)")
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's, or the --hf folder's)")
    p.add_argument("--json", metavar="FILE", help="also write the results as one JSON object to FILE")
    return p


@command
def main(argv=None) -> int:
    from meshtrain.core.folders import file_target, replace_file
    from meshtrain.data import tasks
    from meshtrain.parallel.mesh import describe
    from meshtrain.run.loggers import format_record

    args = arguments(parser(), argv)
    start_jax(args)
    json_out = args.json and file_target(args.json, "--json")  # checked before any work
    flagged = task_entries(args.task, args.limit)
    for entry in tasks.entries(flagged, "--task"):  # a bad --task file is found before any weight is read
        tasks.read(entry.path, entry.limit)
    loaded = load(args.run, args.hf, mesh=args.mesh, step=args.step, seq_len=args.seq_len,
                  batch_size=args.batch_size, data=args.data, tokenizer=args.tokenizer)
    tasks_config = flagged or loaded.cfg.eval.tasks
    val_batches = args.val_batches
    if args.hf and val_batches and not args.data:
        raise UserError("--val-batches with --hf needs --data PATH: a Hugging Face folder has no validation data")
    if val_batches is None:
        val_batches = loaded.cfg.train.eval_batches if (args.run or args.data) else 0
    record = evaluate(loaded, tasks_config, val_batches)
    print(f"evaluated {loaded.source} on mesh {describe(loaded.program.sizes)}")
    if "eval_loss" in record or "eval_reward" in record:
        held_out = {k: v for k, v in record.items() if k.startswith(("eval_loss", "eval_reward", "eval_response"))}
        print(format_record({"step": 0, **held_out})
              .removeprefix(f"step {0:>6}  "))
    tasks = {k: v for k, v in record.items() if k.startswith("eval_acc")}
    if tasks:
        print(format_record({"step": 0, **tasks}).removeprefix(f"step {0:>6}  "))
    if not record:
        print("nothing to evaluate: no validation data held out and no tasks (pass --task FILE or --data)")
    if args.json:
        replace_file(json_out, json.dumps({"source": loaded.source, **record}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
