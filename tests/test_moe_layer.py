"""models/experts.py and meshtrain/ops/grouped_matmul.py: a dense reference, capacity drops counted
in numpy, expert-parallel parity (outputs, stats, gradients) on 8 simulated devices, the all-to-alls
in the HLO, and the errors."""
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshtrain.ops.grouped_matmul as gmm_module
from meshtrain.config.loader import UserError
from meshtrain.models.experts import capacity, moe_mlp
from meshtrain.ops import block_exchange
from meshtrain.planner import hlo

B, L, D, F, K = 8, 8, 16, 32, 2


def make_inputs(E, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    router = rng.normal(size=(D, E)).astype(np.float32)
    w_gate = (rng.normal(size=(E, D, F)) / np.sqrt(D)).astype(np.float32)
    w_up = (rng.normal(size=(E, D, F)) / np.sqrt(D)).astype(np.float32)
    w_down = (rng.normal(size=(E, F, D)) / np.sqrt(F)).astype(np.float32)
    return x, router, w_gate, w_up, w_down


def routing(x, router):
    logits = jnp.einsum("bld,de->ble", x, router)
    probs = jax.nn.softmax(logits, axis=-1)
    top, expert = jax.lax.top_k(probs, K)
    return logits, probs, expert, top / jnp.sum(top, axis=-1, keepdims=True)


def numpy_keep(expert_BxLxK, E, cap):
    """Which assignments fit: per row, every first choice in position order, then every second..."""
    keep = np.zeros(expert_BxLxK.shape, bool)
    for b in range(expert_BxLxK.shape[0]):
        used = np.zeros(E, int)
        for j in range(K):
            for pos in range(expert_BxLxK.shape[1]):
                e = expert_BxLxK[b, pos, j]
                if used[e] < cap:
                    used[e] += 1
                    keep[b, pos, j] = True
    return keep


def dense_reference(x, router, w_gate, w_up, w_down, keep=None):
    """Every expert on every token; y sums the token's (kept) top-k, weighted by its gates."""
    E = router.shape[1]
    _, _, expert, gate = routing(x, router)
    out_ExBxLxD = jnp.stack([(jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]
                             for e in range(E)])
    y = jnp.zeros_like(x)
    for j in range(K):
        picked = jnp.take_along_axis(out_ExBxLxD, expert[None, :, :, j, None], axis=0)[0]
        w = gate[..., j] if keep is None else jnp.where(keep[..., j], gate[..., j], 0.0)
        y = y + w[..., None] * picked
    return y


def objective(fn, ct, shards=1):
    """A scalar that depends on y and on both router losses, for gradients; `shards`: this is
    one of that many equal row shards, whose sum is the whole batch's objective."""
    def loss(*args):
        y, stats = fn(*args)
        router_loss = 0.1 * stats["aux_loss"] + 0.01 * stats["z_loss"]
        return jnp.sum(y * ct) + router_loss / shards, (y, stats)

    return jax.value_and_grad(loss, argnums=range(5), has_aux=True)


def moe(capacity_factor):
    return lambda *a: moe_mlp(*a, experts_per_token=K, capacity_factor=capacity_factor)


def reference_moe(x, router, w_gate, w_up, w_down, keep=None):
    """The dense reference and the router losses, written from their definitions."""
    E = router.shape[1]
    logits, probs, expert, _ = routing(x, router)
    f_BxE = jax.nn.one_hot(expert, E).sum(axis=2).mean(axis=1) / K
    stats = {"aux_loss": jnp.mean(E * jnp.sum(f_BxE * probs.mean(axis=1), axis=-1)),
             "z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)}
    return dense_reference(x, router, w_gate, w_up, w_down, keep), stats


def assert_close(got, want, tol=1e-5):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=tol, rtol=tol), got, want)


@pytest.fixture
def small_tiles(monkeypatch):
    """Grouped-matmul tiles of 8 rows: several tiles per expert, and tiles that straddle experts."""
    monkeypatch.setattr(gmm_module, "GMM_TILE", 8)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_matches_dense_reference(capacity_factor, small_tiles):
    """Dropless (sorted, grouped matmuls) equals the dense top-k mixture; with capacity, the dense
    mixture of the kept assignments, with `dropped` as counted in numpy."""
    E = 4
    args = make_inputs(E)
    ct = np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)
    (_, (y, stats)), grads = jax.jit(objective(moe(capacity_factor), ct))(*args)

    expert = np.asarray(routing(*args[:2])[2])
    keep = numpy_keep(expert, E, capacity(L, E, K, capacity_factor))
    reference = jax.jit(objective(lambda *a: reference_moe(*a, keep), ct))
    (_, (ref_y, ref_stats)), ref_grads = reference(*args)
    assert_close(y, ref_y)
    assert_close({k: stats[k] for k in ref_stats}, ref_stats)
    assert_close(grads, ref_grads)
    assert float(stats["dropped"]) == pytest.approx(1 - keep.mean(), abs=1e-7)
    if capacity_factor == 0:
        assert float(stats["dropped"]) == 0.0
    else:
        assert float(stats["dropped"]) > 0
    load = np.bincount(expert.ravel(), minlength=E) / expert.size
    np.testing.assert_allclose(stats["load"], load, atol=1e-7)


def mesh_of(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def expert_parallel_objective(batch_spec, weight_spec, capacity_factor, ct):
    """objective(moe) with x's rows sharded by `batch_spec` and the expert weights by
    `weight_spec` (E over 'expert'); run it under jax.set_mesh."""
    def sharded(x, router, w_gate, w_up, w_down):
        x = jax.lax.with_sharding_constraint(x, batch_spec)
        w_gate, w_up, w_down = (jax.lax.with_sharding_constraint(w, weight_spec)
                                for w in (w_gate, w_up, w_down))
        return moe(capacity_factor)(x, router, w_gate, w_up, w_down)

    return jax.jit(objective(sharded, ct))


def collectives(hlo):
    """{op: count} of the collectives in compiled HLO text, and the leading dim of every
    all-to-all's operands."""
    ops = re.findall(r"[ )](all-to-all|all-gather|collective-permute|all-reduce|reduce-scatter)"
                     r"(?:-start)?\(", hlo)
    rows = {int(m) for line in hlo.splitlines() if re.search(r"[ )]all-to-all\(", line)
            for m in re.findall(r"f32\[(\d+),", line.split("all-to-all(")[0])}
    return {op: ops.count(op) for op in set(ops)}, rows


@pytest.mark.parametrize("shape, names, weight_spec", [
    ((2, 4), ("data", "expert"), P("expert")),
    ((2, 2, 2), ("data", "fsdp", "expert"), P("expert", "fsdp")),
])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_expert_parallel_matches_one_device(shape, names, weight_spec, capacity_factor, small_tiles):
    args = make_inputs(E=8)
    ct = np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)
    (_, (y, stats)), grads = jax.jit(objective(moe(capacity_factor), ct))(*args)
    fn = expert_parallel_objective(P(names), weight_spec, capacity_factor, ct)
    with jax.set_mesh(mesh_of(shape, names)):
        (_, (ep_y, ep_stats)), ep_grads = fn(*args)
    assert_close(ep_y, y)
    assert_close(ep_stats, stats)
    assert_close(ep_grads, grads)
    assert (float(stats["dropped"]) > 0) == (capacity_factor > 0)


@pytest.mark.parametrize("shape, names", [((4, 2), ("data", "tensor")), ((2, 2, 2), ("data", "tensor", "expert"))])
def test_dropless_experts_split_over_tensor_match_one_device(shape, names, small_tiles):
    """Experts split on F over 'tensor' (Megatron): each device's grouped matmuls give its F slice's
    partial sums, summed once after the combine, and the compiled layer all-reduces nothing inside
    the grouped matmuls' loops (before: the down projection's partial sums, and backward the gate's
    and up's input gradients, every (tile, expert) step); outputs, stats, gradients as on one device."""
    args = make_inputs(E=8)
    ct = np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)
    (_, (y, stats)), grads = jax.jit(objective(moe(0.0), ct))(*args)
    e = "expert" if "expert" in names else None

    def sharded(x, router, w_gate, w_up, w_down):  # the weights as the model holds them: F over tensor
        x = jax.lax.with_sharding_constraint(x, P(tuple(a for a in names if a != "tensor")))
        w_gate, w_up = (jax.lax.with_sharding_constraint(w, P(e, None, "tensor")) for w in (w_gate, w_up))
        return moe(0.0)(x, router, w_gate, w_up, jax.lax.with_sharding_constraint(w_down, P(e, "tensor")))

    fn = jax.jit(objective(sharded, ct))
    with jax.set_mesh(mesh_of(shape, names)):
        text = fn.lower(*args).compile().as_text()
        (_, (tp_y, tp_stats)), tp_grads = fn(*args)
    looped = [(r.name, r.times) for r in hlo.read(text, 8) if r.kind == "all-reduce" and r.times > 1]
    assert not looped, looped
    assert_close(tp_y, y)
    assert_close(tp_stats, stats)
    assert_close(tp_grads, grads)


def test_expert_parallel_hlo_has_all_to_all():
    """Two all-to-alls forward (slots out, results back), two more backward. With 'expert' the
    major batch axis, the rows enter the expert shard_map as they are (nothing gathered or
    permuted), and each all-to-all moves this device's rows only, not its whole data group's."""
    args = make_inputs(E=8)
    ct = np.ones((B, L, D), np.float32)
    mesh = mesh_of((2, 4), ("data", "expert"))
    for batch_axes in (("data", "expert"), ("expert", "data")):
        fn = expert_parallel_objective(P(batch_axes), P("expert"), 0.5, ct)
        with jax.set_mesh(mesh):
            ops, rows = collectives(fn.lower(*args).compile().as_text())
        assert ops.get("all-to-all", 0) >= 4, ops
        assert rows == {B // 8}, rows
        if batch_axes[0] == "expert":
            assert not ops.get("all-gather") and not ops.get("collective-permute"), ops


def ragged_all_to_all_as_documented(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                    axis_name):
    """jax.lax.ragged_all_to_all as its docstring states it (XLA:CPU has no kernel for it): slice i of a
    device's list goes to device i // (slices per device), which writes it at the offset the sender names
    (output_offsets, all_to_all'd), recv_sizes rows of it; the rest of `output` is kept. All NaN where
    the arguments break the docstring's rules: recv_sizes not the senders' send_sizes, a slice read or
    written past its array."""
    n = jax.lax.axis_size(axis_name)
    per = input_offsets.shape[0] // n
    me = jax.lax.axis_index(axis_name)
    operands, starts = jax.lax.all_gather(operand, axis_name), jax.lax.all_gather(input_offsets, axis_name)
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    broken = jnp.any(recv_sizes != jax.lax.all_to_all(send_sizes, axis_name, 0, 0, tiled=True))
    rows = jnp.arange(output.shape[0])
    result = output
    for i in range(n * per):
        src, k = i // per, me * per + i % per  # k: the slice of src's list addressed to this device
        broken |= (offsets[i] + recv_sizes[i] > output.shape[0]) | (starts[src, k] + recv_sizes[i] > operand.shape[0])
        inside = (rows >= offsets[i]) & (rows < offsets[i] + recv_sizes[i])
        taken = operands[src][jnp.clip(starts[src, k] + rows - offsets[i], 0, operand.shape[0] - 1)]
        result = jnp.where(inside.reshape(-1, *(1,) * (output.ndim - 1)), taken, result)
    return jnp.where(broken, jnp.nan, result)


def on_devices(n, fn, *args):
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])
    split = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P("x")))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(*map(split, args))


@pytest.mark.fast
def test_the_documented_ragged_all_to_all_reproduces_its_docstrings_example():
    """The reference the exchange is checked against gives jax.lax.ragged_all_to_all's own example."""
    def call(operand, output, *args):
        return ragged_all_to_all_as_documented(operand, output, *args, axis_name="x")

    got = on_devices(2, call, np.array([1, 2, 2, 3, 4, 0]), np.zeros(8, np.int32), np.array([0, 1, 0, 1]),
                     np.array([1, 2, 1, 1]), np.array([0, 0, 1, 2]), np.array([1, 1, 2, 1]))
    np.testing.assert_array_equal(got, [1, 3, 0, 0, 2, 2, 4, 0])


@pytest.mark.fast
def test_unfilled_is_an_allocation_on_gpus_and_zeros_elsewhere():
    """meshtrain/ops/unfilled.py: lowered for CUDA, XLA's AllocateBuffer and nothing else; on the CPU
    zeros, under jit, vmap and grad (no gradient flows to `after`)."""
    from meshtrain.ops.unfilled import unfilled

    make = lambda x: unfilled((4, 3), jnp.bfloat16, x)
    cuda = jax.jit(make).trace(jnp.ones(3)).lower(lowering_platforms=("cuda",)).as_text()
    assert [line.split("=", 1)[1].strip() for line in cuda.splitlines() if "stablehlo.custom_call" in line] == \
        ["stablehlo.custom_call @AllocateBuffer() : () -> tensor<4x3xbf16>"]
    assert not jax.jit(make)(jnp.ones(3)).any() and jax.vmap(make)(jnp.ones((2, 3))).shape == (2, 4, 3)
    grad = jax.grad(lambda x: jnp.sum(x * 2 + unfilled(x.shape, x.dtype, x)))(jnp.ones(3))
    np.testing.assert_array_equal(grad, [2.0, 2.0, 2.0])


def poisoned(shape, dtype, after):
    """block_exchange's receive buffer as a GPU may hand it over (`unfilled`: not filled), here all NaN,
    so that any use of a row no run wrote shows."""
    del after
    return jnp.full(shape, jnp.nan, dtype)


def ragged_exchange(f):
    """block_exchange's GPU exchange `f` with the documented ragged all-to-all and poisoned buffers."""
    return partial(f, op=ragged_all_to_all_as_documented, empty=poisoned)


@pytest.mark.fast
def test_the_ragged_exchange_moves_what_the_whole_blocks_do():
    """The dropless dispatch's exchange (meshtrain/ops/block_exchange.py) on 4 devices, each sending its
    8 packed rows at random among the devices, 0-8 to each (blocks of 8: 32 rows a device): the GPU's
    ragged all-to-alls (their offsets and sizes run through the documented semantics, into receive
    buffers poisoned with NaN) give the CPU's whole-block all-to-alls' numbers, forward and backward
    (the exchange's own VJP: each direction's transpose is the other). Block i of a dispatch holds the
    rows device i sent (past them: zeros on the CPU, the buffer's old values on a GPU); collect brings
    each row back to its place."""
    N, A, D, M = 4, 8, 3, 8
    rng = np.random.default_rng(0)
    sent_NxN = rng.multinomial(M, [1 / N] * N, size=N).astype(np.int32)  # [sender, receiver]: M a sender
    rows = rng.normal(size=(N * M, D)).astype(np.float32)
    cotangent = rng.normal(size=(N * M, D)).astype(np.float32)

    def run(ragged):
        go = ragged_exchange(block_exchange._ragged_dispatch) if ragged else block_exchange._dense_dispatch
        back = ragged_exchange(block_exchange._ragged_collect) if ragged else block_exchange._dense_collect

        def local(rows, sent, recv, ct):
            there = go(rows, sent, recv, block=A, axis="x")
            round_trip, vjp = jax.vjp(lambda r: back(go(r, sent, recv, block=A, axis="x") * 2, recv, sent,
                                                     rows=M, axis="x"), rows)
            return there.reshape(N * A, D), round_trip, vjp(ct)[0]
        return jax.device_get(on_devices(N, local, rows, sent_NxN.reshape(-1), sent_NxN.T.reshape(-1), cotangent))

    (there, round_trip, d_rows), (dense_there, *reference) = run(True), run(False)
    for got, want in zip((round_trip, d_rows), reference):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(round_trip, 2 * rows)
    np.testing.assert_array_equal(d_rows, 2 * cotangent)
    filled = np.zeros((N, N, A), bool)  # [receiver, sender, row of the block]
    for i in range(N):  # device i: what each sender s sent it
        for s in range(N):
            block, start, n = there.reshape(N, N, A, D)[i, s], sent_NxN[s, :i].sum(), sent_NxN[s, i]
            filled[i, s, :n] = True
            np.testing.assert_array_equal(block[:n], rows.reshape(N, M, D)[s, start:start + n])
    filled = filled.reshape(-1)
    np.testing.assert_array_equal(there[filled], dense_there[filled])
    assert np.isnan(there[~filled]).all() and not dense_there[~filled].any()


@pytest.mark.fast
@pytest.mark.parametrize("kernels", ["loop", "interpret"])
def test_expert_parallel_through_the_gpus_exchange_matches_one_device(monkeypatch, small_tiles, kernels):
    """Dropless experts on data=2 x expert=4 through the GPU's exchange (ragged all-to-alls run by their
    documented semantics, receive buffers poisoned with NaN as `unfilled` may hand them over on a GPU),
    the grouped matmuls on the loop or on the Triton kernels in Pallas' interpreter (which leave padding
    rows unwritten): outputs and gradients equal one device's, so no row past the runs reaches a result
    (the grouped matmuls mask them, forward and backward)."""
    import meshtrain.models.experts as experts_module

    monkeypatch.setattr(experts_module, "dispatch", ragged_exchange(block_exchange._ragged_dispatch))
    monkeypatch.setattr(experts_module, "collect", ragged_exchange(block_exchange._ragged_collect))
    monkeypatch.setattr(experts_module, "grouped_matmul", lambda x, w, g, rows, _, runs: gmm_module.grouped_matmul(
        x, w, g, rows, kernels, runs))
    args = make_inputs(E=8)
    ct = np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)
    (_, (y, stats)), grads = jax.jit(objective(moe(0.0), ct))(*args)
    fn = expert_parallel_objective(P(("data", "expert")), P("expert"), 0.0, ct)
    with jax.set_mesh(mesh_of((2, 4), ("data", "expert"))):
        (_, (ep_y, ep_stats)), ep_grads = fn(*args)
    assert_close(ep_y, y)
    assert_close(ep_stats, stats)
    assert_close(ep_grads, grads)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_expert_parallel_inside_a_data_shard_map(capacity_factor):
    """moe_mlp called where 'data' is already manual (as in the data-parallel and pipeline
    executors): the expert shard_map nests inside."""
    args = make_inputs(E=8)
    ct = np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)
    (_, (y, _)), grads = jax.jit(objective(moe(capacity_factor), ct))(*args)

    def per_shard(x, router, w_gate, w_up, w_down, ct):
        (_, (y, _)), g = objective(moe(capacity_factor), ct, shards=2)(x, router, w_gate, w_up, w_down)
        return y, g[0], jax.tree.map(lambda t: jax.lax.psum(t, "data"), g[1:])

    rows = P("data")
    fn = jax.jit(jax.shard_map(per_shard, in_specs=(rows,) + (P(),) * 4 + (rows,),
                               out_specs=(rows, rows, P()), axis_names={"data"}, check_vma=False))
    with jax.set_mesh(mesh_of((2, 4), ("data", "expert"))):
        ep_y, g_x, g_weights = fn(*args, ct)
    assert_close(ep_y, y)
    assert_close((g_x, *g_weights), grads)


@pytest.mark.fast
def test_errors():
    """E not divisible by the expert axis; rows not divisible by it."""
    args = make_inputs(E=6)
    with jax.set_mesh(mesh_of((2, 4), ("data", "expert"))):
        with pytest.raises(UserError, match="model.num_experts=6 .* 'expert' mesh axis \\(4\\)"):
            jax.jit(moe(0.0))(*args)
        x, *weights = make_inputs(E=8)
        with pytest.raises(UserError, match="batch rows"):
            jax.jit(moe(0.0))(x[:2], *weights)


@pytest.mark.fast
def test_grouped_matmul_matches_per_row_products(monkeypatch):
    """Small tiles so that tiles straddle groups, empty groups, a ragged last tile and padding rows
    (group >= G, output 0): y and the gradients equal the per-row products."""
    monkeypatch.setattr(gmm_module, "GMM_TILE", 4)
    rng = np.random.default_rng(0)
    G, M, Kd, N = 5, 23, 6, 7
    group = np.sort(rng.choice([0, 1, 3, 3, 4, G], size=M)).astype(np.int32)
    x = rng.normal(size=(M, Kd)).astype(np.float32)
    w = rng.normal(size=(G, Kd, N)).astype(np.float32)
    ct = rng.normal(size=(M, N)).astype(np.float32)

    def reference(x, w):
        y = jnp.einsum("mk,mkn->mn", x, jnp.take(w, jnp.minimum(group, G - 1), axis=0))
        return jnp.where((group < G)[:, None], y, 0)

    got = jax.value_and_grad(lambda x, w: jnp.sum(gmm_module.grouped_matmul(x, w, group) * ct), (0, 1))
    want = jax.value_and_grad(lambda x, w: jnp.sum(reference(x, w) * ct), (0, 1))
    assert_close(jax.jit(got)(x, w), want(x, w))


@pytest.mark.fast
def test_the_triton_kernels_match_per_row_products_in_pallas_interpreter():
    """The GPU's grouped matmul (meshtrain/ops/grouped_matmul_triton.py) run by Pallas' interpreter:
    3 tiles of 128 rows straddling groups, an empty group, padding rows and a ragged last tile; y, dx
    and dw (fp32, summed per group) equal the per-row products on every row of a group (padding rows:
    0 on the loop, not written by the kernels). Widths the blocks do not divide down to 16 stay on the
    loop (`fits`). The loop alike; and both on two sorted runs (`runs`)."""
    from meshtrain.ops import grouped_matmul_triton as triton

    rng = np.random.default_rng(1)
    G, M, Kd, N = 6, 300, 32, 48
    group = np.sort(rng.choice([0, 1, 1, 3, 4, 5, G], size=M)).astype(np.int32)
    x, w = rng.normal(size=(M, Kd)).astype(np.float32), rng.normal(size=(G, Kd, N)).astype(np.float32)
    ct = rng.normal(size=(M, N)).astype(np.float32)

    def loss(matmul, expert):  # sum(y ct) over the rows of a group: value, dx on those rows, dw
        real = (expert < G)[:, None]
        grad = jax.value_and_grad(lambda x, w: jnp.sum(jnp.where(real, matmul(x, w), 0) * ct), (0, 1))

        def value_dx_dw(x, w):
            value, (dx, dw) = grad(x, w)
            return value, dx[real[:, 0]], dw
        return value_dx_dw

    per_row = lambda expert: lambda x, w: jnp.einsum("mk,mkn->mn", x, jnp.take(w, jnp.minimum(expert, G - 1), axis=0))
    for kernels in ("interpret", "loop"):
        got = loss(lambda x, w, k=kernels: gmm_module.grouped_matmul(x, w, group, None, k), group)
        assert_close(got(x, w), loss(per_row(group), group)(x, w))
    # two runs, each sorted with its padding last (an expert-parallel receive buffer of 2 senders):
    # ids r (G + 1) + j, no sort, the same products
    cut = 170
    ids = np.concatenate([group[:cut], (G + 1) + group[cut:]]).astype(np.int32)
    ids[cut - 20:cut] = G  # the first run's padding
    expert = ids % (G + 1)  # G: padding
    pad = (expert == G)[:, None]
    for kernels in ("interpret", "loop"):
        matmul = lambda x, w, k=kernels: gmm_module.grouped_matmul(x, w, ids, None, k, 2)
        assert_close(loss(matmul, expert)(x, w), loss(per_row(expert), expert)(x, w))
        # padding rows may hold anything on a GPU (the unfilled receive blocks): NaN there, in x and in
        # the output cotangent, changes no row of a group, nor dw
        (y, pullback), (clean_y, clean_pullback) = jax.vjp(matmul, np.where(pad, np.nan, x), w), jax.vjp(matmul, x, w)
        (dx, dw), (clean_dx, clean_dw) = pullback(np.where(pad, np.nan, ct)), clean_pullback(np.where(pad, 0, ct))
        real = ~pad[:, 0]
        assert_close((y[real], dx[real], dw), (clean_y[real], clean_dx[real], clean_dw))
        if kernels == "loop":
            assert not np.asarray(clean_y)[~real].any()
    assert triton.fits(Kd, N) and not triton.fits(6, 7) and triton.block(48, 128) == 16


def test_dropless_memory_is_flat_in_experts():
    """Dropless temporaries (forward and backward, weights as arguments) barely grow from 8 to 32
    experts at top-2 beyond two weight-sized arrays: the sorted buffer holds B*L*K rows, not B*E*L (at
    these sizes the E-slot buffer's took 5.0 -> 20.1 MiB, 4.0x; sorted 1.97 -> 1.99 MiB, and 2.09 ->
    3.24 MiB since gate and up run as one grouped matmul of both weights side by side, `gate_and_up`:
    that stack [E, D, 2F] and its gradient are as large as the weights)."""
    Bm, Lm, Dm, Fm = 2, 128, 128, 32

    def temp(E):
        def loss(x, *weights):
            y, stats = moe(0.0)(x, *weights)
            return jnp.sum(y) + stats["aux_loss"]
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        compiled = jax.jit(jax.grad(loss, argnums=range(5))).lower(
            f32(Bm, Lm, Dm), f32(Dm, E), f32(E, Dm, Fm), f32(E, Dm, Fm), f32(E, Fm, Dm)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    stacked = lambda E: 2 * E * Dm * 2 * Fm * 4  # gate and up side by side, and its gradient (fp32)
    assert temp(32) - stacked(32) < 1.3 * (temp(8) - stacked(8))


def test_balance_loss_against_hugging_faces():
    """docs/huggingface.md's table: on one sequence row of one layer, Hugging Face's balance loss
    (load_balancing_loss_func, Mixtral's and Qwen3-MoE's) is k x ours; over several rows it is taken
    over the batch at once, ours per row."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    E = 4
    x, router, *experts = make_inputs(E)
    ours = lambda rows: float(moe(0.0)(x[rows], router, *experts)[1]["aux_loss"])
    logits = lambda rows: torch.tensor(np.einsum("bld,de->ble", x[rows], router).reshape(-1, E))
    theirs = lambda rows: float(load_balancing_loss_func((logits(rows),), E, K))
    one_row, batch = slice(0, 1), slice(None)
    assert theirs(one_row) == pytest.approx(K * ours(one_row), rel=1e-5)
    print(f"one row: HF {theirs(one_row):.5f}, k x ours {K * ours(one_row):.5f}; "
          f"the batch: HF {theirs(batch):.5f}, k x ours {K * ours(batch):.5f}")
    assert abs(theirs(batch) - K * ours(batch)) > 1e-2
