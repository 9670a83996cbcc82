"""Optimizers and learning-rate schedules (meshtrain/ops/optimizers.py): each optimizer's sharded run
computes the one-device run and resumes exactly; Muon and Adafactor treat every layer's and
expert's matrix on its own; AdamW and cosine are today's; the planner's state bytes per optimizer."""
import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from conftest import MOE_TINY, max_param_diff, run_tiny, tiny_config

from meshtrain.config.loader import UserError, load_config
from meshtrain.config.spec import OptimSpec
from meshtrain.core import formulas
from meshtrain.engine.program import TrainProgram
from meshtrain.engine.step import make_optimizer
from meshtrain.models import FAMILIES
from meshtrain.ops.optimizers import LR_SCHEDULES, OPTIMIZERS, is_hidden_matrix, matrix_dims
from meshtrain.planner import traffic
from meshtrain.planner.aot import shard_bytes
from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

NEW = [name for name in OPTIMIZERS if name != "adamw"]  # adamw: tests/test_parity.py and test_checkpoint.py
SHARDED = ("parallel.mesh=data=2,fsdp=2,tensor=2", "parallel.zero=3", "train.steps=4")


@pytest.mark.parametrize("name", NEW)
def test_sharded_run_matches_one_device_and_resumes_exactly(name):
    """data=2,fsdp=2,tensor=2 at ZeRO 3 gives the one-device losses and weights (fp32, 1e-5); a run
    resumed from its step-2 checkpoint in a fresh folder gives its steps 3 and 4 bitwise."""
    _, one, one_params = run_tiny("parallel.mesh=1", "train.steps=4", f"optim.optimizer={name}",
                                  devices=jax.devices()[:1])
    straight, losses, params = run_tiny(*SHARDED, f"optim.optimizer={name}", "checkpoint.every=2")
    np.testing.assert_allclose(losses, one, rtol=1e-5, atol=0)
    assert max_param_diff(params, one_params) < 1e-5
    assert losses[-1] != losses[1]  # it trained (step 1 runs at warmup's lr 0)

    checkpoint = straight.out / "checkpoints" / "2"
    resumed = Trainer(tiny_config(*SHARDED, f"optim.optimizer={name}", f"checkpoint.resume={checkpoint}"))
    history = resumed.fit(log=MetricsLog(resumed.out, primary=False))
    assert resumed.resumed_from == checkpoint
    assert [r["loss"] for r in history if "loss" in r] == list(losses[2:])
    assert max_param_diff(jax.device_get(resumed.state["params"]), params) == 0

    other = NEW[(NEW.index(name) + 1) % len(NEW)]  # another state layout: one line naming the key
    with pytest.raises(UserError, match=rf"^checkpoint {checkpoint} holds the state of optim.optimizer={name}, this "
                                        rf"run has {other}; resume with optim.optimizer={name}, "
                                        r"or pass --resume never"):
        Trainer(tiny_config(*SHARDED, f"optim.optimizer={other}", f"checkpoint.resume={checkpoint}"))


@functools.cache
def tiny_moe():
    """The tiny MoE model's parameters (every axis: layers, experts, a router) and logical axes."""
    model = FAMILIES["moe"](load_config(MOE_TINY, []).model)
    params = jax.jit(model.init)(jax.random.key(0))
    return params, model.logical_axes(params)


def random_like(params):
    return jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_layer_and_expert_is_its_own_matrix(name):
    """Scaling one layer's gradients (and one expert's) by 1000 changes no other layer's or expert's
    updates over two steps: Muon orthogonalises, Adafactor factors and clips each matrix alone."""
    params, axes = tiny_moe()
    tx = OPTIMIZERS[name].build(OptimSpec(), 1e-2, axes)
    grads = random_like(params)
    loud = jax.tree.map(lambda g, names: g.at[1].multiply(1000.0) if names[0] == "layers" else g, grads, axes,
                        is_leaf=lambda n: isinstance(n, tuple))
    loud["blocks"]["expert_up"] = grads["blocks"]["expert_up"].at[0, 2].multiply(1000.0)

    def two_steps(g):
        state = tx.init(params)
        _, state = tx.update(g, state, params)
        return tx.update(g, state, params)[0]

    quiet_updates, loud_updates = jax.jit(two_steps)(grads), jax.jit(two_steps)(loud)
    for (path, quiet), changed in zip(jax.tree_util.tree_leaves_with_path(quiet_updates["blocks"]),
                                      jax.tree.leaves(loud_updates["blocks"])):
        key, quiet, changed = jax.tree_util.keystr(path), np.asarray(quiet), np.asarray(changed)
        others = [0, 2, 3]
        if "expert_up" in key:
            np.testing.assert_allclose(changed[0, [0, 1, 3]], quiet[0, [0, 1, 3]], rtol=1e-6, atol=1e-9)
            others = [2, 3]
        np.testing.assert_allclose(changed[others], quiet[others], rtol=1e-6, atol=1e-9, err_msg=key)


def test_muon_updates_the_blocks_matrices_and_adamw_the_rest():
    """Muon's part: the attention, MLP and expert matrices (embed x the other named axes, per layer
    and expert); AdamW's: embedding, norms and the router. A Muon update is orthogonal per layer:
    its singular values, over 0.2 sqrt(max(rows, cols)), lie in Newton-Schulz's (0.5, 1.5)."""
    params, axes = tiny_moe()
    flat = {k: v for k, v in axes["blocks"].items()}
    assert {k for k, n in flat.items() if is_hidden_matrix(n)} == {
        "expert_down", "expert_gate", "expert_up", "w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"}
    assert not is_hidden_matrix(axes["embedding"]) and not is_hidden_matrix(axes["final_norm"]["scale"])
    assert matrix_dims(flat["wo"]) == ((1, 2), (3,)) and matrix_dims(flat["wq"]) == ((1,), (2, 3))
    assert matrix_dims(flat["expert_down"]) == ((2,), (3,))

    tx = OPTIMIZERS["muon"].build(OptimSpec(weight_decay=0.0), 1.0, axes)
    grads = random_like(params)
    updates = jax.jit(lambda g: tx.update(g, tx.init(params), params)[0])(grads)
    wo = np.asarray(updates["blocks"]["wo"]).reshape(4, 64, 32) / -(0.2 * np.sqrt(64))
    singular = np.linalg.svd(wo, compute_uv=False)
    assert singular.shape == (4, 32) and 0.5 < singular.min() and singular.max() < 1.5
    adam = optax.adamw(1.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
    norm = {"s": params["final_norm"]["scale"]}
    expected = adam.update({"s": grads["final_norm"]["scale"]}, adam.init(norm), norm)[0]["s"]
    np.testing.assert_allclose(updates["final_norm"]["scale"], expected, rtol=1e-6)


@pytest.mark.fast
def test_adafactor_keeps_row_and_column_statistics_per_matrix():
    params, axes = tiny_moe()
    state = OPTIMIZERS["adafactor"].build(OptimSpec(), 1e-2, axes).init(params)[0]
    assert state.v_row["blocks"]["wq"].shape == (4, 32, 1, 1) and state.v_col["blocks"]["wq"].shape == (4, 1, 8, 8)
    assert state.v_row["blocks"]["expert_up"].shape == (4, 4, 32, 1)
    assert state.v["blocks"]["attn_norm"]["scale"].shape == (4, 32)
    assert isinstance(state.v["blocks"]["wq"], optax.MaskedNode)


def test_adamw_and_cosine_are_todays():
    """The default optimizer is the AdamW and cosine schedule of before the registry, bitwise."""
    params, axes = tiny_moe()
    ocfg = OptimSpec(warmup_steps=2)
    old_schedule = optax.warmup_cosine_decay_schedule(0.0, ocfg.lr, 2, 10, end_value=ocfg.lr * ocfg.min_lr_ratio)
    mask = jax.tree.map(lambda names: len([n for n in names if n != "layers"]) >= 2, axes,
                        is_leaf=lambda n: isinstance(n, tuple))
    old = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(old_schedule, b1=0.9, b2=0.95, eps=1e-8,
                                                                  weight_decay=0.1, mask=mask))
    new = make_optimizer(ocfg, 10, axes)
    grads = random_like(params)
    three = lambda tx: jax.jit(lambda g: functools.reduce(lambda s, _: tx.update(g, s[1], params), range(3),
                                                          (None, tx.init(params)))[0])(grads)
    assert max_param_diff(three(old), three(new)) == 0
    new_schedule = LR_SCHEDULES["cosine"](ocfg, 10)
    assert [float(new_schedule(k)) for k in range(12)] == [float(old_schedule(k)) for k in range(12)]


@pytest.mark.fast
def test_schedules():
    """Warmup over 2 steps to lr 1, horizon 10, min_lr_ratio 0.1; wsd decays over the last 20%."""
    ocfg = OptimSpec(lr=1.0, warmup_steps=2, min_lr_ratio=0.1, decay_fraction=0.2)
    at = lambda name, *steps: [round(float(LR_SCHEDULES[name](ocfg, 10)(k)), 6) for k in steps]
    assert at("linear", 0, 1, 2, 6, 10, 20) == [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    assert at("wsd", 0, 1, 2, 8, 9, 10, 20) == [0.0, 0.5, 1.0, 1.0, 0.55, 0.1, 0.1]
    assert at("constant", 0, 1, 2, 10, 100) == [0.0, 0.5, 1.0, 1.0, 1.0]
    assert at("cosine", 2, 6, 10) == [1.0, 0.55, 0.1]


MEMORY_LAYOUTS = [("parallel.mesh=data=8", "parallel.zero=1"), ("parallel.mesh=2x2x2", "parallel.zero=3"),
                  ("parallel.mesh=data=2,pipeline=2,tensor=2", "parallel.zero=1")]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("layout", MEMORY_LAYOUTS + [("parallel.mesh=data=2,expert=4", "parallel.zero=3", "moe")])
def test_state_bytes_formula_matches_the_shardings(name, layout):
    """zero_bytes with the registry's state bytes (AdamW 8, Lion 4, Muon 4 + AdamW's 8, Adafactor
    4 (rows + cols) per matrix) against the state's shardings: within 2%, except Adafactor's tiny
    factored statistics on 2-3 model axes (dimensions of 4 or 8 that the mesh axes cannot all divide)."""
    *overrides, family = layout if layout[-1] == "moe" else (*layout, "llama")
    program = TrainProgram.from_config(tiny_config(f"optim.optimizer={name}", *overrides,
                                                   **({"config": MOE_TINY} if family == "moe" else {})))
    measured = shard_bytes(program.abstract_state["opt_state"], program.state_shardings["opt_state"])
    formula = formulas.zero_bytes(program.num_params, program.sizes, program.plan.zero,
                                  traffic.stage_replicated_params(program), traffic.expert_params(program),
                                  program.optimizer_state_bytes())["optimizer_state"]
    wide = name == "adafactor" and program.sizes["tensor"] > 1
    assert measured == pytest.approx(formula, rel=0.12 if wide else 0.02)


@pytest.mark.fast
def test_state_bytes_per_parameter():
    params, axes = tiny_moe()
    leaves = list(zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=lambda n: isinstance(n, tuple))))
    total = lambda name: sum(OPTIMIZERS[name].state_bytes(p.shape, n) for p, n in leaves)
    psi = sum(p.size for p in jax.tree.leaves(params))
    assert total("adamw") == 8 * psi and total("lion") == 4 * psi
    muon_params = sum(p.size for k, p in params["blocks"].items() if is_hidden_matrix(axes["blocks"][k]))
    assert total("muon") == 4 * muon_params + 8 * (psi - muon_params)
    # wq: 4 layers x (32 rows + 64 columns); the embedding 256 + 32; a norm whole
    assert OPTIMIZERS["adafactor"].state_bytes((4, 32, 8, 8), axes["blocks"]["wq"]) == 4 * 4 * (32 + 64)
    assert OPTIMIZERS["adafactor"].state_bytes((256, 32), axes["embedding"]) == 4 * (256 + 32)
    assert total("adafactor") < psi


def test_a_compiled_adafactor_step_holds_those_bytes():
    """The compiled step's arguments (the parity test's program: its compile is cached) are the
    sharded parameters and optimizer state, the tokens and the scalar counters (within 0.1%), and
    the formula's (within 2%: the tiny model's norms and factored statistics do not split evenly)."""
    program = TrainProgram.from_config(tiny_config(*SHARDED, "optim.optimizer=adafactor"))
    state, shardings = program.abstract_state, program.state_shardings
    formula = formulas.zero_bytes(program.num_params, program.sizes, 3, traffic.stage_replicated_params(program),
                                  optimizer_state=program.optimizer_state_bytes())
    tokens = 4 * program.batch_shape[0] * program.batch_shape[1] / (program.sizes["data"] * program.sizes["fsdp"])
    arguments = program.lower().compile().memory_analysis().argument_size_in_bytes
    sharded = (shard_bytes(state["params"], shardings["params"])
               + shard_bytes(state["opt_state"], shardings["opt_state"]))
    assert arguments == pytest.approx(sharded + tokens, rel=0.001)
    assert arguments == pytest.approx(formula["parameters"] + formula["optimizer_state"] + tokens, rel=0.02)


@pytest.mark.fast
def test_bad_optimizer_or_schedule_is_one_line_naming_the_key():
    with pytest.raises(UserError, match=r"optim\.optimizer.*sgd.*adamw"):
        tiny_config("optim.optimizer=sgd")
    with pytest.raises(UserError, match=r"optim\.schedule.*step"):
        tiny_config("optim.schedule=step")
    with pytest.raises(UserError, match=r"optim\.decay_fraction"):
        tiny_config("optim.schedule=wsd", "optim.decay_fraction=0")
    assert dataclasses.asdict(tiny_config().optim)["optimizer"] == "adamw"
