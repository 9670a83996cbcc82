"""The analytical formulas meshtrain's figures are checked against, each written once: the planner
prints them beside the compiled facts, the tests and the benchmarks compare with them. (A pipeline
schedule's bubble formula is its own, in its entry of meshtrain/parallel/schedules.py SCHEDULES.)

Sizes: D, F, T, P, E, C the data, fsdp, tensor, pipeline, expert and context axis sizes; Psi
parameters; N devices in a collective's group; B bytes.
"""
from __future__ import annotations

# ---- memory: ZeRO (Rajbhandari et al. 2020), with fp32 in place of their fp16 copies ----
ADAM_BYTES = {"parameters": 4, "gradients": 4, "optimizer_state": 8}  # fp32 Adam: 16 bytes/param
ZERO_STAGE_SHARDS = {"optimizer_state": 1, "gradients": 2, "parameters": 3}  # the stage from which data shards it


def zero_split(bytes_per_param: dict[str, float], psi: float, data: int, zero: int) -> dict[str, float]:
    """Bytes per device of each kind for psi parameters: bytes/param x psi, divided by D from the
    stage that shards it (ZERO_STAGE_SHARDS)."""
    return {what: per_param * psi / (data if zero >= ZERO_STAGE_SHARDS[what] else 1)
            for what, per_param in bytes_per_param.items()}


def zero_bytes(psi: float, sizes: dict[str, int], zero: int, stage_replicated: float = 0, experts: float = 0,
               optimizer_state: tuple[float, float, float] | None = None) -> dict[str, float]:
    """Per device: fp32 parameters 4Psi, gradients 4Psi, optimizer state (Adam moments 8Psi), each
    divided by F x C x T x P and also by D from stage 3, 2 and 1 respectively (the `embed` rule
    shards weights over fsdp and context). `stage_replicated`: the parameters every pipeline stage
    holds whole (embedding, final norm, head: those outside the stacked layers), divided by F x C x T
    only; `experts`: the MoE experts' parameters, each expert-parallel device holding its own,
    divided by E too. `optimizer_state`: the optimizer's state bytes in all, of the stage-replicated
    parameters and of the experts' (meshtrain/ops/optimizers.py, summed by traffic.optimizer_state_bytes);
    default AdamW's, 8 bytes per parameter."""
    split = sizes["fsdp"] * sizes.get("context", 1) * sizes["tensor"]

    def per_device(total, replicated, expert):
        staged = total - replicated - expert
        return (staged / (split * sizes["pipeline"]) + replicated / split
                + expert / (split * sizes["pipeline"] * sizes.get("expert", 1)))

    params = per_device(psi, stage_replicated, experts)
    state = per_device(*optimizer_state) if optimizer_state else ADAM_BYTES["optimizer_state"] * params
    whole = {**{k: b * params for k, b in ADAM_BYTES.items()}, "optimizer_state": state}  # before D
    return zero_split(whole, 1, sizes["data"], zero)


def zero_stage_totals(psi: float, data: int, params_bytes: float = 2, grad_bytes: float = 2,
                      optimizer_bytes: float = 12) -> list[float]:
    """Model-state bytes per device at ZeRO stages 0-3, the paper's way (Figure 1: baseline,
    P_os, P_os+g, P_os+g+p): (2 + 2 + K)Psi, (2 + 2 + K/N_d)Psi, (2 + (2 + K)/N_d)Psi,
    (2 + 2 + K)Psi/N_d with its defaults, mixed-precision Adam: fp16 parameters and gradients,
    K = 12 (fp32 master copy, momentum, variance). meshtrain keeps no fp16 copy: fp32 parameters
    and gradients and the two fp32 moments (ADAM_BYTES: 4, 4 and K = 8, 16 bytes/param), so
    zero_stage_totals(psi, D, 4, 4, 8)[z] is the sum of zero_bytes at stage z on a data-only mesh."""
    per_param = {"parameters": params_bytes, "gradients": grad_bytes, "optimizer_state": optimizer_bytes}
    return [sum(zero_split(per_param, psi, data, zero).values()) for zero in range(4)]


# ---- activation memory per layer (Korthikanti et al. 2022) ----
def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, tensor: int = 1,
                                 sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Bytes one GPT-3 layer keeps for its backward, 16-bit activations, 1-byte dropout masks (eq. 1,
    Table 2): s b h (34 + 5as/h), i.e. attention 11sbh + 5as^2b (Q, K, V, their input, the
    out-projection's input, its dropout mask; softmax output, its dropout mask and output), MLP 19sbh
    (input, GeLU input and output at 4h, dropout mask), LayerNorm inputs 4sbh. Tensor parallelism T
    splits the 24sbh + 5as^2b inside the blocks but not the 10sbh at their edges (eq. 2), sequence
    parallelism splits those too: s b h (34 + 5as/h) / T. Selective recomputation drops the 5as^2b;
    full keeps only the layer input, 2sbh."""
    if recompute == "full":
        return 2 * s * b * h
    inside = 24 + (0 if recompute == "selective" else 5 * a * s / h)
    return s * b * h * (10 / (tensor if sequence_parallel else 1) + inside / tensor)


def llama_activation_terms(s: int, b: int, h: int, heads: int, kv_heads: int, head_dim: int, mlp: int,
                           compute_bytes: int = 2, tensor: int = 1, sequence_parallel: bool = False,
                           remat: str = "none", matmul_input_bytes: int | None = None) -> dict[str, float]:
    """Bytes one meshtrain Llama block (models/base.py) keeps for its backward, by tensor:
    what the compiled step stacks per layer. The paper's accounting (`korthikanti_activation_bytes`)
    with c = compute bytes (2 in bf16) and RMSNorm and softmax internals in fp32:
      LayerNorm inputs 4sbh         -> per RMSNorm its input and the normalized x in fp32 and its
                                       output (c; the paper's QKV and MLP inputs): 2(4 + 4 + c)sbh,
                                       and two fp32 statistics per token;
      Q, K, V 6sbh, out-proj input  -> q, k, v and the attention context: c(2a + 2g) x head_dim
                                       per token (g key/value heads);
      softmax output 2as^2b         -> the fp32 exp and the probabilities (c): (4 + c)as^2b, and two
                                       fp32 row statistics;
      GeLU input and output 16sbh   -> SwiGLU gate, up, silu's three saved values, gate x up:
                                       6c x mlp x sb;
      dropout masks and output      -> none (no dropout).
    So 76 + 6as/h per sbh in bf16 with a = g, mlp = 4h, against the paper's 34 + 5as/h. Tensor
    parallelism T splits the head- and mlp-wide terms; the width-wide ones [s, b, h] only under
    sequence parallelism. remat=save_matmuls keeps the block input, the attention projection, q, k,
    v, the context, gate and up (the paper's selective recomputation drops the softmax alike); full
    keeps the block input, as the paper's full recomputation. `matmul_input_bytes` (default c; 1
    under fp8, whose matmuls keep their inputs' fp8 copies, meshtrain/ops/recipes.py): the bytes of
    what only a matmul's backward reads: the norms' outputs, the attention context and gate x up."""
    if remat not in ("none", "save_matmuls", "full"):
        raise ValueError(f"no activation accounting for remat={remat!r} (offload keeps them on the host)")
    n, c, fp32 = s * b, compute_bytes, 4
    mm = c if matmul_input_bytes is None else matmul_input_bytes
    width = lambda nbytes: nbytes / (tensor if sequence_parallel else 1)  # [s, b, h]-wide
    split = lambda nbytes: nbytes / tensor  # head- or mlp-wide
    qkv_context = split(c * n * (2 * heads + 2 * kv_heads) * head_dim)
    if remat == "full":
        return {"block input": width(c * n * h)}
    if remat == "save_matmuls":
        return {"block input, attention projection": width(2 * c * n * h),
                "q, k, v, attention context": qkv_context, "SwiGLU gate, up": split(2 * c * n * mlp)}
    return {"RMSNorm inputs and normalized (fp32), outputs": width(2 * (2 * fp32 + mm) * n * h),
            "RMSNorm statistics (fp32)": width(2 * 2 * fp32 * n),
            "q, k, v, attention context": split(n * ((c + mm) * heads + 2 * c * kv_heads) * head_dim),
            "softmax exp (fp32), probabilities": split((fp32 + c) * n * heads * s),
            "softmax row statistics (fp32)": split(2 * fp32 * n * heads),
            "SwiGLU gate, up, silu (3), gate x up": split((5 * c + mm) * n * mlp)}


def kv_cache_bytes(layer_positions: int, rows: int, values: int, split: int = 1, value_bytes: int = 4) -> float:
    """Generation's KV cache per device: `values` per layer, row and position (ModelSpec.cached_values:
    a key and a value per kv head, 2 G K, or MLA's latent, kv_lora_rank + qk_rope_head_dim), of
    `value_bytes` each (generate.precision's, fp32 by default; a trainer's rollouts cache the compute
    dtype), split `split` ways (the batch axes, x tensor where the cache has heads). `layer_positions`: the positions
    cached summed over layers (layers x positions; a sliding-window layer keeps its window's,
    ModelSpec.cached_positions)."""
    return layer_positions * rows * values * value_bytes / split


# ---- collectives: ring algorithms (Patarasuk & Yuan 2009), link bytes per device ----
RING_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
               "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: (n - 1) / n,
               "collective-permute": lambda n: 1.0}


def ring_traffic(kind: str, payload: float, n: int) -> float:
    """Link bytes per device of one collective over n devices whose output is `payload` bytes per
    device: all-reduce 2(N-1)/N x B, all-gather (N-1)/N x B (B the gathered tensor), reduce-scatter
    (N-1) x B (B one shard), all-to-all (N-1)/N x B, collective-permute B."""
    return 0.0 if n <= 1 else RING_FACTOR[kind](n) * payload


def int8_bytes(fp32_bytes: float, block: int) -> float:
    """fp32 values sent as int8 with one fp32 scale per `block` of them: B/4 + B/block."""
    return fp32_bytes / 4 + fp32_bytes / block


def compressed_reduction_traffic(grad_bytes: float, n: int, block: int, gathered: bool) -> dict[str, float]:
    """The int8 data-parallel gradient mean (meshtrain/parallel/compression.py) of `grad_bytes` fp32 bytes
    per device over n devices: an all-to-all of the int8 rows and scales, (N-1)/N x (B/4 + B/block),
    in place of the reduce-scatter's (N-1)/N x B; with `gathered` (zero 0/1) also an all-gather of
    the int8 mean, the same volume again, in place of the all-reduce's second half. Padding each
    row to whole blocks is left out (at most one block per row: N blocks per device)."""
    payload = int8_bytes(grad_bytes, block)
    out = {"all-to-all": ring_traffic("all-to-all", payload, n)}
    if gathered:
        out["all-gather"] = ring_traffic("all-gather", payload, n)
    return out


# ---- tensor and expert parallelism ----
def megatron_allreduce_bytes(tokens_per_device: float, width: int, tensor: int, layers: float, per_layer: int,
                             act_bytes: int) -> float:
    """Tensor parallelism: `per_layer` activation all-reduces of [b, s, h] per layer (2 forward, 2
    backward, 2 more when remat reruns the forward), each 2(T-1)/T x b s h bytes on the links;
    sequence parallelism replaces each by a reduce-scatter and an all-gather of the same volume."""
    return per_layer * layers * ring_traffic("all-reduce", tokens_per_device * width * act_bytes, tensor)


def moe_all_to_all_bytes(buffer_bytes: float, expert_axis: int, moe_layers: float, passes: int = 4,
                         count_bytes: float = 0) -> float:
    """Expert parallelism: per MoE layer the dispatch buffer (models/experts.py `dispatch_bytes`) goes
    to the experts' devices and back, in the forward and again in the backward (4 all-to-alls; 6
    when remat reruns the forward), each (N-1)/N x its bytes over the expert axis (N = its size);
    dropless routing also sends `count_bytes` (an int32 count per expert) once per forward run."""
    forward_runs = passes // 2 - 1
    return moe_layers * (passes * ring_traffic("all-to-all", buffer_bytes, expert_axis)
                         + forward_runs * ring_traffic("all-to-all", count_bytes, expert_axis))


# ---- context parallelism ----
def ulysses_all_to_all_bytes(tokens_per_device: float, heads: float, kv_heads: float, head_dim: int, degree: int,
                             act_bytes: int, passes: int = 2) -> float:
    """Ulysses context parallelism (meshtrain/ops/ulysses.py), one layer: q, k and v all-to-all'd
    from sequence- to head-sharded and the output back (4 all-to-alls) per forward run, their
    transposes in the backward (4 more; `passes` 3 when remat reruns the forward), each (u-1)/u of
    the tensor's local bytes over a group of u = `degree` devices: q and the output
    tokens x heads x head_dim, k and v tokens x kv_heads x head_dim (heads per tensor shard)."""
    local = tokens_per_device * (2 * heads + 2 * kv_heads) * head_dim * act_bytes
    return passes * ring_traffic("all-to-all", local, degree)
