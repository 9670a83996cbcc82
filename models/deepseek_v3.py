"""The `deepseek_v3` family: DeepSeek-V3's decoder (Liu et al. 2024; DeepSeek-V2's attention, Moonlight,
Kimi K2): multi-head latent attention and DeepSeek MoE. Hugging Face form: `DeepseekV3ForCausalLM`.

Multi-head latent attention: models/latent_attention.py (`MLABlock`), its yarn softmax gain the spec's
`softmax_gain`; generation caches the latent only.

DeepSeek MoE (models/experts.py `moe_mlp` with its `Router` options): `num_shared_experts` experts every
token passes through beside its routed ones; sigmoid scores; `router_bias` (transformers'
e_score_correction_bias, aux-loss-free balancing) added for the choice only, outside the gradient and
the optimizer, and moved by the step when model.router_bias_update_rate > 0; group-limited top-k
(`router_groups`, `router_topk_groups`); gates renormalised (`norm_topk_prob`) and x
`routed_scaling_factor`. The first `first_k_dense_replace` layers have a dense SwiGLU MLP of
`dense_mlp_dim` instead: they are a second stack, `dense_blocks`, run by `embed` (so the stacked
`blocks` the layer scan and pipeline stages split stay alike); they run without the remat policy.
On a pipeline they are outer parameters (logical axis `outer_layers`, whole on every stage) and the
first stage runs them with the embedding, rerunning their forward for its embedding gradient: its
ticks are longer by their work (the planner prices it: meshtrain/planner/roofline.py). The sequence-wise balance loss is
model.router_aux_loss (models/experts.py's aux_loss is DeepSeek-V3's eq. 17-20).

Multi-token prediction (DeepSeek-V3 section 2.2, model.mtp_depth D > 0): D sequential `MTPModule`s,
the stack `mtp`, on the trunk's last hidden state, sharing the embedding and head; the train step adds
mtp_loss_weight x the mean of their losses (`mtp_losses`, meshtrain/objectives/next_token.py).
Training only (`training_only`): generation, evaluation and export use the trunk.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.core.bounds import setting
from meshtrain.core.errors import UserError
from meshtrain.core.metrics import flops_per_token
from meshtrain.models.base import (
    RESIDUAL,
    Block,
    LanguageModel,
    RMSNorm,
    Transformer,
    _init,
    scan_blocks,
    stacked_blocks,
)
from meshtrain.models.experts import Router
from meshtrain.models.hf_llama import LAYER, LLAMA_TENSORS, read_llama_config, write_llama_config
from meshtrain.models.latent_attention import MLA_AXES, MLABlock
from meshtrain.models.rope import yarn_mscale
from meshtrain.models.routed import MOE_PARAM_AXES, MoEBlock, MoELanguageModel, RoutedExperts
from meshtrain.models.spec import Family, HFConfig, HFMap, family_setting
from meshtrain.ops.loss import cross_entropy
from meshtrain.parallel.sharding import constrain


@dataclass
class DeepSeekV3Spec(RoutedExperts):
    """head_dim resolves to qk_nope_head_dim + qk_rope_head_dim and num_kv_heads to num_heads (MLA);
    mlp_dim is one routed expert's width (moe_intermediate_size)."""
    family: str = family_setting("deepseek_v3")
    router_aux_loss: float = setting(0.0, "weight of the load-balancing loss (sequence-wise); DeepSeek-V3 "
                                          "balances by the router bias instead", min=0.0, architecture=False)
    router_z_loss: float = setting(0.0, "weight of the router z-loss (mean squared logsumexp of the router "
                                        "logits)", min=0.0, architecture=False)
    q_lora_rank: int = setting(0, "rank of the query compression (q_a_proj); 0 = a full-rank q projection "
                                  "(DeepSeek-V2-Lite, Moonlight)", min=0)
    kv_lora_rank: int = setting(512, "width of the compressed key/value latent", min=1)
    qk_nope_head_dim: int = setting(128, "query/key channels per head without rotary embeddings", min=1)
    qk_rope_head_dim: int = setting(64, "query/key channels per head with rotary embeddings (the key's shared "
                                        "by all heads)", min=2)
    v_head_dim: int = setting(128, "value channels per head", min=1)
    num_shared_experts: int = setting(1, "experts every token passes through besides its routed ones", min=0)
    first_k_dense_replace: int = setting(1, "the first layers with a dense MLP instead of experts", min=0)
    dense_mlp_dim: int = setting(0, "SwiGLU width of the dense layers (intermediate_size); 0 = mlp_dim x "
                                    "(experts_per_token + num_shared_experts)", min=0)
    router_groups: int = setting(1, "expert groups of the group-limited top-k (n_group)", min=1)
    router_topk_groups: int = setting(1, "groups a token's experts are chosen from (topk_group)", min=1)
    routed_scaling_factor: float = setting(1.0, "routed experts' gates are multiplied by this", above=0.0)
    norm_topk_prob: bool = setting(True, "renormalise a token's k gates to sum 1 (before the scaling factor)")
    rope_interleave: bool = setting(True, "the rope channels come in interleaved pairs (transformers' "
                                          "rope_interleave, DeepSeek's checkpoints)")
    mtp_depth: int = setting(0, "multi-token prediction modules D (DeepSeek-V3 section 2.2: module k predicts the "
                                "token k + 1 ahead, sharing the embedding and head); 0 = off", min=0)
    mtp_loss_weight: float = setting(0.3, "lambda: the training objective adds lambda / D x the sum of the MTP "
                                          "modules' losses", min=0.0, architecture=False)

    def resolved(self) -> DeepSeekV3Spec:
        r = super().resolved()
        dense = self.dense_mlp_dim or r.mlp_dim * (self.experts_per_token + self.num_shared_experts)
        return dataclasses.replace(r, head_dim=self.qk_nope_head_dim + self.qk_rope_head_dim,
                                   num_kv_heads=self.num_heads, dense_mlp_dim=dense)

    def has_router_bias(self) -> bool:
        return True  # transformers' e_score_correction_bias, moved only when router_bias_update_rate > 0

    def check(self) -> None:
        super().check()
        E, G = self.num_experts, self.router_groups
        if self.lora.rank:
            raise UserError("model.lora: adapters on deepseek_v3's latent attention (q_a/q_b/kv_a/kv_b) and its dense "
                            "first layers are not implemented yet; train it without model.lora")
        if not E:
            raise UserError("model.num_experts=0: deepseek_v3 routes to experts after its first_k_dense_replace "
                            "layers; set model.num_experts (DeepSeek-V3: 256, Moonlight: 64)")
        if self.first_k_dense_replace >= self.num_layers:
            raise UserError(f"model.first_k_dense_replace={self.first_k_dense_replace} leaves none of the "
                            f"{self.num_layers} layers routed; make it smaller than model.num_layers")
        if E % G or E // G < 2 or self.router_topk_groups > G:
            raise UserError(f"model.router_groups={G} must divide model.num_experts={E} into groups of 2 or more, "
                            f"and model.router_topk_groups={self.router_topk_groups} be at most that many")
        if self.experts_per_token > self.router_topk_groups * (E // G):
            raise UserError(f"model.experts_per_token={self.experts_per_token} exceeds the experts of "
                            f"model.router_topk_groups={self.router_topk_groups} groups ({E // G} each)")
        if self.qk_rope_head_dim % 2 or self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise UserError("model.qk_rope_head_dim must be even and model.v_head_dim at most qk_nope_head_dim + "
                            "qk_rope_head_dim (values are padded to the query/key width for the kernel)")

    def shared_experts(self) -> int:
        return self.num_shared_experts

    def dense_first_layers(self) -> int:
        return self.first_k_dense_replace

    def mtp_modules(self) -> int:
        return self.mtp_depth

    def rope_width(self) -> tuple[str, int]:
        return "qk_rope_head_dim", self.qk_rope_head_dim  # MLA rotates the decoupled channels only

    def latent_rank(self) -> int:
        return self.kv_lora_rank

    def stacked_layers(self) -> int:
        """The routed layers: the dense first ones are the stack `dense_blocks`."""
        return self.num_layers - self.first_k_dense_replace

    def cached_values(self) -> int:
        """Per layer and position, MLA's cache holds the normalised latent and the rotated rope key:
        kv_lora_rank + qk_rope_head_dim values, whatever the heads."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_gain(self) -> float:
        """What the softmax scale (Kn + Kr)^-1/2 is multiplied by: yarn's m(rope_mscale_all_dim)^2."""
        if self.rope_scaling == "yarn" and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        return 1.0


class DenseBlock(MLABlock):
    """A first_k_dense_replace layer: MLA and a dense SwiGLU of dense_mlp_dim."""

    def init_mlp(self, cfg, rngs: nnx.Rngs):
        Block.init_mlp(self, cfg, rngs, width=cfg.dense_mlp_dim)


class RoutedBlock(MLABlock, MoEBlock):
    """MLA and DeepSeek MoE: shared experts (MoEBlock's dense SwiGLU of num_shared_experts x mlp_dim),
    routed ones, and the router's selection bias."""

    def routing(self) -> Router:
        c = self.cfg
        return Router("sigmoid", c.router_groups, c.router_topk_groups, c.norm_topk_prob, c.routed_scaling_factor)

    def mlp(self, h_BxLxD):
        return self.moe(h_BxLxD, router=self.routing(), bias_E=self.router_bias[...])


def ahead(a_BxL, k: int, fill: int, order=None):
    """a[:, i + k] at position i, `fill` past the row's end, i in true order: with a `sequence_order`
    (context parallelism stores the sequence permuted: stored[:, j] = true[:, order[j]]) the shift runs
    on the true order and the result is stored as `a` is."""
    true_BxL = a_BxL if order is None else a_BxL[:, np.argsort(order)]
    shifted_BxL = jnp.pad(true_BxL[:, k:], ((0, 0), (0, k)), constant_values=fill)
    return shifted_BxL if order is None else shifted_BxL[:, order]


class MTPModule(nnx.Module):
    """Multi-token prediction module k (DeepSeek-V3 section 2.2, eq. 21-22): h'_i = M_k [enorm(Emb(t_{i+k}));
    hnorm(h^{k-1}_i)] (the released checkpoints' eh_proj order; the paper writes [h; e]), then one block
    (a dense one here: MLA and the dense SwiGLU of dense_mlp_dim, where DeepSeek-V3's is MoE), h^k its
    output; `norm` is its own final norm before the shared head."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        D = cfg.d_model
        self.enorm = RMSNorm(D, cfg.norm_eps)
        self.hnorm = RMSNorm(D, cfg.norm_eps)
        self.mtp_proj = nnx.Param(_init(0, 1)(rngs.params(), (2 * D, D)))
        self.block = DenseBlock(cfg, rngs)
        self.norm = RMSNorm(D, cfg.norm_eps)

    def __call__(self, h_BxLxD, e_BxLxD, attend, positions_L=None, docs=None):
        x_BxLx2D = jnp.concatenate([self.enorm(e_BxLxD), self.hnorm(h_BxLxD)], axis=-1)
        x_BxLxD = constrain(self.block.einsum("blc,cd->bld", x_BxLx2D, self.mtp_proj[...]), RESIDUAL)
        return self.block(x_BxLxD, attend, positions_L, docs)[0]


class DeepSeekTransformer(Transformer):
    block_type = RoutedBlock

    def __init__(self, cfg, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        if cfg.first_k_dense_replace:
            self.dense_blocks = stacked_blocks(DenseBlock, cfg, rngs, cfg.first_k_dense_replace)
        if cfg.mtp_depth:
            self.mtp = stacked_blocks(MTPModule, cfg, rngs, cfg.mtp_depth)


class DeepSeekV3LanguageModel(MoELanguageModel):
    module = DeepSeekTransformer
    # mtp_proj [2D, D]: its input the two normalized halves
    param_axes = {**MOE_PARAM_AXES, **MLA_AXES, "mtp_proj": ("mtp_in", "embed")}
    stacks = ("blocks", "dense_blocks", "mtp")
    training_only = ("mtp",)  # the multi-token prediction modules
    embed_stacks = ("dense_blocks",)  # the dense first layers

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        abstract = nnx.eval_shape(lambda: self.module(self.cfg, nnx.Rngs(0)))
        if self.cfg.first_k_dense_replace:
            self._dense_graphdef = nnx.graphdef(abstract.dense_blocks)
        if self.cfg.mtp_depth:
            self._mtp_graphdef = nnx.graphdef(abstract.mtp)

    def dense_block(self, params_i, x_BxLxD, docs=None):
        block = nnx.merge(self._dense_graphdef, params_i)
        block.einsum = self.matmul
        return block(x_BxLxD, self.attention, self.sequence_order, docs)

    def embed(self, params, tokens_BxL):
        """The embedding, then the dense layers (tokens in the stored sequence order); on a pipeline,
        the first stage's."""
        x_BxLxD = super().embed(params, tokens_BxL)
        if "dense_blocks" not in params:
            return x_BxLxD
        docs = []
        if self.packing is not None:  # the documents of the tokens in true order, stored as they are
            order = self.sequence_order
            true_BxL = tokens_BxL if order is None else tokens_BxL[:, np.argsort(order)]
            docs = [self.packing.documents(true_BxL, order)]
        return scan_blocks(self.dense_block, params["dense_blocks"], x_BxLxD, *docs)[0]

    def mtp_targets(self, targets_BxL, docs=None):
        """[M, B, L] (M = mtp_depth): depth k's target at position i, targets[i + k] (t_{i+k+1}), and
        < 0 (not trained) where i + k is past the row, the target is masked in the main loss, or, with
        packed `docs`, t_{i+k} lies in another document than position i (positions in true order,
        stored in the model's `sequence_order` as `targets_BxL` is)."""
        out, order = [], self.sequence_order
        for k in range(1, self.cfg.mtp_depth + 1):
            t_BxL = ahead(targets_BxL, k, -1, order)
            if docs is not None:
                t_BxL = jnp.where(ahead(docs.segments, k, -1, order) == docs.segments, t_BxL, -1)
            out.append(t_BxL)
        return jnp.stack(out)

    def mtp_shares(self, targets_BxL, docs=None):
        """[M]: the fraction of the B x L positions each depth trains (at least one position's), on
        the step's whole batch: `mtp_losses` divides by it, so each L_k is a mean over its trained
        positions on every layout and microbatch split (as step.trained_share does for the main loss)."""
        trained_MxBxL = self.mtp_targets(targets_BxL, docs) >= 0
        return jnp.maximum(jnp.mean(trained_MxBxL, axis=(1, 2), dtype=jnp.float32), 1.0 / targets_BxL.size)

    def mtp_losses(self, params, h_BxLxD, inputs_BxL, targets_BxL, docs, shares_M):
        """[M]: L_k (DeepSeek-V3 eq. 24), each depth's cross-entropy over its trained positions,
        `shares_M` those of the whole step batch (`mtp_shares`). h^0 = `h_BxLxD`, the trunk's last
        hidden state before the final norm; the modules run in sequence (h^k feeds module k + 1)
        with the shared embedding and head; the token k ahead's input id is 0 past the row's end (its
        target is untrained there)."""
        M, (B, L) = self.cfg.mtp_depth, inputs_BxL.shape
        # The embeddings and the head's losses run outside the depths' loop: a shared weight's
        # gradient reduced inside a loop is reduced once per depth (deepseek_v3_tiny on data=2,expert=4
        # with M = 2: the expert-axis all-reduce 1.36x its formula); outside, once for all depths (one
        # lookup of the M shifted rows side by side; XLA adds the M head gradients before reducing).
        ids_BxML = jnp.concatenate([ahead(inputs_BxL, k, 0, self.sequence_order) for k in range(1, M + 1)], axis=1)
        rows_MxBxLxD = jnp.moveaxis(LanguageModel.embed(self, params, ids_BxML).reshape(B, M, L, -1), 1, 0)

        def depth(h_BxLxD, xs):
            params_k, rows_BxLxD = xs
            module = nnx.merge(self._mtp_graphdef, params_k)
            module.block.einsum = self.matmul
            h_BxLxD = module(h_BxLxD, rows_BxLxD, self.attention, self.sequence_order, docs)
            return h_BxLxD, module.norm(h_BxLxD)

        normed_MxBxLxD = jax.lax.scan(depth, h_BxLxD, (params["mtp"], rows_MxBxLxD))[1]
        head_DxV, targets_MxBxL = self.unembedding(params), self.mtp_targets(targets_BxL, docs)
        return jnp.stack([cross_entropy(normed_MxBxLxD[k], head_DxV, targets_MxBxL[k]) / shares_M[k]
                          for k in range(M)])

    def active_matmul_params(self, params) -> int:
        """The MoE count (the MTP modules' parameters included, dense), plus the head's V x D once
        more per MTP depth: each depth multiplies by the shared head again."""
        return super().active_matmul_params(params) + self.cfg.mtp_depth * self.cfg.vocab_size * self.cfg.d_model

    def block_matmul_params(self, params) -> int:
        """Less every head matmul (the trunk's and each MTP depth's; they run in the loss, bf16)."""
        return super().block_matmul_params(params) - self.cfg.mtp_depth * self.cfg.vocab_size * self.cfg.d_model

    @property
    def routed_layers(self) -> int:
        return self.cfg.stacked_layers()

    @property
    def mtp_depth(self) -> int:
        return self.cfg.mtp_depth

    def flops_per_token(self, params, seq_len: int) -> float:
        """6N + 6 L H (Kn + Kr + Kv) S: QK^T over Kn + Kr channels, PV over Kv (the 12 L H K S of
        meshtrain/core/metrics.py with K their mean)."""
        c = self.cfg  # each MTP module's block attends as a layer does
        return flops_per_token(self.active_matmul_params(params), c.num_layers + c.mtp_depth,
                               c.num_heads * (c.head_dim + c.v_head_dim) / 2, seq_len,
                               c.layer_windows() + (0,) * c.mtp_depth)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """An empty compressed-latent cache: for each stack (the dense first layers' and the routed
        ones'), [layers, B, T, kv_lora_rank + qk_rope_head_dim] (`MLABlock.decode`)."""
        c = self.cfg
        layers = {"dense_blocks": c.first_k_dense_replace, "blocks": self.routed_layers}
        return {stack: jnp.zeros((n, batch, max_len, c.cached_values()), dtype) for stack, n in layers.items() if n}

    @functools.cached_property
    def _decode_graphdefs(self) -> dict:
        abstract = nnx.eval_shape(lambda: self.module(self.decoding_spec(), nnx.Rngs(0)))
        return {stack: nnx.graphdef(getattr(abstract, stack)) for stack in self.stacks if hasattr(abstract, stack)}

    def decode(self, params, tokens_BxL, cache, start_B, window: int | None = None, ends_B=None):
        """`LanguageModel.decode` on the latent cache: the embedding, then the dense layers' scan and
        the routed layers' (`MLABlock.decode`), each stack with its own cache."""
        def run(x_BxLxD, stack):
            def layer(x_BxLxD, xs):
                params_i, cache_BxTxA = xs
                return nnx.merge(self._decode_graphdefs[stack], params_i).decode(x_BxLxD, cache_BxTxA, start_B,
                                                                                  window)
            return jax.lax.scan(layer, x_BxLxD, (params[stack], cache[stack]))

        x_BxLxD, written = LanguageModel.embed(self, params, tokens_BxL), {}
        for stack in ("dense_blocks", "blocks"):
            if stack in cache:
                x_BxLxD, written[stack] = run(x_BxLxD, stack)
        return x_BxLxD, written


# ---- its Hugging Face form: DeepseekV3ForCausalLM ----

ATTENTION = {"attn_norm": ("input_layernorm", False), "mlp_norm": ("post_attention_layernorm", False),
             "wq": ("self_attn.q_proj", True), "wq_a": ("self_attn.q_a_proj", True),
             "q_norm": ("self_attn.q_a_layernorm", False), "wq_b": ("self_attn.q_b_proj", True),
             "wkv_a": ("self_attn.kv_a_proj_with_mqa", True), "kv_norm": ("self_attn.kv_a_layernorm", False),
             "wkv_b": ("self_attn.kv_b_proj", True), "wo": ("self_attn.o_proj", True)}


def _layer_tensors(stack: str, mlp: dict) -> dict:
    path = lambda name: (stack, name, "scale") if "norm" in name else (stack, name)
    return {path(ours): (LAYER + hf + ".weight", linear) for ours, (hf, linear) in {**ATTENTION, **mlp}.items()}


EXPERT = LAYER + "mlp.experts.{j}."
TENSORS = {
    **{path: name for path, name in LLAMA_TENSORS.items() if path[0] != "blocks"},
    **_layer_tensors("dense_blocks", {"w_gate": ("mlp.gate_proj", True), "w_up": ("mlp.up_proj", True),
                                      "w_down": ("mlp.down_proj", True)}),
    **_layer_tensors("blocks", {"w_gate": ("mlp.shared_experts.gate_proj", True),
                                "w_up": ("mlp.shared_experts.up_proj", True),
                                "w_down": ("mlp.shared_experts.down_proj", True),
                                "router": ("mlp.gate", True)}),
    ("blocks", "router_bias"): (LAYER + "mlp.gate.e_score_correction_bias", False),
    ("blocks", "expert_gate"): (EXPERT + "gate_proj.weight", True),
    ("blocks", "expert_up"): (EXPERT + "up_proj.weight", True),
    ("blocks", "expert_down"): (EXPERT + "down_proj.weight", True),
}


def read_deepseek_v3(c: HFConfig) -> DeepSeekV3Spec:
    """Hugging Face routes dropless (capacity_factor 0) with no auxiliary losses. Multi-token
    prediction layers (num_nextn_predict_layers) are not read: a file holding them is refused."""
    c.refuse(topk_method=lambda v: v != "noaux_tc", scoring_func=lambda v: v != "sigmoid",
             n_shared_experts=lambda v: not v)
    heads = c.need("num_attention_heads")
    return read_llama_config(
        c, DeepSeekV3Spec, num_kv_heads=heads, head_dim=c.need("qk_nope_head_dim") + c.need("qk_rope_head_dim"),
        mlp_dim=c.need("moe_intermediate_size"), dense_mlp_dim=c.need("intermediate_size"),
        num_experts=c["n_routed_experts"] if "n_routed_experts" in c else c.need("num_local_experts"),
        experts_per_token=c.need("num_experts_per_tok"), capacity_factor=0.0, router_aux_loss=0.0,
        router_z_loss=0.0, q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c.need("kv_lora_rank"),
        qk_nope_head_dim=c.need("qk_nope_head_dim"), qk_rope_head_dim=c.need("qk_rope_head_dim"),
        v_head_dim=c.need("v_head_dim"), num_shared_experts=c.need("n_shared_experts"),
        first_k_dense_replace=c.need("first_k_dense_replace"), router_groups=c.get("n_group") or 1,
        router_topk_groups=c.get("topk_group") or 1, routed_scaling_factor=float(c.need("routed_scaling_factor")),
        norm_topk_prob=bool(c.need("norm_topk_prob")), rope_interleave=bool(c.get("rope_interleave", True)))


def write_deepseek_v3(m: DeepSeekV3Spec) -> dict:
    config = write_llama_config(m, "deepseek_v3", "DeepseekV3ForCausalLM")
    del config["mlp_bias"]
    return {**config, "head_dim": m.qk_rope_head_dim, "intermediate_size": m.dense_mlp_dim,
            "moe_intermediate_size": m.mlp_dim, "n_routed_experts": m.num_experts,
            "n_shared_experts": m.num_shared_experts, "num_experts_per_tok": m.experts_per_token,
            "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "first_k_dense_replace": m.first_k_dense_replace,
            "n_group": m.router_groups, "topk_group": m.router_topk_groups,
            "routed_scaling_factor": m.routed_scaling_factor, "norm_topk_prob": m.norm_topk_prob,
            "rope_interleave": m.rope_interleave, "num_nextn_predict_layers": 0}


FAMILY = Family("deepseek_v3", "DeepSeek-V3: multi-head latent attention, shared + routed experts with sigmoid, "
                               "bias-balanced, group-limited routing, the first layers dense",
                DeepSeekV3Spec, DeepSeekV3LanguageModel,
                HFMap(("deepseek_v3",), TENSORS, read_deepseek_v3, write_deepseek_v3,
                      layer_offset=lambda spec, path: spec.first_k_dense_replace if path[0] == "blocks" else 0))
