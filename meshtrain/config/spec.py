"""What is trained, how it runs, how it learns: the config's sections as dataclasses.

- `ModelSpec` (`model:`): the model family and its architecture, declared by the family
  (meshtrain/models/spec.py; each family's spec adds its own keys). Its architecture keys define
  the weights; a checkpoint resumes only into the same ones (`architecture()`).
- `ParallelPlan` (`parallel:`): how the run executes on the devices: mesh axes, logical-axis
  rules, ZeRO stage, precision, remat policy, attention backend, microbatches, pipeline schedule,
  sequence parallelism. Any of it may change on resume.
- `OptimSpec` (`optim:`): how it learns (optimizer, schedule, clipping).
The loop, data, checkpoint, guard and logging sections complete `Config`.

Each setting is declared once, with its default, its meaning (`help`), its allowed values or range
(`Bounds`); the parser, the reference (docs/config.md) and the resume check all read that. The checks
that involve several settings or the mesh live in meshtrain/config/validate.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtrain.core import compile_cache as cache_setting
from meshtrain.core.bounds import Applies, setting
from meshtrain.core.cli import MAX_SIMULATED_DEVICES
from meshtrain.data.sources import KINDS as DATA_KINDS
from meshtrain.models import ModelSpec  # noqa: F401 (the model section: its family's spec, models/spec.py)
from meshtrain.ops.attention import BACKENDS as ATTENTION_BACKENDS
from meshtrain.ops.offload import MODES as OFFLOAD_MODES
from meshtrain.ops.optimizers import LR_SCHEDULES, OPTIMIZERS, describe
from meshtrain.ops.recipes import RECIPES
from meshtrain.ops.remat import POLICIES as REMAT_POLICIES
from meshtrain.parallel.schedules import SCHEDULES


@dataclass
class ParallelPlan:
    mesh: str = setting("data=-1", "'8x8x4' (data x fsdp x tensor [x pipeline]) or named axes "
                                   "'data=2,expert=4' (data, fsdp, tensor, pipeline, expert, context); "
                                   "-1 = the rest")
    zero: int = setting(1, "what the data axis shards: 0 nothing, 1 optimizer state, 2 + gradients, "
                           "3 + parameters", choices=(0, 1, 2, 3))
    precision: str = setting("fp32", "fp32, or bf16 / fp16 compute with fp32 master weights (fp16 with dynamic "
                                     "loss scaling: the loss_scale_* keys), or fp8: bf16 with the attention "
                                     "projections' and MLP's matmuls in fp8 (e4m3 forward, e5m2 gradients, "
                                     "per-tensor current scaling), or fp8_rowwise: fp8 with a scale per row "
                                     "of each GEMM's operands, or fp8_blockwise (DeepSeek-V3's: e4m3, a scale "
                                     "per 1x128 activation tile and 128x128 weight block; Hopper, Blackwell), "
                                     "or on Blackwell mxfp8 (e4m3, a power-of-2 scale "
                                     "per 32 elements) or nvfp4 (e2m1, an e4m3 scale per 16 and one per tensor; "
                                     "16x16 weight blocks, stochastic gradient rounding, Hadamard-rotated dw "
                                     "operands): docs/precision.md",
                             choices=("fp32", "bf16", "fp16", *RECIPES))
    bf16_layers: list = setting([], "under a low-precision recipe, the layers whose projections and MLP stay bf16, "
                                    "by index (0 the first, -1 the last), e.g. [-2, -1]: the published NVFP4 and "
                                    "MXFP8 recipes keep the last layers in bf16; the rest run the recipe",
                                applies=Applies("parallel.precision", tuple(RECIPES)))
    loss_scale_initial: float = setting(65536.0, "fp16: the loss scale at step 0 (2^16, DeepSpeed's default); an "
                                                 "overflowing step is skipped and halves it", min=1.0,
                                        applies=Applies("parallel.precision", ("fp16",)))
    loss_scale_window: int = setting(1000, "fp16: the scale doubles after this many steps in a row without "
                                           "overflow (Megatron/DeepSpeed: 1000)", min=1,
                                     applies=Applies("parallel.precision", ("fp16",)))
    loss_scale_min: float = setting(1.0, "fp16: the scale never falls below this; at it an overflow is a "
                                         "NaN/Inf step for the guard", above=0.0,
                                    applies=Applies("parallel.precision", ("fp16",)))
    grad_compression: str = setting("none", "the data-parallel gradient reduction: none (fp32), or int8 (blockwise "
                                            "int8 with a scale per block and error feedback, carried over the "
                                            "network as int8)", choices=("none", "int8"))
    compression_block: int = setting(256, "grad_compression=int8: values per quantization block (one fp32 scale "
                                          "each)", min=1, applies=Applies("parallel.grad_compression", ("int8",)))
    rules: dict = setting({}, "logical axis -> mesh axes overrides, e.g. {mlp: [tensor, fsdp]}")
    remat: str = setting("none", "activation rematerialisation policy for each block",
                         choices=tuple(REMAT_POLICIES))
    offload: str = setting("none", "what lives in host memory between steps: none; optimizer (the optimizer "
                                   "state's moments, in pinned host memory, streamed through the device a layer "
                                   "at a time for the update: ZeRO-Offload's offload_optimizer); optimizer+params "
                                   "(and the stacked layers' parameters and gradients, each layer fetched inside "
                                   "its rematerialised block: FSDP's CPU offload)",
                           choices=OFFLOAD_MODES)
    attention: str = setting("auto", "attention backend: auto (cudnn on GPUs where cuDNN takes the model's "
                                     "shapes, else blockwise, with a notice saying why; ring on a context axis "
                                     "that runs the ring; xla elsewhere), xla (forms [B, H, L, L] scores), "
                                     "blockwise (online softmax over blocks of positions, any device), cudnn "
                                     "(fused, GPU, bf16), ring (context parallelism: keys/values passed around "
                                     "the context axis)", choices=("auto", *ATTENTION_BACKENDS))
    context_strategy: str = setting("ring", "how attention spans a `context` axis > 1: ring (parallel.attention=ring: "
                                            "K/V passed around the axis), ulysses (all-to-all to whole sequences "
                                            "of heads/context heads, then the local kernel parallel.attention), "
                                            "hybrid (ulysses within groups of parallel.ulysses_degree devices, "
                                            "the ring across groups)", choices=("ring", "ulysses", "hybrid"))
    ulysses_degree: int = setting(0, "context_strategy=hybrid: devices per all-to-all group; divides the context "
                                     "axis, and the ring runs over context / ulysses_degree groups", min=0,
                                  applies=Applies("parallel.context_strategy", ("hybrid",)))
    microbatches: int = setting(0, "microbatches per step: gradient accumulation, or the pipeline's "
                                   "microbatches (>= stages); 0 = 1 without a pipeline, 2 x stages with one",
                                min=0)
    gather_once: bool = setting(False, "with microbatches: gather the compute-dtype weights over fsdp and "
                                       "context once per step, before the microbatch loop, and keep them for every "
                                       "microbatch (FSDP2's reshard_after_backward=False) instead of again per layer "
                                       "and microbatch; costs a whole compute-dtype copy of the parameters those axes "
                                       "split, in memory. No effect with one microbatch or a pipeline; not with DPO "
                                       "or GRPO")
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism: norms and residuals split along "
                                             "the sequence over the tensor axis (all-gather and reduce-scatter "
                                             "in place of all-reduce)")
    schedule: str = setting("1f1b", "pipeline schedule when the mesh's pipeline axis is > 1 (zb: zero-bubble "
                                    "ZB-H1, weight gradients deferred into the bubbles; dualpipev: DeepSeek's "
                                    "DualPipeV, 2 chunks per device in a V, a forward beside another "
                                    "microbatch's backward in each steady tick)", choices=tuple(SCHEDULES))
    virtual_stages: int = setting(1, "chunks of layers per device (interleaved: 2 or more; dualpipev: 2)", min=1)
    expert_chunks: int = setting(1, "each device's rows of a MoE layer in this many slices under expert "
                                    "parallelism: one slice's dispatch and combine all-to-alls beside another's "
                                    "expert matmuls, for XLA's scheduler to overlap (DeepSeek-V3's two-chunk "
                                    "overlap); the same math", min=1)
    residuals: str = setting("save", "pipeline stages keep each chunk's backward residuals from its forward "
                                     "(save: what parallel.remat lets them keep) or only its input, rerunning "
                                     "the forward in the backward (recompute)", choices=("save", "recompute"))

    def num_microbatches(self, stages: int) -> int:
        """`microbatches`, where 0 means 1 without a pipeline and twice the stages with one."""
        return self.microbatches or (2 * stages if stages > 1 else 1)

    def gathers_once(self, sizes: dict[str, int]) -> bool:
        """Whether the step on mesh `sizes` gathers its weights once, before the microbatch loop
        (`gather_once` with microbatches and no pipeline, fsdp or context splitting the weights; `data`
        under ZeRO 3 with microbatches is gathered once anyway: meshtrain/parallel/data_parallel.py)."""
        return (self.gather_once and sizes.get("pipeline", 1) == 1 and self.num_microbatches(1) > 1
                and sizes.get("fsdp", 1) * sizes.get("context", 1) > 1)


@dataclass
class OptimSpec:
    optimizer: str = setting("adamw", "the optimizer (meshtrain/ops/optimizers.py): " + describe(OPTIMIZERS),
                             choices=tuple(OPTIMIZERS))
    lr: float = setting(1e-3, "peak learning rate", min=0.0)
    schedule: str = setting("cosine", "learning rate after the linear warmup: cosine (decay to lr x min_lr_ratio), "
                                      "linear (decay to it), wsd (warmup-stable-decay: lr, then a linear decay to "
                                      "it over the horizon's last decay_fraction), constant (lr)",
                            choices=tuple(LR_SCHEDULES))
    min_lr_ratio: float = setting(0.1, "cosine, linear and wsd decay to lr x min_lr_ratio at the schedule's last "
                                       "step", min=0.0, max=1.0,
                                  applies=Applies("optim.schedule", ("cosine", "linear", "wsd")))
    decay_fraction: float = setting(0.2, "wsd: the share of the schedule's horizon that decays", above=0.0, max=1.0,
                                    applies=Applies("optim.schedule", ("wsd",)))
    schedule_steps: int = setting(0, "the schedule's horizon: warmup + decay span this many steps, then lr stays "
                                     "at its last value; 0 = train.steps of the run's first start (recorded in "
                                     "<out>/run.json, so resuming with more --steps continues the same curve)",
                                  min=0)
    warmup_steps: int = setting(20, "linear warmup steps", min=0)
    weight_decay: float = setting(0.1, "decoupled weight decay on matrices (not norms)", min=0.0)
    b1: float = setting(0.9, "Adam beta1 (Lion: the update's interpolation beta)", min=0.0, below=1.0)
    b2: float = setting(0.95, "Adam beta2 (Lion: the momentum's beta)", min=0.0, below=1.0)
    eps: float = setting(1e-8, "Adam epsilon", above=0.0)
    muon_momentum: float = setting(0.95, "muon: Nesterov momentum of the matrices' updates", min=0.0, below=1.0,
                                   applies=Applies("optim.optimizer", ("muon",)))
    muon_ns_steps: int = setting(5, "muon: Newton-Schulz iterations that orthogonalise each matrix's update",
                                 min=1, max=100, applies=Applies("optim.optimizer", ("muon",)))
    clip_norm: float = setting(1.0, "global gradient-norm clipping; 0 disables it", min=0.0)


@dataclass
class DataConfig:
    path: str = setting("", "text file or folder, .jsonl, Parquet file or folder (part-*.parquet), datasets "
                            "save_to_disk folder, .bin token file, or a prepared folder (python -m "
                            "meshtrain.data prepare), local or in an object store (s3://bucket/prefix, gs://, ...: "
                            "copied into data.cache_dir first); '' = the Python standard library's .py files")
    cache_dir: str = setting("", "where prepared data from an object store is copied, one folder per content hash "
                                 "(each host keeps its own copy); '' = ~/.cache/meshtrain/data")
    kind: str = setting("auto", "auto detects it: a file by its suffix (.bin tokens, .jsonl, .parquet, else "
                                "text), a folder by its contents (manifest.json: prepared; state.json: "
                                "hf_datasets; else jsonl, Parquet or text files); stdlib without a path",
                        choices=DATA_KINDS)
    text_field: str = setting("text", "jsonl field / Parquet or datasets column holding each document's text")
    tokenizer: str = setting("auto", "byte, or a tokenizer.json (or a folder holding one); auto = the data's "
                                     "own (a prepared folder's, a token file's sidecar's), byte for raw text")
    sources: list = setting([], "a mixture: [{path: ..., weight: ...}, ...], each entry with the keys path (as "
                                "data.path), weight (> 0, default 1; a source's share is its weight / the weights' "
                                "sum), and optionally kind and text_field (default: data.kind, data.text_field); each "
                                "row of a batch comes from one source, in proportion to the weights "
                                "(meshtrain/data/mixture.py); [] = the one source data.path")
    val_fraction: float = setting(0.05, "tail of the token stream (of each source, in a mixture) held out for "
                                        "eval_loss", min=0.0, below=1.0)
    prefetch: int = setting(1, "batches built ahead in a background thread while the device computes; "
                               "0 builds each one in the loop", min=0, max=64)
    document_mask: bool = setting(False, "packed documents: attention stays inside each document of a "
                                         "training window (a token after an EOS starts a new one); false "
                                         "attends across them (GPT-style)")
    restart_positions: bool = setting(True, "with document_mask: rotary positions restart at 0 in each document",
                                      applies=Applies("data.document_mask"))
    eos_id: int = setting(-1, "the end-of-document id document_mask splits at; -1 = the tokenizer's (the byte "
                              "tokenizer has none: prepared byte data ends documents with a newline, 10)", min=-1,
                          applies=Applies("data.document_mask"))
    train_on: str = setting("assistant", "chat data (prepare --chat): assistant = the loss averages over the "
                                         "assistant turns' tokens only, all = over every token; data without a "
                                         "loss mask trains on every token either way", choices=("assistant", "all"))


@dataclass
class DPOConfig:
    beta: float = setting(0.1, "the DPO temperature: the implicit reward is beta x (policy - reference) log-prob "
                               "of a response", above=0.0, applies=Applies("train.objective", ("dpo",)))
    label_smoothing: float = setting(0.0, "the share of pairs taken as mislabelled (conservative DPO): the loss is "
                                          "-(1 - ls) log sigmoid(beta m) - ls log sigmoid(-beta m)",
                                     min=0.0, below=0.5, applies=Applies("train.objective", ("dpo",)))


GRPO = Applies("train.objective", ("grpo",))


@dataclass
class RLConfig:
    group_size: int = setting(8, "completions sampled per prompt; a step trains train.batch_size completions, "
                                 "train.batch_size / group_size prompts", min=2, applies=GRPO)
    max_new_tokens: int = setting(64, "the longest completion, in tokens (a prompt then has at most train.seq_len + "
                                      "1 - max_new_tokens)", min=1, applies=GRPO)
    temperature: float = setting(1.0, "the sampling temperature; the policy's log-probabilities are of logits / "
                                      "temperature, in the sampler and the trainer alike", above=0.0, applies=GRPO)
    top_p: float = setting(1.0, "nucleus sampling mass (1 = the policy's whole distribution; below 1 the draws "
                                "come from a truncated one the loss does not correct for)", above=0.0, max=1.0,
                           applies=GRPO)
    reward: str = setting("exact_answer", "the reward, a weighted sum of comma-separated terms [weight*]name: "
                                          "exact_answer (the completion's final answer equals the row's answer), "
                                          "format (it matches rl.format_pattern) or module:function, a Python "
                                          "function(prompts, completions, rows) -> one number per completion "
                                          "(docs/fine-tuning.md)", applies=GRPO)
    format_pattern: str = setting("", "the regular expression a whole completion must match for the format "
                                      "reward", applies=GRPO)
    scale_rewards: bool = setting(True, "divide each group's centred rewards by their standard deviation (GRPO); "
                                        "false keeps them centred only (Dr. GRPO)", applies=GRPO)
    clip_eps: float = setting(0.2, "PPO's clip range: a token's ratio to the rollout policy is clipped to "
                                   "[1 - clip_eps, 1 + clip_eps_high]", min=0.0, below=1.0, applies=GRPO)
    clip_eps_high: float = setting(0.0, "the clip range's upper side (DAPO's clip-higher, e.g. 0.28); 0 = rl.clip_eps",
                                   min=0.0, applies=GRPO)
    kl_coef: float = setting(0.0, "weight of the KL penalty to the frozen initial policy (k3 estimator); 0 keeps no "
                                  "reference model", min=0.0, applies=GRPO)
    sampler: str = setting("cache", "cache: the KV-cache sampler (one forward a new token over one position); "
                                    "exact: each new token runs the training forward over the whole sequence, so "
                                    "the sampled tokens' log-probabilities equal the trainer's bit for bit where "
                                    "its step has the sampler's shapes (one microbatch; dense or dropless MoE "
                                    "models; docs/fine-tuning.md); rl.max_new_tokens whole forwards a rollout",
                           choices=("cache", "exact"), applies=GRPO)
    updates_per_batch: int = setting(1, "policy updates (train steps) per rollout batch, each against the rollout "
                                        "policy's log-probabilities", min=1, applies=GRPO)


@dataclass
class TrainConfig:
    steps: int = setting(200, "optimizer steps", min=1)
    batch_size: int = setting(32, "global batch, in sequences", min=1)
    seq_len: int = setting(64, "tokens per sequence", min=1)
    seed: int = setting(0, "seeds the initial weights and the data order", min=0)
    log_every: int = setting(10, "steps between log lines and metrics.jsonl records", min=1)
    eval_every: int = setting(50, "steps between eval_loss measurements; 0 disables them", min=0)
    eval_batches: int = setting(4, "batches per evaluation", min=1)
    step_timeout: float = setting(0.0, "the step watchdog (docs/operating.md): when no step completes for this many "
                                       "seconds, every process writes its stacks to <out>/stalls/ and exits 4, for "
                                       "the scheduler to rerun (resuming); 0 = auto: max(600, 10 x the slowest "
                                       "logged step time); negative = off", min=-1.0)
    straggler_every: int = setting(0, "several processes: every N steps each reports its host time per step "
                                      "(outside waiting for the devices) and data wait; one slower than the "
                                      "median by train.straggler_factor is logged by host name; 0 = off", min=0)
    straggler_factor: float = setting(2.0, "train.straggler_every: how many times the median host time per step "
                                           "makes a process a straggler", above=1.0,
                                      applies=Applies("train.straggler_every"))
    grad_norms_every: int = setting(0, "every N steps, log the gradient norm of each layer (grad_norm_layer_<i>) "
                                       "and of each parameter kind (grad_norm_<name>), and the timed "
                                       "communication share of the step (comm_share); 0 = off (the step then "
                                       "computes no per-layer norms)", min=0)
    objective: str = setting("sft", "the training objective, one of meshtrain.objectives.OBJECTIVES: sft, "
                                    "next-token cross-entropy (with chat data's loss mask); dpo, direct "
                                    "preference optimisation on data from prepare --preference, train.batch_size "
                                    "pairs a batch; grpo, reinforcement learning from rewards on data from prepare "
                                    "--prompts, train.batch_size completions a batch (the rl section; "
                                    "docs/fine-tuning.md)")
    dpo: DPOConfig = setting(DPOConfig(), "train.objective=dpo: its temperature and label smoothing")


@dataclass
class EvalConfig:
    tasks: list = setting([], "downstream multiple-choice tasks scored while training: [{name: ..., path: FILE.jsonl}, "
                              "...], each file JSON lines of {context, choices, label}, each entry with the keys path, "
                              "name (default: the file's) and limit (the first N items; default all); logged as "
                              "eval_acc_<name> and eval_acc_norm_<name> (docs/evaluation.md); [] = none")
    task_every: int = setting(0, "steps between downstream task evaluations (and the last step); 0 = with eval_loss, "
                                 "every train.eval_every steps", min=0, applies=Applies("eval.tasks"))


@dataclass
class GenerateConfig:
    batch_size: int = setting(8, "prompts generated together (`python -m meshtrain.generate`); the planner sizes "
                                 "generation's KV cache for this many rows", min=1)
    max_new_tokens: int = setting(200, "tokens generated per prompt (the generate command's default for "
                                       "--max-new-tokens); the KV cache holds train.seq_len + this - 1 positions",
                                  min=1)
    precision: str = setting("fp32", "the dtype generate holds the parameters and the KV cache in (the generate "
                                     "command's default for --precision): bf16 or fp16 halves both; the "
                                     "checkpoint is read into host memory and cast there, so no device holds "
                                     "fp32 weights", choices=("fp32", "bf16", "fp16"))


@dataclass
class CheckpointConfig:
    every: int = setting(0, "save every N steps (async); 0 = by time only, at the end and on preemption", min=0)
    every_minutes: float = setting(10.0, "also save when this many minutes passed since the last save; "
                                         "0 disables it", min=0.0)
    keep: int = setting(3, "keep the newest N checkpoints", min=1)
    resume: str = setting("auto", "auto (newest under <out>/checkpoints), never, or a checkpoint folder")
    init_from: str = setting("", "weights to start from when there is no checkpoint to resume (fine-tuning): "
                                 "hf:DIR (a Hugging Face checkpoint folder) or a meshtrain run folder; the "
                                 "optimizer starts fresh; '' = random initialisation")
    local_dir: str = setting("", "the fast local tier (docs/checkpoints.md, Two tiers): a folder on each node's own "
                                 "disk (NVMe) where every process saves its own shards, more often than the "
                                 "persistent tier in <out>/checkpoints; a restart on the same processes and mesh "
                                 "restores from whichever tier is newer; '' = off")
    local_every: int = setting(0, "checkpoint.local_dir: save there every N steps; 0 = by time only", min=0,
                               applies=Applies("checkpoint.local_dir"))
    local_every_minutes: float = setting(0.0, "checkpoint.local_dir: also save there when this many minutes "
                                              "passed since the last local save; 0 disables it", min=0.0,
                                         applies=Applies("checkpoint.local_dir"))
    local_keep: int = setting(2, "checkpoint.local_dir: keep the newest N local checkpoints of each process",
                              min=1, applies=Applies("checkpoint.local_dir"))


@dataclass
class GuardConfig:
    max_consecutive_bad: int = setting(3, "NaN/Inf steps in a row before rolling back to the last checkpoint",
                                       min=1)
    max_rollbacks: int = setting(3, "rollbacks before stopping with an error", min=0)
    spike_factor: float = setting(0.0, "loss spikes: a step whose loss exceeds this many times the running mean "
                                       "of the losses before it rolls back to the last checkpoint and skips its "
                                       "batch, as a NaN/Inf streak does; 0 = off (2 is a cautious value)", min=0.0)
    spike_window: int = setting(50, "guard.spike_factor: the running mean is an exponential moving average with "
                                    "weight 1/spike_window on each new loss; judging starts after this many steps "
                                    "(checkpoints keep the mean: a resumed run on the same data does not warm up "
                                    "again)", min=1, applies=Applies("guard.spike_factor"))


@dataclass
class LoggingConfig:
    progress: str = setting("auto", "console output while training: lines (a line per train.log_every steps), "
                                    "bar (the same lines above a live progress bar with ETA), none (only the "
                                    "first and the summary line); auto = bar on a terminal, lines otherwise",
                            choices=("auto", "bar", "lines", "none"))
    tensorboard: bool = setting(True, "write TensorBoard event files to <out>/tensorboard, one scalar per metric "
                                      "(train/loss, eval/loss, perf/tokens_per_sec, memory/..., moe/...)")
    wandb: bool = setting(False, "also log to Weights & Biases (needs pip install wandb)")
    wandb_project: str = setting("meshtrain", "logging.wandb: the W&B project", applies=Applies("logging.wandb"))
    wandb_mode: str = setting("offline", "logging.wandb: offline (files under <out>/wandb; wandb sync uploads "
                                         "them) or online", choices=("offline", "online"),
                              applies=Applies("logging.wandb"))
    profile: str = setting("", "START:STOP: trace these steps (as logged, both included) with jax.profiler "
                               "into <out>/profile, for TensorBoard's profile plugin and Perfetto; '' = none")


@dataclass
class Config:
    model: ModelSpec = setting(ModelSpec(), "what is trained: the family and its architecture")
    parallel: ParallelPlan = setting(ParallelPlan(), "how it runs: mesh, sharding, precision, remat, attention, "
                                                     "microbatches, pipeline")
    optim: OptimSpec = setting(OptimSpec(), "how it learns: optimizer, learning-rate schedule, clipping")
    data: DataConfig = setting(DataConfig(), "where tokens come from")
    train: TrainConfig = setting(TrainConfig(), "the loop")
    rl: RLConfig = setting(RLConfig(), "train.objective=grpo: rollouts, rewards and the policy loss")
    eval: EvalConfig = setting(EvalConfig(), "downstream tasks scored while training (meshtrain.eval scores them "
                                             "without training)")
    generate: GenerateConfig = setting(GenerateConfig(), "text generation from a run: batch and length")
    checkpoint: CheckpointConfig = setting(CheckpointConfig(), "saving and resuming")
    guard: GuardConfig = setting(GuardConfig(), "the NaN/Inf and loss-spike guard")
    logging: LoggingConfig = setting(LoggingConfig(), "console, TensorBoard, W&B and profiler output")
    devices: int = setting(0, f"simulate this many CPU devices (1 to {MAX_SIMULATED_DEVICES}) when no "
                              "accelerator is present; 0 = the machine's devices", min=0, max=MAX_SIMULATED_DEVICES)
    out: str = setting("", "output folder; '' = runs/<config file name> (runs/default without --config)")
    compile_cache: str = setting("auto", cache_setting.SETTING_HELP)
    compile_cache_max_gb: float = setting(cache_setting.DEFAULT_MAX_GB, "the compilation cache's bound: past it, the "
                                          "least recently used programs are evicted", above=0.0)


def settings(cfg=None, prefix: str = ""):
    """(dotted key, dataclasses.Field, value) for every leaf setting, in declaration order."""
    cfg = Config() if cfg is None else cfg
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from settings(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, value


# Keys of earlier versions, still accepted with a one-line notice (docs/config.md lists them).
RENAMED = {"mesh": "parallel.mesh", "zero": "parallel.zero", "precision": "parallel.precision",
           "rules": "parallel.rules", "model.remat": "parallel.remat", "model.attention": "parallel.attention",
           "train.microbatches": "parallel.microbatches", "pipeline.microbatches": "parallel.microbatches",
           "pipeline.schedule": "parallel.schedule", "pipeline.virtual_stages": "parallel.virtual_stages",
           "pipeline.residuals": "parallel.residuals"}
