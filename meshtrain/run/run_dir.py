"""The run's output folder (`--out`): checked before anything is built, owned by one run at a time
(run.lock, meshtrain/run/lock.py), and written only by a run that starts training (config.yaml and
run.json here, metrics.jsonl in loggers.py, checkpoints/ in checkpoint.py).

run.json records what defines the run: the model's architecture, the data's fingerprint (a
mixture's: every source's, with its share), the seed and the learning-rate schedule's horizon. A
later start in the same folder continues that run; one that would change any of them is refused
(a new run needs a new --out), unless the user says `--allow-change`, which records the change as
a new phase (the model never changes: its checkpoints hold its weights). Each start's entry also
holds its goodput account (meshtrain/run/goodput.py), rewritten whenever it changes.

The data's fingerprint is its token count, dtype and the sha256 of every byte of its token stream
(meshtrain/data/digest.py). run.json also records where each source was (`data_files`: absolute,
and relative to the run folder), so the commands that read a run's data (eval, int8 export) find it
from any working folder (`resolve_data`) and refuse other content (`check_run_data`)."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import yaml

from meshtrain.config.loader import Config, UserError, default_out, load_config, parse_yaml, to_dict
from meshtrain.core import schema
from meshtrain.core.console import NOTICE, log
from meshtrain.core.errors import first_line
from meshtrain.core.folders import full_disk_is_user_error, replace_file, writable
from meshtrain.data import mixture, store
from meshtrain.data.mixture import sources as data_sources
from meshtrain.engine.program import TrainProgram
from meshtrain.interop import hf
from meshtrain.models import FAMILIES, make_spec
from meshtrain.models.spec import LoraSpec
from meshtrain.ops.trainable import merge, select
from meshtrain.run import goodput
from meshtrain.run.checkpoint import check_model, complete_steps, saved_metadata
from meshtrain.run.lock import LOCK_FILE

RUN_RECORD = "run.json"
# What the readers use of run.json (meshtrain/core/schema.py); `record_start` writes it, later versions add keys.
START_SCHEMA = {"at": str, "step": schema.Int(), "steps": schema.Int(), "changes": [str],
                "record_rebuilt_from": schema.Optional(str), "goodput": schema.Optional(goodput.ACCOUNT_SCHEMA)}
DATA_FILE_SCHEMA = {"path": schema.Nullable(str), "from_run": schema.Nullable(str), "data": schema.Line()}
RUN_SCHEMA = {"identity": {"model": {"family": schema.Optional(tuple(FAMILIES))},
                           "data": schema.Nullable(schema.Line()),
                           "seed": schema.Int(), "schedule_steps": schema.Int(1)},
              "data_source": schema.Optional(schema.Line()), "starts": [START_SCHEMA],
              "data_files": schema.Optional([DATA_FILE_SCHEMA])}
WRITTEN_SECTIONS = {"model", "parallel", "optim", "train", "data"}  # in every config.yaml meshtrain writes
HEADER = "# written by meshtrain"


def is_run(path: Path) -> bool:
    """A folder meshtrain made for a run: it holds run.json, or (an earlier version's run) a config.yaml
    that meshtrain wrote: its header, or the resolved config with every section. A user's file that
    happens to be named config.yaml (notes, another tool's config) does not make a folder a run."""
    if (path / RUN_RECORD).is_file():
        return True
    config = path / "config.yaml"
    try:
        if not config.is_file() or config.stat().st_size > 1 << 20:
            return False
        text = config.read_text(encoding="utf-8")
        written = parse_yaml(text, str(config))
    except (OSError, UnicodeDecodeError, UserError):
        return False
    return text.startswith(HEADER) or isinstance(written, dict) and WRITTEN_SECTIONS <= written.keys()


def checked(out: str) -> Path:
    """The output folder, once it is known that it can be created or written and is new, empty or a
    run's; nothing is written."""
    path = writable(out or default_out(), "--out")
    if path.is_dir() and not is_run(path):
        foreign = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)
        if foreign:
            raise UserError(f"--out {path} is a folder that is not a meshtrain run (it holds {foreign[0]}"
                            f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); pick a new or "
                            f"empty folder")
    return path


def data_fingerprint(tokens) -> str:
    """The token stream's identity: its length, dtype and the sha256 of all its bytes (a prepared
    folder's from its manifest). Another file with the same tokens has the same fingerprint (a moved
    dataset); any other token changes it."""
    if tokens is None:
        return "synthetic"
    return f"{len(tokens)}:{tokens.dtype.name}:sha256:{tokens.sha256()}"


def windows_fingerprint(tokens) -> str:
    """The fingerprint earlier versions recorded (its length and 64 windows of 1024 tokens spread over
    it, hashed), computed to compare with a run.json they wrote; blind to a change between windows."""
    if tokens is None:
        return "synthetic"
    n = len(tokens)
    width = min(1024, n)
    starts = np.unique(np.linspace(0, n - width, 64).astype(np.int64))
    digest = hashlib.sha256(str(n).encode())
    digest.update(tokens.windows(starts, width).astype("<i4").tobytes())
    return f"{n}:{digest.hexdigest()[:16]}"


def earlier_format(fingerprint: str | None) -> bool:
    """A fingerprint of `windows_fingerprint`'s format (a run.json written before whole-stream hashes)."""
    return fingerprint not in (None, "synthetic") and "sha256:" not in fingerprint


def mixture_fingerprint(mix, of: Callable = data_fingerprint) -> str:
    """A mixture's identity (meshtrain/data/mixture.py `Mixture`): each source's share and fingerprint
    (`of` its tokens), in order (the order decides which rows come from which source); one source: its
    own fingerprint."""
    if len(mix.sources) == 1:
        return of(mix.tokens[0])
    return "mixture " + ", ".join(f"{s.share:.6g} x {of(t)}" for s, t in zip(mix.sources, mix.tokens))


def shown(fingerprint: str) -> str:
    """A fingerprint in a message: each sha256 cut to 12 digits."""
    return re.sub(r"(sha256:[0-9a-f]{12})[0-9a-f]{52}", r"\1...", str(fingerprint))


def data_files(out: Path, mix) -> list[dict]:
    """Each source of `mix` as run.json records it: its path absolute and relative to the run folder
    (None: the standard library or synthetic data; an object-store URI as it is, both times) and its
    fingerprint."""
    files = []
    for s, tokens in zip(mix.sources, mix.tokens):
        if store.is_uri(s.path):
            where = from_run = s.path
        else:
            where = os.path.abspath(s.path) if s.path else None
            from_run = where and os.path.relpath(where, os.path.abspath(out))
        files.append({"path": where, "from_run": from_run,
                      "data": data_fingerprint(tokens)})
    return files


def resolve_data(run: str | Path, cfg: Config) -> None:
    """The run's data paths in `cfg` (its config.yaml's) as run.json's `data_files` records them, the
    same from any working folder: the absolute path where it exists, else the one relative to the run
    folder where that exists, else the absolute one (`run_mixture` says it is gone). A run.json of an
    earlier version (none recorded) leaves the config's paths as they are."""
    try:
        record = read_record(Path(run)) or {}
    except UserError:
        return  # the command that needs the record says it is unreadable
    files, found = _data_files(record), data_sources(cfg.data)
    if len(files) != len(found):
        return
    paths = [_located(run, f) if f["path"] else s.path for s, f in zip(found, files)]
    if cfg.data.sources:
        cfg.data.sources = [{**entry, "path": p} for entry, p in zip(cfg.data.sources, paths)]
    else:
        cfg.data.path = paths[0]


def _data_files(record: dict) -> list[dict]:
    """run.json's `data_files` (checked by RUN_SCHEMA); [] where it has none (an earlier version's)."""
    return [f for f in record.get("data_files", []) if f["path"] is None or f["from_run"] is not None]


def _located(run: str | Path, file: dict) -> str:
    if store.is_uri(file["path"]):
        return file["path"]
    beside = os.path.normpath(Path(run).absolute() / file["from_run"])
    return beside if not os.path.exists(file["path"]) and os.path.exists(beside) else file["path"]


def run_mixture(run: str | Path, cfg: Config, other: str | None = None):
    """The data `cfg` (a run's config, `resolve_data` applied) names, loaded and checked to be what
    the run trained on (`check_run_data`); a source that is gone is one error. `other`: how to use
    other data instead (a flag), if the command has a way."""
    record, problems = readable_record(Path(run))  # a read-only command: it shows what it can
    files = _data_files(record)
    for i, s in enumerate(data_sources(cfg.data)):
        if s.path and not store.is_uri(s.path) and not os.path.exists(s.path):
            recorded = files[i] if len(files) > i and files[i].get("path") == s.path else None
            where = (f"{s.path} (where it trained) nor at {Path(run) / recorded['from_run']} (relative to the run)"
                     if recorded else s.path if os.path.isabs(s.path) else f"{s.path} (from this working folder)")
            raise UserError(f"the data the run in {run} trained on is not at {where}; put it back"
                            f"{f', or {other}' if other else ''}")
    mix = mixture.load(cfg.data, cfg.model.vocab_size)
    if problems and "identity" not in record:
        log.warning(f"{run}: {'; '.join(problems)}: the data is not checked against what the run trained on")
        return mix
    check_run_data(run, mix, other, record or None)
    return mix


def check_run_data(run: str | Path, mix, other: str | None = None, record: dict | None = None) -> None:
    """`mix` is the data the run in `run` trained on last (run.json's identity; `record`: run.json
    as read already), or one error naming the source that differs and the fix (`other`: how to use
    other data instead)."""
    record = record if record is not None else read_record(Path(run))
    recorded = record["identity"].get("data") if record else None
    if recorded is None:
        return  # an earlier version's run without run.json: nothing to compare with
    if mixture_fingerprint(mix, windows_fingerprint if earlier_format(recorded) else data_fingerprint) == recorded:
        return
    files = _data_files(record) or [{}] * len(mix.sources)  # none: each source may differ
    name = lambda s: s.path or "the Python standard library"
    differ = [name(s) for s, t, f in zip(mix.sources, mix.tokens, files)
              if f.get("data") != data_fingerprint(t)] or [name(s) for s in mix.sources]
    raise UserError(f"{', '.join(differ)} {'holds' if len(differ) == 1 else 'hold'} other data than the run in "
                    f"{run} trained on (fingerprint {shown(mixture_fingerprint(mix))}, the run's {shown(recorded)}); "
                    f"restore the data it trained on{f', or {other}' if other else ''}")


def identity(cfg: Config, data: str) -> dict:
    """What defines a run (`data`: its fingerprint): what run.json records and a later start compares."""
    return {"model": cfg.model.architecture(), "data": data, "seed": cfg.train.seed,
            "schedule_steps": cfg.optim.schedule_steps or cfg.train.steps}


def read_record(out: Path) -> dict | None:
    """run.json (checked against RUN_SCHEMA, its model against its family's spec), or None where
    there is none."""
    path = out / RUN_RECORD
    if not path.exists():
        return None
    fix = "it records what defines this run: restore it, or use a new --out for a new run"
    record = schema.read_json(path, RUN_SCHEMA, fix)
    check_model(record["identity"]["model"], str(path), fix, "identity.model")
    return record


def readable_record(out: Path) -> tuple[dict, list[str]]:
    """For a read-only command (report, eval): run.json's sections that read, each checked alone, and
    what is missing or unreadable, named; ({}, []) where there is no run.json. A run that continues
    reads it whole (`read_record`)."""
    path = out / RUN_RECORD
    if not path.exists():
        return {}, []
    try:
        record = schema.parse_json(path.read_bytes(), str(path), "")
    except (UserError, OSError) as e:
        return {}, [first_line(e).rstrip("; ")]
    if not isinstance(record, dict):
        return {}, [f"{RUN_RECORD} does not hold a mapping"]
    kept, problems = {}, []
    for key, inner in RUN_SCHEMA.items():
        optional = isinstance(inner, schema.Optional)
        if key not in record:
            problems += [] if optional else [f"{RUN_RECORD} has no {key}"]
            continue
        try:
            schema.check(record[key], inner.schema if optional else inner, str(path), "", key)
            if key == "identity":
                check_model(record[key]["model"], str(path), "", "identity.model")
            kept[key] = record[key]
        except UserError as e:
            problems.append(f"{RUN_RECORD}'s {key} is unreadable ({first_line(e).rstrip('; ')})")
    return kept, problems


def record_or_rebuilt(out: Path) -> dict | None:
    """run.json; or, where it is missing from a folder with checkpoints (deleted, or an earlier version's
    run), the identity the newest readable checkpoint records (model, seed, schedule horizon) with
    `rebuilt_from` naming it; None for a new run."""
    record = read_record(out)
    if record is not None:
        return record
    root = out / "checkpoints"
    for step in complete_steps(root):
        try:
            saved = saved_metadata(root / str(step))["config"]
            recorded = {"model": make_spec(saved["model"]).architecture(), "data": None,
                        "seed": saved["train"]["seed"],
                        "schedule_steps": saved["optim"].get("schedule_steps") or saved["train"]["steps"]}
        except Exception:  # noqa: BLE001 - an unreadable step: the previous one may tell
            continue
        return {"identity": recorded, "starts": [], "rebuilt_from": str(root / str(step))}
    if complete_steps(root):
        raise UserError(f"{out} holds checkpoints but no {RUN_RECORD} (what defines the run), and no checkpoint "
                        f"records it readably; restore {RUN_RECORD}, or use a new --out for a new run")
    return None


def set_horizon(out: Path, cfg: Config) -> None:
    """optim.schedule_steps = the run's recorded horizon, or this first start's train.steps, unless the
    config sets one."""
    _apply_horizon(cfg, record_or_rebuilt(out) if not cfg.optim.schedule_steps else None)


def _apply_horizon(cfg: Config, record: dict | None) -> None:
    if not cfg.optim.schedule_steps:
        cfg.optim.schedule_steps = record["identity"]["schedule_steps"] if record else cfg.train.steps


def continued(out: Path, cfg: Config, data: str, allow_change: bool,
              earlier: Callable[[], str] | None = None) -> tuple[dict, list[str]]:
    """(this start's identity, what changes from the recorded run); a change is refused unless
    `allow_change`. Sets the schedule's horizon (`set_horizon`) if the config does not. A run.json
    rebuilt from a checkpoint (`record_or_rebuilt`) is said, and its data (which no checkpoint
    records) taken as this start's. `earlier`: this start's data fingerprint in the format of an
    earlier version (`windows_fingerprint`), compared where its run.json recorded that one."""
    record = record_or_rebuilt(out)
    recorded = record["identity"] if record else None
    _apply_horizon(cfg, record)  # the record read once (a rebuilt one reads a checkpoint's metadata)
    mine = identity(cfg, data)
    if recorded is None:
        return mine, []
    if "rebuilt_from" in record:
        recorded["data"] = mine["data"]
        log.log(NOTICE, f"{out / RUN_RECORD} is missing: what defines the run (model, seed, schedule horizon) is "
                        f"read from checkpoint {record['rebuilt_from']}; the data it trained on is not recorded "
                        f"there and is taken as this start's, and the earlier starts are lost")
    model_change = cfg.model.architecture_difference(
        make_spec(recorded["model"]), "this start",
        f"the run in {out}")
    if model_change:  # other weights: no phase of this run can continue from its checkpoints
        raise UserError(f"{model_change}; use a new --out for a new run, or the model section of "
                        f"{out / 'config.yaml'}")
    changes, then = [], mine["data"]
    if recorded["data"] != mine["data"] and earlier_format(recorded["data"]) and earlier is not None:
        then = earlier()  # like with like: the run.json of an earlier version
        if then == recorded["data"]:
            log.log(NOTICE, f"{out / RUN_RECORD} records its data by an earlier version's fingerprint "
                            f"({recorded['data']}), which this start's data matches; from this start on it records "
                            f"the sha256 of the whole token stream ({shown(mine['data'])})")
    if then != recorded["data"]:
        changes.append(f"the run in {out} trained on other data (fingerprint {shown(recorded['data'])}, from "
                       f"{record.get('data_source')}), this start's is {shown(then)} (from {data_source(cfg)})")
    for key, name in (("seed", "train.seed"), ("schedule_steps", "optim.schedule_steps")):
        if recorded[key] != mine[key]:
            changes.append(f"the run in {out} has {name}={recorded[key]}, this start {mine[key]}")
    if changes and not allow_change:
        raise UserError(f"{changes[0]}{f' (and {len(changes) - 1} more)' if len(changes) > 1 else ''}; use a new "
                        f"--out for a new run, or pass --allow-change to continue this one with the change")
    return mine, changes


def data_source(cfg: Config) -> str:
    if cfg.data.sources:
        return "data.sources " + ", ".join(f"{s.path or 'stdlib'} (share {s.share:.3g})"
                                           for s in data_sources(cfg.data))
    return cfg.data.path or ("synthetic data" if cfg.data.kind == "synthetic" else "the Python standard library")


def record_start(out: Path, mine: dict, cfg: Config, step: int, changes: list[str],
                 files: list[dict] | None = None) -> None:
    """run.json: the run's identity, where its data is (`files`: `data_files`), and one entry per start
    (the step it started at, the changes it was allowed to make). Written whole."""
    record = record_or_rebuilt(out) or {"starts": []}
    rebuilt = record.pop("rebuilt_from", None)  # run.json was missing: this start says from where it came
    record.update(identity=mine, data_source=data_source(cfg), **({"data_files": files} if files is not None else {}))
    record["starts"].append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "step": step, "steps": cfg.train.steps,
                             "changes": changes, **({"record_rebuilt_from": rebuilt} if rebuilt else {})})
    replace_file(out / RUN_RECORD, json.dumps(record, indent=1) + "\n")


def record_goodput(out: Path, account: dict) -> None:
    """This start's goodput account (meshtrain/run/goodput.py) in its entry of run.json (the last),
    written whole; not where run.json was removed while the run trains (the next start rebuilds it)."""
    record = read_record(out)
    if record is None or not record["starts"]:
        return
    record["starts"][-1]["goodput"] = account
    with full_disk_is_user_error(out, f"{RUN_RECORD}'s goodput account", then="rerun the same command to resume"):
        replace_file(out / RUN_RECORD, json.dumps(record, indent=1) + "\n")


def version() -> str:
    try:
        return importlib.metadata.version("meshtrain")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def write_config(out: Path, cfg: Config, mesh) -> None:
    """config.yaml: the resolved config (head_dim and mlp_dim filled in), usable again as --config,
    under a header naming the meshtrain version and the devices it ran on."""
    resolved = to_dict(cfg)
    resolved["model"] = to_dict(cfg.model.resolved())
    device = mesh.devices.flat[0]
    header = (f"{HEADER} {version()} at the start of training on {mesh.size} x "
              f"{device.device_kind} ({device.platform}), {len({d.process_index for d in mesh.devices.flat})} "
              f"process(es)\n")
    replace_file(out / "config.yaml", header + yaml.safe_dump(resolved, sort_keys=False))


def run_config(run: str | Path, overrides: list[str] = ()) -> Config:
    """The config a finished or running run recorded (<run>/config.yaml), with out = the run and its
    data where run.json says it is (`resolve_data`), unless `overrides` name other data."""
    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run} is not a meshtrain run folder (no config.yaml); pass the --out of a training run")
    try:  # config.yaml's schema is the config itself (meshtrain/config): its loader checks every key
        cfg = load_config(str(path), [f"out={run}", *overrides], recorded=True)
    except UserError as e:  # named the file when the loader did not
        raise UserError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
    if not any(o.startswith(("data.path=", "data.sources=")) for o in overrides):
        resolve_data(run, cfg)
    return cfg


def newest_params(run: str | Path, model, shardings=None, step: int | None = None, part: str = "params"):
    """(params in model order, step) of the newest intact checkpoint under <run>/checkpoints, or of
    `step`, verified (meshtrain.run.checkpoint.read_params), read straight into `shardings` (a tree like
    the params, or one sharding for all; default: the first device). Only the parameters are read,
    never the optimizer state; `part="reference"`: a DPO run's frozen reference parameters instead."""
    from meshtrain.run.checkpoint import read_params  # orbax: only where a checkpoint is read

    shapes = jax.eval_shape(model.init, jax.random.key(0))
    if shardings is None or not isinstance(shardings, dict):
        one = shardings or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    lora = model.cfg.lora.rank  # its checkpoints hold the adapters; the base is rebuilt from their record
    params, meta, step = read_params(Path(run) / "checkpoints", select(abstract, model.cfg.trainable) if lora
                                     else abstract, step, part)
    order = np.asarray(meta.get("layer_order", range(model.cfg.stacked_layers())))  # interleaved, dualpipev: permuted
    params = {**params, "blocks": TrainProgram.reorder_blocks(params["blocks"], np.argsort(order))}
    return (merge(lora_base(meta, model, shardings), params) if lora else params), step


def trunk_params(run, model, params) -> dict:
    """`params` without the model's training-only ones (deepseek_v3's multi-token prediction modules),
    which an export leaves out: inference runs the trunk. Says so in one notice line when it drops any."""
    if extra := [k for k in model.training_only if k in params]:
        log.log(NOTICE, f"{run}: writing the model without its training-only parameters ({', '.join(extra)}: "
                        f"model.mtp_depth's multi-token prediction modules); inference uses the trunk only")
    return {k: v for k, v in params.items() if k not in model.training_only}


def base_record(cfg: Config, base) -> dict:
    """What a LoRA run's checkpoints record of its frozen `base` (parameters) instead of holding it:
    the pointer (`checkpoint.init_from`, or none: the base is `model.init` of `train.seed`, rebuilt
    bitwise on any mesh, so a run from scratch stores no copy of it) and its hash."""
    from meshtrain.run.checksums import tree_hash

    return {"init_from": cfg.checkpoint.init_from or None, "seed": cfg.train.seed, "hash": tree_hash(base)}


def lora_base(meta: dict, model, shardings) -> dict:
    """The frozen base (model order, in `shardings`) of a LoRA checkpoint whose metadata is `meta`,
    rebuilt from its record (`base_record`) and checked against the recorded hash: another base is
    one error naming both hashes, before anything is written."""
    from meshtrain.run.checksums import tree_hash

    record, frozen = meta.get("base"), lambda path: not model.cfg.trainable(path)
    if record is None:
        raise UserError("this LoRA checkpoint records no base (saved by an earlier version, whose checkpoints "
                        "hold the whole model); train it with that version, or start a new run")
    if record["init_from"]:
        params = initial_params(record["init_from"], model, shardings, record["seed"])
    else:
        params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(record["seed"]))
    base = select(params, frozen)
    found = tree_hash(base)
    if found != record["hash"]:
        source = record["init_from"] or f"model.init of train.seed={record['seed']}"
        raise UserError(f"the LoRA base {source} has hash {found}, but the checkpoint's adapters were trained on "
                        f"base {record['hash']}; restore the base the run started from (or start a new run "
                        f"on this base with another --out)")
    return base


def initial_params(source: str, model, shardings, seed: int = 0):
    """checkpoint.init_from: the parameters (model order, in `shardings`) of a Hugging Face folder
    (`hf:DIR`, verified against its SHA256SUMS when it has one) or of a meshtrain run's newest intact
    checkpoint, whose architecture must be this model's. With LoRA (model.lora) the source is the
    frozen base, and the adapters start fresh (from `seed`, as `model.init`)."""
    if source.startswith("hf:"):
        folder = source[3:]
        spec, fix = hf.read_spec(folder), f"python -m meshtrain.convert --from-hf {folder} --out RUN"
    else:
        spec, fix = run_config(source).model, f"use the model section of {Path(source) / 'config.yaml'}"
    lora = model.cfg.lora
    if lora.rank and spec.lora.rank:
        raise UserError(f"checkpoint.init_from={source} is a LoRA run: start from its base, or export it merged "
                        f"(python -m meshtrain.convert --to-hf RUN OUT --merge) and start from that")
    spec = dataclasses.replace(spec.resolved(), lora=lora)  # the base's architecture, with this run's adapters
    differ = model.cfg.architecture_difference(spec, "this run", f"checkpoint.init_from={source}")
    if differ:
        raise UserError(f"{differ}; the model must match the weights: {fix}")
    base, frozen = model, lambda path: not model.cfg.trainable(path)
    if lora.rank:
        base = FAMILIES[spec.family](dataclasses.replace(spec, lora=LoraSpec()))
        adapters = jax.jit(lambda key: select(model.init(key), model.cfg.trainable),
                           out_shardings=select(shardings, model.cfg.trainable))(jax.random.key(seed))
        shardings = select(shardings, frozen)
    params = hf.load_params(source[3:], base, shardings) if source.startswith("hf:") else \
        newest_params(source, base, shardings)[0]
    return merge(params, adapters) if lora.rank else params
