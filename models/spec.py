"""The family protocol: what a model family declares, and the architecture fields all families share.

A family is one module of models/ with a `FAMILY = Family(...)`, registered in models/__init__.py:
- `spec`: its architecture, a `ModelSpec` (sub)class. The fields below are every family's; a family
  adds its own (each a `setting`: default, meaning, range), so a dense model has no MoE fields.
  `model.family` in a config picks the class; the other `model:` keys are its fields, flat.
- `model`: its `LanguageModel` (models/base.py: the protocol the library trains through),
  which holds its modules, the logical axes of its parameters (`param_axes`) and its counts
  (`num_params`, `active_matmul_params` and `flops_per_token`, the FLOPs model's N and 6N + 12LHKS;
  `block_matmul_params`, N less the head, and `fp8_matmul_params`, the part of it that runs in fp8;
  `slot_matmul_params`, what the step runs beyond N: capacity routing's every expert slot, dropless
  expert parallelism's whole receive buffer; `dispatch_bytes`, a routed-expert layer's dispatch buffer).
- `hf`: its Hugging Face form (`HFMap`: the config.json model types it imports, the tensor name map,
  the config translation both ways), which meshtrain/interop/hf.py reads; None when it has none.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from meshtrain.core.bounds import Applies, setting
from meshtrain.core.errors import UserError

FAMILY_HELP = "model family (docs/families.md); it decides which other model keys exist"
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections an adapter may sit on


@dataclass
class LoraSpec:
    """Low-rank adapters (Hu et al. 2021, LoRA) on the chosen projections (docs/fine-tuning.md):
    y = x W + (alpha / rank) dropout(x) A B, A [in, rank], B [rank, out], B zero at the start; W frozen.
    The dropout (inverted, in training only) draws its masks as models/lora.py `lora_dropout` says."""
    rank: int = setting(0, "LoRA rank; 0 = no adapters, every weight is trained", min=0)
    alpha: float = setting(16.0, "LoRA scale numerator: the adapters' output is multiplied by alpha / rank",
                           above=0.0, applies=Applies("model.lora.rank"))
    dropout: float = setting(0.0, "dropout on the adapters' input in training (PEFT's lora_dropout); the same mask "
                             "on every layout", min=0.0, below=1.0, applies=Applies("model.lora.rank"))
    targets: list = setting(list(LORA_TARGETS), "the projections that get adapters, of q, k, v, o, gate, up, down "
                                                   "(routed experts: an adapter per expert)",
                            applies=Applies("model.lora.rank"))

    def check(self) -> None:
        """One UserError for targets that are not projections, named twice, or none at all."""
        if not self.rank:
            return
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets or len(set(self.targets)) < len(self.targets):
            raise UserError(f"model.lora.targets={list(self.targets)}: name each of {', '.join(LORA_TARGETS)} "
                            f"at most once, and at least one")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class ModelSpec:
    """The architecture fields every family has (the llama and qwen3 families have no others)."""
    family: str = setting("llama", FAMILY_HELP)
    vocab_size: int = setting(256, "vocabulary size (256 for byte-level text)", min=1)
    num_layers: int = setting(4, "transformer blocks", min=1)
    d_model: int = setting(128, "model width", min=1)
    num_heads: int = setting(4, "query heads", min=1)
    num_kv_heads: int = setting(4, "key/value heads (fewer than num_heads: grouped-query attention)", min=1)
    head_dim: int = setting(0, "width of one head; 0 = d_model / num_heads", min=0)
    mlp_dim: int = setting(0, "SwiGLU hidden width (of each expert in a mixture-of-experts family); 0 = 8/3 x "
                              "d_model rounded up to a multiple of 64", min=0)
    rope_theta: float = setting(10000.0, "rotary embedding base", min=1.0)
    rope_scaling: str = setting("none", "rotary frequency rescaling for long context: none, llama3 (Llama "
                                        "3.1+: the rope_* keys below), linear (every frequency / rope_factor) or "
                                        "yarn (YaRN, DeepSeek-V3, Qwen: rope_factor, rope_original_max_len, "
                                        "rope_beta_*, rope_mscale*)",
                                choices=("none", "llama3", "linear", "yarn"))
    rope_factor: float = setting(8.0, "llama3, linear and yarn rope scaling: low (linear: all) frequencies are "
                                      "divided by this", min=1.0)
    rope_low_freq_factor: float = setting(1.0, "llama3 rope scaling: wavelengths above original_max_len / "
                                               "this are scaled", above=0.0)
    rope_high_freq_factor: float = setting(4.0, "llama3 rope scaling: wavelengths below original_max_len / "
                                                "this are kept", above=0.0)
    rope_original_max_len: int = setting(8192, "llama3 and yarn rope scaling: the context length of pre-training",
                                         min=1)
    rope_beta_fast: float = setting(32.0, "yarn rope scaling: dimensions turning more than this many times over "
                                          "original_max_len keep their frequency", above=0.0)
    rope_beta_slow: float = setting(1.0, "yarn rope scaling: dimensions turning fewer than this many times are "
                                         "divided by rope_factor (a linear ramp between)", above=0.0)
    rope_mscale: float = setting(0.0, "yarn rope scaling: cos and sin are scaled by m(rope_mscale) / "
                                      "m(rope_mscale_all_dim), m(s) = 0.1 s ln(rope_factor) + 1; 0 (either): by "
                                      "m(1)", min=0.0)
    rope_mscale_all_dim: float = setting(0.0, "yarn rope scaling: see rope_mscale (deepseek_v3 also multiplies "
                                              "its softmax scale by m(this)^2 when > 0)", min=0.0)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", above=0.0)
    tie_embeddings: bool = setting(True, "the output head reuses the embedding table")
    lora: LoraSpec = setting(LoraSpec(), "low-rank adapters on a frozen base (docs/fine-tuning.md)")

    def __post_init__(self):
        if isinstance(self.lora, dict):  # from a run's record
            self.lora = LoraSpec(**self.lora)

    def trainable(self, path: tuple[str, ...]) -> bool:
        """Whether the parameter at `path` (its dict keys, e.g. ("blocks", "wq")) is trained: the one
        place that decides it (meshtrain/ops/trainable.py splits the trees by it). With LoRA only
        the adapters are; the base is frozen (no gradient, no optimizer state)."""
        return not self.lora.rank or path[-1].startswith("lora_")

    def resolved(self) -> ModelSpec:
        head_dim = self.head_dim or self.d_model // self.num_heads
        mlp_dim = self.mlp_dim or -(-(8 * self.d_model // 3) // 64) * 64
        return dataclasses.replace(self, head_dim=head_dim, mlp_dim=mlp_dim)

    def check(self) -> None:
        """The family's own checks across its keys (meshtrain/config/validate.py runs the shared
        ones first): a one-line UserError naming the key and the fix. None here."""

    def stacked_layers(self) -> int:
        """The layers of the stack `blocks`, which the layer scan runs and pipeline stages split: all."""
        return self.num_layers

    # What code outside models/ asks of any spec; a family with the feature overrides it.
    def routed_experts(self) -> int:
        """Routed experts per block (models/routed.py `RoutedExperts`): none, dense MLPs."""
        return 0

    def shared_experts(self) -> int:
        """Experts every token passes through besides its routed ones: none."""
        return 0

    def dense_first_layers(self) -> int:
        """The first layers with a dense MLP in a routed model, a stack of their own (deepseek_v3): none."""
        return 0

    def mtp_modules(self) -> int:
        """Multi-token prediction modules, training only (deepseek_v3): none."""
        return 0

    def rope_width(self) -> tuple[str, int]:
        """(the key that sets it, the channels per head rotary embeddings rotate), for errors that name
        the family's own key: the whole head here."""
        return "head_dim", self.resolved().head_dim

    def latent_rank(self) -> int:
        """The width of a compressed key/value latent (models/latent_attention.py): 0, keys and values
        per kv head."""
        return 0

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding attention window, in model order (0: full causal attention)."""
        return (0,) * self.num_layers

    def window_kinds(self) -> tuple[int, ...]:
        """The distinct windows of `layer_windows`, sorted: a layer's kind is its index here."""
        return tuple(sorted(set(self.layer_windows())))

    def cached_values(self) -> int:
        """The values a layer caches per position (resolved spec): a key and a value per kv head, 2 G K
        (split over `tensor` with the heads, unless the cache is latent)."""
        return 2 * self.num_kv_heads * self.head_dim

    def cached_positions(self, positions: int) -> int:
        """The KV-cache positions generation keeps, summed over layers, for `positions` in all: a
        windowed layer keeps its window's (a ring buffer), the others all."""
        return sum(min(w, positions) if w else positions for w in self.layer_windows())

    def architecture(self) -> dict:
        """What defines the weights (resolved): a checkpoint resumes only into the same one."""
        resolved = self.resolved()
        unused = {"rope_low_freq_factor", "rope_high_freq_factor"} if self.rope_scaling != "llama3" else set()
        unused |= {"rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim"} \
            if self.rope_scaling != "yarn" else set()
        unused |= {"rope_original_max_len"} if self.rope_scaling not in ("llama3", "yarn") else set()
        unused |= {"rope_factor"} if self.rope_scaling == "none" else set()
        value = lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        return {f.name: value(getattr(resolved, f.name)) for f in dataclasses.fields(self)
                if f.metadata["architecture"] and f.name not in unused}

    def architecture_difference(self, other: ModelSpec, here: str, there: str) -> str | None:
        """'<there> has model.d_model=32, <here> has 64 (and 2 more keys differ)', or None when both
        define the same weights."""
        mine, theirs = self.architecture(), other.architecture()
        differ = [k for k in mine if theirs.get(k) != mine[k]] + [k for k in theirs if k not in mine]
        if not differ:
            return None
        more = f" (and {len(differ) - 1} more keys differ)" if len(differ) > 1 else ""
        return f"{there} has model.{differ[0]}={theirs.get(differ[0])}, {here} has {mine.get(differ[0])}{more}"


class HFConfig(dict):
    """A Hugging Face config.json being translated, which names itself (`path`) in its errors."""

    def __init__(self, values: dict, path):
        super().__init__(values)
        self.path = path

    def need(self, key: str, table: dict | None = None):
        """table[key] (table: this config), or a UserError saying the file lacks it."""
        table = self if table is None else table
        if key not in table:
            raise UserError(f"{self.path} lacks {key!r}, which a {self.get('model_type')} config.json has; the "
                            f"file is incomplete")
        return table[key]

    def refuse(self, **bad: Callable) -> None:
        """A UserError for the first key present whose value `bad[key](value)` says meshtrain does
        not compute: never an approximation."""
        for key, is_bad in bad.items():
            if key in self and is_bad(self[key]):
                raise UserError(f"{self.path}: {key}={self[key]!r} is not implemented by meshtrain's "
                                f"{self.get('model_type')} model; this checkpoint cannot be imported exactly")


@dataclass(frozen=True)
class HFMap:
    """A family's Hugging Face form. `tensors`: our parameter path -> (the Hugging Face name, with
    {i} for the layer and {j} for the expert, and whether it is a linear weight [out, in]);
    `read(HFConfig) -> spec` and `write(resolved spec) -> dict` translate config.json (`write`
    leaves out the dtype, which the exporter adds); `layer_offset(spec, path)`: the Hugging Face
    index of the first layer a stacked parameter holds (0 but where a family keeps its layers in
    more than one stack)."""
    model_types: tuple[str, ...]
    tensors: dict
    read: Callable[[HFConfig], ModelSpec]
    write: Callable[[ModelSpec], dict]
    layer_offset: Callable[[ModelSpec, tuple], int] = lambda spec, path: 0


@dataclass(frozen=True)
class Family:
    """One model family (see the module doc). Calling it builds its model:
    `FAMILIES[spec.family](spec, attention=..., sequence_order=...)`."""
    name: str
    help: str
    spec: type
    model: type
    hf: HFMap | None = None

    def __call__(self, spec: ModelSpec, **kwargs):
        return self.model(spec, **kwargs)

    def fields(self) -> list:
        """The fields this family adds to the shared ones (`ModelSpec`)."""
        shared = {f.name for f in dataclasses.fields(ModelSpec)}
        return [f for f in dataclasses.fields(self.spec) if f.name not in shared]


def family_setting(name: str):
    """A family's own `family` field: its name as the default."""
    return setting(name, FAMILY_HELP)
