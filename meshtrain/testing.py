"""Tiny runs for the tests, the benchmarks and notebooks: one harness, so every parity figure is
measured the same way. A tiny run trains configs/tiny.yaml (or another config) for its 5 steps in
a fresh output folder and returns (trainer, per-step losses, final parameters on the host)."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
MOE_TINY = str(ROOT / "configs" / "moe_tiny.yaml")
QWEN3_MOE_TINY = str(ROOT / "configs" / "qwen3_moe_tiny.yaml")
DEEPSEEK_V3_TINY = str(ROOT / "configs" / "deepseek_v3_tiny.yaml")
SHAKESPEARE_TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"  # beside the clone, where there is one


def benchmark_text() -> str:
    """The benchmarks' default --data: tinyshakespeare.txt where ../shared/data holds it, else ''
    (the Python standard library's source, which every machine has)."""
    return str(SHAKESPEARE_TEXT) if SHAKESPEARE_TEXT.is_file() else ""
_RUNS: dict = {}


@functools.cache
def _run_folders() -> str:
    """This process's folder of tiny run folders, removed when the process exits."""
    folder = tempfile.mkdtemp(prefix="meshtrain-tiny-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def fresh_run_folder() -> str:
    """A new, empty run folder inside this process's folder of them (`_run_folders`): a test session
    leaves no run folders behind in the system's temp folder."""
    return tempfile.mkdtemp(dir=_run_folders())


def tiny_config(*overrides, out=None, config=TINY):
    """The config in a fresh output folder (never resuming another run's checkpoint), removed with
    this process (`fresh_run_folder`) unless `out` names one."""
    from meshtrain.config.loader import load_config

    out = out or fresh_run_folder()
    return load_config(config, [f"out={out}", "checkpoint.resume=never", *overrides])


def run_tiny(*overrides, devices=None, config=TINY):
    """Train and return (trainer, per-step losses, final params); `trainer.history` holds the
    records and `trainer.grad_norms` the per-step gradient norms. Memoized: callers share runs."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    key = (overrides, None if devices is None else len(devices), config)
    if key not in _RUNS:
        trainer = Trainer(tiny_config(*overrides, config=config), devices=devices)
        history = trainer.history = trainer.fit(log=MetricsLog(trainer.out, primary=False))
        trainer.grad_norms = np.array([r["grad_norm"] for r in history if "loss" in r])
        losses = np.array([r["loss"] for r in history if "loss" in r])
        _RUNS[key] = (trainer, losses, jax.device_get(trainer.state["params"]))
    return _RUNS[key]


def max_param_diff(a, b) -> float:
    """The largest absolute difference between two parameter trees."""
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def value_and_grads(attend, q, k, v, cot):
    """An attention kernel's output and d(sum(out * cot))/d(q, k, v): what the kernel parity tests compare."""
    def loss(q, k, v):
        out = attend(q, k, v)
        return jax.numpy.sum(out * cot), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def full_forward_greedy(model, params, rows, new):
    """Greedy tokens by rerunning the whole forward on each row's growing sequence (right-padded:
    causal, so the padding never reaches a row's last position): what cached generation must equal."""
    apply = jax.jit(model.apply)
    buf = np.zeros((len(rows), max(map(len, rows)) + new), np.int32)
    for b, row in enumerate(rows):
        buf[b, :len(row)] = row
    for t in range(new):
        logits = np.asarray(apply(params, buf))
        for b, row in enumerate(rows):
            buf[b, len(row) + t] = logits[b, len(row) + t - 1].argmax()
    return [buf[b, len(row):len(row) + new] for b, row in enumerate(rows)]


# MoE runs trained on expert meshes, exported to Hugging Face (tests/test_hf_moe.py, benchmarks/hf_parity.py
# --expert-mesh): each family's tiny config (Mixtral's form has no shared experts) on each layout.
MOE_EXPORT_FAMILIES = {"mixtral": (MOE_TINY, ("model.num_shared_experts=0",)), "qwen3_moe": (QWEN3_MOE_TINY, ()),
                       "deepseek_v3": (DEEPSEEK_V3_TINY, ("model.router_bias_update_rate=0.01",))}  # biases move
MOE_EXPORT_LAYOUTS = {"data=2,expert=4": ("parallel.mesh=data=2,expert=4",),
                      "fsdp=2,expert=4, ZeRO-3": ("parallel.mesh=fsdp=2,expert=4", "parallel.zero=3")}
MOE_RESUMED_ON = "parallel.mesh=expert=2,data=2,fsdp=2"  # 8 experts: 2, then 4 per device
MOE_RESUMED_FAMILIES = ("qwen3_moe", "deepseek_v3")  # trained on data=2,expert=4, resumed on MOE_RESUMED_ON


def trained_run(out, config, overrides, steps, resume=False):
    """A run of `config` trained for `steps` in the folder `out` (resuming its checkpoint when `resume`),
    its final save written: the trainer."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    trainer = Trainer(tiny_config(*overrides, *(["checkpoint.resume=auto"] if resume else []), out=str(out),
                                  config=config))
    trainer.fit(steps, log=MetricsLog(trainer.out, primary=False))  # ends with its save of `steps`
    trainer.checkpointer.wait()
    return trainer


def hf_export_parity(trainer, folder, tokens) -> tuple[float, float, float]:
    """Export the trainer's run with `convert --to-hf` into `folder`, load it with transformers (fp32,
    CPU torch) and import it back onto one device: (max |logit difference| from meshtrain's on `tokens`,
    the largest |logit|, max |imported - trained| parameter difference)."""
    import torch
    import transformers

    from meshtrain import convert
    from meshtrain.interop import hf
    from meshtrain.models import FAMILIES
    from meshtrain.parallel.mesh import build_mesh, parse_mesh
    from meshtrain.parallel.sharding import param_shardings

    convert.to_hf(str(trainer.out), str(folder), "float32", 1 << 30, "fsdp=-1")
    params = jax.device_get(trainer.unpermuted_params())
    ours = np.asarray(trainer.program.model.apply(params, tokens))
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = theirs_model(torch.tensor(np.asarray(tokens))).logits.numpy()
    spec = hf.read_spec(folder)
    model = FAMILIES[spec.family](spec)
    one = build_mesh(parse_mesh("1", 1), jax.devices()[:1])
    imported = jax.device_get(hf.load_params(folder, model, param_shardings(model, one)))
    return float(np.abs(theirs - ours).max()), float(np.abs(ours).max()), max_param_diff(imported, params)
