"""`python -m meshtrain.convert`: weights in and out of meshtrain.

  --from-hf DIR --out RUN   a run folder that fine-tunes a Hugging Face checkpoint: RUN/config.yaml
                            with the checkpoint's model section and checkpoint.init_from=hf:DIR (the
                            weights are read straight into their shards when training starts);
                            every tensor's name and shape is checked now
  --to-hf RUN DIR           the newest intact checkpoint of a run (or --step N) as a Hugging Face
                            folder (config.json + safetensors), loadable by transformers'
                            from_pretrained; a LoRA run's with --merge (the adapters folded into
                            the weights) or --adapters-only (a PEFT adapter folder on its base)
  --quantize int8 RUN OUT   per-channel INT8 weights for deployment, with their eval loss against
                            the run's fp32 model (meshtrain/run/int8_export.py)

Checkpoints are read verified (meshtrain.run.checkpoint.read_params): a damaged one is skipped with a
warning, a damaged --step is an error. Nothing is written unless the whole output could be: outputs
go to a temporary folder first, and carry a SHA256SUMS of their files.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from meshtrain.config.loader import Config, UserError, commented_yaml
from meshtrain.core.cli import Parser, arguments, command, compile_cache_flag, devices_flag, number, start_jax
from meshtrain.core.folders import check_new, writing_whole
from meshtrain.data import tokenizer
from meshtrain.interop import hf
from meshtrain.models.spec import LoraSpec
from meshtrain.ops.trainable import select
from meshtrain.run import run_dir


def parser() -> Parser:
    p = Parser(prog="python -m meshtrain.convert", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-hf", metavar="DIR", help="a Hugging Face checkpoint folder to fine-tune (with --out)")
    mode.add_argument("--to-hf", nargs=2, metavar=("RUN", "DIR"), help="export a run's newest checkpoint")
    mode.add_argument("--quantize", nargs=3, metavar=("int8", "RUN", "OUT"), help="INT8 export of a run")
    p.add_argument("--out", help="--from-hf: the run folder to create")
    p.add_argument("--dtype", default="float32", choices=tuple(hf.DTYPE_NAMES),
                   help="--to-hf: the dtype written")
    p.add_argument("--max-shard-gb", type=number(float, above=0.0), default=5.0,
                   help="--to-hf: largest safetensors file (> 0)")
    p.add_argument("--scheme", default="symmetric", help="--quantize: symmetric or affine")
    p.add_argument("--mesh", default="fsdp=-1",
                   help="--to-hf: the mesh the weights are read onto (default: split over every device)")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--merge", action="store_true", help="--to-hf of a LoRA run: merged full weights")
    lora.add_argument("--adapters-only", action="store_true",
                      help="--to-hf of a LoRA run: a PEFT adapter folder whose base_model_name_or_path is the "
                           "run's init_from: hf: folder, or its base exported to DIR/base")
    p.add_argument("--step", type=number(int, min=0), help="--to-hf, --quantize: read this checkpoint step "
                                                         "(default: the newest intact one)")
    devices_flag(p, "simulate this many CPU devices")
    compile_cache_flag(p)
    return p


@command
def main(argv=None) -> int:
    args = arguments(parser(), argv)
    start_jax(args)
    if args.from_hf:
        if args.step is not None:
            raise UserError("--step chooses the checkpoint --to-hf or --quantize reads; --from-hf has none")
        from_hf(args.from_hf, args.out)
    elif args.to_hf:
        if args.max_shard_gb <= 0:
            raise UserError(f"--max-shard-gb {args.max_shard_gb}: must be > 0 (Hugging Face uses 5)")
        to_hf(*args.to_hf, args.dtype, int(args.max_shard_gb * 2**30), args.mesh, args.step,
              "merge" if args.merge else "adapters" if args.adapters_only else None)
    elif args.merge or args.adapters_only:
        raise UserError("--merge and --adapters-only choose how --to-hf writes a LoRA run")
    else:
        from meshtrain.run.int8_export import export_int8

        kind, run, out = args.quantize
        if kind != "int8":
            raise UserError(f"--quantize {kind}: only int8 is implemented")
        export_int8(run, out, args.scheme, step=args.step)
    return 0


def from_hf(folder: str, out: str | None) -> Path:
    from meshtrain.models import FAMILIES

    if not out:
        raise UserError("--from-hf needs --out RUN: the run folder to fine-tune in")
    check_new(out, "--out")
    spec = hf.read_spec(folder)
    hf.check_tensors(hf.SafetensorsFolder(folder), FAMILIES[spec.family](spec), folder)
    cfg = Config(model=spec, out=str(Path(out)))
    cfg.checkpoint.init_from = f"hf:{Path(folder).absolute()}"
    if (Path(folder) / tokenizer.HF_FILE).is_file():  # train on text with the checkpoint's own tokenizer
        cfg.data.tokenizer = str(Path(folder).absolute())
    with writing_whole(out, "--out") as tmp:
        (tmp / "config.yaml").write_text(
            f"# fine-tunes {Path(folder).absolute()} (python -m meshtrain.convert --from-hf); set data and train\n"
            + commented_yaml(cfg))
    print(f"wrote {Path(out) / 'config.yaml'} ({spec.family}, {spec.num_layers} layers, d_model {spec.d_model}); "
          f"fine-tune with: python -m meshtrain.train --config {Path(out) / 'config.yaml'} --data DATA")
    return Path(out)


def to_hf(run: str, folder: str, dtype: str, max_shard_bytes: int, mesh_spec: str,
          step: int | None = None, lora: str | None = None) -> list[Path]:
    """RUN's checkpoint of `step` (default: the newest intact one) as a Hugging Face folder; a LoRA
    run's `lora`: "merge" (merged weights) or "adapters" (a PEFT folder: `write_adapters`)."""
    import jax

    from meshtrain.models import FAMILIES
    from meshtrain.models.lora import merge_adapters
    from meshtrain.parallel.mesh import build_mesh, parse_mesh
    from meshtrain.parallel.sharding import param_shardings

    if jax.process_count() > 1:
        raise UserError("--to-hf runs in one process: it reads the checkpoint onto one host's devices "
                        "(any mesh's checkpoint); run it on one host, without a multi-host launcher")
    cfg = run_dir.run_config(run)
    if bool(cfg.model.lora.rank) != bool(lora):
        raise UserError(f"{run} is a LoRA run (model.lora.rank={cfg.model.lora.rank}): add --merge or --adapters-only"
                        if cfg.model.lora.rank else f"{run} has no LoRA adapters: --merge and --adapters-only are for "
                                                    f"LoRA runs; leave them out")
    check_new(folder, "--to-hf DIR")
    model = FAMILIES[cfg.model.family](cfg.model)
    hf.hf_config(cfg.model, dtype)  # refuses what has no Hugging Face form before anything is read
    mesh = build_mesh(parse_mesh(mesh_spec, jax.device_count()))
    params, step = run_dir.newest_params(run, model, param_shardings(model, mesh), step)
    params = run_dir.trunk_params(run, model, params)
    with writing_whole(folder, "--to-hf DIR") as tmp:
        if lora == "adapters":
            files = write_adapters(cfg, params, tmp, dtype, max_shard_bytes, Path(folder).absolute())
        else:
            files = hf.save_params(merge_adapters(params, cfg.model.lora), cfg.model, tmp, dtype, max_shard_bytes)
        tok = tokenizer.recorded(Path(run))
        if isinstance(tok, tokenizer.HFTokenizer):  # byte-level runs have no Hugging Face tokenizer to ship
            tokenizer.record(tmp, tok)
        hf.write_sums(tmp)
    size = sum(f.stat().st_size for f in Path(folder).rglob("*.safetensors"))
    print(f"wrote {folder}: step {step} of {run}, {len(files)} safetensors file(s), {size / 1e6:.1f} MB {dtype}")
    return [Path(folder) / f.name for f in files]


def write_adapters(cfg, params, tmp: Path, dtype: str, max_shard_bytes: int, final: Path) -> list[Path]:
    """A PEFT adapter folder in `tmp` (moved to `final`) whose base is the run's `init_from: hf:`
    folder, or the run's base (its frozen weights, the adapters left out) written to final/base."""
    source = cfg.checkpoint.init_from
    if source.startswith("hf:"):
        base, files = str(Path(source[3:]).absolute()), []
    else:
        base_spec = dataclasses.replace(cfg.model, lora=LoraSpec())
        frozen = select(params, lambda path: not cfg.model.trainable(path))
        base, files = str(final / "base"), hf.save_params(frozen, base_spec, tmp / "base", dtype, max_shard_bytes)
    return [*files, hf.save_adapters(params, cfg.model, tmp, base, dtype)]


if __name__ == "__main__":
    sys.exit(main())
