"""The moe family: with no token dropped, expert parallelism (alone, with data and fsdp, with a
pipeline under 1F1B and DualPipeV, with tensor) computes the single-device run per step (fp32):
losses, router statistics and final parameters; drops are counted, layout-independently; the
experts' all-to-alls are in the compiled program; layout errors name the fix."""
import jax
import numpy as np
import pytest
from conftest import MOE_TINY, max_param_diff, run_tiny, tiny_config

from meshtrain.config.loader import UserError
from meshtrain.engine.program import TrainProgram
from meshtrain.planner import hlo, traffic

STATS = ("router_aux_loss", "router_z_loss", "dropped", "expert_load_max")
LAYOUTS = ["data=2,expert=4", "expert=2,data=2,fsdp=2", "data=2,pipeline=2,expert=2", "expert=2,tensor=2,data=2"]
# 2 layers a chunk: a paired tick's scan runs layer i's forward beside layer 1 - i's backward (engine/pipeline.py)
DUALPIPEV = ("parallel.schedule=dualpipev", "parallel.virtual_stages=2", "parallel.microbatches=4",
             "model.num_layers=8")


def run(mesh, *overrides):
    devices = jax.devices()[:1] if mesh == "1" else None
    trainer, losses, _ = run_tiny(f"parallel.mesh={mesh}", *overrides, devices=devices, config=MOE_TINY)
    stats = {k: np.array([r[k] for r in trainer.history if "loss" in r]) for k in STATS}
    return losses, stats, trainer.unpermuted_params()  # in model order (a V placement stores them permuted)


@pytest.mark.parametrize("mesh,more", [(mesh, ()) for mesh in LAYOUTS] + [
    ("data=2,pipeline=2,expert=2", DUALPIPEV), ("data=2,expert=4", ("parallel.expert_chunks=2",))])
def test_expert_layouts_match_single_device(mesh, more):
    """... and DualPipeV's V over the pipeline, its steady ticks one microbatch's forward beside another's
    backward, each with its expert all-to-alls; and each device's rows in two slices whose exchanges
    can overlap each other's expert matmuls (parallel.expert_chunks)."""
    ref_losses, ref_stats, ref_params = run("1", *(o for o in more if o.startswith("model.")))
    losses, stats, params = run(mesh, *more)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    for k in STATS:
        np.testing.assert_allclose(stats[k], ref_stats[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert max_param_diff(params, ref_params) < 1e-5
    assert not stats["dropped"].any()  # dropless
    assert losses[-1] != losses[0]


def test_dropped_tokens_are_counted_and_layout_independent():
    """Capacity is per sequence row, so a layout drops exactly what one device drops."""
    ref_losses, ref_stats, _ = run("1", "model.capacity_factor=0.5")
    assert (ref_stats["dropped"] > 0).all()
    for chunks in (1, 2):  # a device's rows in two slices drop what one device drops (capacity is per row)
        losses, stats, _ = run("data=2,expert=4", "model.capacity_factor=0.5", f"parallel.expert_chunks={chunks}")
        np.testing.assert_allclose(stats["dropped"], ref_stats["dropped"], rtol=1e-6)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_all_to_alls_carry_the_tokens():
    """Per MoE layer: dispatch and return in the forward, both again in the backward, and (dropless)
    the int32 counts per expert the receiving devices sort by, once in the forward; their link
    bytes are traffic.py's (models/experts.py dispatch_bytes: 4 x rows x L x min(K, E/4) x D)."""
    program = TrainProgram.from_config(tiny_config("parallel.mesh=data=2,expert=4", config=MOE_TINY))
    text = program.lower().compile().as_text()
    found = hlo.collectives(text, 8)
    assert found["all-to-all"]["count"] == 5 * program.spec.num_layers
    chunked = TrainProgram.from_config(tiny_config("parallel.mesh=data=2,expert=4", "parallel.expert_chunks=2",
                                                   config=MOE_TINY))  # each slice its own exchanges
    found_chunked = hlo.collectives(chunked.lower().compile().as_text(), 8)
    assert found_chunked["all-to-all"]["count"] == 2 * found["all-to-all"]["count"]
    # the rows' bytes unchanged; only the int32 counts per expert go once per slice (48 bytes here)
    assert found_chunked["all-to-all"]["traffic_bytes"] == pytest.approx(found["all-to-all"]["traffic_bytes"], rel=1e-3)
    measured = hlo.by_kind(hlo.read(text, 8))["all-to-all"]["traffic_bytes"]
    assert measured == pytest.approx(traffic.expected_traffic(program)["all-to-all"]["traffic_bytes"], rel=0.1)


def test_auxiliary_losses_reach_the_router():
    """The load-balancing loss joins the objective: its weight changes the router's update."""
    params = {w: run_tiny("parallel.mesh=1", f"model.router_aux_loss={w}", "model.router_z_loss=0",
                          "train.steps=2", devices=jax.devices()[:1], config=MOE_TINY)[2] for w in (0.0, 1.0)}
    changed = lambda name: not np.allclose(params[0.0]["blocks"][name], params[1.0]["blocks"][name])
    assert changed("router")


def test_active_parameters_count_k_of_e_experts():
    program = TrainProgram.from_config(tiny_config("parallel.mesh=1", config=MOE_TINY), devices=jax.devices()[:1])
    m, blocks = program.spec, program.abstract_state["params"]["blocks"]
    routed = sum(blocks[k].size for k in ("expert_gate", "expert_up", "expert_down"))
    assert program.model.active_matmul_params(program.abstract_state["params"]) == \
        program.num_params - routed * (1 - m.experts_per_token / m.num_experts)


@pytest.mark.parametrize("overrides,message", [
    (("parallel.mesh=expert=8",), "model.num_experts=4 is not divisible by expert=8"),
    (("parallel.mesh=expert=2,data=4", "model.family=llama", "model.num_experts=0", "model.num_shared_experts=0"),
     "mesh expert=2 splits experts, and this model has none"),
    (("model.experts_per_token=5",), "model.experts_per_token=5 exceeds model.num_experts=4"),
    (("parallel.mesh=data=8", "parallel.expert_chunks=2"), "parallel.expert_chunks=2 overlaps expert parallelism's"),
    (("parallel.mesh=data=2,expert=4", "parallel.expert_chunks=4"),
     "parallel.expert_chunks=4 does not divide the 2 rows each device routes per microbatch"),
])
def test_expert_layout_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        TrainProgram.from_config(tiny_config(*overrides, config=MOE_TINY))
