"""Packed documents and sliding windows (meshtrain/ops/packing.py): every attention backend against a
dense reference mask (fp32, 1e-5), the ring's exchanges under a window (counted, and in the compiled
HLO), and a packed batch trained as its documents one by one: the same per-token logits and
gradients on one device, under context parallelism and through a pipeline."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshtrain.ops.attention as attention_lib
from meshtrain.config.loader import UserError
from meshtrain.models import LanguageModel
from meshtrain.objectives.next_token import make_loss_fn
from meshtrain.ops import ring_schedule
from meshtrain.ops.attention import BACKENDS, blockwise_attention, executed_attention, xla_attention
from meshtrain.ops.context_parallel import ring_attention
from meshtrain.ops.packing import Packing, packing_of, visible
from meshtrain.ops.ring_schedule import load_balanced_order
from meshtrain.planner import hlo
from meshtrain.testing import value_and_grads

B, L, H, G, K = 2, 64, 4, 2, 8
EOS = 0


def mesh_of(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def reference(q, k, v, segments=None, window=0):
    """Attention with the dense [L, L] mask `visible` gives, in true order, the textbook way."""
    n = q.shape[1]
    pos = jnp.arange(n)
    segs = () if segments is None else (segments[:, None, None, :, None], segments[:, None, None, None, :])
    mask = visible(pos[:, None], pos[None, :], window, *segs)
    q5 = q.reshape(q.shape[0], n, G, H // G, K)
    s = jnp.einsum("blgrk,bmgk->bgrlm", q5, k) * K ** -0.5
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bgrlm,bmgk->blgrk", jax.nn.softmax(s, axis=-1), v).reshape(q.shape)


def inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, L, H, K))
    k, v = (jax.random.normal(key, (B, L, G, K)) for key in keys[1:3])
    cot = jax.random.normal(keys[3], (B, L, H, K))
    # documents of 1 to 20 tokens: EOS ends each (row 0 starts mid-document, row 1 with a 1-token one)
    tokens = jax.random.randint(keys[4], (B, L), 1, 50)
    tokens = tokens.at[0, jnp.array([5, 6, 25, 44])].set(EOS).at[1, jnp.array([0, 17, 37, 38, 63])].set(EOS)
    return q, k, v, cot, Packing(EOS).documents(tokens).segments


def assert_close(got, want):
    (got_out, got_grads), (want_out, want_grads) = got, want
    np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip((got_out, *got_grads), (want_out, *want_grads)))


MASKS = [(False, 5), (True, 0), (True, 13)]  # (segments, window)


@pytest.mark.fast
def test_documents_segments_and_positions():
    tokens = jnp.array([[3, 4, EOS, 5, EOS, EOS, 6, 7]])
    docs = Packing(EOS).documents(tokens)
    assert docs.segments.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]  # a token after an EOS starts a document
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert Packing(EOS, restart_positions=False).documents(tokens).positions is None
    order = load_balanced_order(8, 2)
    stored = Packing(EOS).documents(tokens, order)
    assert stored.segments.tolist() == [docs.segments[0, order].tolist()]


@pytest.mark.parametrize("backend,segmented,window", [(b, *m) for b in ("xla", "blockwise") for m in MASKS]
                         + [("ring-one-device", True, 13)])
def test_local_kernels_match_the_dense_mask(backend, segmented, window):
    q, k, v, cot, segments = inputs()
    segments = segments if segmented else None
    kernel = {"xla": xla_attention,
              "blockwise": lambda *a, **kw: blockwise_attention(*a, block=8, **kw),
              "ring-one-device": lambda q, k, v, **kw: ring_attention(q, k, v, np.arange(L), **kw)}[backend]
    got = jax.jit(lambda *a: value_and_grads(lambda q, k, v: kernel(q, k, v, segment_ids=segments,
                                                                     window=window), *a))(q, k, v, cot)
    want = value_and_grads(lambda q, k, v: reference(q, k, v, segments, window), q, k, v, cot)
    print(f"{backend} segments={segmented} window={window}: max |diff| {assert_close(got, want):.2e}")


@pytest.mark.parametrize("cp,ring_block,segmented,window", [(8, 512, True, 13), (4, 4, True, 5), (4, 4, True, 1),
                                                            (4, 4, False, 40)])
def test_ring_matches_the_dense_mask(cp, ring_block, segmented, window, monkeypatch):
    """The ring on a `context` axis of cp (chunks of L / 2cp positions, sub-blocks of ring_block),
    in storage order, against the reference in true order; windows that need 1 or 3 chunks back,
    only the own block (1) or the whole ring (40). (Segments without a window: the model's ring
    test below.)"""
    monkeypatch.setattr(ring_schedule, "RING_BLOCK", ring_block)
    q, k, v, cot, segments = inputs()
    segments = segments if segmented else None
    positions = load_balanced_order(L, cp)
    inverse = np.argsort(positions)
    mesh = mesh_of((cp,), ("context",))

    def attend(q, k, v):
        stored = [x[:, positions] for x in (q, k, v)]
        segs = None if segments is None else segments[:, positions]
        return ring_attention(*stored, positions, segment_ids=segs, window=window)[:, inverse]

    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: value_and_grads(attend, *a))(q, k, v, cot)
    want = value_and_grads(lambda q, k, v: reference(q, k, v, segments, window), q, k, v, cot)
    print(f"ring cp={cp} segments={segmented} window={window}: max |diff| {assert_close(got, want):.2e}")


@pytest.mark.fast
@pytest.mark.parametrize("cp,window,exchanges", [(8, 0, 7), (8, 5, 2), (8, 9, 4), (8, 13, 6), (8, 17, 7),
                                                 (8, 1, 0), (4, 5, 2), (4, 9, 2), (4, 10, 3), (2, 5, 1)])
def test_a_short_window_skips_ring_exchanges(cp, window, exchanges):
    """L = 64: chunks of 64 / 2cp positions; a window reaching D chunks back needs 2D < cp - 1
    exchanges (D each way round the ring), else the whole ring."""
    assert ring_schedule.ring_exchanges(L, cp, window) == exchanges


@pytest.mark.fast
@pytest.mark.parametrize("cp,window", [(8, 0), (8, 5), (8, 13), (4, 9), (1, 7)])
def test_computed_fraction_counts_what_the_window_leaves(cp, window, monkeypatch):
    """Ring steps x chunk pairs x needed sub-blocks, in true positions: every visible (query, key)
    once, and the share `computed_fraction` (and so the roofline's executed_attention) reports."""
    monkeypatch.setattr(ring_schedule, "RING_BLOCK", 2)
    positions = load_balanced_order(L, cp).reshape(cp, 1 if cp == 1 else 2, -1)
    Lc = positions.shape[-1]
    S = ring_schedule.sub_block(Lc)
    steps = [0] + [t for _, ts in ring_schedule.ring_legs(cp, Lc, window) for t in ts]
    computed, visited = 0, np.zeros((L, L), int)
    for me in range(cp):
        for t in steps:
            src = (me - t) % cp
            for qc, kc, causal in ring_schedule.step_pairs(me, t, cp):
                for i, j, _ in ring_schedule.sub_block_pairs(Lc // S, causal):
                    q = positions[me, qc, i * S:(i + 1) * S][:, None]
                    k = positions[src, kc, j * S:(j + 1) * S][None, :]
                    if window and q.min() - k.max() >= window:
                        continue  # wholly outside the window: skipped
                    shown = np.broadcast_to(visible(q, k, window), (S, S))
                    np.add.at(visited, (np.broadcast_to(q, (S, S))[shown], np.broadcast_to(k, (S, S))[shown]), 1)
                    computed += S * S
    pos = np.arange(L)
    assert (visited == visible(pos[:, None], pos[None, :], window)).all()
    fraction = ring_schedule.computed_fraction(L, cp, window)
    assert computed / L**2 == pytest.approx(fraction)
    assert executed_attention("ring", L, cp, window)[1] == pytest.approx(fraction) or cp == 1
    if window:
        assert fraction < ring_schedule.computed_fraction(L, cp)


@pytest.mark.fast
def test_blockwise_share_under_a_window(monkeypatch):
    import meshtrain.ops.attention as attention_lib

    monkeypatch.setattr(attention_lib, "ATTENTION_BLOCK", 8)  # 8 blocks of 8
    assert executed_attention("blockwise", L)[1] == pytest.approx(9 / 16)
    # window 9: block i needs key blocks i and i - 1 (distance 1..15 reaches), 8 + 7 of the 64
    assert executed_attention("blockwise", L, window=9)[1] == pytest.approx(15 / 64)


@pytest.mark.parametrize("cp,window", [(8, 5), (4, 10)])
def test_compiled_ring_sends_what_ring_sends_counts(cp, window):
    """Forward and backward of the ring, compiled (window 5 on 8 devices: two legs of 1 exchange;
    10 on 4: the whole ring): 2 collective-permutes (K and V) per K/V send and per dK/dV send; the
    backward's first K/V send of each leg is the forward's own (XLA keeps one)."""
    mesh = mesh_of((cp,), ("context",))
    positions = load_balanced_order(L, cp)
    shard = NamedSharding(mesh, P(None, "context"))
    args = [jax.ShapeDtypeStruct((B, L, n, K), jnp.float32, sharding=shard) for n in (H, G, G)]
    segments = jnp.zeros((B, L), jnp.int32)

    def loss(q, k, v):
        return jnp.sum(ring_attention(q, k, v, positions, segment_ids=segments, window=window))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    found = hlo.collectives(text, cp)
    sends = ring_schedule.ring_sends(L, cp, window)
    assert found["collective-permute"]["count"] == 2 * (2 * sends["kv"] - sends["legs"] + sends["grads"])
    assert sends["kv"] == ring_schedule.ring_exchanges(L, cp, window)
    assert found["all-gather"]["count"] == 0  # the segment ids are read where they are, never gathered


@pytest.mark.fast
def test_document_mask_needs_an_eos():
    from meshtrain.config.spec import DataConfig

    assert packing_of(DataConfig(), None) is None  # off by default: GPT-style, attend across documents
    assert packing_of(DataConfig(document_mask=True), 7) == Packing(7, True)
    assert packing_of(DataConfig(document_mask=True, eos_id=10, restart_positions=False), 7) == Packing(10, False)
    with pytest.raises(UserError, match=r"data.document_mask=true needs an EOS id.*set data.eos_id"):
        packing_of(DataConfig(document_mask=True), None)
    with pytest.raises(UserError, match=r"data.eos_id=300 is outside model.vocab_size=256"):
        tiny_config("data.document_mask=true", "data.eos_id=300")
    from meshtrain.run.trainer import Trainer

    with pytest.raises(UserError, match=r"data.document_mask=true needs an EOS id"):  # synthetic data: no tokenizer
        Trainer(tiny_config("data.document_mask=true"))


def test_the_eval_command_splits_a_masked_run_at_its_tokenizers_eos(tmp_path):
    """data.document_mask with no data.eos_id and a tokenizer that has an EOS (a trained BPE): the run
    splits at the tokenizer's EOS, and `meshtrain.eval` reads the run with the same split (it asked
    for data.eos_id), reproducing the run's eval_loss."""
    from meshtrain.data import tokenizer
    from meshtrain.eval import load, validation
    from meshtrain.run.loggers import MetricsLog
    from meshtrain.run.trainer import Trainer

    text = "To be, or not to be, that is the question. " * 40
    tok = tokenizer.train_bpe([text], 300, tmp_path / "tokenizer.json")
    (tmp_path / "text.txt").write_text(text * 20)
    cfg = tiny_config("model.vocab_size=300", f"data.path={tmp_path / 'text.txt'}", "data.kind=auto",
                      f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.document_mask=true", "train.steps=2",
                      "train.eval_every=2", "train.eval_batches=1", "parallel.mesh=1", out=str(tmp_path / "run"))
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    logged = [r["eval_loss"] for r in trainer.fit(log=MetricsLog(primary=False)) if "eval_loss" in r]
    assert trainer.program.model.packing == Packing(tok.eos_id, True) and tok.eos_id is not None
    loaded = load(run=str(tmp_path / "run"), mesh="1", devices=jax.devices()[:1])
    assert loaded.program.model.packing == trainer.program.model.packing
    assert validation(loaded, 1)["eval_loss"] == pytest.approx(logged[-1], abs=1e-5)


# ---- the model: a packed batch against its documents one by one ----
SEQ = 32  # divisible by 2 x 8 for the ring on 8 devices
DOC_LENGTHS = [(9, 11, 12), (4, 20, 8)]  # per row; every document ends with EOS


@pytest.fixture(scope="module")
def packed():
    """(model spec, params, tokens [2, SEQ + 1] of packed documents, the documents [(row, start,
    length)])."""
    spec = tiny_config().model
    params = LanguageModel(spec).init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, spec.vocab_size, (2, SEQ + 1))
    docs = []
    for row, lengths in enumerate(DOC_LENGTHS):
        start = 0
        for n in lengths:
            tokens[row, start + n - 1] = EOS
            docs.append((row, start, n))
            start += n
    return spec, params, jnp.asarray(tokens, jnp.int32), docs


def token_losses(logits_BxLxV, targets_BxL):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_BxLxV), targets_BxL[..., None], axis=-1)[..., 0]


def within_documents(docs, shape):
    """1 where a position's target is in its own document (the input is not the document's EOS)."""
    mask = np.zeros(shape, np.float32)
    for row, start, n in docs:
        mask[row, start:start + n - 1] = 1
    return jnp.asarray(mask)


@pytest.mark.parametrize("kernel", ["xla", "blockwise"])
def test_packed_batch_equals_documents_alone(packed, kernel, monkeypatch):
    """Per-token losses of the packed batch (document mask, positions restarting) equal those of
    each document run alone (its own row, padded after its end: causal attention never reads the
    padding), and so do the gradients of their sum."""
    monkeypatch.setattr(attention_lib, "ATTENTION_BLOCK", 8)  # 4 blocks of 8 over the 32 positions
    spec, params, tokens, docs = packed
    model = LanguageModel(spec, attention=BACKENDS[kernel], packing=Packing(EOS))
    alone_model = LanguageModel(spec)
    alone = np.ones((len(docs), SEQ + 1), np.int32)  # padding: token 1
    for d, (row, start, n) in enumerate(docs):
        alone[d, :n + 1] = tokens[row, start:start + n + 1]  # the document and the target after its EOS
    alone = jnp.asarray(alone)
    alone_docs = [(d, 0, n) for d, (_, _, n) in enumerate(docs)]

    def packed_loss(params):
        losses = token_losses(model.apply(params, tokens[:, :-1], model.documents(tokens)), tokens[:, 1:])
        return jnp.sum(losses * within_documents(docs, losses.shape)), losses

    def alone_loss(params):
        losses = token_losses(alone_model.apply(params, alone[:, :-1]), alone[:, 1:])
        return jnp.sum(losses * within_documents(alone_docs, losses.shape)), losses

    (_, got), got_grads = jax.jit(jax.value_and_grad(packed_loss, has_aux=True))(params)
    (_, want), want_grads = jax.jit(jax.value_and_grad(alone_loss, has_aux=True))(params)
    diff = 0.0
    for d, (row, start, n) in enumerate(docs):  # every position of the document, its EOS's too
        np.testing.assert_allclose(got[row, start:start + n], want[d, :n], atol=1e-5, rtol=1e-5)
        diff = max(diff, float(jnp.max(jnp.abs(got[row, start:start + n] - want[d, :n]))))
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        diff = max(diff, float(jnp.max(jnp.abs(a - b))))
    print(f"{kernel}: packed vs alone, max |diff| of per-token losses and grads {diff:.2e}")
    plain = jax.jit(lambda p: token_losses(alone_model.apply(p, tokens[:, :-1]), tokens[:, 1:]))(params)
    assert not np.allclose(plain[0, 9:20], got[0, 9:20], atol=1e-3)  # without the mask: not the same


def loss_and_grads(model, params, tokens):
    return jax.jit(jax.value_and_grad(make_loss_fn(model, "fp32"), has_aux=True))(params, tokens)


def assert_same_step(got, want, label):
    (_, got_metrics), got_grads = got
    (_, want_metrics), want_grads = want
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)
    diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads))]
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    print(f"{label}: loss {float(got_metrics['loss']):.6f} vs {float(want_metrics['loss']):.6f}, "
          f"max |grad diff| {max(diffs):.2e}")


def test_packed_batch_under_context_parallelism(packed):
    """The ring on 8 devices (`context` axis, load-balanced order, segment ids permuted with the
    sequence) computes the one-device packed loss and gradients."""
    spec, params, tokens, _ = packed
    want = loss_and_grads(LanguageModel(spec, packing=Packing(EOS)), params, tokens)
    model = LanguageModel(spec, attention=BACKENDS["ring"], sequence_order=load_balanced_order(SEQ, 8),
                          packing=Packing(EOS))
    with jax.set_mesh(mesh_of((8,), ("context",))):
        got = loss_and_grads(model, params, tokens)
    assert_same_step(got, want, "ring, context=8")


@pytest.mark.parametrize("schedule,residuals", [("zb", "save"), ("gpipe", "recompute")])
def test_packed_batch_through_a_pipeline(packed, schedule, residuals):
    """Two pipeline stages (4 microbatches, segment ids travelling with each: to the saved
    forward and its pullback, zb's deferred weight gradient, the recomputed forward) compute the
    one-device packed loss and gradients. (1F1B's actions are zb's, less the deferral.)"""
    from meshtrain.engine.pipeline_step import make_pipeline_grads
    from meshtrain.engine.program import TrainProgram
    from meshtrain.parallel.batching import StepInputs

    spec, params, tokens, _ = packed
    tokens = jnp.tile(tokens, (2, 1))  # 4 rows: 4 microbatches of 1
    want = loss_and_grads(LanguageModel(spec, packing=Packing(EOS)), params, tokens)
    cfg = tiny_config("parallel.mesh=pipeline=2", f"parallel.schedule={schedule}", "parallel.microbatches=4",
                      f"parallel.residuals={residuals}",
                      f"train.seq_len={SEQ}", "train.batch_size=4")
    program = TrainProgram(cfg.model, cfg.parallel, cfg.optim, cfg.train, jax.devices()[:2], Packing(EOS))
    param_specs = jax.tree.map(lambda s: s.spec, program.state_shardings["params"])
    grads_fn = make_pipeline_grads(program.model, cfg.parallel, program.mesh, param_specs, program.grad_specs,
                                   program.objective)
    with program.context():
        out = jax.jit(grads_fn)(params, StepInputs({"tokens": tokens}, {}))
    assert_same_step(((None, out.metrics), out.grads), want, f"pipeline=2 {schedule} residuals={residuals}")
