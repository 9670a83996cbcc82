"""One choice of implementation by the devices a program is traced for: NVIDIA GPUs (Pallas Triton
kernels, ragged all-to-alls) or anything else (XLA:CPU's portable forms).

`by_platform(gpu, default, *args)` chooses while the program is traced, from the mesh's devices (JAX's
abstract mesh names their platform). `jax.lax.platform_dependent` chooses at lowering by putting the
choices in a one-branch conditional, which XLA keeps: no other kernel runs beside a collective inside
one (XLA's GPU schedule of the dropless dispatch, compiled here without a GPU). Without a mesh that
names its devices (none set, or a JAX whose AbstractMesh has no `abstract_device`), the lowering
still chooses so.
"""
from __future__ import annotations

import jax

GPU_PLATFORMS = ("cuda", "gpu")  # the lowering's name, the device's


def traced_for_gpu() -> bool | None:
    """Whether the active mesh's devices are NVIDIA GPUs; None where no mesh names them."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return None if device is None else device.platform in GPU_PLATFORMS


def by_platform(gpu, default, *args):
    """`gpu(*args)` in a program traced for NVIDIA GPUs, else `default(*args)` (module doc)."""
    on_gpu = traced_for_gpu()
    if on_gpu is None:
        return jax.lax.platform_dependent(*args, default=default, cuda=gpu)
    return (gpu if on_gpu else default)(*args)


# The least cuDNN JAX accepts: what the planner's GPU target names where it finds none installed.
LEAST_CUDNN = (9, 8)


def loaded_cudnn() -> tuple[int, int] | None:
    """(major, minor) of the cuDNN this process's CUDA plugin loads (jaxlib's `cuda_versions`: cuDNN 9's
    version number is major x 10,000 + minor x 100 + patch); None without the plugin, or where it cannot say."""
    try:
        from jax._src.lib import cuda_versions
        version = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 (a plugin without its libraries: unknown)
        return None
    return None if not version else (version // 10000, version // 100 % 100)


def installed_cudnn() -> tuple[int, int]:
    """(major, minor) of the cuDNN a GPU run of this install uses: the one the CUDA plugin loads, else the
    `nvidia-cudnn-cu12` package's (jax[cuda12] and the plan-gpu extra take the newest 9.x), else
    `LEAST_CUDNN`. The planner's GPU target names it (meshtrain/planner/compilers.py) and a block-scaled
    recipe checks it (meshtrain/ops/recipes.py), so the two cannot disagree."""
    if found := loaded_cudnn():
        return found
    from importlib import metadata

    try:
        major, minor = metadata.version("nvidia-cudnn-cu12").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return LEAST_CUDNN
