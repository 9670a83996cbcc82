"""The compiler a plan runs on: XLA's GPU compiler for a GPU device, on a machine without one.

`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology=...)`
gives compile-only GPU devices when the CUDA plugin is installed (`pip install -e ".[plan-gpu]"`:
`jax[cuda12-local]`, the plugin of jaxlib's own version, and cuDNN for fused attention); jit's
`lower(...).compile()` on a mesh of them runs XLA's whole GPU pipeline (cuBLAS/Triton GEMM fusions,
cuDNN attention, async collectives, the GPU's buffer assignment) without a GPU. The plan reads the
pod's own program: no CPU corrections. Without the plugin, or for a device with no GPU target, the
plan falls back to XLA:CPU on simulated devices (meshtrain/planner/aot.py keeps the CPU's corrections
for that path only) and says why in one line.

Each target is a `GpuTargetConfigProto` (xla/stream_executor/device_description.proto) as text: the
fields XLA's GPU compiler reads to pick kernels and tile sizes. Sources per field below; a GPU at
hand holds its own in `xla_client.get_topology_for_devices(jax.devices()).target_config`, to check
these against.
"""
from __future__ import annotations

import contextlib
import dataclasses

from meshtrain.core import compile_cache
from meshtrain.core.errors import UserError, first_line
from meshtrain.core.metrics import DEVICE_PROFILES
from meshtrain.ops.platform import installed_cudnn
from meshtrain.parallel.mesh import simulate_cpu_devices

# Per device: SMs (`core_count`), shared memory per SM and the largest opt-in block share, L2, boost
# clock, compute capability (the device profile's, meshtrain/core/metrics.py), HBM bytes and bandwidth as
# the CUDA driver reports them.
# - H100 SXM5 80GB: the GpuTargetConfigProto XLA's and JAX's own deviceless-compile tests use (a
#   dump of an H100 80GB HBM3: 132 SMs, 228 KiB shared per SM, 50 MiB L2, 1.98 GHz, cc 9.0,
#   84,929,347,584 bytes, 3.35 TB/s).
# - H200 SXM 141GB: the H100's GH100 die (NVIDIA H200 datasheet: same SMs, clocks and L2), with HBM3e:
#   150,754,820,096 bytes (141 GB as the driver reports it) at 4.8 TB/s.
# - B200 (Blackwell, cc 10.0): XLA's own spec, a dump of a B200 (xla/tools/hlo_opt/gpu_specs/b200.txtpb):
#   148 SMs, 228 KiB shared per SM, 126.5 MiB L2, 1.965 GHz, 191,514,673,152 bytes at 7.67 TB/s.
# - GB200 (Blackwell, cc 10.0): XLA's own spec of one (xla/backends/gpu/target_config/specs/gb200.txtpb):
#   152 SMs, 228 KiB shared per SM, 129.25 MiB L2, 2.062 GHz, 197,897,748,480 bytes at 7.93 TB/s.
# - A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs, 164 KiB shared per SM
#   (163 KiB to one block), 40 MiB L2, 1.41 GHz boost, cc 8.0, 64 FP32 units per SM; HBM2e 2,039 GB/s;
#   85,051,572,224 bytes (80 GiB less the driver's reservation, as an A100-SXM4-80GB reports it).
_cc = lambda device: DEVICE_PROFILES[device]["capability"]
GPU_TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", cc=_cc("h100"), sms=132, fpus=128, shared_per_sm=233472,
                 shared_optin=232448, l2=52428800, clock_ghz=1.98, memory=84929347584, bandwidth=3352320000000),
    "h200": dict(name="NVIDIA H200", cc=_cc("h200"), sms=132, fpus=128, shared_per_sm=233472,
                 shared_optin=232448, l2=52428800, clock_ghz=1.98, memory=150754820096, bandwidth=4800000000000),
    "b200": dict(name="NVIDIA B200", cc=_cc("b200"), sms=148, fpus=128, shared_per_sm=233472,
                 shared_optin=232448, l2=132644864, clock_ghz=1.965, memory=191514673152, bandwidth=7672320000000),
    "gb200": dict(name="NVIDIA GB200", cc=_cc("gb200"), sms=152, fpus=128, shared_per_sm=233472,
                  shared_optin=232448, l2=135528448, clock_ghz=2.062, memory=197897748480, bandwidth=7928064000000),
    "a100": dict(name="NVIDIA A100-SXM4-80GB", cc=_cc("a100"), sms=108, fpus=64, shared_per_sm=167936,
                 shared_optin=166912, l2=41943040, clock_ghz=1.41, memory=85051572224, bandwidth=2039000000000),
}
# The CUDA and cuDNN versions the compiler targets (jax-cuda12-plugin 0.10 is built with CUDA 12.8). cuDNN's:
# the one a GPU run of this install uses (meshtrain/ops/platform.py `installed_cudnn`: the plugin's library,
# else the nvidia-cudnn-cu12 package's, else 9.8, the least JAX accepts). It decides kernels: XLA's GPU
# compiler makes a block-scaled GEMM (mxfp8, nvfp4: `__cudnn$blockScaledDot`) on Blackwell only from cuDNN
# 9.10 (a dequantization and a bf16 GEMM before; checked on the B200 target, jaxlib 0.10.2), and cuDNN's
# fused attention is planned only when the installed library can build its graphs.
RUNTIME = {"cuda": (12, 8, 0)}


def cudnn_version() -> tuple[int, int]:
    """(major, minor) of the cuDNN the target names: `installed_cudnn` (above)."""
    return installed_cudnn()


COMPILERS = ("auto", "gpu", "cpu")
INSTALL_HINT = 'pip install -e ".[plan-gpu]"'


def target_config(device: str) -> str:
    """The GpuTargetConfigProto of `device` (a GPU_TARGETS key) as text."""
    t = GPU_TARGETS[device]
    major, minor = t["cc"]
    cuda, cudnn = RUNTIME["cuda"], cudnn_version()
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {t['shared_per_sm']} threads_per_core_limit: 2048 core_count: {t['sms']}
  fpus_per_core: {t['fpus']} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {t['bandwidth']} l2_cache_size: {t['l2']} clock_rate_ghz: {t['clock_ghz']}
  device_memory_size: {t['memory']} shared_memory_per_block_optin: {t['shared_optin']}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}
runtime_version {{ major: {cuda[0]} minor: {cuda[1]} patch: {cuda[2]} }}
device_description_str: "{t['name']}"
"""


@dataclasses.dataclass
class Target:
    """Where a plan's programs are compiled: `platform` "cuda" (XLA's GPU compiler, compile-only
    devices of `device`) or "cpu" (simulated CPU devices); `reason` says why a plan that could
    have used the GPU compiler did not."""
    platform: str
    device: str
    devices: list
    hosts: int = 1
    reason: str = ""

    @property
    def gpu(self) -> bool:
        return self.platform == "cuda"

    def describe(self) -> dict:
        """The JSON report's `compiled_for`."""
        out = {"platform": self.platform, "device": self.device, "devices": len(self.devices)}
        if self.gpu:
            out.update(device_kind=GPU_TARGETS[self.device]["name"], hosts=self.hosts)
        if self.reason:
            out["fallback"] = self.reason
        return out

    @contextlib.contextmanager
    def compiling(self):
        """XLA's GPU compiler refusing a program (an internal error of its own, e.g. "Couldn't find output
        tile sizes" for a GEMM of odd small widths) is said in one line, with the CPU plan to fall back to."""
        from jax.errors import JaxRuntimeError

        try:
            with compile_cache.suspended() if self.gpu else contextlib.nullcontext(), \
                    cudnn_checks_see(GPU_TARGETS[self.device]["cc"]) if self.gpu else contextlib.nullcontext():
                yield
        except JaxRuntimeError as e:
            if not self.gpu:
                raise
            raise refused(e) from None


def refused(e: Exception) -> UserError:
    """XLA's GPU compiler's refusal of a program, in one line with what to do."""
    return UserError(f"XLA's GPU compiler failed on this run's program: {first_line(e)[:300]}; plan it with "
                     f"--compiler cpu, or change the widths it names")



@contextlib.contextmanager
def cudnn_checks_see(capability: tuple[int, int]):
    """JAX's cuDNN attention checks (head widths up to 256 and multi-head latent attention from
    Hopper on) answering for the target's compute `capability`: they ask the local GPU backend, which a
    compile-only plan has not (it would refuse what the pod's own run takes). The checks are JAX's
    private functions (jax/_src/cudnn/fused_attention_stablehlo.py, 0.10 and 0.11 alike); where they
    are gone the plan keeps JAX's answer."""
    from jax._src.cudnn import fused_attention_stablehlo as checks

    from meshtrain.ops.attention import cudnn_refusal

    names = ("check_compute_capability", "is_cuda_compute_capability_equal")
    if not all(hasattr(checks, name) for name in names):
        yield
        return
    wanted = lambda c: tuple(int(x) for x in c.split("."))
    saved = {name: getattr(checks, name) for name in names}
    checks.check_compute_capability = lambda c: capability >= wanted(c)
    checks.is_cuda_compute_capability_equal = lambda c: capability == wanted(c)
    cudnn_refusal.cache_clear()  # answers memoised for another device
    try:
        yield
    finally:
        for name, check in saved.items():
            setattr(checks, name, check)
        cudnn_refusal.cache_clear()


def summary(compiled_for: dict) -> str:
    """A report's `compiled_for` (Target.describe) as one line of text."""
    c = compiled_for
    if c["platform"] == "cuda":
        return (f"compiled by XLA's GPU compiler for {c['devices']} x {c['device_kind']} ({c['hosts']} host(s) x "
                f"{c['devices'] // c['hosts']}), without a GPU")
    return f"compiled by XLA:CPU on {c['devices']} simulated devices: {c.get('fallback', '')}"


def gpu_compiler_missing() -> str | None:
    """Why XLA's GPU compiler cannot be used in this process (None when it can)."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (the compile-only backend's plugin)
    except ImportError:
        return f"the compile-only GPU backend is not installed ({INSTALL_HINT} brings it)"
    return None


def topology_shape(devices: int, per_node: int) -> tuple[int, int]:
    """(hosts, devices per host) of a pod of `devices` GPUs with `per_node` to a host: whole hosts when
    `per_node` divides the count, else one host of them all."""
    return (devices // per_node, per_node) if devices > per_node and devices % per_node == 0 else (1, devices)


def gpu_devices(device: str, devices: int, per_node: int) -> tuple[list, int]:
    """Compile-only devices of `device` for a pod of `devices` GPUs, `per_node` to a host (the
    topology's "slices x hosts x devices per host"): each device's process_index is its host, as on a
    multi-host pod. Returns (devices, hosts)."""
    from jax.experimental import topologies

    hosts, per_host = topology_shape(devices, per_node)
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(device),
                                            topology=f"1x{hosts}x{per_host}")
    return list(topology.devices), hosts


def choose(compiler: str, device: str, devices: int, per_node: int) -> Target:
    """The Target of a plan: `compiler` "gpu" (XLA's GPU compiler or an error), "cpu", or "auto" (the
    GPU compiler when `device` is a GPU target and the plugin is installed, else the CPU, with why).
    Call before JAX starts its CPU backend (it reads the simulated device count once)."""
    import jax

    jax.config.update("jax_platforms", "cpu")  # no local GPU backend: the topology brings compile-only devices
    if compiler != "cpu":
        missing = (f"no GPU target for --device {device} (GPU targets: {', '.join(sorted(GPU_TARGETS))})"
                   if device not in GPU_TARGETS else gpu_compiler_missing())
        if missing is None:
            try:
                found, hosts = gpu_devices(device, devices, per_node)
                return Target("cuda", device, found, hosts)
            except Exception as e:  # a plugin of another jaxlib's version, a broken install: said, not raised
                missing = f"XLA's GPU compiler did not start ({first_line(e)[:200]})"
        if compiler == "gpu":
            raise UserError(f"--compiler gpu: {missing}; or plan with --compiler cpu")
        reason = f"{missing}; the figures are XLA:CPU's, corrected where it differs from a GPU's"
    else:
        reason = "--compiler cpu"
    simulate_cpu_devices(devices)
    return Target("cpu", device, jax.devices("cpu")[:devices], reason=reason)
