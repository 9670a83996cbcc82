"""Every check of a config, in one place, each failing with a one-line `UserError` that names the
key and the fix.

- `check_config(cfg)`: what needs no devices (allowed values, bounds, settings that must agree);
  run when a config is loaded.
- `resolve_attention(model, plan, seq_len, sizes, backend)`: parallel.attention=auto made a kernel for
  the device kind; run by the program before `check_layout`.
- `check_layout(model, plan, train, sizes, rules, backend)`: what depends on the mesh and the device kind; run by
  the program before anything is traced.
- `check_train_size(program)`, `check_generation_size(...)`: sizes no device can hold (a sequence of
  10^8 tokens, 10^9 new tokens), refused before compiling: a lower bound per device from the
  planner's formulas (meshtrain/core/formulas.py) against ABSURD_FACTOR x the device's memory. Near
  misses are the planner's to judge (`python -m meshtrain.plan`), with the compiled figure.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from meshtrain.config.spec import settings
from meshtrain.core.bounds import INT_LIMIT
from meshtrain.core.errors import LayoutError, UserError
from meshtrain.core.formulas import kv_cache_bytes, llama_activation_terms, zero_bytes
from meshtrain.data.mixture import sources as data_sources
from meshtrain.data.tasks import entries as task_entries
from meshtrain.data.tokenizer import check_vocab
from meshtrain.data.tokenizer import load as load_tokenizer
from meshtrain.models import declaring, family, layer_runs
from meshtrain.objectives import objective
from meshtrain.objectives.grpo import longest_prompt
from meshtrain.ops import offload
from meshtrain.ops.attention import ATTENTION_BLOCK, MIN_ATTENTION_BLOCK, attention_block, cudnn_refusal
from meshtrain.ops.block_scaled import gpu_layout_refusal
from meshtrain.ops.precision import COMPUTE_DTYPES, compute_bytes, saved_matmul_bytes
from meshtrain.ops.ulysses import context_degrees
from meshtrain.parallel.schedules import check as check_schedule
from meshtrain.parallel.schedules import check_residuals
from meshtrain.parallel.sharding import make_rules

ABSURD_FACTOR = 4  # a step whose lower bound needs this many times a device's memory is refused
MIN_COMPRESSION_BLOCK = 16  # int8 + a scale per block: 0.31x the fp32 bytes at 16, 1.25x at 1


def check_effective(cfg) -> None:
    """One rule for every setting that declares where it has an effect (meshtrain/core/bounds.py
    `Applies`): changed from its default where it has none (a LoRA dropout without adapters, a loss
    scale outside fp16, a local tier's cadence without its folder), it is one line; the user meant
    something the run would not do."""
    for key, f, value in settings(cfg):
        applies = f.metadata.get("applies")
        if applies is None or value == _default(f):
            continue
        switch = _lookup(cfg, applies.key)
        if switch in applies.values if applies.values else switch != _default(_field(cfg, applies.key)):
            continue
        where = " or ".join(map(repr, applies.values)) if applies.values else "set"
        raise UserError(f"{key}={value!r} has no effect with {applies.key}={switch!r} (it applies where "
                        f"{applies.key} is {where}); leave {key} out, or set {applies.key}")


def _lookup(cfg, dotted: str):
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _field(cfg, dotted: str) -> dataclasses.Field:
    *section, name = dotted.split(".")
    holder = _lookup(cfg, ".".join(section)) if section else cfg
    return next(f for f in dataclasses.fields(holder) if f.name == name)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_config(cfg, effective: bool = True) -> None:
    """`effective`: also refuse a setting changed where it has no effect (`check_effective`)."""
    family(cfg.model.family)  # registered (meshtrain.models.FAMILIES)
    trains = objective(cfg.train.objective)  # registered (meshtrain.objectives.OBJECTIVES)
    if cfg.parallel.gather_once and trains.scores_first:
        raise UserError(f"parallel.gather_once shares one gather of the weights among the train step's microbatches, "
                        f"and train.objective={cfg.train.objective}'s forward-only pass would still gather them per "
                        f"layer; set parallel.gather_once=false")
    for key, f, value in settings(cfg):
        choices = f.metadata["choices"]
        if choices and value not in choices:
            raise UserError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            f.metadata["bounds"].check(key, value)
    if effective:  # a value in range, then: does it do anything here
        check_effective(cfg)
    m, t, par = cfg.model, cfg.train, cfg.parallel
    make_rules(par.rules, par.sequence_parallel)  # its own checks: logical axes, mesh axes, each once
    # the task scorer reads the train state's parameters as they lie (meshtrain/ops/offload.py check_layout)
    offload.check_layout(par.offload, {}, {"eval.tasks": par.offload == "optimizer+params" and bool(cfg.eval.tasks)})
    if m.num_heads % m.num_kv_heads:
        raise UserError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
    if not m.head_dim and m.d_model % m.num_heads:
        raise UserError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
                        f"set model.head_dim")
    if why := layer_runs.check(m, par.bf16_layers):
        raise UserError(why)
    rope_key, rope_width = m.rope_width()  # the family's own key: head_dim, or deepseek_v3's qk_rope_head_dim
    if rope_width % 2:
        derived = "" if getattr(m, rope_key) else f" (d_model / num_heads = {rope_width})"
        raise UserError(f"model.{rope_key}={getattr(m, rope_key)}{derived}: rotary embeddings rotate pairs of "
                        f"channels, so it must be even; set model.{rope_key}")
    if m.mtp_modules() >= t.seq_len:  # module k predicts the token k + 1 places past the next one
        raise UserError(f"model.mtp_depth={m.mtp_modules()} predicts up to {m.mtp_modules() + 1} tokens ahead, which "
                        f"train.seq_len={t.seq_len} does not hold; set model.mtp_depth below train.seq_len "
                        f"(DeepSeek-V3 uses 1)")
    if m.rope_scaling == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise UserError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                        f"model.rope_low_freq_factor={m.rope_low_freq_factor} (Llama 3.1 uses 4 and 1)")
    m.check()  # the family's own
    m.lora.check()
    experts_adapted = m.routed_experts() and {"gate", "up", "down"} & set(m.lora.targets)
    if m.lora.rank and m.lora.dropout and experts_adapted:  # models/experts.py: the adapters see dispatch buffers
        raise UserError(f"model.lora.dropout={m.lora.dropout} on the adapters of routed experts is not built (their "
                        f"input is the experts' dispatch buffer, with no row or position to key a mask by); set "
                        f"model.lora.dropout=0, or adapt the attention only: model.lora.targets=[q,k,v,o]")
    for key in ("straggler_every", "grad_norms_every"):
        if getattr(t, key) % t.log_every:
            raise UserError(f"train.{key}={getattr(t, key)} is not a multiple of train.log_every={t.log_every} "
                            f"(its figures are taken at log steps); use a multiple, or 0 to turn it off")
    if 0 < cfg.guard.spike_factor <= 1:
        raise UserError(f"guard.spike_factor={cfg.guard.spike_factor} would call an ordinary step a spike: use a "
                        f"factor above 1 (2 is a cautious value), or 0 to turn spike detection off")
    if par.loss_scale_min > par.loss_scale_initial:
        raise UserError(f"parallel.loss_scale_min={par.loss_scale_min} exceeds parallel.loss_scale_initial="
                        f"{par.loss_scale_initial}; lower the minimum or raise the initial scale")
    if par.grad_compression == "int8" and par.compression_block < MIN_COMPRESSION_BLOCK:
        raise UserError(f"parallel.compression_block={par.compression_block} sends a 4-byte scale per "
                        f"{par.compression_block} int8 values, {0.25 + 1 / par.compression_block:.2f}x the fp32 "
                        f"bytes; use at least {MIN_COMPRESSION_BLOCK} (the default 256 sends 0.254x)")
    if par.microbatches and t.batch_size % par.microbatches:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by "
                        f"parallel.microbatches={par.microbatches}")
    if cfg.data.kind == "synthetic" and cfg.data.path:
        raise UserError(f"data.kind=synthetic ignores data.path={cfg.data.path!r}; set data.kind=auto or drop the path")
    data_sources(cfg.data)  # data.sources' entries (meshtrain/data/mixture.py)
    task_entries(cfg.eval.tasks)  # eval.tasks' entries (meshtrain/data/tasks.py); the files are read by the run
    if cfg.eval.tasks and not (cfg.eval.task_every or t.eval_every):
        raise UserError("eval.tasks are set but never scored: eval.task_every and train.eval_every are 0; set "
                        "eval.task_every=N")
    _check_local_tier(cfg.checkpoint, cfg.out)
    if t.objective == "dpo":
        _check_dpo(cfg)
    if t.objective == "grpo":
        _check_grpo(cfg)
    spec = cfg.data.tokenizer  # a missing file is reported when the data loads: a run's config stays readable
    if spec == "byte" or (spec != "auto" and Path(spec).exists()):
        check_vocab(load_tokenizer(spec), m.vocab_size, "data.tokenizer")
    if cfg.data.eos_id >= m.vocab_size:
        raise UserError(f"data.eos_id={cfg.data.eos_id} is outside model.vocab_size={m.vocab_size}; set the "
                        f"tokenizer's EOS id, or -1 for the tokenizer's own")


def _check_dpo(cfg) -> None:
    """train.objective=dpo reads one folder of preference pairs and trains no multi-token prediction
    modules."""
    d = cfg.data
    if cfg.model.mtp_modules():
        raise UserError("train.objective=dpo trains the next-token policy only; set model.mtp_depth=0 (the "
                        "multi-token prediction modules are a pretraining objective)")
    if d.sources or d.kind == "synthetic" or not d.path or d.train_on != "assistant":
        raise UserError("train.objective=dpo trains on one folder from python -m meshtrain.data prepare --preference "
                        "(data.path, with data.train_on=assistant and no data.sources)")


def _check_grpo(cfg) -> None:
    """train.objective=grpo: whole groups a batch, room for a prompt beside the completion, one
    folder of prompts, the next-token policy only."""
    t, rl, d = cfg.train, cfg.rl, cfg.data
    if d.sources or d.kind == "synthetic" or not d.path:
        raise UserError("train.objective=grpo trains on one folder from python -m meshtrain.data prepare --prompts "
                        "(data.path, no data.sources)")
    if t.batch_size % rl.group_size:
        raise UserError(f"train.batch_size={t.batch_size} is not a multiple of rl.group_size={rl.group_size} (a "
                        f"batch holds whole groups of completions); use a multiple of {rl.group_size}")
    if longest_prompt(t.seq_len, rl) < 1:
        raise UserError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in train.seq_len + 1 = "
                        f"{t.seq_len + 1} tokens; raise train.seq_len or lower rl.max_new_tokens")
    if cfg.model.mtp_modules():
        raise UserError("train.objective=grpo trains the next-token policy only; set model.mtp_depth=0")
    if cfg.model.lora.dropout:  # the scored log-probs are dropout's-free: the first update's ratio would not be 1
        raise UserError(f"model.lora.dropout={cfg.model.lora.dropout} with train.objective=grpo: the policy's ratio "
                        f"to the rollout's would measure the dropout noise; set model.lora.dropout=0")
    if d.document_mask:  # the sampler attends across an EOS in the prompt, training would not
        raise UserError("data.document_mask with train.objective=grpo would train completions that do not see "
                        "their prompt past an EOS, which the sampler saw; set data.document_mask=false")


def _check_local_tier(c, out: str) -> None:
    """checkpoint.local_*: the local tier is written when it is set, and is never the persistent tier."""
    if not c.local_dir:  # its cadence set without it: check_effective
        return
    if not (c.local_every or c.local_every_minutes):
        raise UserError(f"checkpoint.local_dir={c.local_dir!r} is never written: set checkpoint.local_every (steps) "
                        f"or checkpoint.local_every_minutes")
    local = Path(c.local_dir).expanduser().absolute()
    persistent = (Path(out).expanduser().absolute() / "checkpoints") if out else None
    if persistent and (local == persistent or persistent in local.parents):
        raise UserError(f"checkpoint.local_dir={c.local_dir!r} is inside the persistent tier {persistent}; pick a "
                        f"folder on the node's own disk, outside --out/checkpoints")


def resolve_attention(m, par, seq_len: int, sizes: dict[str, int], backend: str, documents: bool = False):
    """(`par` with parallel.attention=auto made a kernel, why it is not cuDNN's fused attention on a
    GPU or None). A context axis that splits the sequence around a ring (context_strategy ring or
    hybrid) takes `ring`. On GPUs: `cudnn` where JAX's cuDNN check takes the model's heads, head
    width, windows and document mask in the compute dtype (`cudnn_refusal`), else `blockwise` (O(L)
    memory), or `xla` where blockwise cannot cut train.seq_len into blocks. Elsewhere `xla`, the CPU
    kernel. `documents`: the batches carry a document mask (data.document_mask)."""
    if par.attention != "auto":
        return par, None
    choice, why = "xla", None
    if sizes["context"] > 1 and par.context_strategy != "ulysses":
        choice = "ring"
    elif backend == "gpu":
        m = m.resolved()
        why = cudnn_refusal(m.num_heads, m.num_kv_heads, m.head_dim, seq_len, COMPUTE_DTYPES[par.precision],
                            m.layer_windows(), documents)
        choice = ("cudnn" if why is None else
                  "blockwise" if attention_block(seq_len) >= min(seq_len, MIN_ATTENTION_BLOCK) else "xla")
    return dataclasses.replace(par, attention=choice), why


def check_layout(m, par, t, sizes: dict[str, int], rules: dict, backend: str) -> None:
    """Checks that need the mesh's axis sizes, the resolved logical rules and the device backend:
    `m` the ModelSpec, `par` the ParallelPlan, `t` the TrainConfig."""
    _check_kernels(par, t.seq_len, backend)
    capacity_experts = bool(getattr(m, "num_experts", 0)) and getattr(m, "capacity_factor", 0.0) > 0
    if backend == "gpu" and (why := gpu_layout_refusal(par.precision, sizes, capacity_experts)):
        raise LayoutError(why)
    stages = sizes["pipeline"]
    micro = par.num_microbatches(stages)
    if par.bf16_layers and stages > 1:  # the stages scan their chunks whole (engine/pipeline.py)
        raise LayoutError(f"parallel.bf16_layers={list(par.bf16_layers)} on a pipeline (pipeline={stages}) is not "
                          f"built: its stages run each chunk of layers as one scan; drop the pipeline axis, or "
                          f"parallel.bf16_layers")
    dense = m.dense_first_layers()
    if dense and stages > 1 and sizes["fsdp"] > 1 and sizes["tensor"] > 1:  # XLA:CPU hung in a collective-permute
        raise LayoutError(f"model.first_k_dense_replace={dense} on a pipeline with fsdp and tensor both > 1 is not "
                          f"built (the first stage's dense layers wait for the other stages); keep one of them at 1")
    if stages > 1:
        check_schedule(par.schedule, stages, micro, par.virtual_stages)
        check_residuals(par.schedule, par.residuals, par.remat)
        stacked = m.stacked_layers()  # deepseek_v3: less its dense first layers, which the first stage runs
        if stacked % (stages * par.virtual_stages):
            of = f" ({stacked} in the stacked blocks)" if stacked != m.num_layers else ""
            raise LayoutError(f"model.num_layers={m.num_layers}{of} is not divisible by pipeline stages ({stages}) x "
                              f"parallel.virtual_stages ({par.virtual_stages})")
    if t.objective == "grpo" and (stages > 1 or sizes["context"] > 1):
        axis = "pipeline" if stages > 1 else "context"
        raise LayoutError(f"train.objective=grpo samples its rollouts on the training mesh, and the sampler runs no "
                          f"{axis} axis; drop it (data, fsdp, tensor and expert axes sample)")
    tp = sizes["tensor"]
    for key, value in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads)):
        if value % tp:
            raise LayoutError(f"model.{key}={value} is not divisible by tensor={tp}; use a tensor size that divides it")
    _check_context(m, par, t.seq_len, sizes["context"], tp)
    for name in ("seq", "residual_seq"):
        shards = math.prod(sizes[a] for a in rules[name])
        if t.seq_len % shards:
            raise LayoutError(f"parallel.rules.{name}={list(rules[name])} splits the sequence {shards} ways, which "
                              f"does not divide train.seq_len={t.seq_len}; use a multiple of {shards} or other rules")
    experts = sizes["expert"]
    if experts > 1 and not m.routed_experts():
        raise UserError(f"mesh expert={experts} splits experts, and this model has none; set model.family to one "
                        f"with experts ({', '.join(f.name for f in declaring('num_experts'))}) and "
                        f"model.num_experts, or drop the expert axis")
    if experts > 1 and m.num_experts % experts:
        raise LayoutError(f"model.num_experts={m.num_experts} is not divisible by expert={experts}; use an expert "
                          f"axis size that divides it")
    batch_axes = list(rules["batch"])
    dp = math.prod(sizes[a] for a in batch_axes)
    if t.batch_size % (dp * micro):
        raise LayoutError(f"train.batch_size={t.batch_size} is not divisible by the batch axes "
                          f"{' x '.join(f'{a} ({sizes[a]})' for a in batch_axes)} x parallel.microbatches ({micro}); "
                          f"use a multiple of {dp * micro}")
    chunks = par.expert_chunks
    if chunks > 1 and experts == 1:
        raise UserError(f"parallel.expert_chunks={chunks} overlaps expert parallelism's all-to-alls, and the mesh has "
                        f"no expert axis; set parallel.expert_chunks=1 or add an expert axis")
    if chunks > 1 and t.batch_size // (dp * micro) % chunks:
        raise LayoutError(f"parallel.expert_chunks={chunks} does not divide the {t.batch_size // (dp * micro)} rows "
                          f"each device routes per microbatch; use a divisor of it, or a larger train.batch_size")


def _check_context(m, par, seq_len: int, context: int, tensor: int) -> None:
    """parallel.context_strategy on a context axis of `context` (meshtrain/ops/ulysses.py): the ring
    needs the ring kernel; ulysses a local kernel and heads (per tensor shard) that divide by the
    axis; hybrid the ring kernel across groups of parallel.ulysses_degree devices, which divides it."""
    strategy, degree = par.context_strategy, par.ulysses_degree  # a degree outside hybrid: check_effective
    if context == 1:
        return
    if strategy == "ulysses":
        if par.attention == "ring":
            raise UserError("parallel.context_strategy=ulysses gives each device whole sequences of some heads and "
                            "runs a local kernel on them; set parallel.attention to xla, blockwise or cudnn")
    elif par.attention != "ring":
        raise UserError(f"mesh context={context} splits the sequence, which parallel.attention={par.attention} "
                        f"cannot attend across; set parallel.attention=ring, or parallel.context_strategy=ulysses")
    if strategy == "hybrid" and (degree < 2 or degree >= context or context % degree):
        divisors = [d for d in range(2, context) if context % d == 0]
        raise UserError(f"parallel.context_strategy=hybrid needs parallel.ulysses_degree (devices per all-to-all "
                        f"group) dividing context={context} strictly between 1 and it: "
                        + (f"one of {', '.join(map(str, divisors))}" if divisors else
                           "none exists; use context_strategy=ring or ulysses"))
    ring, degree = context_degrees(strategy, context, degree)
    if strategy in ("ulysses", "hybrid"):
        q, kv = m.num_heads // tensor, m.num_kv_heads // tensor  # heads per tensor shard
        if q % degree or kv % degree:
            shard = f" per tensor shard (tensor={tensor})" if tensor > 1 else ""
            fits = [d for d in range(2, kv + 1) if q % d == 0 and kv % d == 0]
            hint = (f"a degree that divides both: {', '.join(map(str, fits))}" if fits
                    else "parallel.context_strategy=ring")
            raise UserError(f"parallel.context_strategy={strategy} splits the heads {degree} ways, and {q} query and "
                            f"{kv} kv heads{shard} do not both divide by {degree}; use {hint}")
    if strategy == "ring":
        if seq_len % (2 * context):
            raise LayoutError(f"train.seq_len={seq_len} is not divisible by 2 x context ({2 * context}): each "
                              f"device holds an early and a late chunk; use a multiple of {2 * context}")
        return
    # hybrid: groups round the ring, each an early and a late chunk over its devices
    chunks = context if ring == 1 else math.lcm(context, 2 * ring)
    if seq_len % chunks:
        raise LayoutError(f"train.seq_len={seq_len} is not divisible by {chunks}: context_strategy={strategy} "
                          f"splits it over context={context}" + (f" in {2 * ring} chunks" if ring > 1 else "")
                          + f"; use a multiple of {chunks}")


def _check_kernels(par, seq_len: int, backend: str) -> None:
    if par.attention == "cudnn" and backend != "gpu":
        raise UserError("parallel.attention=cudnn needs an NVIDIA GPU; use parallel.attention=blockwise or xla here")
    if par.attention == "cudnn" and par.precision == "fp32":
        raise UserError("parallel.attention=cudnn runs in bf16/fp16 only; set parallel.precision=bf16, or use "
                        "parallel.attention=blockwise for fp32")
    if par.attention == "blockwise" and attention_block(seq_len) < min(seq_len, MIN_ATTENTION_BLOCK):
        raise UserError(f"parallel.attention=blockwise splits train.seq_len={seq_len} into blocks of "
                        f"{attention_block(seq_len)} positions (its largest divisor up to {ATTENTION_BLOCK}); "
                        f"use a seq_len with a divisor from {MIN_ATTENTION_BLOCK} to {ATTENTION_BLOCK}, "
                        f"e.g. a multiple of {MIN_ATTENTION_BLOCK}")
    if par.remat == "offload" and backend == "cpu":
        raise UserError("parallel.remat=offload moves activations to host memory and needs a GPU/TPU; "
                        "use full or save_matmuls on CPU")


def device_memory(devices) -> tuple[float, str]:
    """(bytes one device has, who has them): an accelerator's own memory; on CPU the host's memory,
    which its local devices share."""
    device = devices[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"one {device.device_kind} has"
    local = sum(d.process_index == device.process_index for d in devices)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / local, f"each of {local} CPU device(s) has of this host's memory"


def _refuse_beyond_memory(what: str, need: float, figure: str, memory: tuple[float, str], fix: str) -> None:
    """`memory`: (bytes one device has, who has them), as `device_memory` gives them."""
    have, who = memory
    if need > ABSURD_FACTOR * have:
        raise UserError(f"{what} needs at least {need / 1e9:,.1f} GB per device ({figure}), over {ABSURD_FACTOR}x "
                        f"the {have / 1e9:,.1f} GB {who}; {fix}")


def check_train_size(program, memory: tuple[float, str] | None = None) -> None:
    """A train step's activations (one microbatch, formulas.llama_activation_terms) and model states
    (formulas.zero_bytes) per device, a lower bound, against the devices' memory (`memory`: (bytes,
    who has them) of the device planned for; default the program's own devices)."""
    m, par, t, sizes = program.model.cfg, program.plan, program.train, program.sizes
    stages = sizes["pipeline"]
    rows = t.batch_size / math.prod(sizes[a] for a in program.rules["batch"]) / par.num_microbatches(stages)
    remat = par.remat if par.remat in ("none", "save_matmuls", "full") else "full"  # offload: on the host
    terms = llama_activation_terms(t.seq_len / sizes["context"], rows, m.d_model, m.num_heads, m.num_kv_heads,
                                   m.head_dim, m.mlp_dim, compute_bytes(par.precision), sizes["tensor"],
                                   par.sequence_parallel, remat, saved_matmul_bytes(par.precision))
    # [L, L] scores where the kernel forms them: under Ulysses each device forms H/C heads of the whole
    # sequence's, C times the terms' (L/C)^2 x H
    whole = sizes["context"] if par.context_strategy == "ulysses" else 1
    formed = {k: v * (whole if k.startswith("softmax exp") else 1) for k, v in terms.items()
              if par.attention == "xla" or "softmax" not in k}
    activations = sum(formed.values()) * m.num_layers / stages
    states = sum(zero_bytes(program.num_params, sizes, par.zero,
                            optimizer_state=program.optimizer_state_bytes()).values()) - program.offloaded_bytes()
    _refuse_beyond_memory(f"train.seq_len={t.seq_len} x train.batch_size={t.batch_size}", activations + states,
                          f"activations {activations / 1e9:,.1f} GB + model states {states / 1e9:,.1f} GB, "
                          f"meshtrain/core/formulas.py", memory or device_memory(list(program.mesh.devices.flat)),
                          "lower train.seq_len or train.batch_size, or add devices" +
                          ("" if memory else "; python -m meshtrain.plan shows the compiled figure"))


def check_generation_size(m, rows: int, prompt_len: int, max_new_tokens: int, devices, value_bytes: int = 4) -> None:
    """Generation's KV cache (formulas.kv_cache_bytes; `m` a resolved ModelSpec) for `rows` prompts of
    up to `prompt_len` tokens, `value_bytes` a value, split over every device at best, against their memory."""
    positions = prompt_len + max_new_tokens - 1
    what = f"--max-new-tokens {max_new_tokens}"
    if positions > INT_LIMIT:
        raise UserError(f"{what}: {positions:,} positions exceed the 2^31 - 1 a position id holds; "
                        f"generate fewer tokens")
    need = kv_cache_bytes(m.cached_positions(positions), rows, m.cached_values(), len(devices), value_bytes)
    _refuse_beyond_memory(what, need, f"the KV cache of {rows} row(s) x {positions:,} positions, "
                          f"meshtrain/core/formulas.py", device_memory(devices),
                          "generate fewer tokens or fewer prompts at once")
