"""The planner on XLA's GPU compiler, without a GPU (meshtrain/planner/compilers.py: compile-only H100
devices from a topology, the plan-gpu extra): the plan says which compiler made its figures and falls
back to XLA:CPU with the reason; pods span hosts; and what only the GPU's program shows, checked here:
fp8 projections run fp8 GEMMs forward and backward (the bf16 step none), cuDNN's fused attention runs
the kernels per layer docs/speed.md states for each remat policy, and no step holds f32 logits."""
import gc
import json
import os
import re
import subprocess
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from conftest import MOE_TINY, ROOT, TINY, tiny_config
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_plan import one_of_each_collective
from test_roofline import _no_memory

from meshtrain.core import cli, compile_cache
from meshtrain.core.errors import LayoutError, UserError
from meshtrain.core.metrics import DEVICE_PROFILES, devices_per_host
from meshtrain.engine.compiler_options import GPU_OPTIONS
from meshtrain.engine.program import TrainProgram
from meshtrain.ops.block_scaled import swapped
from meshtrain.ops.embedding import lookup
from meshtrain.ops.fp8 import transposed_specs
from meshtrain.ops.loss import cross_entropy
from meshtrain.parallel.mesh import build_mesh
from meshtrain.parallel.sharding import activation_rules, make_rules
from meshtrain.plan import main
from meshtrain.planner import compilers, hlo, kernel_time, kernels, known_gaps, roofline, traffic
from meshtrain.planner.budget import host_budget
from meshtrain.planner.hlo import Module, collectives
from meshtrain.planner.text import format_kernels, format_plan

pytestmark = pytest.mark.skipif(compilers.gpu_compiler_missing() is not None,
                                reason="the compile-only GPU backend (the plan-gpu extra) is not installed")


@pytest.fixture(scope="module", autouse=True)
def release_gpu_programs():
    """The GPU programs compiled here skip the compilation cache, as the planner's do
    (compile_cache.suspended: JAX could not load them back), and serve no other test file: their
    executables leave the worker's jit caches with this file (an xdist worker runs other files after it;
    a clean-clone CI worker crashed in LLVM with "Cannot allocate memory" a few files later)."""
    with compile_cache.suspended():
        yield
    jax.clear_caches()
    gc.collect()


def gpu_devices(count=1, per_node=8):
    return compilers.choose("gpu", "h100", count, per_node).devices


def compiled_step(*overrides, config=TINY, count=1):
    cfg = tiny_config(*overrides, config=config)
    return TrainProgram.from_config(cfg, devices=gpu_devices(count)).lower().compile().as_text()


@pytest.fixture(scope="module")
def steps():
    """The tiny model's train step on one H100, by precision (mesh=1: every row on the device)."""
    return {p: compiled_step("parallel.mesh=1", f"parallel.precision={p}") for p in ("bf16", "fp8", "fp8_rowwise")}


def test_the_plan_is_the_gpu_programs_and_says_so(capsys):
    assert main(["--config", TINY, "--devices", "8", "--mesh", "2x2x2", "--compiler", "gpu", "--json",
                 "--search-budget", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiled_for"] == {"platform": "cuda", "device": "h100", "devices": 8,
                                      "device_kind": "NVIDIA H100 80GB HBM3", "hosts": 1}
    assert not any(report["corrections"].values())  # the GPU program is read as it is
    assert report["memory"]["cpu_copies"] == 0 and report["flops"]["compiled_per_device"] is None
    k = report["kernels"]
    assert sum(k["gemms"].values()) > 0 and k["collectives"]["all-reduce"] > 0 and k["fusions"] > 0
    assert set(k["gemms"]) == {"f32 x f32"}  # the tiny config's fp32
    assert k["largest"][0]["bytes"] >= k["largest"][-1]["bytes"] > 0
    text = format_plan(report)
    assert "compiled by XLA's GPU compiler for 8 x NVIDIA H100 80GB HBM3 (1 host(s) x 8), without a GPU" in text
    assert re.search(r"GEMMs [\d,]+ by operand types: f32 x f32 [\d,]+", text)
    roof = report["roofline"]  # the GPU program's kernels price the step, the formulas' bound kept beside it
    assert roof["priced_by"] == "kernels" and roof["step_s"] == roof["kernel_time"]["step_s"] > 0
    assert roof["formula_step_s"] < roof["step_s"] and "priced by the GPU program's kernels: step" in text


def test_a_pod_of_several_hosts_is_a_topology_of_hosts():
    devices, hosts = compilers.gpu_devices("h200", 16, 8)
    assert hosts == 2 and [d.process_index for d in devices] == [0] * 8 + [1] * 8
    assert {d.device_kind for d in devices} == {"NVIDIA H200"}
    assert compilers.topology_shape(12, 8) == (1, 12)  # 8 does not divide 12: one host of them all
    for device, target in compilers.GPU_TARGETS.items():  # every shipped target makes its devices
        assert {d.device_kind for d in compilers.gpu_devices(device, 2, 8)[0]} == {target["name"]}
    # a GB200 NVL72 rack: one NVLink domain of 72, hosts (compute trays) of 4 GPUs sharing 960 GB
    gb200 = DEVICE_PROFILES["gb200"]
    per_host = devices_per_host(gb200, gb200["devices_per_node"])
    assert per_host == 4 and devices_per_host(DEVICE_PROFILES["h100"], 8) == 8
    assert compilers.gpu_devices("gb200", 64, per_host)[1] == 16
    assert host_budget(gb200["host_memory"], 64, per_host, "profile")["share"] == 240e9


def test_without_the_gpu_compiler_the_plan_says_why_and_how(monkeypatch):
    tpu = compilers.choose("auto", "tpu-v5p", 8, 8)
    assert tpu.platform == "cpu" and tpu.reason.startswith("no GPU target for --device tpu-v5p")
    monkeypatch.setattr(compilers, "gpu_compiler_missing", lambda: "the compile-only GPU backend is not installed "
                                                                   f"({compilers.INSTALL_HINT} brings it)")
    fallback = compilers.choose("auto", "h100", 8, 8)
    assert fallback.platform == "cpu" and len(fallback.devices) == 8
    assert compilers.summary(fallback.describe()).startswith(
        'compiled by XLA:CPU on 8 simulated devices: the compile-only GPU backend is not installed (pip install -e '
        '".[plan-gpu]" brings it)')
    with pytest.raises(UserError, match=r"--compiler gpu: the compile-only GPU backend is not installed"):
        compilers.choose("gpu", "h100", 8, 8)
    monkeypatch.setattr(compilers, "gpu_compiler_missing", lambda: None)  # installed, but it fails to start
    monkeypatch.setattr(compilers, "gpu_devices", raising(RuntimeError("Unable to load cuda plugin\ntraceback...")))
    broken = compilers.choose("auto", "h100", 8, 8)
    assert broken.platform == "cpu" and broken.reason.startswith(
        "XLA's GPU compiler did not start (Unable to load cuda plugin); the figures are XLA:CPU's")


def raising(error):
    def fail(*args, **kwargs):
        raise error
    return fail


def test_combined_async_collectives_are_read_whole():
    """The GPU compiler runs collectives asynchronously and combines several into one launch (one
    all-gather-start of two arrays here): the payload is every array its -done gives, the same bytes
    as XLA:CPU's program; one_of_each_collective's kinds carry the bytes test_plan.py counts on the CPU."""
    mesh = jax.sharding.Mesh(gpu_devices(8), ("x",), axis_types=(AxisType.Auto,))
    arg = jax.ShapeDtypeStruct((8 * 64,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    two = lambda a: sum(g.sum() for g in jax.lax.all_gather((a, a * 2), "x", tiled=True))
    read = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False)
                              ).lower(arg).compile().as_text()
    local = 64 * 4
    combined = read(two)
    assert len(re.findall(r" all-gather-start\(", combined)) == 1  # one launch of both arrays
    assert collectives(combined, 8, correct=False)["all-gather"]["payload_bytes"] == 2 * 8 * local
    found = collectives(read(one_of_each_collective), 8, correct=False)
    for kind, payload in (("all-reduce", 4 * local), ("all-gather", 8 * local), ("reduce-scatter", local / 8),
                          ("collective-permute", local), ("all-to-all", local)):
        assert found[kind]["payload_bytes"] == payload, kind


def test_the_head_is_gathered_once_a_loss_and_its_gradient_reduced_onto_its_shards():
    """meshtrain/ops/loss.py on 8 H100s as expert=4 x fsdp=2, the loss in 4 chunks: the head is
    gathered over fsdp once (XLA:GPU gathered it in every chunk, forward and backward: 8 here) and its
    gradient is reduce-scattered over fsdp, then all-reduced over expert, never all-reduced whole."""
    mesh = build_mesh({"expert": 4, "fsdp": 2}, gpu_devices(8))
    B, L, D, V = 8, 16, 64, 256
    arg = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    rows = P(("expert", "fsdp"))
    args = (arg((B, L, D), jnp.float32, rows), arg((D, V), jnp.float32, P("fsdp")), arg((B, L), jnp.int32, rows))

    def loss(x, w, t):
        with activation_rules(make_rules(), mesh):
            return cross_entropy(x, w, t, budget=4 * 4 * V, least_tokens=1)  # a row of 4 positions per device: 4 chunks

    with jax.set_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    head = D * V * 4
    records = hlo.read(text, 8, correct=False)
    gathers = [r for r in records if r.kind == "all-gather" and r.payload == head]
    assert sum(r.times for r in gathers) == 1
    assert [r.group_size for r in records if r.kind == "reduce-scatter" and r.payload == head // 2] == [2]
    assert [r.group_size for r in records if r.kind == "all-reduce" and r.payload >= head // 2] == [4]


def test_the_lookups_gradient_is_reduce_scattered_onto_the_tables_shards():
    """meshtrain/ops/embedding.py on 8 H100s as expert=4 x fsdp=2: the bf16 table's gradient is
    reduce-scattered over fsdp, then its half all-reduced over expert, both summed in fp32 (jnp.sum of
    bf16); autodiff's scatter-add was
    all-reduced whole over all 8 (mixtral's pod: all-reduce 1.49x its formula, issue 39 section 3)."""
    mesh = build_mesh({"expert": 4, "fsdp": 2}, gpu_devices(8))
    B, L, V, D = 8, 16, 256, 64
    arg = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    rows = P(("expert", "fsdp"))
    args = (arg((V, D), jnp.bfloat16, P(None, "fsdp")), arg((B, L), jnp.int32, rows),
            arg((B, L, D), jnp.bfloat16, rows))

    def grad(table, ids, cotangent):
        with activation_rules(make_rules(), mesh):
            return jax.vjp(lambda t: lookup(t, ids), table)[1](cotangent)[0]

    with jax.set_mesh(mesh):
        text = jax.jit(grad).lower(*args).compile().as_text()
    half = V * D * 4 // 2  # summed in fp32
    reductions = [(r.kind, r.group_size, r.payload) for r in hlo.read(text, 8, correct=False)
                  if r.kind in ("all-reduce", "reduce-scatter") and r.payload >= half]
    assert sorted(reductions) == [("all-reduce", 4, half), ("reduce-scatter", 2, half)]


@pytest.mark.parametrize("tied,once", [(False, False), (True, False), (False, True)])
def test_fsdp_formula_holds_on_the_gpu_program(tied, once):
    """fsdp x tensor in 2 microbatches on 8 H100s (the pods' layout, tiny): every kind within 10% of
    meshtrain/planner/traffic.py's formula on the GPU's program, where the embedding and head are
    gathered per microbatch and the lookup's gradient reduced in the compute dtype (XLA:CPU's differ).
    With parallel.gather_once no weight is gathered again per microbatch: each all-gather runs once a
    step, before the loop (per microbatch the layers' run in it, times 2 x the layers)."""
    cfg = tiny_config("parallel.mesh=fsdp=4,tensor=2", "parallel.microbatches=2", "parallel.zero=3",
                      "parallel.precision=bf16", f"model.tie_embeddings={str(tied).lower()}",
                      f"parallel.gather_once={str(once).lower()}")
    program = TrainProgram.from_config(cfg, devices=gpu_devices(8))
    text = program.lower().compile().as_text()
    measured = collectives(text, 8, correct=False)
    expected = traffic.expected_traffic(program)
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        assert measured[kind]["traffic_bytes"] == pytest.approx(expected[kind]["traffic_bytes"], rel=0.10), kind
    most = max(r.times for r in hlo.read(text, 8, correct=False) if r.kind == "all-gather")
    assert most == (1 if once else 2 * cfg.model.num_layers)


def test_gathered_once_an_fp8_recipes_weights_cross_in_bf16_once_a_step():
    """parallel.gather_once under fp8 on 8 H100s as fsdp=8 in 2 microbatches: the compute-dtype copy is
    gathered once, before the loop, in bf16 (the recipe quantizes inside the loop), as traffic.py counts it;
    the reduce-scatters are the per-microbatch ones."""
    cfg = tiny_config("parallel.mesh=fsdp=8", "parallel.microbatches=2", "parallel.zero=3", "parallel.precision=fp8",
                      "parallel.gather_once=true")
    program = TrainProgram.from_config(cfg, devices=gpu_devices(8))
    text = program.lower().compile().as_text()
    measured, expected = collectives(text, 8, correct=False), traffic.expected_traffic(program)
    for kind in ("all-gather", "reduce-scatter"):
        assert measured[kind]["traffic_bytes"] == pytest.approx(expected[kind]["traffic_bytes"], rel=0.10), kind
    assert {r.times for r in hlo.read(text, 8, correct=False) if r.kind == "all-gather"} == {1}
    assert not any("f8e4m3fn[" in line for line in text.splitlines() if " all-gather-start(" in line)


def test_a_program_of_an_fp8_recipe_for_an_a100_is_refused_before_it_compiles():
    """The program itself refuses (a run on an A100 as much as its plan by the GPU compiler), from the
    device's own compute capability."""
    a100 = compilers.choose("gpu", "a100", 1, 8).devices
    with pytest.raises(UserError, match=r"the NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no fp8 GEMMs"):
        TrainProgram.from_config(tiny_config("parallel.mesh=1", "parallel.precision=fp8"), devices=a100)


BLOCK_SCALED_GEMMS = {"mxfp8": "f8e4m3fn x f8e4m3fn scaled f8e8m0fnu", "nvfp4": "f4e2m1fn x f4e2m1fn scaled f8e4m3fn"}


@pytest.mark.parametrize("recipe, device", [("fp8", "h100"), ("fp8_rowwise", "h100"), ("mxfp8", "b200"),
                                            ("nvfp4", "b200")])
def test_quantized_matrices_are_gathered_quantized_and_their_gradients_reduced_in_bf16(recipe, device):
    """A recipe on 8 GPUs as fsdp=8 in 2 microbatches: XLA:GPU quantizes the layers' matrices before
    the FSDP gather, so the all-gather moves them quantized (fp8: 1 byte; mxfp8 with its E8M0 scales,
    nvfp4 packed with its e4m3 scales), as meshtrain/planner/traffic.py counts (bf16's count would be 2x,
    or 3.6x nvfp4's); the GEMMs write their sums in bf16, so the gradient reduce-scatter moves bf16, as a
    bf16 step's (fp32 sums moved 1.77x the formula on llama3_8b's pod, nvfp4's 1.94x here); the scales'
    amaxes are the all-reduce's known gap, not an unexplained one.
    On Blackwell, the block-scaled recipes' every projection GEMM, forward and both gradients (the 7
    projections' einsums and their transposes: 21 a layer, each microbatch), is cuDNN's block-scaled GEMM
    on the recipe's values and scales (mxfp8: e4m3 with E8M0 scales; nvfp4: e2m1 with e4m3 scales), the
    rest bf16: the head's 3 and nvfp4's Hadamard rotation of dw's operands (16 x 16, one GEMM a layer as
    XLA merges them). XLA makes them from cuDNN 9.10: meshtrain/planner/compilers.py targets the installed
    cuDNN. nvfp4's last layer is kept in bf16 (parallel.bf16_layers): its 21 GEMMs bf16, its matrices gathered
    in bf16, as the formula counts them."""
    # nvfp4: the last layer left in bf16 (under every remat policy: tests/test_layer_runs.py)
    kept = ("parallel.bf16_layers=[-1]",) if recipe == "nvfp4" else ()
    cfg = tiny_config("parallel.mesh=fsdp=8", "parallel.microbatches=2", f"parallel.precision={recipe}",
                      "model.d_model=256", "model.mlp_dim=1024", "model.head_dim=32", "train.seq_len=64", *kept)
    program = TrainProgram.from_config(cfg, devices=compilers.choose("gpu", device, 8, 8).devices)
    text = program.lower().compile().as_text()
    layers = cfg.model.num_layers
    low = layers - (recipe == "nvfp4")  # the layers the recipe runs
    if recipe in BLOCK_SCALED_GEMMS:
        gemms = kernels.read(text)["gemms"]
        assert gemms.pop(BLOCK_SCALED_GEMMS[recipe]) == 21 * low * 2
        rest = 3 + (low if recipe == "nvfp4" else 0)  # the head's and the rotations
        # the kept layer's 21 in bf16 (XLA merges some that share an operand: 15 of them here)
        assert list(gemms) == ["bf16 x bf16"] and (rest + 15 * (layers - low)) * 2 <= gemms["bf16 x bf16"] \
            <= (rest + 21 * (layers - low)) * 2
    measured, expected = collectives(text, 8, correct=False), traffic.expected_traffic(program)
    assert traffic.param_slices(program)["fp8"] > 0.9 * traffic.param_slices(program)["blocks"] * low / layers
    for kind in ("all-gather", "reduce-scatter"):
        assert measured[kind]["traffic_bytes"] == pytest.approx(expected[kind]["traffic_bytes"], rel=0.10), kind
    assert any("f8e4m3fn[" in line for line in text.splitlines() if " all-gather-start(" in line)
    flag = traffic.compare(measured, expected, gaps=known_gaps.known_gaps(program))["all-reduce"]["flag"]
    assert flag is None or f"the {recipe} recipe's scales" in flag


# fp8_rowwise's GEMMs take the same path (ops/fp8.py); `peaks`: (bf16, the recipe's) peak of each datasheet, TFLOP/s
@pytest.mark.parametrize("recipe, device, peaks", [("fp8", "b200", (2250, 4500)), ("nvfp4", "gb200", (2500, 10000))])
def test_a_blackwell_plan_is_its_gpu_program_with_low_precision_gemms_and_says_its_constants_are_not_calibrated(
        capsys, recipe, device, peaks):
    """Blackwell as a target (XLA's own B200 and GB200 specs, cc 10.0): fp8 compiles to fp8 GEMMs on the B200
    as on an H100, nvfp4 to block-scaled e2m1 ones on the GB200, and the step priced from its kernels says
    the constants are the H100/H200's. (One device: the claims are the target's, not a layout's.) A GB200
    NVL72 rack is one NVLink domain of 72 GPUs: a 64-GPU fsdp group runs at NVLink's 900 GB/s, where B200s
    cross 8 nodes (8 NICs of 50 GB/s a group)."""
    assert main(["--config", TINY, "--devices", "1", "--mesh", "1", "--device", device, "--compiler", "gpu",
                 "--set", f"parallel.precision={recipe}", "--json", "--search-budget", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiled_for"]["device_kind"] == f"NVIDIA {device.upper()}"
    gemms = set(report["kernels"]["gemms"])
    if recipe == "fp8":
        assert {"f8e4m3fn x f8e4m3fn", "f8e5m2 x f8e4m3fn", "f8e4m3fn x f8e5m2"} <= gemms
    else:
        assert BLOCK_SCALED_GEMMS[recipe] in gemms
    roof = report["roofline"]
    assert roof["priced_by"] == "kernels" and roof["kernel_time"]["calibrated"] is False
    text = format_plan(report)
    assert "GPU kernels (NOT calibrated on this GPU: the H100/H200's shares" in text
    if recipe == "fp8":  # the recipe's step measured on an H200 against its prediction (FP8_MEASURED_OVER_PREDICTED)
        assert f"{recipe}: a step measured on an H200 ran 1.1" in text
    assert roof["mfu_fp8_ceiling"] == pytest.approx(roof["mfu_ceiling"] * peaks[0] / peaks[1])
    profile = DEVICE_PROFILES[device]
    assert roofline.placement({"fsdp": 64}, profile["devices_per_node"]) == \
        {"fsdp": "in-node" if device == "gb200" else "cross-node"}
    assert roofline.link_bandwidth(profile, ("fsdp",), {"fsdp": 64}, profile["devices_per_node"]) == \
        (900e9 if device == "gb200" else 8 * 50e9)


PROJECTIONS = ("bld,dhk->blhk", "bld,dgk->blgk", "blhk,hkd->bld", "bld,df->blf", "blf,fd->bld")  # the 7


def test_xla_makes_the_block_scaled_gemm_from_cudnn_9_10_which_the_target_names_when_installed(monkeypatch):
    """The planner's target names the installed cuDNN (compilers.cudnn_version): with 9.9, XLA's GPU
    compiler dequantizes an mxfp8 scaled_matmul and runs a bf16 cuBLASLt GEMM; from 9.10, cuDNN's
    block-scaled GEMM."""
    assert compilers.cudnn_version() >= (9, 10)  # the plan-gpu extra's cuDNN
    shapes = [((1, 256, 256), jnp.float8_e4m3fn)] * 2 + [((1, 256, 8), jnp.float8_e8m0fnu)] * 2
    made = {}
    for version in ((9, 9), (9, 10)):
        monkeypatch.setattr(compilers, "cudnn_version", lambda v=version: v)
        device = compilers.choose("gpu", "b200", 1, 8).devices[0]
        args = [jax.ShapeDtypeStruct(s, d, sharding=jax.sharding.SingleDeviceSharding(device)) for s, d in shapes]
        text = jax.jit(lambda *a: jax.nn.scaled_matmul(*a, preferred_element_type=jnp.bfloat16)).lower(
            *args).compile().as_text()
        made[version] = sorted(set(kernels.CALL_TARGET.findall(text)))
    assert made == {(9, 9): ["__cublas$lt$matmul"], (9, 10): ["__cudnn$blockScaledDot"]}


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_block_scaled_recipe_is_refused_on_a_hopper_and_on_a_b200_mesh_with_a_data_axis(recipe):
    """Before Blackwell XLA would dequantize the block-scaled GEMM; on a data axis scaled_matmul cannot be
    partitioned (block_scaled.gpu_layout_refusal): both stop before anything compiles."""
    with pytest.raises(LayoutError, match=f"parallel.precision={recipe} on NVIDIA GPUs with data > 1"):
        TrainProgram.from_config(tiny_config("parallel.mesh=data=2", f"parallel.precision={recipe}"),
                                 devices=compilers.choose("gpu", "b200", 2, 8).devices)
    hopper = r"the NVIDIA H100 80GB HBM3 \(compute capability 9.0\) has no "
    with pytest.raises(UserError, match=hopper + f"{recipe} GEMMs"):
        TrainProgram.from_config(tiny_config("parallel.mesh=1", f"parallel.precision={recipe}"), devices=gpu_devices())


def test_fp8_blockwise_runs_every_projection_gemm_as_its_triton_fp8_kernel_priced_as_one():
    """2 H100s as data=2 (a region manual over data, each GPU its own rows: the kernel unpartitioned): each
    projection's forward, dx and dw (21 GEMMs a layer) is meshtrain's Pallas Triton kernel
    (meshtrain/ops/fp8_blockwise_triton.py) on e4m3 values with their fp32 block scales, named by its einsum;
    the only bf16 GEMMs are the head's 3. The planner counts them by operand type and prices each as a GEMM
    of its shape at the fp8 peak and the Triton kernels' share (`grouped_gemm_peak`)."""
    text = compiled_step("parallel.mesh=data=2", "parallel.precision=fp8_blockwise", "model.num_layers=2", count=2)
    layers = 2
    assert kernels.read(text)["gemms"] == {"f8e4m3fn x f8e4m3fn scaled f32": 21 * layers, "bf16 x bf16": 3}
    specs = set(PROJECTIONS) | {t for spec in PROJECTIONS for t in transposed_specs(spec)}
    sites = [s for s in kernels.gemm_sites(text) if s["types"].endswith("scaled f32")]
    assert all(any(f"/{spec}/" in s["op"] or f"/{swapped(spec)}/" in s["op"] for spec in specs) for s in sites)
    profile = DEVICE_PROFILES["h100"]
    walk, c = kernel_time.StepTime(text, profile, {}), profile["kernels"]
    priced = [(kernel_time.gemm_shape(walk.module, comp, ins), walk.work(comp, ins))
              for ins, comp, _ in kernels.launches(walk.module) if kernels.BLOCKWISE_GEMM.search(ins.line)]
    assert priced
    for (dtype, m, n, k), (kind, seconds, _) in priced:
        shape = kernel_time.gemm_efficiency(m, n, k, c) / c["gemm_peak"]
        at_peak = 2.0 * m * n * k / (profile["peak_fp8_flops"] * shape)
        assert dtype == "f8e4m3fn" and kind == "gemm"
        assert seconds == pytest.approx(at_peak * c["gemm_peak"] / c["grouped_gemm_peak"])


def test_fp8_blockwise_is_partitioned_as_an_einsum_at_the_formulas_bytes_and_refused_where_it_cannot_be():
    """8 H100s as fsdp=4 x tensor=2 in 2 microbatches (widths whose every shard is whole 128-blocks): the
    kernel computes on each device's shards, its sharded contractions summed after it (tensor's row-parallel
    layers all-reduced, dw's tokens reduce-scattered onto the weight's shards), and the weights gathered in
    e4m3 with their scales: every collective at the formula's bytes (traffic.py, the recipe's
    `gathered_bytes`). A data axis beside fsdp, and tensor beside capacity-routed experts, stop before anything
    compiles (block_scaled.gpu_layout_refusal)."""
    cfg = tiny_config("parallel.mesh=fsdp=4,tensor=2", "parallel.microbatches=2", "parallel.precision=fp8_blockwise",
                      "model.num_layers=2", "model.d_model=256", "model.mlp_dim=1024", "model.head_dim=64",
                      "train.seq_len=256")
    program = TrainProgram.from_config(cfg, devices=gpu_devices(8))
    text = program.lower().compile().as_text()
    measured, expected = collectives(text, 8, correct=False), traffic.expected_traffic(program)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert measured[kind]["traffic_bytes"] == pytest.approx(expected[kind]["traffic_bytes"], rel=0.02), kind
    assert measured["all-to-all"]["traffic_bytes"] == 0
    assert any("f8e4m3fn[" in line for line in text.splitlines() if " all-gather-start(" in line)
    with pytest.raises(LayoutError, match="parallel.precision=fp8_blockwise on NVIDIA GPUs with data > 1 beside fsdp"):
        TrainProgram.from_config(tiny_config("parallel.mesh=data=2,fsdp=2", "parallel.precision=fp8_blockwise"),
                                 devices=gpu_devices(4))
    with pytest.raises(LayoutError, match="with tensor > 1 and capacity-routed experts"):
        TrainProgram.from_config(tiny_config("parallel.mesh=tensor=2", "parallel.precision=fp8_blockwise",
                                             "model.capacity_factor=1.25", config=MOE_TINY), devices=gpu_devices(2))


@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise"])
def test_fp8_projections_run_fp8_gemms_forward_and_backward_and_bf16_none(steps, recipe):
    """Every GEMM a projection's einsum makes (forward, and both gradients' transposed einsums) takes
    fp8 operands on the GPU: e4m3 x e4m3 forward, e5m2 cotangents x e4m3 operands backward, with a
    scale per tensor or per row; the bf16 step has no fp8 GEMM. (XLA may merge the q, k and v GEMMs,
    which share their input.)"""
    specs = {spec: "forward" for spec in PROJECTIONS}
    specs.update({t: "backward" for spec in PROJECTIONS for t in transposed_specs(spec)})
    fp8 = kernels.gemm_sites(steps[recipe])
    made = {}
    for site in fp8:
        spec = next((s for s in specs if f"/{s}/" in site["op"]), None)
        if spec:
            made.setdefault(specs[spec], set()).add(site["types"])
    assert made["forward"] == {"f8e4m3fn x f8e4m3fn"}
    assert made["backward"] == {"f8e5m2 x f8e4m3fn", "f8e4m3fn x f8e5m2"}
    assert not any("f8" in s["types"] for s in kernels.gemm_sites(steps["bf16"]))


def test_no_step_holds_f32_logits():
    """[rows, seq, vocab] in fp32 is never made: the loss takes the head in chunks of a quarter GiB of
    logits (meshtrain/ops/loss.py), here 8 x 512 x 32768 (512 MiB) in two, and so does the GPU program."""
    B, L, V = 8, 512, 32768
    text = compiled_step("parallel.mesh=1", "parallel.precision=bf16", f"model.vocab_size={V}",
                         f"train.seq_len={L}", f"train.batch_size={B}", "model.num_layers=1")
    made = list(kernels.arrays_made(Module(text)))
    assert any(a["shape"].endswith(f",{V}]") and a["bytes"] == 4 * B * L * V // 2 for a in made)  # a chunk's
    assert not [a for a in made if a["shape"].startswith("f32[") and a["bytes"] >= 4 * B * L * V]


@pytest.mark.parametrize("remat,per_layer", [("none", (1, 1)), ("save_matmuls", (2, 1)), ("full", (2, 1))])
def test_cudnn_attention_runs_the_fused_kernels_per_layer_docs_speed_states(remat, per_layer):
    """docs/speed.md: one fused forward and one backward per layer; save_matmuls and full rerun the
    forward in the backward (for its softmax statistics, which JAX does not name). The default,
    parallel.attention=auto, takes cuDNN's kernel on the GPU."""
    layers = 2
    text = compiled_step("parallel.mesh=1", "parallel.precision=bf16", f"parallel.remat={remat}", "model.head_dim=64",
                         f"model.num_layers={layers}", "train.seq_len=128", "train.batch_size=2")
    att = kernels.read(text)["attention"]
    assert (att["forward"], att["backward"]) == (per_layer[0] * layers, per_layer[1] * layers)


def test_auto_attention_says_why_it_is_not_cudnn_and_stays_xla_on_the_cpu():
    """parallel.attention=auto where JAX's cuDNN check refuses the model (a head width of 256 on the
    compile-only GPU, which JAX cannot see is a Hopper unless a plan says so, `cudnn_checks_see`, as
    an A100 refuses it; fp32) runs blockwise, or xla where blockwise
    cannot cut the sequence (521 is prime), with JAX's reason (`attention_note`, a notice); a context
    axis running the ring takes the ring; the CPU keeps xla. Programs built, nothing compiled."""
    def chosen(*sets, devices=None):
        program = TrainProgram.from_config(tiny_config(*sets), devices=devices or gpu_devices(1))
        return program.plan.attention, program.attention_note

    kernel, why = chosen("parallel.precision=bf16", "model.head_dim=256", "train.seq_len=128")
    assert kernel == "blockwise" and why.startswith("The head dim must be <= 128")
    with compilers.cudnn_checks_see(compilers.GPU_TARGETS["h100"]["cc"]):  # as a plan for H100s asks
        assert chosen("parallel.precision=bf16", "model.head_dim=256", "train.seq_len=128") == ("cudnn", None)
    with compilers.cudnn_checks_see(compilers.GPU_TARGETS["a100"]["cc"]):
        assert chosen("parallel.precision=bf16", "model.head_dim=256", "train.seq_len=128")[0] == "blockwise"
    kernel, why = chosen("parallel.precision=fp32", "train.seq_len=521")
    assert kernel == "xla" and why.startswith("Q must be fp16/bf16")
    assert chosen("parallel.precision=bf16") == ("cudnn", None)
    assert chosen("parallel.mesh=context=2", "parallel.precision=bf16", devices=gpu_devices(2)) == ("ring", None)
    assert chosen("parallel.mesh=1", devices=jax.devices("cpu")[:1]) == ("xla", None)


def test_a_plan_for_h100s_runs_cudnn_on_gemma3s_head_width_and_windows():
    """Gemma 3's heads of 256 with sliding windows: a Hopper's cuDNN takes them, so the train step a plan
    for H100s compiles (inside the plan's `Target.compiling`, compilers.cudnn_checks_see) runs the fused
    kernel for every layer, local and global, as the pod's own run does, with no fallback note."""
    layers = 4
    target = compilers.choose("gpu", "h100", 1, 8)
    cfg = tiny_config("parallel.mesh=1", "parallel.precision=bf16", "model.head_dim=256", "train.seq_len=128",
                      "model.sliding_window=32", "train.batch_size=2", "parallel.remat=none",
                      config=os.path.join(ROOT, "configs", "gemma3_tiny.yaml"))
    with target.compiling():
        program = TrainProgram.from_config(cfg, devices=target.devices)
        text = program.lower().compile().as_text()
    assert program.plan.attention == "cudnn" and program.attention_note is None
    # the layer scan's switch over the kinds holds a local and a global kernel: both counted per layer
    assert kernels.read(text)["attention"] == {"forward": 2 * layers, "backward": 2 * layers}


def test_sequence_parallelism_gathers_the_sequence_before_attention_and_sends_no_all_to_all():
    """Megatron-SP: the normed input of attention is gathered over the sequence once (models/base.py
    `project`), and q, k and v are projected from it. Left to the partitioner, XLA's GPU compiler
    projected q on the sequence shards and moved it with all-to-alls: llama3_8b on fsdp=8,tensor=8
    sent 37.58 GB of them a step, with no formula. Shrunk llama3_8b on fsdp=2,tensor=4: none, and the
    all-gathers within 10% of the formula (1.19x before)."""
    from test_traffic_configs import SHRINK

    cfg = tiny_config(*SHRINK, "parallel.mesh=fsdp=2,tensor=4", "parallel.sequence_parallel=true",
                      "train.batch_size=32", "parallel.zero=3", "parallel.remat=full", "parallel.microbatches=1",
                      "parallel.precision=bf16", config=os.path.join(ROOT, "configs", "llama3_8b.yaml"))
    program = TrainProgram.from_config(cfg, devices=gpu_devices(8))
    measured = collectives(program.lower().compile().as_text(), 8, correct=False)
    expected = traffic.expected_traffic(program)
    assert measured["all-to-all"]["traffic_bytes"] == 0
    assert measured["all-gather"]["traffic_bytes"] == pytest.approx(expected["all-gather"]["traffic_bytes"], rel=0.1)


def test_a_layer_switch_costs_its_branches_by_the_layers_that_take_them():
    """gemma3's layer scan switches between the local and the global kernel by an array of the layers'
    kinds, which as_text() elides when it is long ({...}); the planner's text prints it
    (kernels.module_text) and the walk weights each branch by its layers (kernel_time.branch_shares): 8 local
    and 4 global layers, 2/3 and 1/3, not half and half (gemma3_4b's pod: attention 283.5 -> 163.4 ms).
    Under remat save_matmuls (the pod's) the backward reads the same array; without remat it reads the
    kinds the forward saved, a residual the walk does not trace (the mean there)."""
    cfg = tiny_config("parallel.mesh=1", "parallel.precision=bf16", "model.head_dim=64", "model.num_layers=12",
                      "parallel.remat=save_matmuls", "train.seq_len=128", "train.batch_size=2",
                      config=os.path.join(ROOT, "configs", "gemma3_tiny.yaml"))
    compiled = TrainProgram.from_config(cfg, devices=gpu_devices(1)).lower().compile()
    assert "s32[12]{0} constant({...})" in compiled.as_text()
    module = Module(kernels.module_text(compiled))
    switches = [(comp, ins) for comp, instrs in module.comps.items() for ins in instrs.values()
                if ins.op == "conditional"]
    assert switches and all(sorted(kernel_time.branch_shares(module, comp, ins, 2)) == pytest.approx([1 / 3, 2 / 3])
                            for comp, ins in switches)
    assert kernel_time.branch_shares(Module(compiled.as_text()), *switches[0], 2) is None  # elided: the mean


@pytest.mark.parametrize("mesh,n,sets", [("data=2", 2, ()), ("data=2,pipeline=2,tensor=2", 8, ()),
                                         ("fsdp=4,tensor=2", 8, ("parallel.sequence_parallel=true",))])
def test_cudnn_attention_runs_inside_the_executors_manual_regions(mesh, n, sets):
    """The data-parallel executor's and the pipeline's steps run in shard_maps manual over some axes;
    cuDNN's kernel, custom-partitioned, runs there manual over the others too (meshtrain/ops/
    attention.py `each_device`; XLA's GPU compiler refuses custom partitioning in a partly manual
    region), fused forward and backward; so it does under sequence parallelism, whose q, k and v JAX's
    partitioner saw sharded apart (llama2_70b's plan with it failed to compile)."""
    text = compiled_step(f"parallel.mesh={mesh}", "parallel.precision=bf16", "model.head_dim=64",
                         "train.seq_len=128", "train.batch_size=8", "parallel.microbatches=2", *sets, count=n)
    att = kernels.read(text)["attention"]
    assert att["forward"] >= 1 and att["backward"] >= 1, att


def test_ulysses_runs_cudnns_kernel_per_layer_and_moves_its_formulas_all_to_all_bytes():
    """docs/context.md: under Ulysses cuDNN's fused kernel runs on the whole sequence (the shard_map is
    manual over every axis: XLA's GPU compiler refuses its custom partitioning in a partly manual
    region), and the step's all-to-alls move exactly the formula's bytes."""
    cfg = tiny_config("parallel.mesh=data=2,context=4", "parallel.precision=bf16", "train.seq_len=256",
                      "train.batch_size=2", "parallel.context_strategy=ulysses", "parallel.attention=cudnn")
    program = TrainProgram.from_config(cfg, devices=gpu_devices(8))
    text = program.lower().compile().as_text()
    att, layers = kernels.read(text)["attention"], cfg.model.num_layers
    assert att["forward"] >= layers and att["backward"] == layers, att
    expected = traffic.expected_traffic(program)["all-to-all"]["traffic_bytes"]
    assert expected > 0 and collectives(text, 8)["all-to-all"]["traffic_bytes"] == expected


NOT_KERNELS = ("parameter", "constant", "get-tuple-element", "bitcast", "tuple")


def waited_on_at_once(module) -> list[str]:
    """The async collectives the schedule waits on with no kernel between their start and done."""
    waited = []
    for instrs in module.comps.values():
        order = [ins for ins in instrs.values() if ins.op not in NOT_KERNELS]
        waited += [ins.op for ins, then in zip(order, order[1:])
                   if ins.op.endswith("-start") and then.op.endswith("-done") and then.operands[:1] == [ins.name]]
    return waited


def test_experts_compile_for_the_gpu_with_their_all_to_alls_triton_kernels_and_their_formulas_bytes():
    """moe_tiny's pod layout (data=2,expert=4, a tied table) in 2 microbatches on 8 H100s: the dispatch
    runs as async ragged all-to-alls, the experts as the grouped-matmul Triton kernels, and each kind moves its
    formula's bytes (XLA:GPU all-reduces the tied lookup's gradient over expert per microbatch apart
    from the head's: uncounted before, qwen3_moe_tiny read 1.08x there)."""
    cfg = tiny_config("parallel.mesh=data=2,expert=4", "parallel.microbatches=2", config=MOE_TINY)
    program = TrainProgram.from_config(cfg, devices=gpu_devices(8))
    text = program.lower().compile().as_text()
    k = kernels.read(text)
    # the buffer's rows go out and back as ragged all-to-alls (forward and backward, 4 layers x 2
    # microbatches), moving the rows routed; the counts per expert as all-to-alls
    assert k["collectives"]["ragged-all-to-all"] == 4 * 4 * 2 and k["collectives"]["all-to-all"] > 0
    assert sum(k["gemms"].values()) > 0
    # the routed experts' grouped matmuls are meshtrain's Triton kernels, two a layer a microbatch (gate and
    # up side by side, down; 4 layers x 2): forward, dx and dw; each expects its device's b*K*L = 32 rows and
    # is priced as 2·rows·K·N FLOPs (one local expert: no group boundary)
    assert k["grouped_gemms"] == {"gmm": 16, "gmm_t": 16, "tgmm": 16}
    # each expects 32 rows of its 128-row buffer: the plan says such buffers run slower than priced
    assert k["grouped_filled"] == 0.25
    assert "their buffers 25% filled" in "\n".join(format_kernels(k))
    module = Module(text)
    # no receive buffer is filled (meshtrain/ops/unfilled.py): each ragged all-to-all (the forward's dispatch
    # into the worst-case blocks, 4 senders x 16 rows, and its collect into the packed [32, 32]; the backward's
    # two) writes an allocation of its own, with no zero fill or copy before it
    into = Counter((comp[ins.operands[1]].shape.split("{")[0], kernels.allocation(comp[ins.operands[1]]))
                   for comp in module.comps.values() for ins in comp.values() if ins.op == "ragged-all-to-all-start")
    assert into == {("f32[64,32]", True): 2, ("f32[32,32]", True): 2}
    walk = kernel_time.StepTime(text, DEVICE_PROFILES["h100"], {})  # an allocation launches no kernel
    assert [walk.work(c, i) for c, comp in module.comps.items() for i in comp.values() if kernels.allocation(i)] \
        == [None] * 4
    # compiled with XLA's latency-hiding scheduler (meshtrain/engine/compiler_options.py): kernels run between
    # every async collective's start and its done (XLA's default schedule waits at once on 16 of the 18)
    assert program.compiler_options == GPU_OPTIONS and waited_on_at_once(module) == []
    grouped = [(ins, kernel_time._grouped_gemm(module, comp, ins)) for ins, comp, _ in kernels.launches(module)
               if kernels.GROUPED_GEMM.search(ins.line)]
    # D = F = 32: gate and up [32 -> 64], down [32 -> 32]
    assert {found[1] for _, found in grouped} == {2.0 * 32 * 32 * 64, 2.0 * 32 * 32 * 32}
    assert "meshtrain_gmm_rows32" in text
    # bytes (fp32): gmm and gmm_t read their 32 rows of x and the weights and write their 32 rows of the
    # 128-row buffer (padding rows: not written); tgmm reads 32 rows of x and of dy and writes dw
    priced_bytes = {(kernels.GROUPED_GEMM.search(ins.line).group(1), ins.shape.split("{")[0], found[3])
                    for ins, found in grouped}
    rows_x_w_y = lambda k, n: (32 * k + k * n + 32 * n) * 4
    assert priced_bytes == {("gmm", "f32[128,64]", rows_x_w_y(32, 64)), ("gmm", "f32[128,32]", rows_x_w_y(32, 32)),
                            ("gmm_t", "f32[128,32]", rows_x_w_y(64, 32)), ("gmm_t", "f32[128,32]", rows_x_w_y(32, 32)),
                            ("tgmm", "f32[1,32,64]", (32 * 96 + 32 * 64) * 4),
                            ("tgmm", "f32[1,32,32]", (32 * 64 + 32 * 32) * 4)}
    # the roofline's executed FLOPs count the rows routed on this program, the loop's whole buffer
    # (ep x min(k, E/ep) = 4 rows a token, not 2) on the CPU's
    hardware = lambda: roofline.estimate(program, _no_memory(), [], DEVICE_PROFILES["h100"])["flops"][
        "hardware_per_device"]
    on_gpu, program.backend = hardware(), "cpu"
    slot = program.model.slot_matmul_params(program.abstract_state["params"], program.train.seq_len, 4)
    assert slot > 0 and hardware() - on_gpu == pytest.approx(6 * slot * 16 * 16 / 8, rel=1e-9)
    # moe_tiny, E=4, K=2 on expert=4: the ragged all-to-alls move 2 of a token's 4 worst-case rows
    assert traffic.moe_dispatch(program)["routed_share"] == 0.5
    records = hlo.read(text, 8, correct=False)
    measured, expected = hlo.by_kind(records), traffic.expected_traffic(program)
    for kind in ("all-reduce", "all-gather", "all-to-all"):
        assert measured[kind]["traffic_bytes"] == pytest.approx(expected[kind]["traffic_bytes"], rel=0.02), kind
    # the step's walk puts every collective, the ragged ones among them, on its link once per execution
    profile = DEVICE_PROFILES["h100"]
    link_s = kernel_time.link_seconds(records, program.sizes, profile, 8)
    walked = kernel_time.step_time(text, profile, link_s)
    assert walked["by_kind_s"]["collectives"] == pytest.approx(sum(r.times * link_s[r.name] for r in records))


@pytest.mark.parametrize("platforms", ["cpu", None])
def test_a_commands_stderr_is_its_own_with_the_cuda_plugin_installed(platforms):
    """With the plan-gpu extra on a machine without a GPU driver, JAX's plugin probes for CUDA as it
    loads; a command's stderr is still only its own (meshtrain/core/cli.py CUDA_DRIVER_PROBE), with
    JAX_PLATFORMS=cpu and without it."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update({"JAX_PLATFORMS": platforms} if platforms else {})
    done = subprocess.run([sys.executable, "-m", "meshtrain.plan", "--config", TINY, "--devices", "8",
                           "--set", "bad.key=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: unknown config key 'bad'"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.skipif(not cli.no_cuda_driver(), reason="a CUDA driver loads here: the plugin's version check is real")
def test_a_script_that_imports_meshtrain_first_gets_no_cuda_check_traceback():
    """In a script or notebook (`import meshtrain` before JAX) on a machine without a GPU driver, the CUDA
    plugin's version check is skipped (meshtrain/core/cli.py skip_cuda_check): JAX starts on the CPU
    without the check's traceback. (absl's probe lines, written by the plugin's C++ as it loads, remain.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    done = subprocess.run([sys.executable, "-c", "import meshtrain, jax; print(jax.devices()[0].platform)"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "cpu\n", done.stderr
    assert "Traceback" not in done.stderr and "configuration error" not in done.stderr, done.stderr


def test_a_loop_xla_left_without_its_trip_count_is_counted_from_its_bounds():
    """XLA:GPU's collective pipelining peels an iteration off the microbatch loop and drops its
    known_trip_count: the walk and the kernel count read it from the loop's bounds (hlo.Module.trip_count:
    start, step, limit), so the step counts every microbatch's GEMMs, as without the flag."""
    cfg = tiny_config("parallel.mesh=fsdp=4", "parallel.microbatches=4", "parallel.precision=bf16")
    program = TrainProgram.from_config(cfg, devices=gpu_devices(4))
    plain = program.lower().compile().as_text()
    piped = program.lower().compile(compiler_options={"xla_gpu_enable_pipelined_all_gather": True,
                                                      "xla_gpu_enable_pipelined_reduce_scatter": True}).as_text()
    module = Module(piped)
    loops = [(comp, ins) for comp, instrs in module.comps.items() for ins in instrs.values() if ins.op == "while"]
    unknown = [module.trip_count(comp, ins) for comp, ins in loops if "known_trip_count" not in ins.line]
    assert unknown == [3]  # the microbatch loop, its first iteration peeled
    assert kernels.read(piped)["gemms"] == kernels.read(plain)["gemms"]


def test_a_gemms_flops_come_from_its_dots_shapes():
    """kernel_time on a compiled GPU program: one bf16 GEMM of [512, 256] x [256, 1024] is 2·m·n·k FLOPs
    at the bf16 peak (its shape's efficiency apart), and the step is the sum of its kernels' seconds."""
    m, k, n = 512, 256, 1024
    on_gpu = jax.sharding.SingleDeviceSharding(gpu_devices()[0])
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=on_gpu) for s in ((m, k), (k, n))]
    text = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(*args).compile().as_text()
    h100 = DEVICE_PROFILES["h100"]
    walk = kernel_time.StepTime(text, h100, {})
    step = walk.run(walk.module.entry)
    (gemm,) = [kernel for kernel in walk.launched if kernel[0] == "gemm"]
    shape = kernel_time.gemm_efficiency(m, n, k, h100["kernels"]) / h100["kernels"]["gemm_peak"]
    assert gemm[1] * h100["peak_flops"] * shape == pytest.approx(2 * m * n * k)
    costed = [t * kernel_time.kernel_seconds(kind, a, b, h100) for kind, a, b, t in walk.launched]
    assert step == pytest.approx(sum(costed))


def test_the_calibrated_step_time_of_a_held_out_measured_step_is_within_25_percent():
    """benchmarks/RESULTS.md, "A step time to book a pod on": llama_1b, batch 16, cuDNN attention,
    save_matmuls, one H200, measured 530.9 ms (JAX 0.11.2); not one of the rows the constants are
    fitted on (meshtrain/core/metrics.py, KERNEL_CONSTANTS). benchmarks/step_time.py checks every row."""
    from meshtrain.config.loader import load_config

    cfg = load_config(os.path.join(ROOT, "configs/llama_1b.yaml"),
                      ["parallel.mesh=1", "devices=0", "parallel.microbatches=1", "train.batch_size=16",
                       "parallel.attention=cudnn"])
    devices = compilers.choose("gpu", "h200", 1, 8).devices
    text = TrainProgram.from_config(cfg, devices=devices).lower().compile().as_text()
    predicted = kernel_time.step_time(text, DEVICE_PROFILES["h200"], {})["step_s"]
    assert predicted == pytest.approx(0.5309, rel=0.25)


def test_the_grouped_matmul_compiles_for_a_hopper_in_fp32_as_in_bf16():
    """fp32 operands take half bf16's K and N blocks (grouped_matmul_triton.py `most_blocks`): at bf16's
    blocks three pipeline stages of fp32 tiles asked XLA's GPU compiler for 257 KiB of an H100's 227 KiB
    of shared memory, and an fp32 MoE step on a GPU did not compile. Forward and both backward products,
    each one Triton kernel, in both dtypes."""
    from meshtrain.ops.grouped_matmul import grouped_matmul

    mesh = jax.sharding.Mesh(gpu_devices(1), ("one",))
    loss = lambda x, w, g: jnp.sum(grouped_matmul(x, w, g).astype(jnp.float32) ** 2)
    for dtype in (jnp.float32, jnp.bfloat16):
        shapes = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(mesh, P()))
                  for s, t in (((1024, 256), dtype), ((4, 256, 512), dtype), ((1024,), jnp.int32))]
        with jax.set_mesh(mesh):
            text = jax.jit(jax.grad(loss, (0, 1))).lower(*shapes).compile().as_text()
        assert kernels.read(text)["grouped_gemms"] == {"gmm": 1, "gmm_t": 1, "tgmm": 1}
    # the walk prices them at grouped_gemm_peak (metrics.py), not gemm_peak: with launches and bytes free,
    # the bf16 program's GEMM seconds are the grouped kernels' arithmetic alone, inverse to that share
    h100 = DEVICE_PROFILES["h100"]
    gemm_s = lambda share: kernel_time.step_time(text, {**h100, "hbm_bw": float("inf"), "kernels": {
        **h100["kernels"], "launch_s": 0.0, "grouped_gemm_peak": share}}, {})["by_kind_s"]["gemm"]
    assert gemm_s(0.2) == pytest.approx(2 * gemm_s(0.4)) and gemm_s(0.4) > 0
