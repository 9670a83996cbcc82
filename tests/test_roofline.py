"""The machine-aware roofline (meshtrain/planner/roofline.py): which mesh axes cross nodes, which axes a
collective's replica groups span, the timing arithmetic, and the FLOPs convention behind MFU."""
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import MOE_TINY, ROOT, TINY, tiny_config

from meshtrain.core.metrics import DEVICE_PROFILES, flops_per_token
from meshtrain.ops.grouped_matmul import GMM_TILE
from meshtrain.parallel.mesh import AXES
from meshtrain.parallel.schedules import timetable
from meshtrain.planner import loops, roofline

H100 = DEVICE_PROFILES["h100"]


def sizes(**axes):
    return {a: axes.get(a, 1) for a in AXES}


# ---- placement: 16 H100s, 8 per node ----
@pytest.mark.fast
@pytest.mark.parametrize("mesh,expected", [
    # data is major: data index d holds ids 8d..8d+7, one node each, so data's groups {f, 8+f} span
    # both nodes and fsdp's groups {8d..8d+7} stay in one.
    (sizes(data=2, fsdp=8), {"data": "cross-node", "fsdp": "in-node"}),
    (sizes(fsdp=16), {"fsdp": "cross-node"}),  # one group of ids 0..15
    # tensor is minor (stride 1): {2f, 2f+1} in one node; fsdp strides by 2 over 0..14: both nodes.
    (sizes(fsdp=8, tensor=2), {"fsdp": "cross-node", "tensor": "in-node"}),
    # data=4 strides by 4: {p, 4+p, 8+p, 12+p} spans both nodes; pipeline (stride 1, 4 ids) does not.
    (sizes(data=4, pipeline=4), {"data": "cross-node", "pipeline": "in-node"}),
    (sizes(data=2, fsdp=2, tensor=2), {"data": "in-node", "fsdp": "in-node", "tensor": "in-node"}),  # 8: one node
])
def test_axis_placement_on_two_nodes(mesh, expected):
    assert roofline.placement(mesh, devices_per_node=8) == expected


@pytest.mark.fast
def test_device_grid_is_the_mesh_order_and_a_combined_axis_set_can_cross_alone():
    mesh = sizes(data=2, fsdp=8)
    assert roofline.device_grid(mesh).reshape(2, 8).tolist() == [list(range(8)), list(range(8, 16))]
    assert roofline.crosses_nodes(("data", "fsdp"), mesh, 8)
    assert not roofline.crosses_nodes((), mesh, 8)
    # 4 per node: fsdp=8's groups {0..7} now hold two nodes
    assert roofline.placement(mesh, devices_per_node=4) == {"data": "cross-node", "fsdp": "cross-node"}


def _fake_gpus(processes: int, local: int):
    return [SimpleNamespace(id=p * local + i, process_index=p, platform="gpu", device_kind="fake GPU")
            for p in range(processes) for i in range(local)]


@pytest.mark.fast
@pytest.mark.parametrize("mesh,nodes", [
    (sizes(data=2, fsdp=8), 2),
    (sizes(data=4, fsdp=2, tensor=2), 2),  # data's factor 4 = 2 across nodes x 2 within one
    (sizes(data=4, fsdp=2, tensor=2), 4),
    (sizes(data=2, fsdp=2, pipeline=2), 2),
])
def test_device_grid_is_build_mesh_multi_process_layout(mesh, nodes):
    """build_mesh on several GPU processes: jax's create_hybrid_device_mesh with the data axis
    across them (its default), on fake GPUs; the plain mesh-order grid is the same layout."""
    from jax.experimental import mesh_utils

    outer = tuple(nodes if a == "data" else 1 for a in AXES)
    inner = tuple(mesh[a] // o for a, o in zip(AXES, outer))
    devices = _fake_gpus(nodes, int(np.prod(inner)))
    jax_grid = mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=True)
    assert np.vectorize(lambda d: d.id)(jax_grid).tolist() == roofline.device_grid(mesh).tolist()


# ---- attribution of replica groups to axes ----
MESH_222 = sizes(data=2, fsdp=2, tensor=2)  # position = 4d + 2f + t


@pytest.mark.fast
@pytest.mark.parametrize("groups,axes", [
    ([[0, 1], [2, 3], [4, 5], [6, 7]], ("tensor",)),
    ([[0, 2], [1, 3], [4, 6], [5, 7]], ("fsdp",)),
    ([[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
    ([[0, 1, 2, 3], [4, 5, 6, 7]], ("fsdp", "tensor")),
    ([[0, 2, 4, 6], [1, 3, 5, 7]], ("data", "fsdp")),
    ([list(range(8))], ("data", "fsdp", "tensor")),
    # XLA's iota form [4,2]<=[2,2,2]T(0,2,1), read from a compiled data=2,fsdp=2,tensor=2 step:
    (np.arange(8).reshape(2, 2, 2).transpose(0, 2, 1).reshape(4, 2).tolist(), ("fsdp",)),
    ([[0, 0], [2, 4], [4, 2], [6, 6]], ("data", "fsdp")),  # a permute's pairs, some to itself
    ([[3, 3], [5, 5]], ()),  # nothing leaves a device
])
def test_replica_groups_map_to_the_axes_they_span(groups, axes):
    assert roofline.axes_of_groups(groups, MESH_222) == axes


@pytest.mark.fast
def test_pipeline_ring_pairs_span_the_pipeline_axis():
    mesh = sizes(data=2, pipeline=4)  # position = 4d + p
    ring = [[4 * d + p, 4 * d + (p + 1) % 4] for d in range(2) for p in range(4)]  # the wrap-around too
    assert roofline.axes_of_groups(ring, mesh) == ("pipeline",)


@pytest.mark.fast
def test_traffic_is_summed_per_axis_set():
    traffic = roofline.traffic_by_axes([([[0, 1], [2, 3], [4, 5], [6, 7]], 10.0),
                                        ([[0, 4], [1, 5], [2, 6], [3, 7]], 5.0),
                                        ([[6, 7], [0, 1], [4, 5], [2, 3]], 1.0)], MESH_222)
    assert traffic == {("tensor",): 11.0, ("data",): 5.0}


# ---- timing arithmetic ----
@pytest.mark.fast
def test_comm_time_puts_each_axis_on_its_link():
    """data=2,fsdp=8 on two H100 nodes: data at 50 GB/s (one 400 Gb/s NIC per GPU), fsdp at
    450 GB/s (NVLink 4, one direction); 1 GB on data and 9 GB on fsdp take 20 ms each."""
    assert (H100["in_node_bw"], H100["cross_node_bw"]) == (450e9, 400e9 / 8)
    links = roofline.comm_times({("data",): 1e9, ("fsdp",): 9e9, (): 7e9}, sizes(data=2, fsdp=8), H100)
    assert links[("data",)] == {"traffic_bytes": 1e9, "cross_node": True, "bandwidth": 50e9,
                                "seconds": pytest.approx(0.02)}
    assert links[("fsdp",)]["cross_node"] is False
    assert links[("fsdp",)]["seconds"] == pytest.approx(0.02)
    assert links[()]["seconds"] == 0.0  # sent to itself: no link
    # one node of 16 (--devices-per-node 16): data runs on NVLink too, 9x faster
    assert roofline.comm_times({("data",): 1e9}, sizes(data=2, fsdp=8), H100, 16)[("data",)]["seconds"] \
        == pytest.approx(1e9 / 450e9)


@pytest.mark.fast
def test_a_group_with_k_devices_in_each_node_crosses_on_k_nics():
    """roofline.link_bandwidth: a ring channel per NIC, so a group's k devices in a node cross the
    node boundary on k 400 Gb/s NICs at once (NVLink's 450 GB/s at most): fsdp=16 on two nodes 400 GB/s
    (NCCL's published multi-node H100 bus bandwidth, 400-450), fsdp=16 beside tensor=2 (4 a node)
    200 GB/s, fsdp=8 beside tensor=8 (one a node) the NIC's 50 GB/s."""
    bw = lambda axes, **mesh: roofline.link_bandwidth(H100, axes, sizes(**mesh), 8)
    assert bw(("fsdp",), fsdp=16) == 400e9
    assert bw(("fsdp",), fsdp=16, tensor=2) == 200e9
    assert bw(("fsdp",), fsdp=8, tensor=8) == 50e9
    assert bw(("fsdp",), fsdp=4, tensor=2) == 450e9  # in a node
    assert bw(("data", "fsdp"), data=4, fsdp=8) == 400e9
    assert roofline.link_bandwidth(H100, ("fsdp",), sizes(fsdp=32), 16) == 450e9  # 16 a node: NVLink's cap


@pytest.mark.fast
def test_roofs_overlapped_and_serial():
    """Model FLOPs of half a second at peak, 10% more hardware FLOPs (a recompute), a 20% bubble:
    0.55 / 0.8 = 0.6875 s of compute; 0.3 s of communication; 0.1 s of HBM traffic. Overlapped the
    step is 0.6875 s and compute-bound, the MFU ceiling 0.5 / 0.6875 (model FLOPs only), the HFU
    ceiling 0.55 / 0.6875; serial 1.0875 s."""
    peak, hbm = H100["peak_flops"], H100["hbm_bw"]
    r = roofline.times(0.5 * peak, 0.55 * peak, 0.3, 0.1 * hbm, H100, bubble=0.2)
    assert r["compute_s"] == pytest.approx(0.55 / 0.8)
    assert r["memory_s"] == pytest.approx(0.1)
    assert r["step_s"] == pytest.approx(0.6875) and r["bound"] == "compute"
    assert r["serial_s"] == pytest.approx(0.6875 + 0.3 + 0.1)
    assert r["mfu_ceiling"] == pytest.approx(0.5 / 0.6875)
    assert r["hfu_ceiling"] == pytest.approx(0.55 / 0.6875)
    comm_bound = roofline.times(0.5 * peak, 0.5 * peak, 2.0, 0.0, H100)
    assert comm_bound["bound"] == "communication" and comm_bound["mfu_ceiling"] == pytest.approx(0.25)


# ---- the FLOPs convention and recompute ----
def _program(*overrides, devices=1, config=TINY):
    from meshtrain.engine.program import TrainProgram

    cfg = tiny_config(f"parallel.mesh={devices}", *overrides, config=config)
    return TrainProgram.from_config(cfg, devices=jax.devices()[:devices])


@pytest.mark.fast
def test_mfu_attention_term_uses_heads_times_head_dim():
    """d_model 32 with 2 heads of 8: the attention width H*K = 16, not 32. N by hand (tied
    embedding, 4 layers): per block wq and wo D*H*K each, wk and wv D*G*K each, the SwiGLU's
    3*D*F, two norms 2D; the final norm D and the embedding V*D."""
    p = _program("model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=8", "model.mlp_dim=64")
    V, L, D, H, G, K, F, S = 256, 4, 32, 2, 1, 8, 64, 16
    n = L * (2 * D * H * K + 2 * D * G * K + 3 * D * F + 2 * D) + D + V * D
    assert p.flops_per_token == 6 * n + 12 * L * (H * K) * S
    assert flops_per_token(n, L, H * K, S) != flops_per_token(n, L, D, S)


@pytest.mark.parametrize("heads,head_dim", [(4, 64), (2, 16)])
def test_mfu_formula_matches_the_compiled_step_when_attention_is_not_d_model_wide(heads, head_dim):
    """As test_plan's check (one layer, XLA's count 1.0-1.05x the formula), with H*K = 256 and 32
    against d_model 128: d_model in the attention term reads 6% low and 3% high of the compiled
    count (measured), outside that band."""
    p = _program("model.num_layers=1", "model.d_model=128", f"model.num_heads={heads}",
                 f"model.num_kv_heads={heads}", f"model.head_dim={head_dim}", "model.mlp_dim=512",
                 "train.seq_len=64")
    cost = p.lower().compile().cost_analysis()
    compiled = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert 1.0 <= compiled / (p.flops_per_token * p.train.batch_size * 64) < 1.05


def test_capacity_routing_counts_the_slots_its_experts_run():
    """Capacity routing runs each row's E*C slots through the experts, empty or not: at factor 1.5
    (E 4, k 2, L 64: C = 48 slots) C/L = 3/4 of the routed parameters per token, against N's
    k/E = 1/2, so the executed FLOPs add 6 * (3/4 - 1/2) * E * 3 * D * F. One layer, so XLA's count
    (which takes a loop body once) holds every matmul: 1.0-1.05x the executed FLOPs, while it is
    1.32x the model's (measured); MFU still counts the model's."""
    E, D, F, L = 4, 128, 512, 64
    p = _program("model.num_layers=1", f"model.d_model={D}", f"model.mlp_dim={F}", f"train.seq_len={L}",
                 "model.capacity_factor=1.5", config=MOE_TINY)
    routed = E * 3 * D * F
    assert p.model.slot_matmul_params(p.abstract_state["params"], L) == routed * 48 / L - routed * 2 / E
    est = roofline.estimate(p, _no_memory(), [], H100)
    tokens = p.train.batch_size * L
    assert est["flops"]["hardware_per_device"] == pytest.approx(est["flops"]["model_per_device"]
                                                                + 6 * routed / 4 * tokens, rel=1e-12)
    assert est["mfu_ceiling"] * est["step_s"] * H100["peak_flops"] == pytest.approx(p.flops_per_token * tokens)
    full = _program("model.num_layers=1", f"model.d_model={D}", f"model.mlp_dim={F}", f"train.seq_len={L}",
                    "model.capacity_factor=1.5", "parallel.remat=full", config=MOE_TINY)
    rerun = roofline.estimate(full, _no_memory(), [], H100)["flops"]["hardware_per_device"] - \
        est["flops"]["hardware_per_device"]  # a forward of the blocks, every slot, and attention's 4·H·K·S
    blocks = p.model.block_matmul_params(p.abstract_state["params"])
    assert rerun == pytest.approx((2 * (blocks + routed / 4) + 4 * 8 * 8 * L) * tokens, rel=1e-12)
    cost = p.lower().compile().cost_analysis()
    compiled = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert 1.0 <= compiled / est["flops"]["hardware_per_device"] < 1.05
    assert compiled / est["flops"]["model_per_device"] > 1.3


def test_dropless_expert_parallelism_counts_its_whole_receive_buffer():
    """Dropless under expert=2 (E 4, k 2): a device's grouped matmuls run its whole receive buffer,
    ep x min(k, E/ep) = 4 rows per token, filled or not (k = 2 when balanced), so the executed FLOPs
    add 6 (4 - 2)/E of the routed parameters per token (bf16: none in fp8; one device: none). The
    compiled loops say so: ceil(ep x A / tile) + ep (E/ep + 1) - 1 = 7 steps each (2 grouped matmuls,
    gate and up side by side and down, forward, dx and dw; the buffer is ep runs, a sender's each, of
    E/ep experts and their padding),
    A = b L min(k, E/ep) = 8 x 16 x 2 rows from each sender, where the filled rows alone would take 2."""
    E, K, ep = 4, 2, 2
    p = _program("parallel.mesh=expert=2", "model.num_layers=1", devices=ep, config=MOE_TINY)
    params = p.abstract_state["params"]
    routed = sum(params["blocks"][n].size for n in ("expert_gate", "expert_up", "expert_down"))
    L = p.train.seq_len
    assert p.model.slot_matmul_params(params, L, ep) == routed / E * (ep * min(K, E // ep) - K) == routed / 2
    assert p.model.slot_matmul_params(params, L, ep, in_fp8=True) == 0 == p.model.slot_matmul_params(params, L)
    assert p.model.slot_matmul_params(params, L, ep, rows_routed=True) == 0  # the GPU's Triton kernels
    est = roofline.estimate(p, _no_memory(), [], H100)
    tokens = p.train.batch_size * L / ep
    assert est["flops"]["hardware_per_device"] == pytest.approx(est["flops"]["model_per_device"]
                                                                + 6 * routed / 2 * tokens, rel=1e-12)
    buffer_rows = ep * (p.train.batch_size // ep) * L * min(K, E // ep)
    trips = [int(n) for n in loops.TRIP_COUNT.findall(p.lower().compile().as_text())]
    assert trips.count(-(-buffer_rows // GMM_TILE) + ep * (E // ep + 1) - 1) >= 6, trips


def _no_memory():
    return SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0, temp_size_in_bytes=0)


@pytest.mark.fast
def test_remat_full_adds_one_forward_of_the_blocks():
    """remat=full: compute grows by one forward of the blocks, 2*N_blocks + 4*L*H*K*S per token
    (N_blocks = N without the V*D head, which is not rerun), over 6N + 12*L*H*K*S; save_matmuls
    keeps every matmul output and adds nothing. MFU still counts the model's FLOPs only."""
    V, L, D, H, K, S = 256, 4, 32, 8, 8, 16
    plain, full, save = (_program(f"parallel.remat={r}") for r in ("none", "full", "save_matmuls"))
    n = plain.model.active_matmul_params(plain.abstract_state["params"])
    model = 6 * n + 12 * L * H * K * S
    assert plain.flops_per_token == model
    est = {r: roofline.estimate(p, _no_memory(), [], H100) for r, p in (("none", plain), ("full", full),
                                                                        ("save_matmuls", save))}
    expected = (model + 2 * (n - V * D) + 4 * L * H * K * S) / model
    assert est["full"]["compute_s"] / est["none"]["compute_s"] == pytest.approx(expected, rel=1e-12)
    assert est["save_matmuls"]["compute_s"] == est["none"]["compute_s"]
    tokens = 16 * S
    for r in est.values():
        assert r["mfu_ceiling"] * r["step_s"] * H100["peak_flops"] == pytest.approx(model * tokens)
    assert est["full"]["flops"]["recompute"] and not est["none"]["flops"]["recompute"]


@pytest.mark.fast
def test_pipeline_recompute_counts_a_rerun_forward_and_the_bubble():
    """residuals=recompute reruns the chunk's forward like remat=full; on a pipeline the compute
    time is also stretched by the lockstep timetable's bubble (1F1B, 2 stages, 4 microbatches) and
    by the last stage's head (`stage_factor`)."""
    assert roofline.recomputes("none", "recompute", stages=2)
    assert not roofline.recomputes("none", "recompute", stages=1)  # no pipeline: nothing kept or rerun
    assert roofline.recomputes("full", "save", stages=1)
    p = _program("parallel.mesh=pipeline=2", "parallel.residuals=recompute", devices=2)
    est = roofline.estimate(p, _no_memory(), [], H100)
    bubble = timetable("1f1b", 2, 4, 1, "recompute").bubble
    assert est["pipeline_bubble"] == bubble > 0
    assert est["compute_s"] == pytest.approx(est["flops"]["hardware_per_device"] / H100["peak_flops"] / (1 - bubble)
                                             * est["stage_factor"]) and est["stage_factor"] > 1
    assert est["flops"]["hardware_per_device"] > est["flops"]["model_per_device"]


@pytest.mark.fast
@pytest.mark.parametrize("mtp", [0, 2])
def test_a_pipelines_slowest_stage_prices_the_dense_layers_the_head_and_the_mtp_modules(mtp):
    """deepseek_v3_tiny on pipeline=2: the first stage runs the dense first layer (N_d parameters,
    H*K = 64 wide) with the embedding, its forward again for the embedding gradient: the executed
    FLOPs grow by 2*N_d + 4*H*K*S per token over one device's (xla: 2 of its 6 score matmuls). The
    last stage runs the tied head, 6*V*D, and with model.mtp_depth=2 the 2 modules (N_m parameters,
    full causal attention: 6*N_m + 12*H*K*S*M) and 2 more head passes. Compute is x the slowest
    stage's work over the mean, 1 + S max(f, l) - f - l with f = (8*N_d + 16*H*K*S) / all and l the
    last stage's share."""
    deepseek = str(ROOT / "configs" / "deepseek_v3_tiny.yaml")
    depth = (f"model.mtp_depth={mtp}",)
    one, piped = (_program("parallel.attention=xla", *depth, *more, devices=n, config=deepseek)
                  for n, more in ((1, ()), (2, ("parallel.mesh=pipeline=2",))))
    params = piped.abstract_state["params"]
    n_d = sum(x.size for x in jax.tree.leaves(params["dense_blocks"]))
    n_m = sum(x.size for x in jax.tree.leaves(params.get("mtp", {})))
    HK, S, tokens, VD = 4 * 16, 16, 16 * 16, 256 * 32
    est_one, est = (roofline.estimate(p, _no_memory(), [], H100) for p in (one, piped))
    hardware = est["flops"]["hardware_per_device"]
    assert 2 * hardware == pytest.approx(est_one["flops"]["hardware_per_device"] + (2 * n_d + 4 * HK * S) * tokens)
    first = (8 * n_d + 16 * HK * S) * tokens / 2 / hardware
    last = (6 * VD * (1 + mtp) + 6 * n_m + 12 * HK * S * mtp) * tokens / 2 / hardware
    factor = 1 + 2 * max(first, last) - first - last
    assert est["stage_factor"] == pytest.approx(factor) and 1.1 < factor < 2
    bubble = timetable("1f1b", 2, 4, 1, "save").bubble
    assert est["compute_s"] == pytest.approx(hardware / H100["peak_flops"] / (1 - bubble) * factor)
    assert est_one["stage_factor"] == 1.0
    assert (last > first) == bool(mtp)  # the 2 modules and heads outweigh the dense layer


@pytest.mark.fast
def test_a_pipelines_last_stage_runs_the_head_and_the_slowest_stage_sets_the_tick():
    """Without layers that `embed` runs, the last stage alone runs the head: l = 6*V*D*tokens / all,
    the factor 1 + l (S - 1); the factor is symmetric in which end is heavier."""
    piped = _program("parallel.mesh=pipeline=2", devices=2)
    est = roofline.estimate(piped, _no_memory(), [], H100)
    c = piped.model.cfg
    tokens = piped.train.batch_size * piped.train.seq_len / 2
    last = 6 * c.vocab_size * c.d_model * tokens / est["flops"]["hardware_per_device"]
    assert est["stage_factor"] == pytest.approx(1 + last) and last > 0
    assert roofline.stage_factor(3.0, 1.0, 10.0, 4) == roofline.stage_factor(1.0, 3.0, 10.0, 4) == pytest.approx(1.8)
    assert roofline.stage_factor(0.0, 0.0, 10.0, 4) == 1.0 and roofline.stage_factor(1.0, 0.0, 0.0, 4) == 1.0


@pytest.mark.fast
def test_estimate_times_collectives_on_the_links_they_cross():
    """Records as meshtrain/planner/hlo.py gives them: 2 executions of 1 GB over data (cross-node on two
    8-GPU nodes) and 1 of 4.5 GB over fsdp: 2 GB / 50 GB/s + 4.5 GB / 450 GB/s = 50 ms."""
    mesh = sizes(data=2, fsdp=8)
    program = SimpleNamespace(
        sizes=mesh, plan=SimpleNamespace(remat="none", residuals="save", attention="xla", precision="bf16",
                                         context_strategy="ring", ulysses_degree=0, offload="none"),
        flops_per_token=0.0, backend="cpu", rules={},
        train=SimpleNamespace(batch_size=16, seq_len=16),
        model=SimpleNamespace(cfg=SimpleNamespace(num_heads=1, head_dim=1, num_layers=1, vocab_size=1, d_model=1,
                                                  mlp_dim=1,
                                                  layer_windows=lambda: (0,), window_kinds=lambda: (0,)),
                              block_matmul_params=lambda params: 0, slot_matmul_params=lambda params, *_, **__: 0),
        abstract_state={"params": None})
    data = SimpleNamespace(groups=[[f, 8 + f] for f in range(8)], times=2, traffic=1e9)
    fsdp = SimpleNamespace(groups=[list(range(8)), list(range(8, 16))], times=1, traffic=4.5e9)
    est = roofline.estimate(program, _no_memory(), [data, fsdp], H100)
    assert est["placement"] == {"data": "cross-node", "fsdp": "in-node"} and est["nodes"] == 2
    assert est["links"]["data"]["traffic_bytes"] == 2e9
    assert est["comm_s"] == pytest.approx(2e9 / 50e9 + 4.5e9 / 450e9)
    assert est["step_s"] == est["comm_s"] and est["bound"] == "communication"


# ---- the GPU program's step time, kernel by kernel (meshtrain/planner/kernel_time.py) ----
GEMM = '"fusion_backend_config":{"kind":"__triton_gemm"}'
WALKED = f"""HloModule walked, is_scheduled=true

%add_body (p0: f32[1024,1024], p1: f32[1024,1024]) -> f32[1024,1024] {{
  %p0 = f32[1024,1024]{{1,0}} parameter(0)
  %p1 = f32[1024,1024]{{1,0}} parameter(1)
  ROOT %add = f32[1024,1024]{{1,0}} add(%p0, %p1)
}}

%update_body (q0: f32[8,1024,1024], q1: f32[1024,1024], q2: s32[]) -> f32[8,1024,1024] {{
  %q0 = f32[8,1024,1024]{{2,1,0}} parameter(0)
  %q1 = f32[1024,1024]{{1,0}} parameter(1)
  %row = f32[1,1024,1024]{{2,1,0}} bitcast(%q1)
  %q2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[8,1024,1024]{{2,1,0}} dynamic-update-slice(%q0, %row, %q2, %zero, %zero)
}}

%gemm_body (g0: bf16[4096,2048], g1: bf16[2048,1024]) -> bf16[4096,1024] {{
  %g0 = bf16[4096,2048]{{1,0}} parameter(0)
  %g1 = bf16[2048,1024]{{1,0}} parameter(1)
  ROOT %dot = bf16[4096,1024]{{1,0}} dot(%g0, %g1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%loop (arg: (s32[], f32[1024,1024], f32[8,1024,1024])) -> (s32[], f32[1024,1024], f32[8,1024,1024]) {{
  %arg = (s32[], f32[1024,1024]{{1,0}}, f32[8,1024,1024]{{2,1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[1024,1024]{{1,0}} get-tuple-element(%arg), index=1
  %buf = f32[8,1024,1024]{{2,1,0}} get-tuple-element(%arg), index=2
  %sum = f32[1024,1024]{{1,0}} fusion(%x, %x), kind=kLoop, calls=%add_body
  %put = f32[8,1024,1024]{{2,1,0}} fusion(%buf, %sum, %i), kind=kLoop, calls=%update_body
  ROOT %out = (s32[], f32[1024,1024]{{1,0}}, f32[8,1024,1024]{{2,1,0}}) tuple(%i, %sum, %put)
}}

%more (c: (s32[], f32[1024,1024], f32[8,1024,1024])) -> pred[] {{
  %c = (s32[], f32[1024,1024]{{1,0}}, f32[8,1024,1024]{{2,1,0}}) parameter(0)
  %n = s32[] get-tuple-element(%c), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%n, %four), direction=LT
}}

ENTRY %main (a: bf16[4096,2048], b: bf16[2048,1024], x: f32[1024,1024], buf: f32[8,1024,1024]) -> bf16[4096,1024] {{
  %a = bf16[4096,2048]{{1,0}} parameter(0)
  %b = bf16[2048,1024]{{1,0}} parameter(1)
  %x = f32[1024,1024]{{1,0}} parameter(2)
  %buf = f32[8,1024,1024]{{2,1,0}} parameter(3)
  %ar = f32[1024,1024]{{1,0}} all-reduce-start(%x), replica_groups={{{{0,1}}}}, to_apply=%add_body
  %mm = bf16[4096,1024]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm_body, backend_config={{{GEMM}}}
  %ard = f32[1024,1024]{{1,0}} all-reduce-done(%ar)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024,1024]{{1,0}}, f32[8,1024,1024]{{2,1,0}}) tuple(%zero, %ard, %buf)
  %w = (s32[], f32[1024,1024]{{1,0}}, f32[8,1024,1024]{{2,1,0}}) while(%init), condition=%more, body=%loop, \
backend_config={{"known_trip_count":{{"n":"4"}}}}
  ROOT %r = bf16[4096,1024]{{1,0}} copy(%mm)
}}
"""
# round numbers: 1 PFLOP/s bf16, 1 TB/s HBM, 1 us launches, every efficiency 1/2, no GEMM shape penalty
PROFILE = {"peak_flops": 1e15, "peak_fp8_flops": 2e15, "peak_tf32_flops": 5e14, "hbm_bw": 1e12,
           "kernels": {"gemm_peak": 0.5, "gemm_half_size": 0, "attention_efficiency": 0.5, "hbm_efficiency": 0.5,
                       "launch_s": 1e-6, "grouped_gemm_peak": 0.25}}


@pytest.mark.fast
@pytest.mark.parametrize("link_s", [1e-5, 1e-4])
def test_the_gpu_programs_kernels_are_costed_in_schedule_order(link_s):
    from meshtrain.planner import kernel_time

    r = kernel_time.step_time(WALKED, PROFILE, {"ar": link_s})
    mib = 2 ** 20
    gemm = max(2 * 4096 * 2048 * 1024 / (1e15 * 0.5), (16 + 4 + 8) * mib / 0.5e12)  # FLOPs from the dot's shapes
    add, update = 12 * mib / 0.5e12, 8 * mib / 0.5e12  # a + a -> sum; the update written in place, the buffer unread
    copy = 2 * 8 * mib / 0.5e12
    loop = 4 * (add + update) + 5 * 1e-6  # 4 trips; the condition's compare runs 5 times, at the launch floor
    assert r["by_kind_s"]["gemm"] == pytest.approx(gemm)
    assert r["by_kind_s"]["memory"] == pytest.approx(4 * (add + update) + 5e-6 + copy)
    assert r["launches"] == {"gemm": 1, "attention": 0, "memory": 4 * 2 + 5 + 1, "host": 0}
    # the all-reduce runs beside the GEMM scheduled between its start and done: only what outlasts it shows
    assert r["step_s"] == pytest.approx(max(gemm, link_s) + loop + copy)
    assert r["exposed_comm_s"] == pytest.approx(max(0.0, link_s - gemm))


@pytest.mark.fast
def test_the_memory_bound_time_is_listed_by_kernel_largest_first():
    """`memory_top`: each memory-bound kernel's seconds a step (times its launches), by op, shape and
    the JAX operation it came from (XLA's metadata), largest first, summing to the step's memory-bound time."""
    from meshtrain.planner import kernel_time

    named = WALKED.replace("copy(%mm)", 'copy(%mm), metadata={op_name="jit(step)/while/body/transpose"}')
    r = kernel_time.step_time(named, PROFILE, {"ar": 1e-5})
    mib = 2 ** 20
    assert r["memory_top"] == [("fusion f32[1024,1024]", pytest.approx(4 * 12 * mib / 0.5e12)),  # the loop's add
                               ("fusion f32[8,1024,1024]", pytest.approx(4 * 8 * mib / 0.5e12)),  # its update
                               ("copy bf16[4096,1024] transpose", pytest.approx(2 * 8 * mib / 0.5e12)),
                               ("compare pred[]", pytest.approx(5e-6))]  # the condition, 5 launches
    assert sum(s for _, s in r["memory_top"]) == pytest.approx(r["by_kind_s"]["memory"])


@pytest.mark.fast
def test_a_conditional_costs_the_mean_of_its_branches():
    from meshtrain.planner import kernel_time

    text = WALKED.replace("%w = (s32[], f32[1024,1024]{1,0}, f32[8,1024,1024]{2,1,0}) while(%init), condition=%more, "
                          'body=%loop, backend_config={"known_trip_count":{"n":"4"}}',
                          "%p = pred[] parameter(4)\n  %w = (s32[], f32[1024,1024]{1,0}, f32[8,1024,1024]{2,1,0}) "
                          "conditional(%p, %init, %init), true_computation=%loop, false_computation=%skip")
    text = text.replace("ENTRY", "%skip (s: (s32[], f32[1024,1024], f32[8,1024,1024])) -> "
                        "(s32[], f32[1024,1024], f32[8,1024,1024]) {\n  ROOT %s = (s32[], f32[1024,1024]{1,0}, "
                        "f32[8,1024,1024]{2,1,0}) parameter(0)\n}\n\nENTRY")
    mib = 2 ** 20
    r = kernel_time.step_time(text, PROFILE, {})
    assert r["launches"]["memory"] == pytest.approx(2 * 0.5 + 1)  # the loop body's two kernels half the time
    assert r["by_kind_s"]["memory"] == pytest.approx((12 + 8) * mib / 0.5e12 / 2 + 2 * 8 * mib / 0.5e12)


@pytest.mark.fast
def test_a_fusion_that_reads_a_tile_of_the_buffer_it_updates_in_place_moves_the_tile_only():
    """The grouped matmul's step (meshtrain/ops/grouped_matmul.py `_gmm_loop`): read a tile of the
    output, select, write the tile back. The buffer is updated in place, so only the tile is read and
    written, not the whole buffer (qwen3-30b-a3b's pod priced 596 s a step when the [262144, 2048]
    buffer was counted read each step)."""
    from meshtrain.planner import kernel_time

    read_modify_write = WALKED.replace(
        "  ROOT %dus = f32[8,1024,1024]{{2,1,0}} dynamic-update-slice(%q0, %row, %q2, %zero, %zero)".replace("{{", "{")
        .replace("}}", "}"),
        "  %old = f32[1,1024,1024]{2,1,0} dynamic-slice(%q0, %q2, %zero, %zero), dynamic_slice_sizes={1,1024,1024}\n"
        "  %new = f32[1,1024,1024]{2,1,0} add(%old, %row)\n"
        "  ROOT %dus = f32[8,1024,1024]{2,1,0} dynamic-update-slice(%q0, %new, %q2, %zero, %zero)")
    assert read_modify_write != WALKED
    mib = 2 ** 20
    plain = kernel_time.step_time(WALKED, PROFILE, {})["by_kind_s"]["memory"]
    tiled = kernel_time.step_time(read_modify_write, PROFILE, {})["by_kind_s"]["memory"]
    assert tiled - plain == pytest.approx(4 * 4 * mib / 0.5e12)  # 4 trips, each reading one 4 MiB tile more


@pytest.mark.fast
def test_the_walk_prices_a_program_jax_0_11_compiled_on_a_gpu_with_its_async_fusions():
    """The train step JAX 0.11.2 compiled on an H200 (llama_1b, batch 8, cuDNN, save_matmuls;
    tests/data, written by `python benchmarks/kernel_profile.py ... --hlo-out`) runs its residual
    writes as async fusions (`fusion-start`/`fusion-done` of a dynamic-update-slice into the layers'
    stacked buffer). The walk prices each once, at its fusion's bytes (the update, not the 13 GB
    buffer): the step it predicts is the 262.9 ms measured there, where it read 744 ms before."""
    import gzip

    from meshtrain.planner.kernel_time import step_time

    text = gzip.decompress((ROOT / "tests" / "data" / "llama_1b_b8_cudnn_jax011.hlo.gz").read_bytes()).decode()
    assert text.count("fusion-start(") >= 16 and "fused_dynamic_update_slice" in text
    walked = step_time(text, DEVICE_PROFILES["h200"], {})
    assert walked["step_s"] == pytest.approx(0.2629, rel=0.05)
    assert walked["by_kind_s"]["memory"] < 0.1  # 60.3 ms of memory-bound kernels measured in its trace
