"""The device mesh: four named axes, sized by the config, checked against the visible devices.

Across several slices (Multislice), `dcn` says how many slices each axis spans: that part of the
axis rides the data-center network, the rest the chips' own interconnect (ICI) inside a slice.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

# Order matters for locality: the last axis varies fastest over neighbouring devices, so `model`
# (the axis with the most collectives per layer) lands on the closest chips.
MESH_AXES: tuple[str, ...] = ("data", "sequence", "expert", "model")


class MeshError(ValueError):
    """The requested mesh cannot be built on the visible devices."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes; -1 on at most one axis fills it with the remaining devices.

    dcn: slices spanned by each axis, in MESH_AXES order (all 1 on one slice); each divides its
    axis, and their product is the number of slices.
    """

    data: int = -1
    sequence: int = 1
    expert: int = 1
    model: int = 1
    dcn: tuple[int, int, int, int] = (1, 1, 1, 1)

    def size(self) -> int | None:
        """The device count when every axis is given (no -1), else None."""
        sizes = [getattr(self, a) for a in MESH_AXES]
        return None if -1 in sizes else math.prod(sizes)

    def resolve(self, num_devices: int) -> dict[str, int]:
        sizes = {axis: int(getattr(self, axis)) for axis in MESH_AXES}
        fill = [a for a, s in sizes.items() if s == -1]
        bad = [f"mesh.{a}={s}" for a, s in sizes.items() if s == 0 or s < -1]
        if bad:
            raise MeshError(f"{', '.join(bad)}: mesh axis sizes must be positive, or -1 to fill")
        if len(fill) > 1:
            raise MeshError(f"mesh axes {fill} are all -1; at most one axis may fill the rest")
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if fill:
            if num_devices % fixed:
                raise MeshError(
                    f"mesh {_describe(sizes)}: the fixed axes multiply to {fixed}, which does not "
                    f"divide the {num_devices} visible devices"
                )
            sizes[fill[0]] = num_devices // fixed
        total = math.prod(sizes.values())
        if total != num_devices:
            raise MeshError(
                f"mesh {_describe(sizes)} = {total} devices but {num_devices} are visible; "
                "change the mesh sizes (or set one axis to -1)"
            )
        return sizes


def _describe(sizes: dict[str, int]) -> str:
    return "*".join(f"{a}={s}" for a, s in sizes.items())


def abstract_mesh(shape: MeshShape, num_devices: int) -> AbstractMesh:
    """The mesh's shape alone, for arithmetic and AOT compilation without the devices."""
    sizes = shape.resolve(num_devices)
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))


def make_mesh(shape: MeshShape, devices: list | None = None) -> Mesh:
    """Builds the mesh over all devices of all processes (or the given ones)."""
    devices = list(jax.devices()) if devices is None else list(devices)
    sizes = shape.resolve(len(devices))
    dims = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape.dcn) > 1:
        return Mesh(_hybrid_grid(sizes, shape.dcn, devices), MESH_AXES,
                    axis_types=(AxisType.Auto,) * len(MESH_AXES))
    if devices == list(jax.devices()):
        return jax.make_mesh(dims, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    grid = np.array(devices, dtype=object).reshape(dims)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _hybrid_grid(sizes: dict[str, int], dcn: tuple[int, ...], devices: list) -> np.ndarray:
    """Devices laid out so that each axis crosses slices only in its `dcn` part. A slice is a TPU
    slice (slice_index); off TPU (CPU, GPU) each process counts as one."""
    bad = [f"mesh.dcn.{a}={n} does not divide mesh.{a}={sizes[a]}" for a, n in zip(MESH_AXES, dcn)
           if n < 1 or sizes[a] % n]
    if bad:
        raise MeshError("; ".join(bad) + ": each axis spans a whole number of slices")
    ici = [sizes[a] // n for a, n in zip(MESH_AXES, dcn)]
    per_process = devices[0].platform != "tpu"
    granule = (lambda d: d.process_index) if per_process else (lambda d: d.slice_index)
    slices = len({granule(d) for d in devices})
    if slices != math.prod(dcn):
        unit = "process(es)" if per_process else "slice(s)"
        raise MeshError(f"mesh.dcn {_describe(dict(zip(MESH_AXES, dcn)))} asks for {math.prod(dcn)} "
                        f"slices but the devices come from {slices} {unit}")
    return mesh_utils.create_hybrid_device_mesh(ici, list(dcn), devices, process_is_granule=per_process)
