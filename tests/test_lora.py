"""LoRA (models/spec.py LoraSpec, docs/fine-tuning.md): adapters on a frozen base, the same run on
every layout, only the adapters trained and given optimizer state."""
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_tiny, tiny_config

from meshtrain.config.validate import check_config
from meshtrain.core.errors import UserError
from meshtrain.models import FAMILIES
from meshtrain.models.lora import adapters_off, layer_keys, lora_dropout, row_keys
from meshtrain.ops.trainable import select
from meshtrain.parallel.sharding import shard_factor
from meshtrain.run.checkpoint import saved_metadata
from meshtrain.run.run_dir import lora_base
from meshtrain.testing import MOE_TINY, QWEN3_MOE_TINY, TINY, max_param_diff

LORA = ("model.lora.rank=4", "parallel.precision=fp32")
# The layout runs take dropout on the adapters (PEFT's lora_dropout): LoRA's parity and its masks' at once.
# The XLA-partitioned step and manual data shards, each with accumulation; a pipeline's in
# `test_a_lora_step_on_fsdp_tensor_and_an_interleaved_pipeline_is_its_one_device_run`.
DROPOUT = (*LORA, "model.lora.dropout=0.1")
LAYOUTS = {("parallel.mesh=fsdp=2,tensor=2", "parallel.microbatches=2"): 4,
           ("parallel.mesh=data=2", "parallel.microbatches=2"): 2}


def is_adapter(path) -> bool:
    return path[-1].startswith("lora_")


def test_a_lora_step_is_the_same_on_every_layout_and_trains_only_the_adapters():
    """With dropout on the adapters' input: its mask is keyed by the row's index in the step's batch,
    the layer's in model order, the target and the position (models/lora.py `lora_dropout`), never by
    a shard or a microbatch, so every layout reproduces the 1-device run."""
    trainer, reference, params = run_tiny(*DROPOUT, "parallel.mesh=1", devices=jax.devices()[:1])
    start = jax.device_get(jax.jit(trainer.program.init_state)(jax.random.key(trainer.cfg.train.seed))["params"])
    frozen = lambda tree: select(tree, lambda path: not is_adapter(path))
    assert max_param_diff(frozen(start), frozen(params)) == 0  # the base is bitwise unchanged
    assert max_param_diff(select(start, is_adapter), select(params, is_adapter)) > 1e-4  # the adapters moved
    # Adam's two moments for the adapters only: the base has no optimizer state
    adapters = sum(x.size for x in jax.tree.leaves(select(params, is_adapter)))
    state = sum(x.size for x in jax.tree.leaves(trainer.state["opt_state"]) if x.ndim)
    assert state == 2 * adapters and adapters < 0.2 * sum(x.size for x in jax.tree.leaves(params))
    for layout, n in LAYOUTS.items():
        _, losses, other = run_tiny(*DROPOUT, *layout, devices=jax.devices()[:n])
        np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-5, err_msg=str(layout))
        assert max_param_diff(params, other) < 1e-5, layout


def test_a_lora_step_on_fsdp_tensor_and_an_interleaved_pipeline_is_its_one_device_run():
    """8 devices: split over fsdp, an adapter factor with no tensor axis was resharded inside a stage's
    cond by a collective-permute naming both stages' devices, and the stages deadlocked
    (meshtrain/engine/pipeline.py keeps the adapters whole over fsdp x tensor inside the ticks). With
    dropout: interleaved chunks fold each layer's index in model order into its masks."""
    _, reference, params = run_tiny(*DROPOUT, "parallel.mesh=1", devices=jax.devices()[:1])
    trainer, losses, other = run_tiny(*DROPOUT, "parallel.mesh=fsdp=2,tensor=2,pipeline=2",
                                      "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                      "parallel.microbatches=4", devices=jax.devices()[:8])
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-5)
    assert max_param_diff(params, trainer.program.in_model_order(other)) < 1e-5  # stored in pipeline order


def test_lora_dropout_changes_the_training_loss_and_not_the_evaluation():
    """Dropout acts in training only: the eval step's loss is the run's without dropout."""
    trainer, reference, params = run_tiny(*DROPOUT, "parallel.mesh=1", devices=jax.devices()[:1])
    plain_trainer, plain, _ = run_tiny(*LORA, "parallel.mesh=1", devices=jax.devices()[:1])
    # B starts at zero and Adam's first update is lr x sign(g): the losses part from step 2 on
    assert np.abs(reference - plain)[2:].min() > 2e-5, (reference, plain)
    # evaluation: the same loss as without dropout, and no random bits in its program at all
    tokens = np.random.default_rng(0).integers(0, 256, size=trainer.program.batch_shape, dtype=np.int32)
    with_dropout, without = (t.program.eval_step() for t in (trainer, plain_trainer))
    assert np.asarray(with_dropout(params, tokens)[0]) == np.asarray(without(params, tokens)[0])
    with trainer.program.context():
        assert "threefry" not in with_dropout.lower(params, tokens).as_text()
        assert "threefry" in trainer.program.lower().as_text()


def resumed_at_step_2(tmp_path, *overrides):
    """(the one-device run's losses and params, the same run stopped at step 2 and resumed to its end
    in `tmp_path`: its records, and the resumed Trainer)."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    _, reference, params = run_tiny(*overrides, "parallel.mesh=1", devices=jax.devices()[:1])
    quiet = lambda trainer, steps: trainer.fit(steps, log=MetricsLog(tmp_path, primary=False))
    head = quiet(Trainer(tiny_config(*overrides, "parallel.mesh=1", out=str(tmp_path)), devices=jax.devices()[:1]), 2)
    resumed = Trainer(tiny_config(*overrides, "parallel.mesh=1", "checkpoint.resume=auto", out=str(tmp_path)),
                      devices=jax.devices()[:1])
    return reference, params, head + quiet(resumed, len(reference)), resumed


def test_a_resumed_run_with_lora_dropout_draws_the_masks_of_the_uninterrupted_one(tmp_path):
    """The step's keys come from (seed, step): a run resumed at step 2 is bitwise the whole run."""
    reference, params, records, resumed = resumed_at_step_2(tmp_path, *DROPOUT)
    np.testing.assert_array_equal([r["loss"] for r in records if "loss" in r], reference)
    assert max_param_diff(jax.device_get(resumed.state["params"]), params) == 0


@pytest.mark.fast
def test_lora_dropout_keeps_one_minus_p_scaled_and_keys_each_row_target_and_position_apart():
    assert jax.config.jax_threefry_partitionable  # shards draw their own bits (the values never depend on it)
    x = np.ones((8, 64, 512), np.float32)
    keys_Bx2 = layer_keys(row_keys(0, 3, 8), [1])[0]
    out = np.asarray(lora_dropout(x, keys_Bx2, "q", 0.1))
    kept = out != 0
    sigma = np.sqrt(0.9 * 0.1 / kept.size)
    print(f"kept {kept.mean():.5f} of {kept.size:,} (expected 0.9, sigma {sigma:.1e})")
    assert abs(kept.mean() - 0.9) < 4 * sigma
    np.testing.assert_allclose(out[kept], 1 / 0.9, rtol=1e-6)  # inverted: the kept values / (1 - p)
    # a row's mask is its key's alone (the row travels with it); the sequence stored permuted (context
    # parallelism) carries its mask along; another target draws another mask (agreeing on ~0.82)
    np.testing.assert_array_equal(lora_dropout(x[5:6], keys_Bx2[5:6], "q", 0.1), out[5:6])
    order = np.random.default_rng(0).permutation(64)
    np.testing.assert_array_equal(lora_dropout(x[:, order], keys_Bx2, "q", 0.1, order), out[:, order])
    agree = np.mean(kept == (np.asarray(lora_dropout(x, keys_Bx2, "v", 0.1)) != 0))
    assert abs(agree - 0.82) < 0.01


@pytest.mark.fast
def test_the_peft_export_carries_the_dropout(tmp_path):
    import json

    from meshtrain.interop.hf import save_adapters

    spec = tiny_config(*DROPOUT, "model.lora.targets=[q,v]").model
    params = jax.device_get(FAMILIES[spec.family](spec).init(jax.random.key(0)))
    save_adapters(params, spec, tmp_path, "base")
    assert json.loads((tmp_path / "adapter_config.json").read_text())["lora_dropout"] == 0.1


@pytest.mark.fast
@pytest.mark.parametrize("setting, message", [
    ("model.lora.targets=[q, x]", "model.lora.targets=['q', 'x']"),
    ("model.lora.targets=[q, q]", "at most once"),
    ("model.lora.targets=[]", "at least one"),
    ("model.lora.rank=-1", "model.lora.rank=-1 must be >= 0"),
])
def test_bad_lora_settings_are_one_error(setting, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rank = () if "rank" in setting else ("model.lora.rank=4",)
        check_config(tiny_config(*rank, setting))


@pytest.mark.fast
@pytest.mark.parametrize("config,targets,weight,sides", [
    (TINY, "[q,k,v,o]", "wq", "32 x 64"), (QWEN3_MOE_TINY, "[gate]", "expert_gate", None)])
def test_a_rank_above_the_adapted_weights_is_one_error(config, targets, weight, sides):
    """A B has rank at most min(in, out): a larger rank trains nothing more, at more cost than the
    weight (refused where the adapter is made: the planner's and the run's model alike)."""
    spec = tiny_config("model.lora.rank=1", f"model.lora.targets={targets}", config=config).model.resolved()
    spec.lora.rank = 1 + max(spec.d_model, spec.mlp_dim, spec.num_heads * spec.head_dim)
    with pytest.raises(UserError, match=rf"^model.lora.rank={spec.lora.rank} is above the rank of the {weight} "
                                        rf"weight it adapts \({sides or '.*'}, rank at most"):
        FAMILIES[spec.family](spec)


@pytest.mark.fast
def test_dropout_on_routed_experts_adapters_is_refused_and_on_their_attention_accepted():
    """The experts' adapters see dispatch buffers, with no row or position to key a mask by."""
    with pytest.raises(UserError, match="model.lora.dropout=0.1 on the adapters of routed experts is not built"):
        tiny_config("model.lora.rank=4", "model.lora.dropout=0.1", config=QWEN3_MOE_TINY)
    tiny_config("model.lora.rank=4", "model.lora.dropout=0.1", "model.lora.targets=[q,k,v,o]", config=QWEN3_MOE_TINY)


def test_adapters_per_routed_expert_train_alike_on_expert_and_fsdp_tensor_layouts_with_the_base_frozen():
    """qwen3_moe: an adapter per routed expert on gate/up/down ([E, in, r], [E, r, out], inside the
    dropless grouped matmuls), ordinary ones on q/k/v/o; step 0 is the base model's step."""
    trainer, reference, params = run_tiny(*LORA, "parallel.mesh=1", devices=jax.devices()[:1], config=QWEN3_MOE_TINY)
    E, D, F = (trainer.cfg.model.num_experts, trainer.cfg.model.d_model, trainer.cfg.model.mlp_dim)
    blocks = params["blocks"]
    assert blocks["lora_expert_gate_a"].shape == (4, E, D, 4) and blocks["lora_expert_down_b"].shape == (4, E, 4, D)
    assert blocks["lora_expert_up_b"].shape == (4, E, 4, F) and not any(k in blocks for k in ("lora_gate_a", "w_gate"))
    _, base, _ = run_tiny("parallel.mesh=1", devices=jax.devices()[:1], config=QWEN3_MOE_TINY)
    assert reference[0] == base[0] and np.abs(reference[1:] - base[1:]).max() > 1e-4  # B = 0 at the start
    start = jax.device_get(jax.jit(trainer.program.init_state)(jax.random.key(trainer.cfg.train.seed))["params"])
    frozen = lambda tree: select(tree, lambda path: not is_adapter(path))
    assert max_param_diff(frozen(start), frozen(params)) == 0  # experts and router included
    experts = lambda tree: select(tree, lambda path: path[-1].startswith("lora_expert_"))
    assert max_param_diff(experts(start), experts(params)) > 1e-4  # each expert's adapters moved
    adapters = sum(x.size for x in jax.tree.leaves(select(params, is_adapter)))
    state = sum(x.size for x in jax.tree.leaves(trainer.state["opt_state"]) if x.ndim)
    assert trainer.program.trainable_params == adapters and state == 2 * adapters
    # the planner's ZeRO formula divides the expert adapters by `expert`, as the experts
    from meshtrain.planner.traffic import expert_params
    assert expert_params(trainer.program, trained=True) == sum(x.size for x in jax.tree.leaves(experts(params)))
    for mesh in ("expert=2,data=2", "fsdp=2,tensor=2"):
        other_trainer, losses, other = run_tiny(*LORA, f"parallel.mesh={mesh}", devices=jax.devices()[:4],
                                                config=QWEN3_MOE_TINY)
        np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-5, err_msg=mesh)
        assert max_param_diff(params, other) < 1e-5, mesh
    # on fsdp=2,tensor=2 the expert adapters split as `mlp` (tensor) and `embed` (fsdp) or, without
    # embed, by their rank: gate's A [E, D, r] over fsdp, B [E, r, F] and down's A [E, F, r] over both
    p = other_trainer.program
    split = {k: shard_factor(s.spec, p.mesh) for k, s in p.state_shardings["params"]["blocks"].items()
             if k.startswith("lora_expert_")}
    assert (split["lora_expert_gate_a"], split["lora_expert_gate_b"], split["lora_expert_down_a"]) == (2, 4, 4)


def test_adapters_on_capacity_routed_experts_and_a_shared_expert_train_alike_under_expert_parallelism():
    """moe: capacity routing (the slot einsum, assignments dropped) and a shared expert, whose dense
    SwiGLU gets ordinary adapters beside the routed experts' own."""
    moe = (*LORA, "model.capacity_factor=1.0", "model.lora.targets=[gate,up,down]")
    _, reference, params = run_tiny(*moe, "parallel.mesh=1", devices=jax.devices()[:1], config=MOE_TINY)
    assert {"lora_gate_a", "lora_expert_gate_a"} <= set(params["blocks"]) and "lora_q_a" not in params["blocks"]
    _, losses, other = run_tiny(*moe, "parallel.mesh=expert=2,data=2", devices=jax.devices()[:4], config=MOE_TINY)
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-5)
    assert max_param_diff(params, other) < 1e-5


@pytest.mark.parametrize("config, targets", [(TINY, ()), (QWEN3_MOE_TINY, ("model.lora.targets=[q,o,gate,down]",))],
                         ids=["llama", "qwen3_moe"])
def test_peft_loads_the_adapters_with_the_logits_of_the_merged_export_and_of_meshtrain(tmp_path, config, targets):
    """qwen3_moe: per-expert adapters under transformers 4's per-expert names, which PEFT converts
    onto transformers 5's fused experts (gate_up_proj: up gets a zero adapter beside gate's)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from meshtrain.convert import main

    trainer, _, params = run_tiny(*LORA, *targets, "parallel.mesh=1", "optim.lr=3e-2", devices=jax.devices()[:1],
                                  config=config)
    adapters, merged = tmp_path / "adapters", tmp_path / "merged"
    assert main(["--to-hf", str(trainer.out), str(adapters), "--adapters-only"]) == 0
    assert main(["--to-hf", str(trainer.out), str(merged), "--merge"]) == 0
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 16))
    ours = np.asarray(trainer.program.model.apply(trainer.program.in_model_order(params), tokens))
    base = AutoModelForCausalLM.from_pretrained(adapters / "base", dtype=torch.float32)
    logits = lambda m: m(torch.tensor(tokens)).logits.numpy()
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, adapters).eval()
        with_adapters = logits(adapted)
        with adapted.disable_adapter():
            base_only = logits(adapted)
        full = logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval())
    print(f"PEFT vs merged export {np.abs(with_adapters - full).max():.2e}, vs meshtrain "
          f"{np.abs(with_adapters - ours).max():.2e}")
    np.testing.assert_allclose(with_adapters, full, atol=1e-4)
    np.testing.assert_allclose(with_adapters, ours, atol=1e-4)
    # not vacuous: the adapters change the logits, and adapters_off gives the base's (PEFT's with its adapter disabled)
    off = np.asarray(trainer.program.model.apply(trainer.program.in_model_order(adapters_off(params)), tokens))
    np.testing.assert_allclose(base_only, off, atol=1e-4)
    assert np.abs(ours - off).max() > 1e-2


def saved_paths(tree, path=()) -> list[tuple]:
    """The key paths of a saved tree's leaves (Orbax's metadata tree: nested dicts)."""
    if not isinstance(tree, dict):
        return [path]
    return [p for key, value in tree.items() for p in saved_paths(value, (*path, key))]


def test_a_resumed_lora_run_continues_bitwise_from_its_adapters_and_rebuilds_its_base(tmp_path):
    from meshtrain.run.trainer import Trainer

    reference, params, records, resumed = resumed_at_step_2(tmp_path, *LORA)
    assert resumed.resumed_from == tmp_path / "checkpoints" / "2"
    np.testing.assert_array_equal([r["loss"] for r in records if "loss" in r], reference)
    assert max_param_diff(jax.device_get(resumed.state["params"]), params) == 0
    # the checkpoint holds the adapters and their state; the base is a pointer (here: the seed) and a hash
    folder = resumed.checkpointer.path(len(reference))
    saved = ocp.PyTreeCheckpointHandler().metadata(folder / "state").tree
    assert all(is_adapter(path) for path in saved_paths(saved["params"])) and len(saved_paths(saved["params"])) == 14
    meta = saved_metadata(folder)
    assert meta["base"]["init_from"] is None and meta["base"]["seed"] == resumed.cfg.train.seed
    print(f"LoRA checkpoint {sum(f.stat().st_size for f in folder.rglob('*') if f.is_file()):,} bytes")
    # elastic: on fsdp=2 the base is rebuilt there, bitwise, and checked against the hash
    elastic = Trainer(tiny_config(*LORA, "parallel.mesh=fsdp=2", "checkpoint.resume=auto", out=str(tmp_path)),
                      devices=jax.devices()[:2], allow_change=True)
    assert max_param_diff(jax.device_get(elastic.state["params"]), params) == 0
    elastic.close()
    # another base (another seed's) is one error naming both hashes
    with pytest.raises(UserError, match=f"has hash [0-9a-f]{{16}}, but .* trained on base {meta['base']['hash']}"):
        lora_base({"base": {**meta["base"], "seed": meta["base"]["seed"] + 1}}, resumed.program.model,
                  resumed.program.state_shardings["params"])


@pytest.mark.fast
def test_the_planner_counts_gradients_and_optimizer_state_of_the_adapters_only():
    from meshtrain.engine.program import TrainProgram
    from meshtrain.planner.aot import zero_formula
    from meshtrain.planner.text import trainable_note

    full, lora = (TrainProgram.from_config(tiny_config("parallel.mesh=fsdp=2", *extra), devices=jax.devices()[:2])
                  for extra in ((), ("model.lora.rank=4",)))
    adapters = sum(x.size for x in jax.tree.leaves(select(lora.abstract_state["params"], is_adapter)))
    assert lora.trainable_params == adapters and full.trainable_params == full.num_params
    f, z = zero_formula(full), zero_formula(lora)
    assert z["parameters"] > f["parameters"]  # the adapters are parameters too
    ratio = adapters / lora.num_params
    np.testing.assert_allclose([z["gradients"] / f["gradients"], z["optimizer_state"] / f["optimizer_state"]],
                               ratio * lora.num_params / full.num_params, rtol=1e-6)
    # every adapter factor is split over fsdp, those without an embed axis by their rank (the formula's split)
    grads = jax.tree.leaves(lora.grad_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    moments = [s.spec for s in jax.tree.leaves(lora.state_shardings["opt_state"]) if len(s.spec)]
    assert len(grads) == 14 and len(moments) == 28
    assert all(shard_factor(spec, lora.mesh) == 2 for spec in grads + moments)
    note = trainable_note({"params": lora.num_params, "trainable_params": adapters,
                           "config": {"model": {"lora": {"rank": 4}}}})
    assert note == f", trainable {adapters / 1e6:,.2f}M = {100 * ratio:.2f}% (LoRA r=4)"


def test_lora_on_a_trained_base_learns_a_new_sentence_and_leaves_the_base_as_it_was(tmp_path):
    """A base trained on one sentence (the init_from run), then adapters on another: the new
    sentence's loss falls from the base's ~ln 256 to near zero, the base weights bitwise the run's."""
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.run_dir import newest_params
    from meshtrain.run.trainer import Trainer

    untied = ("parallel.mesh=1", "model.tie_embeddings=false", "optim.lr=1e-2", "train.log_every=10")

    def fit(sentence, out, *extra):
        (tmp_path / f"{out}.txt").write_text(sentence * 400)
        cfg = tiny_config(*untied, f"data.path={tmp_path / out}.txt", "data.kind=auto", "train.steps=60", *extra,
                          out=str(tmp_path / out))
        trainer = Trainer(cfg, devices=jax.devices()[:1])
        losses = [r["loss"] for r in trainer.fit(log=MetricsLog(trainer.out, primary=False)) if "loss" in r]
        trainer.close()
        return trainer, losses

    fit("the quick brown fox jumps over the lazy dog. ", "base")
    tuned, losses = fit("pack my box with five dozen liquor jugs. ", "jugs", "model.lora.rank=8",
                        f"checkpoint.init_from={tmp_path / 'base'}")
    assert losses[0] > 1.0 and losses[-1] < 0.15, losses
    params = jax.device_get(tuned.state["params"])
    base = newest_params(tmp_path / "base", FAMILIES["llama"](tiny_config(*untied).model))[0]
    assert max_param_diff(select(params, lambda path: not is_adapter(path)), base) == 0


def test_lora_on_a_hugging_face_base_loads_it_frozen_and_its_adapters_name_it(tmp_path):
    import json

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from meshtrain.config.loader import load_config
    from meshtrain.convert import main
    from meshtrain.interop import hf
    from meshtrain.parallel.mesh import build_mesh, parse_mesh
    from meshtrain.parallel.sharding import param_shardings
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    assert main(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    cfg = load_config(str(tmp_path / "run" / "config.yaml"),
                      ["model.lora.rank=4", "model.lora.targets=[q,v]", "parallel.mesh=1", "data.kind=synthetic",
                       "train.steps=2", "train.batch_size=4", "train.seq_len=16", "train.eval_every=0"])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.fit(log=MetricsLog(trainer.out, primary=False))
    trainer.close()
    spec = hf.read_spec(tmp_path / "hf")
    base_model = FAMILIES[spec.family](spec)
    base = hf.load_params(tmp_path / "hf", base_model,
                          param_shardings(base_model, build_mesh(parse_mesh("1", 1), jax.devices()[:1])))
    params = jax.device_get(trainer.state["params"])
    assert sorted(k for k in params["blocks"] if is_adapter((k,))) == ["lora_q_a", "lora_q_b", "lora_v_a", "lora_v_b"]
    assert max_param_diff(select(params, lambda path: not is_adapter(path)), jax.device_get(base)) == 0
    assert main(["--to-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--adapters-only"]) == 0
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str((tmp_path / "hf").absolute()) and written["r"] == 4
    assert written["target_modules"] == ["q_proj", "v_proj"] and not (tmp_path / "out" / "base").exists()


def test_a_lora_checkpoint_of_an_interleaved_pipeline_resumes_with_each_layers_moments():
    """An interleaved pipeline stores layers in pipeline order; resumed on one device, each layer's
    adapters and their optimizer moments (of the trained parameters only) come back in model order."""
    from meshtrain.ops.optimizers import map_param_states
    from meshtrain.run.trainer import Trainer

    interleaved, _, _ = run_tiny(*LORA, "parallel.mesh=1x2x1x2", "parallel.zero=1", "parallel.schedule=interleaved",
                                 "parallel.microbatches=4", "parallel.virtual_stages=2", devices=jax.devices()[:4])
    p = interleaved.program
    assert p.layer_order.tolist() == [0, 2, 1, 3]
    plain = Trainer(tiny_config(*LORA, "parallel.mesh=1", f"checkpoint.resume={interleaved.checkpointer.path(5)}"),
                    devices=jax.devices()[:1])
    saved = jax.device_get(interleaved.state["opt_state"])
    layered = map_param_states(lambda x, _, names: bool(names) and names[0] == "layers", saved,
                               p.trained(interleaved.state["params"]), p.trained(p.logical_axes),
                               otherwise=lambda x: False)
    order = np.argsort(p.layer_order)
    for is_layer, a, b in zip(jax.tree.leaves(layered), jax.tree.leaves(saved),
                              jax.tree.leaves(jax.device_get(plain.state["opt_state"])), strict=True):
        np.testing.assert_array_equal(b, a[order] if is_layer else a)


@pytest.mark.parametrize("mesh, n", [("data=2,tensor=2", 4), ("data=2,pipeline=2", 4)])
def test_int8_gradient_compression_reduces_the_adapters_gradients_only(mesh, n):
    """parallel.grad_compression=int8 under LoRA: the residuals are the adapters' (the base has no
    gradient), the run follows its fp32-reduced twin within 1e-4 (not bitwise: compressed), the base
    stays bitwise, and the compiled step's int8 bytes over `data` are the planner's formula's."""
    from meshtrain.planner import hlo, traffic

    common = (*LORA, f"parallel.mesh={mesh}", "parallel.microbatches=2")
    _, fp32, start = run_tiny(*common, devices=jax.devices()[:n])
    trainer, int8, params = run_tiny(*common, "parallel.grad_compression=int8", devices=jax.devices()[:n])
    np.testing.assert_allclose(int8, fp32, rtol=1e-4, atol=0)
    assert not np.array_equal(int8, fp32)
    frozen = lambda tree: select(tree, lambda path: not is_adapter(path))
    assert max_param_diff(frozen(start), frozen(params)) == 0
    residuals = trainer.state["grad_error"]["shards"]
    assert jax.tree.structure(residuals) == jax.tree.structure(select(trainer.state["params"], is_adapter))
    found = hlo.collectives(trainer.compiled_step.as_text(), n)
    formula = traffic.expected_traffic(trainer.program)
    print(f"{mesh}: losses {np.max(np.abs(int8 - fp32)):.2e} from fp32's; int8 all-to-all "
          f"{found['all-to-all']['traffic_bytes']:,.0f} B, formula {formula['all-to-all']['traffic_bytes']:,.0f} B")
    assert found["all-to-all"]["traffic_bytes"] > 0 and set(found["all-to-all"]["dtypes"]) == {"s8", "f32"}
    assert formula["all-to-all"]["traffic_bytes"] == pytest.approx(found["all-to-all"]["traffic_bytes"], rel=0.05)
