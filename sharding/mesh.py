"""The device mesh: four named axes, sized by the config, checked against the visible devices."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

# Order matters for locality: the last axis varies fastest over neighbouring devices, so `model`
# (the axis with the most collectives per layer) lands on the closest chips.
MESH_AXES: tuple[str, ...] = ("data", "sequence", "expert", "model")


class MeshError(ValueError):
    """The requested mesh cannot be built on the visible devices."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes; -1 on at most one axis fills it with the remaining devices."""

    data: int = -1
    sequence: int = 1
    expert: int = 1
    model: int = 1

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
    if devices == list(jax.devices()):
        return jax.make_mesh(dims, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    grid = np.array(devices, dtype=object).reshape(dims)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
