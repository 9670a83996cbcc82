"""meshtrain/generate.py and the cached forward (LanguageModel.decode): greedy cached decoding equals
the argmax of repeated full forwards (llama, dropless moe, a sliding window), sampling is
reproducible from its seed, top-k/top-p filter what they claim, eos stops a row, a sharded mesh
generates what one device does, and the CLI prints text or a one-line error."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MOE_TINY, TINY, tiny_config

from meshtrain.engine.decode import filter_logits, generate, place
from meshtrain.generate import main
from meshtrain.models import FAMILIES
from meshtrain.parallel.mesh import build_mesh, parse_mesh
from meshtrain.testing import full_forward_greedy

NEW = 6


@functools.cache
def tiny(family):
    """One model object per family for the whole module, so the jitted programs are reused."""
    cfg = tiny_config(config={"llama": TINY, "moe": MOE_TINY}[family]).model
    model = FAMILIES[family](cfg)
    rng = np.random.default_rng(0)  # host-side weights: compiling the initializers takes seconds here

    def weight(path, shape):
        if path[-1].key == "scale":
            return jnp.ones(shape.shape)
        fan_in = shape.shape[1] if path[0].key == "blocks" else 1
        return jnp.asarray(rng.normal(size=shape.shape) / np.sqrt(fan_in), jnp.float32)

    return model, jax.tree_util.tree_map_with_path(weight, jax.eval_shape(model.init, jax.random.key(0)))


@pytest.fixture(params=["llama", "moe"])
def model_and_params(request):
    return tiny(request.param)


def prompts(lengths=(5, 9, 2), seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).astype(np.int32) for n in lengths]


def test_cached_greedy_equals_full_forward_argmax(model_and_params):
    model, params = model_and_params  # moe_tiny is dropless (capacity_factor 0)
    rows = prompts()
    got = generate(model, params, rows, NEW)
    for a, b in zip(got, full_forward_greedy(model, params, rows, NEW)):
        np.testing.assert_array_equal(a, b)


def test_chunked_prefill_equals_one_pass():
    """Prompts longer than the prefill chunk (9 positions in chunks of 4, the last chunk padded) are
    prefilled chunk by chunk and decode exactly as the full forward does; a sliding window too."""
    model, params = tiny("llama")
    rows = prompts()
    for a, b in zip(generate(model, params, rows, NEW, prefill_chunk=4), full_forward_greedy(model, params, rows, NEW)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(generate(model, params, rows, NEW, window=3, prefill_chunk=4),
                    generate(model, params, rows, NEW, window=3)):
        np.testing.assert_array_equal(a, b)


def test_moe_decodes_dropless_whatever_the_capacity():
    model, params = tiny("moe")
    capped = FAMILIES["moe"](tiny_config("model.capacity_factor=0.5", config=MOE_TINY).model)
    rows = prompts()
    for a, b in zip(generate(capped, params, rows, NEW), generate(model, params, rows, NEW)):
        np.testing.assert_array_equal(a, b)


def test_window_equals_sliding_window_full_forward():
    window = 4

    def banded(q, k, v, positions_L=None):  # each query sees itself and the window - 1 before it
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0))

    model, params = tiny("llama")
    rows = prompts((7, 3))
    reference = full_forward_greedy(FAMILIES["llama"](model.cfg, attention=banded), params, rows, NEW)
    for a, b in zip(generate(model, params, rows, NEW, window=window), reference):
        np.testing.assert_array_equal(a, b)
    assert any((a != b).any() for a, b in zip(generate(model, params, rows, NEW), reference))


def test_sampling_is_reproducible_from_seed(model_and_params):
    model, params = model_and_params
    rows = prompts()
    sample = lambda seed, **kw: np.stack(generate(model, params, rows, NEW, temperature=1.0, seed=seed, **kw))
    np.testing.assert_array_equal(sample(0), sample(0))
    assert (sample(0) != sample(1)).any()
    greedy = np.stack(generate(model, params, rows, NEW))
    np.testing.assert_array_equal(sample(3, top_k=1), greedy)
    assert (sample(0) != greedy).any()


def test_top_k_and_top_p_keep_what_they_claim():
    probs = np.array([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = jnp.log(jnp.asarray(probs))[None]
    kept = lambda **kw: set(np.flatnonzero(np.isfinite(np.asarray(filter_logits(logits, **kw)[0]))))
    assert kept(top_p=0.4) == {1}  # 0.5 >= 0.4 alone
    assert kept(top_p=0.75) == {1, 3}  # 0.5 + 0.3
    assert kept(top_p=0.9) == {1, 3, 2}  # 0.95
    assert kept(top_p=0.99) == kept(top_p=1.0) == {0, 1, 2, 3}
    assert kept(top_k=2) == {1, 3}
    assert kept(top_k=3, top_p=0.6) == {1, 3}
    assert kept(top_k=1000) == {0, 1, 2, 3}
    kept_logits = np.asarray(filter_logits(logits, top_p=0.75)[0])
    np.testing.assert_allclose(kept_logits[[1, 3]], np.log(probs[[1, 3]]), rtol=1e-6)  # not renormalised here


def test_eos_stops_each_row():
    model, params = tiny("llama")
    rows = prompts()
    free = generate(model, params, rows, NEW)
    eos = int(free[0][2])
    for cut, row in zip(generate(model, params, rows, NEW, eos_id=eos), free):
        stop = np.flatnonzero(row == eos)
        np.testing.assert_array_equal(cut, row[:stop[0]] if len(stop) else row)
    assert len(generate(model, params, rows, NEW, eos_id=eos)[0]) == np.flatnonzero(free[0] == eos)[0] < NEW


def test_ids_beyond_the_tokenizer_are_never_produced():
    """A model vocabulary larger than its tokenizer's (a byte tokenizer's 256 ids padded to 320 is the
    common case; here the tiny model's 256 over a 200-id tokenizer, reusing its compiled program):
    ids from `vocab` up get logit -inf, greedy or sampled; greedy picks the argmax over the rest."""
    model, params = tiny("llama")
    vocab = 200
    params = {**params, "embedding": params["embedding"].at[vocab:].multiply(5.0)}  # (tied head) they win
    rows = prompts()
    assert (np.concatenate(generate(model, params, rows, NEW)) >= vocab).any()  # unrestricted: produced
    greedy = generate(model, params, rows, NEW, vocab=vocab)
    sampled = generate(model, params, rows, NEW, vocab=vocab, temperature=1.0, seed=1)
    assert all((row < vocab).all() for row in greedy + sampled)
    buf = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        buf[b, :len(row)] = row
    logits = np.asarray(jax.jit(model.apply)(params, buf))
    assert [int(row[0]) for row in greedy] == [int(logits[b, len(r) - 1, :vocab].argmax()) for b, r in enumerate(rows)]


@pytest.mark.parametrize("family,mesh", [("llama", "data=2,tensor=2"), ("moe", "expert=2,tensor=2")])
def test_sharded_generation_equals_one_device(family, mesh):
    model, params = tiny(family)
    devices = jax.devices()[:4]
    mesh = build_mesh(parse_mesh(mesh, 4), devices)
    sharded = place(model, mesh, params=params)
    assert sharded["blocks"]["wq"].sharding.spec[2] == "tensor"
    rows = prompts()  # 3 rows: padded to 4 on the mesh
    for kw in ({}, {"temperature": 1.0, "top_k": 20, "seed": 2}):
        one = generate(model, params, rows, NEW, **kw)
        for a, b in zip(generate(model, sharded, rows, NEW, mesh=mesh, **kw), one):
            np.testing.assert_array_equal(a, b)


def test_cli_prints_text_and_errors(reference_run, capsys):
    run = str(reference_run[0].out)
    assert main(["--run", run, "--prompt", "ab", "--prompt", "hello", "--max-new-tokens", "4",
                 "--tokenizer", "byte", "--temperature", "0.8", "--top-p", "0.9"]) == 0
    out = capsys.readouterr().out.split("\n\n")
    assert out[0].startswith("ab") and out[1].startswith("hello")
    for argv, message in [(["--mesh", "data=-1,pipeline=2"], "--mesh tensor=2"),
                          (["--top-p", "0"], "argument --top-p: 0 must be in (0, 1]"),
                          (["--prompt", "x" * 17], "longer than the run's context (train.seq_len=16)"),
                          (["--run", run + "/nowhere"], "no config.yaml")]:
        assert main(["--run", run, "--prompt", "ab", "--tokenizer", "byte", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_half_precision_generation_places_the_cast_checkpoint_and_plans_half_the_cache(reference_run, capsys):
    """generate --precision bf16 (generate.precision): the verified checkpoint is read on the host and
    placed already cast, so the mesh holds bf16 weights equal to the fp32 ones cast; the planner's
    generation holds half the KV cache bytes and less memory than fp32's."""
    from meshtrain.engine.program import TrainProgram
    from meshtrain.generate import load
    from meshtrain.ops.precision import cast_for_compute
    from meshtrain.planner.aot import generation_memory

    run = str(reference_run[0].out)
    model, held, mesh, _ = load(run, "data=-1,tensor=2", precision="bf16")
    full = load(run, "data=-1,tensor=2")[1]
    assert {x.dtype for x in jax.tree.leaves(held)} == {jnp.dtype(jnp.bfloat16)}
    assert held["blocks"]["wq"].sharding.spec[2] == "tensor"
    for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(cast_for_compute(full, "bf16"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert main(["--run", run, "--prompt", "ab", "--max-new-tokens", "4", "--tokenizer", "byte",
                 "--precision", "bf16"]) == 0 and capsys.readouterr().out.startswith("ab")
    plans = {p: generation_memory(cfg := tiny_config("parallel.mesh=1", f"generate.precision={p}"),
                                  TrainProgram.from_config(cfg, jax.devices()[:1])) for p in ("fp32", "bf16")}
    assert plans["bf16"]["kv_cache_formula"] * 2 == plans["fp32"]["kv_cache_formula"] > 0
    assert plans["bf16"]["precision"] == "bf16" and plans["bf16"]["total"] < plans["fp32"]["total"]
