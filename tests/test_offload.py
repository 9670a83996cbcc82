"""parallel.offload=optimizer (meshtrain/ops/offload.py): the optimizer state's moments in pinned host
memory, the update streamed through the device a layer at a time. On CPU devices host and device memory
are one RAM: these prove the program (the same run as without offload, every optimizer, a sharded
layout, exact resume, the nonfinite guard), and the GPU compile proves the placement and its price."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import max_param_diff, run_tiny, tiny_config

from meshtrain.config.loader import UserError
from meshtrain.config.spec import OptimSpec
from meshtrain.engine.program import TrainProgram
from meshtrain.engine.step import optimizer_parts
from meshtrain.ops import offload
from meshtrain.ops.optimizers import OPTIMIZERS
from meshtrain.planner import compilers, roofline
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

SHARDED = ("parallel.mesh=data=2,fsdp=2,tensor=2", "parallel.zero=3", "train.steps=4")


def stack_and_rest(key):
    """Parameters as a model's: a `layers` stack of 3 matrices and norms, an embedding, a final norm."""
    k = jax.random.split(key, 4)
    params = {"blocks": {"w": jax.random.normal(k[0], (3, 8, 16)), "norm": 1 + 0.1 * jax.random.normal(k[1], (3, 8))},
              "embedding": jax.random.normal(k[2], (32, 8)), "final": jnp.ones((8,))}
    axes = {"blocks": {"w": ("layers", "embed", "mlp"), "norm": ("layers", "embed")},
            "embedding": ("vocab", "embed"), "final": ("embed",)}
    grads = jax.tree.map(lambda p: jax.random.normal(k[3], p.shape), params)
    return params, axes, grads


@pytest.mark.fast
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_streamed_update_is_the_optimizers_update_and_a_skipped_step_keeps_everything(name):
    """Two steps of each optimizer a layer at a time equal its update on the whole tree (fp32, 1e-6),
    counts included; with the guard's `applied` false the parameters and state stay bitwise."""
    params, axes, grads = stack_and_rest(jax.random.key(0))
    clip, inner = optimizer_parts(OptimSpec(optimizer=name, lr=1e-2, warmup_steps=0), 10, axes)
    streamed = jax.jit(lambda g, s, p, ok: offload.streamed_update(inner, g, s, p, axes, ok))
    whole, mine = inner.init(params), inner.init(params)
    p_whole, p_mine = params, params
    for scale in (1.0, 2.0):
        g = jax.tree.map(lambda x, scale=scale: x * scale, grads)
        updates, whole = inner.update(g, whole, p_whole)
        p_whole = optax.apply_updates(p_whole, updates)
        p_mine, mine = streamed(g, mine, p_mine, jnp.bool_(True))
    assert max_param_diff(p_whole, p_mine) < 1e-6
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(mine)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    kept_p, kept = streamed(grads, mine, p_mine, jnp.bool_(False))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves((kept_p, kept)), jax.tree.leaves((p_mine, mine))))


@pytest.mark.parametrize("mode", ["optimizer", "optimizer+params"])
def test_an_offloaded_sharded_run_is_the_one_device_run_and_resumes_exactly(mode):
    """data=2,fsdp=2,tensor=2 at ZeRO 3 with the moments (and under optimizer+params the layers'
    parameters) in host memory gives the one-device losses and weights without offload (fp32, 1e-5);
    those are pinned_host arrays, the rest device ones; a run resumed from its step-2 checkpoint gives
    steps 3 and 4 bitwise."""
    _, one, one_params = run_tiny("parallel.mesh=1", "train.steps=4", devices=jax.devices()[:1])
    run = (*SHARDED, f"parallel.offload={mode}", "parallel.remat=full")
    straight, losses, params = run_tiny(*run, "checkpoint.every=2")
    np.testing.assert_allclose(losses, one, rtol=1e-5, atol=0)
    assert max_param_diff(params, one_params) < 1e-5
    state, program = straight.state, straight.program
    kinds = [x.sharding.memory_kind for x in jax.tree.leaves(state)]
    assert kinds == ["pinned_host" if host else "device" for host in jax.tree.leaves(program.host_arguments())]
    assert kinds.count("pinned_host") == 2 * 9 + 2 * 2 + (9 if mode == "optimizer+params" else 0)  # 9 block leaves

    resumed = Trainer(tiny_config(*run, f"checkpoint.resume={straight.out / 'checkpoints' / '2'}"))
    history = resumed.fit(log=MetricsLog(resumed.out, primary=False))
    assert [r["loss"] for r in history if "loss" in r] == list(losses[2:])
    assert max_param_diff(jax.device_get(resumed.state["params"]), params) == 0


@pytest.mark.fast
@pytest.mark.parametrize("setting,what", [
    ("parallel.microbatches=2", r"microbatches \(parallel.microbatches > 1\)"),
    ("parallel.remat=none", r"parallel.remat=none \(set full or save_matmuls\)"),
    ("parallel.zero=1", r"a data axis the step runs by hand \(data > 1 at ZeRO 0/1\)"),
    ("model.lora.rank=4", r"LoRA \(model.lora.rank\)")])
def test_what_optimizer_and_params_offload_does_not_serve_is_refused_in_one_line(setting, what):
    cfg = tiny_config("parallel.mesh=data=2,fsdp=4", "parallel.zero=3", "parallel.remat=full",
                      "parallel.offload=optimizer+params", setting)
    with pytest.raises(UserError, match=rf"^parallel.offload=optimizer\+params keeps the layers' parameters and "
                                        rf"gradients in host memory and does not run with {what}; change that, or set "
                                        rf"parallel.offload=optimizer$"):
        TrainProgram.from_config(cfg)


@pytest.mark.fast
def test_a_pipeline_is_refused_in_one_line():
    cfg = tiny_config("parallel.mesh=data=4,pipeline=2", "parallel.offload=optimizer")
    with pytest.raises(UserError, match=r"^parallel.offload=optimizer streams the optimizer state a layer at a time "
                                        r"and does not run on a pipeline \(pipeline=2\); .* parallel.offload=none$"):
        TrainProgram.from_config(cfg)


@functools.cache
def gpu_arguments(mode: str) -> int:
    """The device argument bytes of the tiny model's train step on one H100 under parallel.offload=`mode`."""
    target = compilers.choose("gpu", "h100", 1, 8)
    program = TrainProgram.from_config(tiny_config(*GPU_PLAN, f"parallel.offload={mode}"), devices=target.devices)
    with target.compiling():
        return program.lower().compile().memory_analysis().argument_size_in_bytes


GPU_PLAN = ("parallel.mesh=1", "parallel.remat=full")


@pytest.mark.skipif(compilers.gpu_compiler_missing() is not None,
                    reason="the compile-only GPU backend (the plan-gpu extra) is not installed")
@pytest.mark.parametrize("mode", ["optimizer", "optimizer+params"])
def test_the_gpu_plan_holds_the_state_in_host_memory_prices_its_copies_and_checks_the_hosts_share(mode):
    """On XLA's GPU compiler the moments (and the layers' parameters) are host-memory-space arguments and
    results (S(5)): the device's arguments lose exactly their bytes, the host's figure is the GPU
    program's and equals the formula (under optimizer+params the layers' gradients too), the copies
    are priced on the host link, and a host share smaller than that does not fit."""
    from meshtrain.core.metrics import DEVICE_PROFILES
    from meshtrain.planner import aot
    from meshtrain.planner.budget import budget, host_budget
    from meshtrain.planner.text import format_plan

    target = compilers.choose("gpu", "h100", 1, 8)
    cfg = tiny_config(*GPU_PLAN, f"parallel.offload={mode}")
    cfg.devices = 0
    profile = DEVICE_PROFILES["h100"]
    limits = {**budget(profile["memory"], 0.75), "host": host_budget(300e3, 1, 8, "--host-memory")}
    with target.compiling():
        report = aot.plan(cfg, profile, limits, devices=target.devices)
    mem, kernel = report["memory"], report["roofline"]["kernel_time"]
    program = TrainProgram.from_config(cfg, devices=target.devices)
    moments, params = program.offloaded_bytes(parts=True)
    assert mem["host_source"] == "the GPU program" and mem["host_total"] == program.offloaded_bytes()
    assert (params > 0) == (mode == "optimizer+params") and 0 < mem["optimizer_state"] - moments <= 16  # counts
    assert gpu_arguments("none") - gpu_arguments(mode) == moments + params
    assert kernel["launches"]["host"] >= 2 * 4 * 9  # 4 layers, 9 block leaves
    # the copies' bytes are the formula's (2 M + 7 P: roofline.offload_seconds)
    assert kernel["by_kind_s"]["host"] == pytest.approx(roofline.offload_seconds(program, profile), rel=1e-9)
    assert report["verdict"]["status"] == "does not fit" and report["verdict"]["margin"] > 0
    text = format_plan(report)
    assert "optimizer state (host)" in text and "host memory per device: " in text
    assert ("parameters (layers: host)" in text) == (mode == "optimizer+params")
    assert "verdict: DOES NOT FIT in host memory: " in text and "the device's peak" in text


@pytest.mark.fast
def test_the_layout_search_offloads_as_a_memory_move_and_counts_the_hosts_share():
    """--fit (meshtrain/planner/fit.py): parallel.offload none -> optimizer -> optimizer+params is a memory
    move (and back a speed move), its command sets it, and a candidate whose host figure exceeds the
    host's share does not fit, whatever its device peak."""
    from meshtrain.planner import fit

    cfg = tiny_config()
    start = fit.Layout.of(cfg, {"data": 8, "fsdp": 1, "tensor": 1, "pipeline": 1, "expert": 1, "context": 1})
    offloaded = dict(fit.moves(start, cfg.model, 16, 8))["parallel.offload=optimizer"]
    assert dict(fit.moves(offloaded, cfg.model, 16, 8))["parallel.offload=optimizer+params"].offload == \
        "optimizer+params"
    assert dict(fit.moves(offloaded, cfg.model, 16, 8, memory=False))["parallel.offload=none"] == start
    assert "parallel.offload=none" not in dict(fit.moves(start, cfg.model, 16, 8, memory=False))
    assert fit.describe_layout(offloaded).endswith(", offload=optimizer")
    # one gather of the weights for every microbatch, with fsdp and microbatches: a speed move, back a memory move
    sharded = fit.Layout.of(tiny_config("parallel.microbatches=2"), {**start.mesh, "data": 1, "fsdp": 8})
    once = dict(fit.moves(sharded, cfg.model, 16, 8, memory=False))["parallel.gather_once=true"]
    assert once == sharded.change(gather_once=True) and "gather_once=true" not in str(fit.moves(start, cfg.model, 16, 8,
                                                                                                memory=False))
    assert dict(fit.moves(once, cfg.model, 16, 8))["parallel.gather_once=false"] == sharded
    assert fit.command("c.yaml", [], cfg, once).endswith("--set parallel.gather_once=true")
    # where it would do nothing (one microbatch) a layout has it off: one program, one candidate
    assert not once.change(microbatches=1).gather_once and not fit.Layout.of(
        tiny_config("parallel.gather_once=true"), sharded.mesh).gather_once
    assert fit.command("c.yaml", [], cfg, offloaded).endswith("--set parallel.offload=optimizer")
    limits = {"budget": 100.0, "host": {"budget": 50.0}}
    plan = lambda host: lambda *_: {"memory": {"total": 10.0, "host_total": host},
                                    "roofline": {"step_s": 1.0, "mfu_ceiling": 0.1, "priced_by": "formulas"}}
    assert fit.evaluate(cfg, offloaded, {}, limits, measure=plan(40.0))["fits"]
    assert not fit.evaluate(cfg, offloaded, {}, limits, measure=plan(60.0))["fits"]
