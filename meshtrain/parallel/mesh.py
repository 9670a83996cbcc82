"""Mesh specs ("8x8x4", "data=2,expert=4"), simulated CPU devices, hybrid meshes across hosts.

The mesh always has the six axes below, in this order; an axis of size 1 costs nothing. The
positional form sets the classic four (`data x fsdp x tensor [x pipeline]`); `expert` (experts of
mixture-of-experts layers) and `context` (the sequence, for context parallelism) are given by name.
Device order follows the axis order, so the innermost axes (`expert`, `context`, then `pipeline`,
`tensor`) get the nearest devices.
"""
from __future__ import annotations

import math

from meshtrain.core.cli import simulate_cpu_devices  # noqa: F401 (lives with the commands' --devices preamble)
from meshtrain.core.errors import LayoutError, UserError

AXES = ("data", "fsdp", "tensor", "pipeline", "expert", "context")
POSITIONAL = AXES[:4]


def parse_mesh(spec: str, num_devices: int) -> dict[str, int]:
    """'8x8x4' -> data x fsdp x tensor (pipeline 1); four numbers set pipeline too;
    'data=2,fsdp=4' names axes (missing ones are 1); one axis may be -1 = the rest."""
    sizes = axis_sizes(spec)
    free = [a for a, s in sizes.items() if s == -1]
    if free:
        rest = math.prod(s for s in sizes.values() if s != -1)
        if num_devices % rest:
            raise LayoutError(f"--mesh {spec}: {num_devices} devices do not divide by {rest}; change --mesh or "
                              f"--devices")
        sizes[free[0]] = num_devices // rest
    if math.prod(sizes.values()) != num_devices:
        raise LayoutError(f"mesh {shape_str(sizes)} needs {math.prod(sizes.values())} devices, found {num_devices}; "
                          f"change --mesh or --devices")
    return sizes


def axis_sizes(spec: str) -> dict[str, int]:
    """The sizes a mesh spec names, every axis of AXES, -1 (at most one) for the rest of the devices."""
    spec = spec.replace(" ", "")
    sizes = dict.fromkeys(AXES, 1)
    if "=" in spec:
        named = set()
        for part in spec.split(","):
            name, _, value = part.partition("=")
            if name not in AXES:
                raise UserError(f"unknown mesh axis '{name}' in --mesh {spec}; axes are {', '.join(AXES)}")
            if name in named:
                raise UserError(f"--mesh {spec} names axis '{name}' twice; give each axis once")
            named.add(name)
            sizes[name] = _axis_size(value, spec)
    else:
        parts = spec.lower().split("x")
        if not 1 <= len(parts) <= len(POSITIONAL):
            raise UserError(f"--mesh {spec} needs 1 to 4 sizes (data x fsdp x tensor [x pipeline]), e.g. 2x2x2; "
                            f"name the other axes: data=2,expert=4")
        for name, value in zip(POSITIONAL, parts):
            sizes[name] = _axis_size(value, spec)
    if sum(s == -1 for s in sizes.values()) > 1:
        raise UserError(f"--mesh {spec}: only one axis may be -1")
    return sizes


def _axis_size(value: str, spec: str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise UserError(f"--mesh {spec}: '{value}' is not an integer axis size") from None
    if size < 1 and size != -1:
        raise UserError(f"--mesh {spec}: axis sizes must be >= 1 (or -1 for the rest)")
    return size


def shape_str(sizes: dict[str, int]) -> str:
    """'2x2x2' (data x fsdp x tensor), with the pipeline size appended when it is not 1; the named
    form when expert or context is used."""
    if any(sizes[a] != 1 for a in AXES if a not in POSITIONAL):
        return describe(sizes)
    dims = [sizes[a] for a in POSITIONAL]
    return "x".join(map(str, dims if dims[3] != 1 else dims[:3]))


def describe(sizes: dict[str, int]) -> str:
    """'data=2,fsdp=2,tensor=2,pipeline=1', with expert and context only when they are used."""
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a in POSITIONAL or sizes[a] != 1)


def build_mesh(sizes: dict[str, int], devices=None, dcn: dict[str, int] | None = None):
    """A jax Mesh with all six axes Auto (compiler-managed; see DESIGN.md).

    `devices` picks a subset (e.g. one device for a reference run). With several processes (one
    per host), the mesh is hybrid: fast in-host links carry the inner axes, the network the outer
    ones; `dcn` gives the across-host factor of each axis (default `across_hosts`: the outermost
    axes, so host g holds mesh positions g*k .. g*k+k-1, the layout the planner's roofline
    assumes). CPU processes (the multi-host tests, benchmarks/multihost_plan.py) take the same
    path as GPU hosts; TPUs keep jax.make_mesh, which knows their slices' topology.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    shape = tuple(sizes.get(a, 1) for a in AXES)
    axis_types = (AxisType.Auto,) * len(AXES)
    if devices is None and jax.process_count() > 1 and jax.default_backend() in ("cpu", "gpu"):
        from jax.experimental import mesh_utils

        dcn = dcn or across_hosts(sizes, jax.process_count())
        dcn_shape = tuple(dcn.get(a, 1) for a in AXES)
        if any(s % d for s, d in zip(shape, dcn_shape)):
            raise UserError(f"mesh {describe(sizes)} is not divisible by the across-host factors {dcn}")
        ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape))
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, process_is_granule=True)
        return Mesh(grid, AXES, axis_types=axis_types)
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) != math.prod(shape):
        raise UserError(f"mesh {describe(sizes)} needs {math.prod(shape)} devices, found {len(devices)}")
    return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)


def across_hosts(sizes: dict[str, int], hosts: int) -> dict[str, int]:
    """The across-host factor of each axis when `hosts` hosts split the mesh in mesh order: the
    outermost axes whole while the host count divides by them, then a factor of the next one
    (data=16 on 2 hosts: data 2; fsdp=16,tensor=8 on 16: fsdp 16; data=2,fsdp=8 on 4: data 2,
    fsdp 2)."""
    dcn, left = {}, hosts
    for a in AXES:
        size = sizes.get(a, 1)
        if left == 1 or size == 1:
            continue
        if left % size and size % left:
            raise UserError(f"mesh {describe(sizes)} cannot be split across {hosts} hosts in mesh order: the {a} "
                            f"axis ({size}) and the {left} hosts left for it do not divide one another; change "
                            f"--mesh, e.g. make data a multiple of {hosts}")
        dcn[a] = min(size, left)
        left //= dcn[a]
    return dcn
