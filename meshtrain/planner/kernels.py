"""The kernels of a compiled GPU program, per step, read from its HLO text (meshtrain/planner/hlo.py's
`Module`, loop bodies by their trip counts).

What XLA's GPU compiler launches is a top-level instruction of a computation that runs (the entry,
loop bodies, branches, async wrappers), never one inside a fusion: a fusion is one kernel. Kinds:
- `gemms`: matmuls, by operand types (`bf16 x bf16`, `f8e4m3fn x f8e4m3fn`, `f8e5m2 x f8e4m3fn`...):
  Triton GEMM fusions (`__triton_gemm`, `__triton_nested_gemm_fusion`; the operands of the `dot`
  inside), cuBLAS/cuBLASLt custom calls (`__cublas$...`; the call's first two operands) and cuDNN's
  block-scaled GEMMs on Blackwell (`__cudnn$blockScaledDot`, mxfp8 and nvfp4: `f8e4m3fn x f8e4m3fn scaled
  f8e8m0fnu`, the values' types and their block scales'), and fp8_blockwise's Triton GEMM
  (meshtrain/ops/fp8_blockwise_triton.py, `__gpu$xla.gpu.triton` calls named `meshtrain_fp8_blockwise`:
  `f8e4m3fn x f8e4m3fn scaled f32`);
- `attention`: cuDNN fused attention calls (`__cudnn$fmha...`), forward and backward;
- `grouped_gemms`: meshtrain's grouped-matmul Triton kernels (meshtrain/ops/grouped_matmul_triton.py,
  `__gpu$xla.gpu.triton` calls named `meshtrain_<kernel>_rows<R>`) by kernel: gmm, gmm_t, tgmm;
  `grouped_filled` the least share of its buffer's rows a gmm expects routed (R / the buffer's rows);
- `collectives`: async collective launches (`all-gather-start`, ...) by kind (`ragged-all-to-all` its own);
- `fusions`: every other fusion (elementwise, reductions, transposes), one kernel each;
- `largest`: the largest arrays the program makes (instruction outputs), name, shape and bytes.
"""
from __future__ import annotations

import re
from collections import Counter

from meshtrain.ops import fp8_blockwise_triton, grouped_matmul_triton
from meshtrain.planner.hlo import DTYPE_BYTES, KINDS, RAGGED, Module, typed_array_elements

GEMM_FUSIONS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas")
BLOCK_SCALED = "__cudnn$blockScaledDot"  # operands: values, values, their block scales (XLA's block-scaling rewriter)
_FUSION_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([\w$]+)"')
CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# meshtrain's grouped-matmul kernels by the name they are given: (kernel, rows expected)
_GROUPED_NAME = grouped_matmul_triton.NAME.format(kernel="(gmm|gmm_t|tgmm)", rows=r"(\d+)")
GROUPED_GEMM = re.compile(f'name = "{_GROUPED_NAME}"')
BLOCKWISE_GEMM = re.compile(f'name = "{fp8_blockwise_triton.NAME}"')  # operands: values, values, their scales
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_NOT_NEW = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")  # no buffer of their own
_FUSED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


def _operand_types(module: Module, comp: str, names: list[str]) -> str:
    types = [module.comps[comp][n].arrays[0][0] for n in names[:2] if n in module.comps[comp]]
    return " x ".join(types)


def allocation(ins) -> bool:
    """An `AllocateBuffer` custom call (meshtrain/ops/unfilled.py, `jax.lax.empty`): XLA's GPU compiler
    allocates its buffer and launches nothing."""
    return ins.op == "custom-call" and 'custom_call_target="AllocateBuffer"' in ins.line


def gemm_types(module: Module, comp: str, ins) -> str | None:
    """The operand types of a GEMM kernel, None when `ins` is not one."""
    if ins.op == "custom-call":
        target = CALL_TARGET.search(ins.line)
        if target and (target.group(1) == BLOCK_SCALED or BLOCKWISE_GEMM.search(ins.line)):
            values, scales = _operand_types(module, comp, ins.operands), _operand_types(module, comp, ins.operands[2:3])
            return f"{values} scaled {scales}"
        return _operand_types(module, comp, ins.operands) if target and target.group(1).startswith("__cublas") \
            else None
    if ins.op != "fusion":
        return None
    kind = _FUSION_KIND.search(ins.line)
    if not (kind and kind.group(1).startswith(GEMM_FUSIONS)):
        return None
    body = module.callee(ins)
    dots = [i for i in module.comps.get(body, {}).values() if i.op in ("dot", "scaled-dot")]
    return _operand_types(module, body, dots[0].operands) if dots else None


def fused_computations(module: Module) -> set[str]:
    """Computations that run inside a kernel (fusion bodies, reducers, custom calls' computations); not a
    `call`'s, which launches its own (a block-scaled GEMM's scale swizzles and cuDNN call)."""
    inside = set()
    for comp in module.comps.values():
        for ins in comp.values():
            if ins.op in ("fusion", "custom-call") or ("to_apply=" in ins.line and ins.op != "call"):
                inside.update(_FUSED.findall(ins.line))
    return inside


def launches(module: Module):
    """(instruction, computation, executions per step) of every kernel-level instruction."""
    inside = fused_computations(module)
    for comp, times in module.execution_counts().items():
        if comp not in inside:
            for ins in module.comps[comp].values():
                yield ins, comp, times


def gemm_sites(hlo_text: str) -> list[dict]:
    """Every GEMM kernel: its operand types, the op that made it (jit's op_name: the einsum's spec is
    in it) and its executions per step."""
    module, sites = Module(hlo_text), []
    for ins, comp, times in launches(module):
        if (types := gemm_types(module, comp, ins)) is not None:
            name = _OP_NAME.search(ins.line)
            sites.append({"types": types, "op": name.group(1) if name else ins.name, "times": times})
    return sites


def arrays_made(module: Module):
    """{name, op, shape, bytes} of each array a kernel-level instruction makes (not a view, a tuple or
    a parameter)."""
    for ins, _, _ in launches(module):
        if ins.shape.startswith("(") or ins.op in _NOT_NEW:
            continue
        for dtype, elements in typed_array_elements(ins.shape):
            name = _OP_NAME.search(ins.line)
            yield {"name": ins.name, "op": name.group(1) if name else ins.op, "shape": ins.shape.split("{")[0],
                   "bytes": elements * DTYPE_BYTES[dtype]}


def read(hlo_text: str, largest: int = 8, tick_plan: dict | None = None) -> dict:
    """Kernels per step of a compiled GPU program by kind (module doc); `tick_plan`: a pipeline's
    (meshtrain/planner/ticks.py)."""
    module = Module(hlo_text, tick_plan)
    gemms, attention, grouped, collectives, fusions = Counter(), Counter(), Counter(), Counter(), 0.0
    filled = []  # rows expected / rows of the buffer, per gmm and gmm_t
    for ins, comp, times in launches(module):
        types = gemm_types(module, comp, ins)
        target = CALL_TARGET.search(ins.line) if ins.op == "custom-call" else None
        if types is not None:
            gemms[types] += times
        elif target and target.group(1).startswith("__cudnn$fmha"):
            attention["backward" if "Backward" in target.group(1) else "forward"] += times
        elif target and (kernel := GROUPED_GEMM.search(ins.line)):
            grouped[kernel.group(1)] += times
            if kernel.group(1) != "tgmm":
                filled.append(int(kernel.group(2)) / int(re.search(r"\[(\d+)", ins.shape).group(1)))
        elif ins.op.endswith("-start") and ins.op.removesuffix("-start") in KINDS + (RAGGED,):
            collectives[ins.op.removesuffix("-start")] += times
        elif ins.op == "fusion":
            fusions += times
    return {"gemms": dict(gemms), "attention": {"forward": attention["forward"], "backward": attention["backward"]},
            "grouped_gemms": dict(grouped), "grouped_filled": min(filled, default=None),
            "collectives": dict(collectives), "fusions": fusions,
            "largest": sorted(arrays_made(module), key=lambda a: -a["bytes"])[:largest]}


def module_text(compiled) -> str:
    """A compiled program's HLO text as `compiled.as_text()` prints it, its large constants in full
    (as_text() elides them as `{...}`; the index array of a layer scan's switch over the layers' kinds
    is one: kernel_time.branch_shares reads it). The elided text where jaxlib cannot print them."""
    try:
        from jaxlib import _hlo

        modules = compiled.runtime_executable().hlo_modules()
        options = _hlo.HloPrintOptions()
        options.print_large_constants = True
    except (ImportError, AttributeError):
        return compiled.as_text()
    return modules[0].to_string(options) if len(modules) == 1 else compiled.as_text()
