"""`python -m meshtrain.generate --run RUN --prompt "ROMEO:"`: text from a training run's newest intact
checkpoint, or `--step N`, read verified (meshtrain/run/checkpoint.py `read_params`), on one device or
sharded over `--mesh`, in fp32 or, with `--precision bf16|fp16` (the run's generate.precision by
default), read into host memory, cast there and placed in that dtype, with its KV cache. The
generation itself is meshtrain/engine/decode.py.
"""
from __future__ import annotations

import sys
import time

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from meshtrain.config.validate import check_generation_size
from meshtrain.core import unicode
from meshtrain.core.cli import Parser, arguments, command, compile_cache_flag, devices_flag, number, start_jax
from meshtrain.core.errors import UserError
from meshtrain.engine.decode import SAMPLING, check_settings, generate, place
from meshtrain.ops.precision import cast_for_compute, compute_bytes


def load(run: str, mesh_spec: str | None = None, step: int | None = None, precision: str = "fp32"):
    """(model, params, mesh, step) of a run's newest intact checkpoint, or of `step`: on the first
    device, or sharded over `mesh_spec` ('run': the run's own parallel.mesh; mesh None on one device);
    in `precision`'s compute dtype (not fp32: read and verified on the host, cast there, then placed)."""
    from meshtrain.models import FAMILIES
    from meshtrain.parallel.mesh import build_mesh, parse_mesh
    from meshtrain.run.run_dir import newest_params, run_config

    cfg = run_config(run)
    model = FAMILIES[cfg.model.family](cfg.model)

    def read(shardings):
        if precision == "fp32":
            return newest_params(run, model, shardings, step)
        try:
            host = jax.devices("cpu")[0]
        except RuntimeError:
            raise UserError(f"--precision {precision} reads the checkpoint on the host through JAX's CPU backend, "
                            f"which JAX_PLATFORMS leaves out; add cpu to it (e.g. cuda,cpu) or pass --precision "
                            f"fp32") from None
        params, at = newest_params(run, model, SingleDeviceSharding(host), step)
        return jax.device_put(cast_for_compute(params, precision), shardings), at

    if mesh_spec is None:
        params, step = read(SingleDeviceSharding(jax.devices()[0]))
        return model, params, None, step
    spec = cfg.parallel.mesh if mesh_spec == "run" else mesh_spec
    sizes = parse_mesh(spec, jax.device_count())
    for axis in ("pipeline", "context"):
        if sizes[axis] > 1:
            raise UserError(f"mesh {spec} has {axis}={sizes[axis]}, which decoding does not use; pass "
                            f"--mesh without it, e.g. --mesh tensor=2 (the parameters are resharded on load)")
    mesh = build_mesh(sizes)
    params, step = read(place(model, mesh))
    return model, params, mesh, step


def encode_prompts(run: str, texts: list[str], tokenizer_spec: str | None = None):
    """(tokenizer, token ids of each text): the run's recorded tokenizer unless one is named; each
    prompt at most the run's context (train.seq_len)."""
    from meshtrain.data import tokenizer
    from meshtrain.run.run_dir import run_config

    cfg = run_config(run)
    tok = tokenizer.load(tokenizer_spec) if tokenizer_spec else tokenizer.for_run(run)
    tokenizer.check_vocab(tok, cfg.model.vocab_size, "the tokenizer")
    for text in texts:  # argv keeps undecodable bytes as lone surrogates: one line, not a replaced character
        unicode.check(text, f"--prompt {text.encode('utf-8', 'replace').decode()[:20]!r}",
                      "pass the prompt as valid UTF-8")
    prompts = [tok.encode(text).astype(np.int32) for text in texts]
    context = cfg.train.seq_len
    for text, ids in zip(texts, prompts):
        if len(ids) > context:
            raise UserError(f"prompt {text[:20]!r}... is {len(ids)} tokens, longer than the run's context "
                            f"(train.seq_len={context}); shorten it to at most {context} tokens")
    return tok, prompts


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.generate",
               description="Generate text from a training run's newest intact checkpoint.")
    p.add_argument("--run", required=True, help="the training run's --out folder")
    p.add_argument("--prompt", action="append", required=True,
                   help="text to continue (repeatable: a batch)")
    p.add_argument("--max-new-tokens", type=number(int, SAMPLING["max_new_tokens"]), default=None,
                   help="tokens per prompt (default: the run's generate.max_new_tokens, 200 unless set)")
    p.add_argument("--temperature", type=number(float, SAMPLING["temperature"]), default=0.0,
                   help="0 = greedy")
    p.add_argument("--top-k", type=number(int, SAMPLING["top_k"]), default=0,
                   help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=number(float, SAMPLING["top_p"]), default=1.0, help="nucleus sampling mass; 1 = all")
    p.add_argument("--seed", type=number(int, min=0), default=0)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                   help="the dtype of the parameters and the KV cache (default: the run's generate.precision, "
                        "fp32 unless set); bf16 and fp16 halve both")
    p.add_argument("--step", type=number(int, min=0), help="read this checkpoint step (default: the newest intact one)")
    p.add_argument("--mesh", help="shard over this mesh ('tensor=2', 'data=2,tensor=2'; 'run' = the run's "
                                  "own); default: one device")
    devices_flag(p)
    compile_cache_flag(p)
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the one the run recorded)")
    return p


@command
def main(argv=None) -> int:
    from meshtrain.run.run_dir import run_config

    args = arguments(parser(), argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = run_config(args.run).generate.max_new_tokens
    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    start_jax(args)
    tok, prompts = encode_prompts(args.run, args.prompt, args.tokenizer)
    precision = args.precision or run_config(args.run).generate.precision
    check_generation_size(run_config(args.run).model.resolved(), len(prompts), max(map(len, prompts)),
                          args.max_new_tokens, jax.devices(), compute_bytes(precision))
    model, params, mesh, step = load(args.run, args.mesh, args.step, precision)
    start = time.perf_counter()
    out = generate(model, params, prompts, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=tok.eos_id,
                   window=run_config(args.run).train.seq_len, vocab=tok.vocab_size, mesh=mesh)
    seconds = time.perf_counter() - start
    for text, ids in zip(args.prompt, out):
        print(text + tok.decode(ids), end="\n\n" if len(out) > 1 else "\n")
    print(f"{sum(map(len, out))} tokens from step {step} in {seconds:.1f} s, compile included", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
