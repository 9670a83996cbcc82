"""Block-scaled matmuls for Blackwell: `parallel.precision=mxfp8` and `nvfp4`.

Each operand is scaled per block of consecutive elements along the axes its GEMM contracts, so an
outlier costs only its own block's precision, and the GEMM takes the low-precision values and their
block scales together (Blackwell's block-scaled tensor cores; XLA's GPU compiler makes one cuDNN call,
`__cudnn$blockScaledDot`, of `jax.nn.scaled_matmul`).

- **mxfp8** (OCP Microscaling v1.0; torchao's and Transformer Engine's MXFP8 recipe): blocks of 32,
  e4m3 values (forward and gradients alike, Transformer Engine's default), one E8M0 scale (a power of 2)
  per block, rounded up so nothing saturates (NVIDIA's "RCEIL"):
      s = 2^ceil(log2(amax_block / 448)),    q = t / s in e4m3    (exact: |t / s| <= 448).
- **nvfp4** (NVIDIA's NVFP4 training recipe, "Pretraining LLMs with NVFP4", 2025): blocks of 16, e2m1
  values (+-6 at most: 0, 0.5, 1, 1.5, 2, 3, 4, 6), one e4m3 scale per block, rounded up so nothing
  saturates, and one fp32 scale per tensor that maps the tensor's amax onto the range of both:
      g = amax / (6 x 448),    s_b = e4m3_up(amax_block / 6 / g),    q = e2m1(t / (s_b g)),    t ~ q s_b g.
  As the recipe has it: the weights in 16 x 16 blocks (one scale for 16 rows and 16 columns, so the
  forward and the data gradient read the same quantized weight, its transpose); the gradient rounded
  stochastically (unbiased: E[q] = t / (s_b g)); and the weight gradient's two operands multiplied
  along their contraction (the tokens) by a random Hadamard transform Q = D H16 / 4 (D random signs,
  H16 Sylvester's Hadamard matrix; Q Q^T = I, so x^T g = (Qx)^T (Qg)), which spreads outliers over 16
  tokens before they are quantized.

- **fp8_blockwise** (DeepSeek-V3's fine-grained FP8, its section 3.3.2, for Hopper): blocks of 128, e4m3
  values everywhere, one fp32 scale per block, a power of 2 rounded up as mxfp8's (DeepSeek's UE8M0 scales
  of V3.1: exact scaling), the weights in 128 x 128 blocks (so dx quantizes the weight into the forward's
  blocks and values, transposed) and the activations and gradients in 1 x 128 tiles along each GEMM's
  contraction. Its GEMM is meshtrain's Pallas Triton kernel on NVIDIA GPUs
  (meshtrain/ops/fp8_blockwise_triton.py), which adds each 128-wide block's fp32 partial sum times its
  scales to an fp32 accumulator.

The backward quantizes again along each gradient GEMM's own contraction (dx over the weight's outputs,
dw over the tokens), as fp8_rowwise does (meshtrain/ops/fp8.py): the step saves x and w in bf16.

Computed by backend (meshtrain/ops/platform.py): on NVIDIA GPUs `jax.nn.scaled_matmul` (cuDNN's
block-scaled GEMM on Blackwell; elsewhere XLA expands it to a dequantization and a bf16 GEMM, so the
config refuses these recipes before Blackwell), fp8_blockwise's Triton kernel; on other backends the same
numbers: each value times its scale is exact in bf16 (e4m3 x 2^e; e2m1 x e4m3 has at most 6 significant
bits), so a bf16 GEMM of the dequantized operands accumulated in fp32 is the block-scaled GEMM up to the
order of its sum.
The stochastic rounding's uniforms come from a key seeded by the gradient's own bits (no key threads
through the model, and a resumed run stays bitwise).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.ops.fp8 import E4M3, fp8_max, power_of_two_above, transposed_specs
from meshtrain.ops.fp8_blockwise_triton import BLOCK, blockwise_gemm
from meshtrain.ops.platform import by_platform

E8M0, E2M1 = jnp.float8_e8m0fnu, jnp.float4_e2m1fn
FP4_MAX = 6.0
FOUR_OVER_SIX_SCALE_MAX = 256.0  # the block scales' cap under Four Over Six (`_four_over_six`)
SMALLEST_SCALE = 2.0 ** -126  # fp32's least normal: E8M0 has 2^-127, but XLA flushes fp32 subnormals to 0 (E8M0 NaN)


@dataclasses.dataclass(frozen=True)
class Format:
    """A block-scaled format: values in `dtype`, one `scale_dtype` scale per `block` elements along the
    contraction, and (nvfp4) an fp32 scale per tensor."""
    name: str
    dtype: object
    block: int
    scale_dtype: object
    tensor_scale: bool


MXFP8 = Format("mxfp8", E4M3, 32, E8M0, tensor_scale=False)
NVFP4 = Format("nvfp4", E2M1, 16, E4M3, tensor_scale=True)
FP8_BLOCKWISE = Format("fp8_blockwise", E4M3, BLOCK, jnp.float32, tensor_scale=False)  # its kernel's K step


@dataclasses.dataclass(frozen=True)
class Gemm:
    """An einsum "a,b->y" in the GEMM's form: a's axes ordered [batch, a's free, contracted] (`a_order`),
    b's [batch, b's free, contracted] (`b_order`), the result's [batch, a's free, b's free] (`out_order`)."""
    a: str
    b: str
    y: str
    batch: int
    a_free: int
    b_free: int

    @classmethod
    def of(cls, spec: str) -> Gemm:
        a, rest = spec.replace(" ", "").split(",")
        b, y = rest.split("->")
        transposed_specs(spec)  # refuses an index summed within one operand
        return cls(a, b, y, sum(c in b and c in y for c in a), sum(c not in b for c in a), sum(c not in a for c in b))

    @property
    def a_order(self) -> str:
        return "".join(sorted(self.a, key=self._rank))

    @property
    def b_order(self) -> str:
        return "".join(sorted(self.b, key=self._rank))

    @property
    def out_order(self) -> str:
        return "".join(sorted(self.y, key=self._rank))

    def _rank(self, c: str) -> tuple[int, int]:
        """Batch axes first (in a's order), then a's free, b's free, then the contracted axes in b's order
        (the weight's, whose 16 x 16 nvfp4 blocks then tile the same way in the forward and in dx)."""
        if c in self.a and c in self.b:
            return (0, self.a.index(c)) if c in self.y else (3, self.b.index(c))
        return (1, self.a.index(c)) if c in self.a else (2, self.b.index(c))

    def operands(self, a, b):
        """a as [batch, M, K] and b as [batch, N, K], and the shapes of batch, a's free and b's free axes."""
        a = jnp.transpose(a, [self.a.index(c) for c in self.a_order])
        b = jnp.transpose(b, [self.b.index(c) for c in self.b_order])
        batch, free_a = a.shape[:self.batch], a.shape[self.batch:self.batch + self.a_free]
        free_b = b.shape[self.batch:self.batch + self.b_free]
        rows = int(np.prod(batch))
        return (a.reshape(rows, int(np.prod(free_a)), -1), b.reshape(rows, int(np.prod(free_b)), -1),
                (batch, free_a, free_b))

    def result(self, y, shapes):
        """[batch, M, N] back to y's axes."""
        batch, free_a, free_b = shapes
        y = y.reshape(*batch, *free_a, *free_b)
        return jnp.transpose(y, [self.out_order.index(c) for c in self.y])


def padded(t, axis: int, multiple: int):
    """`t` with zeros appended along `axis` to a multiple of `multiple` (zeros add nothing to a sum)."""
    extra = -t.shape[axis] % multiple
    if not extra:
        return t
    widths = [(0, 0)] * t.ndim
    widths[axis] = (0, extra)
    return jnp.pad(t, widths)


def blocks(t, block: int):
    """[..., K] as [..., K / block, block]."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // block, block)


def mx_quantize(t, fmt: Format = MXFP8, *, two_d: bool = False):
    """(q, s): [..., N, K] in e4m3 with one power-of-2 scale (`fmt.scale_dtype`) per `fmt.block` elements
    along K, s = 2^ceil(log2(amax / 448)) (1 where the block is 0 or amax / 448 flushes to 0, 2^-126 at the
    least): [..., N, K / block]. `two_d`: one scale per block x block tile of (N, K), repeated along N (N a
    multiple of the block)."""
    x = blocks(t.astype(jnp.float32), fmt.block)
    amax = jnp.max(jnp.abs(x), axis=-1)
    if two_d:
        amax = tiled_amax(amax, fmt.block)
    s = jnp.maximum(power_of_two_above(amax / fp8_max(fmt.dtype)), SMALLEST_SCALE)
    q = (x / s[..., None]).astype(fmt.dtype).reshape(t.shape)
    return q, s.astype(fmt.scale_dtype)


def tiled_amax(block_amax, block: int, reduce=jnp.max):
    """[..., N, J] blocks' amaxes with each `block` consecutive rows' largest (a block x block tile's), repeated
    along N (`reduce`: another reduction over the tile's rows)."""
    n = block_amax.shape[-2]
    tiles = block_amax.reshape(*block_amax.shape[:-2], n // block, block, block_amax.shape[-1])
    return jnp.broadcast_to(reduce(tiles, axis=-2, keepdims=True), tiles.shape).reshape(block_amax.shape)


def round_to_fp4(x, uniform=None):
    """`x` (fp32, |x| <= 6) in e2m1, between its two neighbouring values lo <= |x| <= hi (0.5 apart below 2,
    1 below 4, then 4 and 6): the nearest (a tie to the even code, as IEEE), or stochastically when `uniform`
    (values in [0, 1), x's shape) is given: hi with probability (|x| - lo) / (hi - lo), so E[result] = x.
    Elementwise arithmetic, exact in fp32, then a cast of e2m1 values (exact): XLA:CPU's own convert to
    e2m1 rounds twice, through a 16-bit type."""
    mag = jnp.abs(x)
    step = jnp.where(mag < 2, 0.5, jnp.where(mag < 4, 1.0, 2.0))
    lo = jnp.floor(mag / step) * step
    hi = jnp.minimum(lo + step, FP4_MAX)
    if uniform is None:
        code = lambda v: jnp.where(v < 2, v * 2, jnp.where(v < 4, v + 2, v / 2 + 4))  # e2m1's bits as a number
        up = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (code(hi) % 2 == 0))
    else:
        up = uniform < (mag - lo) / jnp.where(hi > lo, hi - lo, 1.0)
    return (jnp.sign(x) * jnp.where(up, hi, lo)).astype(E2M1)


def nv_quantize(t, *, two_d: bool = False, uniform=None, fmt: Format = NVFP4, four_over_six: bool = False):
    """(q, s, g): [..., N, K] in e2m1 with one e4m3 scale per 16 elements along K ([..., N, K / 16]) and the
    tensor's fp32 scale g = amax / (6 x 448) (1 for a zero tensor). `two_d`: one scale per 16 x 16 block of
    (N, K), repeated along N (N a multiple of 16). `uniform`: stochastic rounding (`round_to_fp4`).
    `four_over_six`: each block's scale chosen by `_four_over_six`, g = amax / (6 x 256)."""
    x = t.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    scale_max = FOUR_OVER_SIX_SCALE_MAX if four_over_six else fp8_max(E4M3)
    g = jnp.where(amax > 0, amax / (FP4_MAX * scale_max), 1.0)
    xb = blocks(x, fmt.block)  # [..., N, K / 16, 16]
    block_amax = jnp.max(jnp.abs(xb), axis=-1)  # [..., N, K / 16]
    if two_d:
        block_amax = tiled_amax(block_amax, fmt.block)
    s = e4m3_above(block_amax / FP4_MAX / g)
    if four_over_six:
        s = _four_over_six(xb, block_amax, g, s, fmt.block if two_d else 0)
    q = _fp4_blocks(xb, s, g, None if uniform is None else blocks(uniform, fmt.block))
    return q.reshape(t.shape), s, g


def _fp4_blocks(xb, s, g, uniform=None):
    """Blocks [..., 16] in e2m1 at their scales s (e4m3, [...]) times the tensor's g: x (1 / (s_b g)), as
    Transformer Engine (a zero scale: 0), clipped to e2m1's range and rounded (`round_to_fp4`)."""
    divisor = s.astype(jnp.float32)[..., None] * g
    scaled = xb * jnp.where(divisor > 0, 1.0 / jnp.where(divisor > 0, divisor, 1.0), 0.0)
    return round_to_fp4(jnp.clip(scaled, -FP4_MAX, FP4_MAX), uniform)


def _four_over_six(xb, block_amax, g, s6, tile: int):
    """Four Over Six (Cook et al., 2025; mit-han-lab/fouroversix): a block's scale maps its largest to 4
    rather than 6 where that quantizes the block (rounded to nearest) with less squared error: e2m1's 3 and
    4 lie nearer a block's large values than its 4 and 6. The tensor scale g = amax / (6 x 256) leaves
    every block's larger scale within e4m3 (amax / 4 / g = 384 at most). `tile`: the choice one per
    tile x tile block (its rows' errors summed), as its scale."""
    s4 = e4m3_above(block_amax / 4.0 / g)

    def error(s):
        dequantized = _fp4_blocks(xb, s, g).astype(jnp.float32) * s.astype(jnp.float32)[..., None] * g
        e = jnp.sum(jnp.square(dequantized - xb), -1)
        return tiled_amax(e, tile, jnp.sum) if tile else e

    return jnp.where(error(s4) < error(s6), s4, s6)


def e4m3_above(target):
    """The least e4m3 value >= `target` (fp32, 0 <= target <= 448 up to its rounding): the cast to nearest,
    or the next code up where that fell below, so no element of the block exceeds 6 (Transformer Engine
    rounds to nearest and saturates the block's largest instead, which biases stochastic rounding)."""
    s = target.astype(E4M3)
    below = (s.astype(jnp.float32) < target) & (s.astype(jnp.float32) < fp8_max(E4M3))
    bits = jax.lax.bitcast_convert_type(s, jnp.uint8)
    return jax.lax.bitcast_convert_type(jnp.where(below, bits + 1, bits), E4M3)  # positive codes increase with value


def hadamard_16(seed: int = 0) -> np.ndarray:
    """Q = D H16 / 4: Sylvester's 16 x 16 Hadamard matrix, its rows times fixed random signs (D), scaled so
    Q Q^T = I."""
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    signs = np.where(np.random.default_rng(seed).random(16) < 0.5, -1.0, 1.0)
    return (signs[:, None] * h / 4.0).astype(np.float32)


def rotated(t):
    """[..., K] with each 16 consecutive elements along K times Q (`hadamard_16`), in fp32: x^T y of two
    rotated operands is theirs (K a multiple of 16). Q's entries (+-1/4) are exact in t's dtype, so the
    GEMM reads t as it is (bf16: half fp32's bytes) and sums in fp32."""
    q = jnp.asarray(hadamard_16()).astype(t.dtype)
    return jnp.matmul(blocks(t, 16), q, preferred_element_type=jnp.float32).reshape(t.shape)


def uniforms_for(t):
    """Uniforms in [0, 1) of t's shape from a key seeded by t's own bits (its fp32 sum and amax)."""
    x = t.astype(jnp.float32)
    seed = jax.lax.bitcast_convert_type(jnp.stack([jnp.sum(x), jnp.max(jnp.abs(x))]), jnp.uint32)
    key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    return jax.random.uniform(key, t.shape, jnp.float32)


def _gpu_gemm(qa, qb, sa, sb, out_dtype, fmt):
    if fmt is FP8_BLOCKWISE:  # meshtrain's Triton kernel (no block-scaled GEMM of XLA's before Blackwell)
        return blockwise_gemm(qa, qb, sa, sb, out_dtype)
    return jax.nn.scaled_matmul(qa, qb, sa, sb, preferred_element_type=out_dtype)


def _emulated_gemm(qa, qb, sa, sb, out_dtype):
    """The block-scaled GEMM by its definition: each value times its block's scale (exact in bf16, module
    doc), a bf16 GEMM accumulated in fp32, rounded once to `out_dtype`."""
    def dequantized(q, s):
        scale = jnp.repeat(s.astype(jnp.bfloat16), q.shape[-1] // s.shape[-1], axis=-1)
        return q.astype(jnp.bfloat16) * scale
    y = jnp.einsum("bmk,bnk->bmn", dequantized(qa, sa), dequantized(qb, sb), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def scaled_matmul(qa, qb, sa, sb, out_dtype, fmt: Format):
    """[B, M, K] x [B, N, K] -> [B, M, N]: the block-scaled GEMM of `fmt`, cuDNN's (fp8_blockwise: meshtrain's
    Triton kernel) on NVIDIA GPUs, its definition elsewhere (module doc)."""
    return by_platform(functools.partial(_gpu_gemm, out_dtype=out_dtype, fmt=fmt),
                       functools.partial(_emulated_gemm, out_dtype=out_dtype), qa, qb, sa, sb)


def block_scaled_gemm(spec: str, a, b, fmt: Format, *, weight_b: bool = False, stochastic_a: bool = False,
                      rotate: bool = False, four_over_six: bool = False):
    """einsum(spec, a, b) as a block-scaled GEMM of `fmt`, in a's dtype: both operands quantized in blocks
    along the axes `spec` contracts (zeros appended to a multiple of the block). nvfp4 only: `weight_b`
    quantizes b in 16 x 16 blocks, `stochastic_a` rounds a stochastically, `rotate` multiplies both along
    the contraction by Q first (module doc), `four_over_six` picks each block's scale (`nv_quantize`).
    `weight_b` (nvfp4, fp8_blockwise): b in block x block tiles. Its kernels carry `spec` in their op
    names (profiles, the plan)."""
    with jax.named_scope(spec):
        return _block_scaled_gemm(spec, a, b, fmt, weight_b, stochastic_a, rotate, four_over_six)


def _block_scaled_gemm(spec: str, a, b, fmt: Format, weight_b: bool, stochastic_a: bool, rotate: bool,
                       four_over_six: bool):
    gemm = Gemm.of(spec)
    a3, b3, shapes = gemm.operands(a, b)
    n = b3.shape[1]
    a3, b3 = padded(a3, 2, fmt.block), padded(b3, 2, fmt.block)
    if weight_b:
        b3 = padded(b3, 1, fmt.block)
    if not fmt.tensor_scale:
        (qa, sa), (qb, sb) = mx_quantize(a3, fmt), mx_quantize(b3, fmt, two_d=weight_b)
        return gemm.result(scaled_matmul(qa, qb, sa, sb, a.dtype, fmt)[:, :, :n], shapes)
    if rotate:
        a3, b3 = rotated(a3), rotated(b3)
    qa, sa, ga = nv_quantize(a3, uniform=uniforms_for(a3) if stochastic_a else None, fmt=fmt,
                             four_over_six=four_over_six)
    qb, sb, gb = nv_quantize(b3, two_d=weight_b, fmt=fmt, four_over_six=four_over_six)
    y = scaled_matmul(qa, qb, sa, sb, a.dtype, fmt)[:, :, :n]  # the sum in bf16, as fp8's (meshtrain/ops/fp8.py)
    return gemm.result((y.astype(jnp.float32) * (ga * gb)).astype(a.dtype), shapes)


def block_scaled_einsum(fmt: Format, weight_2d: bool = False, stochastic: bool = False, rotate: bool = False,
                        four_over_six: bool = False, rotate_all: bool = False):
    """jnp.einsum(spec, x, w) as block-scaled GEMMs of `fmt`, forward and both gradients each quantized along
    its own contraction; output in x's dtype. nvfp4's recipe parts (module doc): `weight_2d` w in 16 x 16
    blocks, `stochastic` the gradient rounded stochastically, `rotate` dw's operands rotated along the
    tokens (all on for `nvfp4_einsum`; one off each for the ablations of benchmarks/precision.py),
    `four_over_six` Four Over Six's block scales (`nv_quantize`; benchmarks/precision.py's nvfp4-4over6), and
    `rotate_all` the forward's and dx's operands rotated along their contractions too (nvfp4-rht_all)."""

    gemm = functools.partial(block_scaled_gemm, fmt=fmt, four_over_six=four_over_six)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def einsum(spec: str, x, w):
        return gemm(spec, x, w, weight_b=weight_2d, rotate=rotate_all)

    def forward(spec, x, w):
        return einsum(spec, x, w), (x, w)

    def backward(spec, residuals, g):
        x, w = residuals
        dx_spec, dw_spec = transposed_specs(spec)
        dx = gemm(dx_spec, g, w, weight_b=weight_2d, stochastic_a=stochastic, rotate=rotate_all)
        # dw = x^T g over the tokens: x first, so the GEMM writes dw in w's layout; g first where it is rounded
        # stochastically (the GEMM's first operand)
        if stochastic:
            dw = gemm(swapped(dw_spec), g, x, stochastic_a=True, rotate=rotate)
        else:
            dw = gemm(dw_spec, x, g, rotate=rotate)
        return dx, dw.astype(w.dtype)

    einsum.defvjp(forward, backward)
    return einsum


mxfp8_einsum = block_scaled_einsum(MXFP8)  # every operand in e4m3, E8M0 scales per 32
nvfp4_einsum = block_scaled_einsum(NVFP4, weight_2d=True, stochastic=True, rotate=True)  # the whole recipe
fp8_blockwise_einsum = block_scaled_einsum(FP8_BLOCKWISE, weight_2d=True)  # DeepSeek-V3's, e4m3 throughout
FORMATS = {"mxfp8": MXFP8, "nvfp4": NVFP4, "fp8_blockwise": FP8_BLOCKWISE}  # parallel.precision's block-scaled


def gpu_layout_refusal(precision: str, sizes: dict[str, int], capacity_experts: bool = False) -> str | None:
    """Why a block-scaled recipe's program cannot be compiled for NVIDIA GPUs on this mesh, or None. Found on
    XLA's GPU compiler (B200 target, jax 0.10.2): `jax.nn.scaled_matmul`'s partitioner fails inside the
    manual regions the `data` axis and the pipeline run (shard_map: "'GSPMDSharding' object has no attribute
    'spec'"), and under mxfp8 with fsdp and tensor both > 1 XLA moves E8M0 scales through an all-reduce
    NCCL refuses ("element type f8e8m0fnu not supported by NCCL"). fsdp, tensor and expert compile.
    fp8_blockwise's kernel is partitioned inside a manual region too, but would gather a contraction sharded
    over another axis there (meshtrain/ops/fp8_blockwise_triton.py): a manual axis beside any other is
    refused, and so is tensor beside capacity-routed experts (`capacity_experts`: their matmuls run in a
    region manual over the batch's axes, tensor left to the compiler, models/experts.py `in_row_shards`)."""
    if precision not in FORMATS:
        return None
    manual = [axis for axis in ("data", "pipeline") if sizes.get(axis, 1) > 1]
    if precision == "fp8_blockwise":
        others = [axis for axis, n in sizes.items() if n > 1 and axis not in ("data", "pipeline")]
        if manual and others:
            why = (f"{' and '.join(manual)} > 1 beside {' and '.join(others)} > 1 (its GEMM would gather the "
                   f"contractions sharded over {' and '.join(others)} inside the manual regions of "
                   f"{' and '.join(manual)})")
        elif capacity_experts and sizes.get("tensor", 1) > 1:
            why = ("tensor > 1 and capacity-routed experts (their GEMMs run in a manual region, where the kernel "
                   "would gather the tensor-sharded contractions)")
        else:
            return None
        return (f"parallel.precision=fp8_blockwise on NVIDIA GPUs with {why}; shard over one of data and pipeline "
                f"alone or over the others alone (fsdp=N in place of data=N), or set parallel.precision=fp8")
    if manual:
        why = (f"{' and '.join(manual)} > 1 (JAX's jax.nn.scaled_matmul cannot be partitioned inside the manual "
               f"regions they run)")
    elif FORMATS[precision].scale_dtype == E8M0 and sizes.get("fsdp", 1) > 1 and sizes.get("tensor", 1) > 1:
        why = "fsdp and tensor both > 1 (XLA moves its E8M0 scales through an all-reduce NCCL does not take)"
    else:
        return None
    return (f"parallel.precision={precision} on NVIDIA GPUs with {why}; shard over fsdp, tensor or expert instead "
            f"(fsdp=N in place of data=N), or set parallel.precision=fp8")


def swapped(spec: str) -> str:
    """"a,b->y" as "b,a->y"."""
    operands, y = spec.replace(" ", "").split("->")
    a, b = operands.split(",")
    return f"{b},{a}->{y}"
