"""Ulysses and hybrid context parallelism (meshtrain/ops/ulysses.py): the kernel against the dense
reference (GQA, packed documents, sliding windows; fp32, 1e-5), a packed batch through a model
with sliding-window layers against one device, the training run against the one-device run, and
the one-line refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, max_param_diff, run_tiny, tiny_config
from test_packing import EOS, assert_close, assert_same_step, inputs, loss_and_grads, mesh_of, reference

from meshtrain.config.loader import UserError
from meshtrain.engine.program import TrainProgram
from meshtrain.models import FAMILIES
from meshtrain.ops.attention import BACKENDS
from meshtrain.ops.packing import Packing
from meshtrain.ops.ulysses import context_layout
from meshtrain.testing import QWEN3_MOE_TINY, value_and_grads

# (strategy, context, ulysses_degree, kernel, segments, window); H = 4 query heads over G = 2 kv heads
KERNEL_CASES = [("ulysses", 2, 0, "xla", True, 13), ("ulysses", 2, 0, "blockwise", True, 5),
                ("hybrid", 4, 2, "ring", True, 13), ("hybrid", 8, 2, "ring", True, 5),
                ("hybrid", 8, 2, "ring", False, 0)]


def in_true_order(attend, order, segments, window):
    """A context_layout kernel taking and returning true order (stored as the model stores it)."""
    if order is None:
        return lambda q, k, v: attend(q, k, v, None, segment_ids=segments, window=window)
    inverse = np.argsort(order)
    stored_segments = None if segments is None else segments[:, order]
    return lambda q, k, v: attend(*(x[:, order] for x in (q, k, v)), order, segment_ids=stored_segments,
                                  window=window)[:, inverse]


@pytest.mark.fast
@pytest.mark.parametrize("strategy,context,degree,kernel,segmented,window", KERNEL_CASES)
def test_kernel_matches_the_dense_mask(strategy, context, degree, kernel, segmented, window):
    """Output and dq, dk, dv on a `context` axis: Ulysses (kv heads 2 / 2) with the local kernels,
    hybrid with groups of 2 and the ring across 2 or 4 of them; windows reaching 1 or 3 chunks back."""
    q, k, v, cot, segments = inputs()
    segments = segments if segmented else None
    attend, order = context_layout(strategy, BACKENDS[kernel], context, q.shape[1], degree)
    with jax.set_mesh(mesh_of((context,), ("context",))):
        got = jax.jit(lambda *a: value_and_grads(in_true_order(attend, order, segments, window), *a))(q, k, v, cot)
    want = value_and_grads(lambda q, k, v: reference(q, k, v, segments, window), q, k, v, cot)
    print(f"{strategy} context={context} degree={degree} {kernel} segments={segmented} window={window}: "
          f"max |diff| {assert_close(got, want):.2e}")


SEQ = 32
DOC_ENDS = [(8, 19, 31), (3, 23, 31)]  # per row: each document's EOS


@pytest.mark.parametrize("strategy,context,degree,kernel", [("ulysses", 2, 0, "xla"),
                                                            ("hybrid", 4, 2, "ring")])
def test_packed_windowed_model_matches_one_device(strategy, context, degree, kernel):
    """gemma3's tiny model (4 query over 2 kv heads; window 8 on three of four layers) on a packed
    batch (document mask, positions restarting): loss and gradients equal the one device's."""
    spec = tiny_config(config=str(ROOT / "configs" / "gemma3_tiny.yaml")).model
    family = FAMILIES[spec.family]
    params = family(spec).init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, spec.vocab_size, (2, SEQ + 1))
    for row, ends in enumerate(DOC_ENDS):
        tokens[row, list(ends)] = EOS
    tokens = jnp.asarray(tokens, jnp.int32)
    want = loss_and_grads(family(spec, packing=Packing(EOS)), params, tokens)
    attend, order = context_layout(strategy, BACKENDS[kernel], context, SEQ, degree)
    model = family(spec, attention=attend, sequence_order=order, packing=Packing(EOS))
    with jax.set_mesh(mesh_of((context,), ("context",))):
        got = loss_and_grads(model, params, tokens)
    assert_same_step(got, want, f"{strategy} context={context} degree={degree} {kernel}")


@pytest.mark.parametrize("overrides", [
    ("parallel.mesh=data=2,context=4", "parallel.context_strategy=ulysses", "parallel.attention=xla"),
    ("parallel.mesh=context=4,pipeline=2", "parallel.context_strategy=hybrid", "parallel.ulysses_degree=2",
     "parallel.attention=ring"),
    ("parallel.mesh=data=2,tensor=2,context=2", "parallel.sequence_parallel=true", "parallel.context_strategy=ulysses",
     "parallel.attention=xla"),
])
def test_training_matches_single_device(overrides, reference_run):
    """5 steps of the tiny model (8 query over 4 kv heads), fp32: losses and final parameters; hybrid
    inside pipeline stages, where the ring gathers K/V within each place's ring (`Ring.group`); Ulysses
    on the heads of each tensor shard, with Megatron's sequence parallelism on the tensor axis."""
    _, ref_losses, ref_params = reference_run
    _, losses, params = run_tiny(*overrides)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    assert max_param_diff(params, ref_params) < 1e-5


def test_moe_training_matches_single_device():
    """configs/qwen3_moe_tiny.yaml (8 query over 4 kv heads, 8 dropless experts), 5 steps, fp32, Ulysses
    on context=2 beside expert=4: the all-to-alls of the heads and of the tokens to their experts
    share the devices."""
    _, ref_losses, ref_params = run_tiny("parallel.mesh=1", devices=jax.devices()[:1], config=QWEN3_MOE_TINY)
    _, losses, params = run_tiny("parallel.mesh=context=2,expert=4", "parallel.context_strategy=ulysses",
                                 "parallel.attention=xla", config=QWEN3_MOE_TINY)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    assert max_param_diff(params, ref_params) < 1e-5


@pytest.mark.fast
@pytest.mark.parametrize("overrides,message", [
    (("parallel.context_strategy=stripes",), r"parallel.context_strategy"),
    (("parallel.mesh=data=2,context=4", "parallel.context_strategy=ulysses", "parallel.attention=ring"),
     r"context_strategy=ulysses gives each device whole sequences.*set parallel.attention to xla, blockwise or cudnn"),
    (("parallel.mesh=data=1,context=8", "parallel.context_strategy=ulysses", "parallel.attention=xla"),
     r"splits the heads 8 ways, and 8 query and 4 kv heads do not both divide by 8; use a degree that divides "
     r"both: 2, 4"),
    (("parallel.mesh=context=4,tensor=2", "parallel.context_strategy=ulysses", "parallel.attention=xla"),
     r"4 query and 2 kv heads per tensor shard \(tensor=2\) do not both divide by 4; use a degree that divides "
     r"both: 2"),
    (("parallel.mesh=data=2,context=4", "parallel.context_strategy=hybrid", "parallel.attention=ring"),
     r"context_strategy=hybrid needs parallel.ulysses_degree .* dividing context=4 strictly between 1 and it: "
     r"one of 2"),
    (("parallel.mesh=data=2,context=4", "parallel.context_strategy=hybrid", "parallel.ulysses_degree=3",
      "parallel.attention=ring"), r"one of 2"),
    (("parallel.mesh=data=2,context=4", "parallel.context_strategy=hybrid", "parallel.ulysses_degree=2",
      "parallel.attention=xla"), r"parallel.attention=xla cannot attend across; set parallel.attention=ring"),
    (("parallel.ulysses_degree=2",), r"parallel.ulysses_degree=2 has no effect with parallel.context_strategy="
                                     r"'ring' \(it applies where parallel.context_strategy is 'hybrid'\)"),
    (("parallel.mesh=data=2,context=4", "parallel.context_strategy=hybrid", "parallel.ulysses_degree=2",
      "parallel.attention=ring", "train.seq_len=10"), r"train.seq_len=10 is not divisible by 4: "
                                                     r"context_strategy=hybrid splits it over context=4 in 4 chunks"),
])
def test_context_strategy_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        TrainProgram.from_config(tiny_config(*overrides))


def test_plan_compare_ranks_the_strategies(capsys):
    """`plan --compare` with settings per entry: Ulysses and hybrid on the same mesh, each planned
    with its own traffic: Ulysses all-to-alls and no ring permutes' formula, hybrid both, each
    all-to-all formula within 10% of the compiled step's (the ring's row: docs/context.md's table)."""
    from test_plan import plan_json
    mesh = "data=2,context=4"
    compared = plan_json(capsys, "--set", "parallel.attention=ring", "--compare",
                         f"{mesh} parallel.context_strategy=ulysses parallel.attention=xla",
                         f"{mesh} parallel.context_strategy=hybrid parallel.ulysses_degree=2")
    assert not compared["skipped"]
    rows = {r["config"]["context_strategy"]: r["collectives"] for r in compared["plans"]}
    assert rows["ulysses"]["collective-permute"]["formula_traffic_bytes"] == 0
    assert rows["hybrid"]["collective-permute"]["formula_traffic_bytes"] > 0
    for strategy in ("ulysses", "hybrid"):
        a2a = rows[strategy]["all-to-all"]
        assert a2a["traffic_bytes"] == pytest.approx(a2a["formula_traffic_bytes"], rel=0.10), strategy


@pytest.mark.fast
def test_size_check_counts_the_whole_sequences_scores():
    """check_train_size's lower bound with the xla kernel: under Ulysses a device forms the [L, L]
    scores of H/C heads, C = 4 times the (L/C)^2 x H of a sequence slice; refused at 4x a memory
    the ring-style accounting would pass."""
    from meshtrain.config.validate import check_train_size
    from meshtrain.core.formulas import llama_activation_terms
    cfg = tiny_config("parallel.mesh=data=2,context=4", "parallel.context_strategy=ulysses",
                      "parallel.attention=xla", "train.seq_len=4096", "train.batch_size=2", "model.num_layers=1")
    program = TrainProgram.from_config(cfg)
    m = cfg.model
    terms = llama_activation_terms(1024, 1, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, 4)
    scores = terms["softmax exp (fp32), probabilities"]
    slice_only = sum(terms.values())
    assert scores == (4 + 4) * 1024 * m.num_heads * 1024
    check_train_size(program, memory=(2 * slice_only, "a test device"))
    with pytest.raises(UserError, match=r"activations 0.3 GB"):  # 4 x 67 MB of scores: over 4 x 34 MB
        check_train_size(program, memory=(slice_only / 2, "a test device"))


@pytest.mark.fast
def test_context_degrees_of_each_strategy():
    """(devices round the ring, devices per all-to-all group): the planner's split of the context axis."""
    from meshtrain.ops.ulysses import context_degrees
    assert context_degrees("ring", 8) == (8, 1)
    assert context_degrees("ulysses", 8) == (1, 8)
    assert context_degrees("hybrid", 8, 2) == (4, 2)
    assert context_degrees("hybrid", 1, 2) == context_degrees("ulysses", 1) == (1, 1)  # no context axis
