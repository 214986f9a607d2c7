"""A device mesh with the axes ('data', 'stage', 'fsdp', 'tensor'), built from plain sizes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# Outermost (slowest link) to innermost (fastest link).
MESH_AXES = ("data", "stage", "fsdp", "tensor")


class ShardingError(ValueError):
    """A user-facing mistake in a mesh, rule table or sharded shape; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; one of them may be -1, meaning "all remaining devices"."""

    data: int = -1
    stage: int = 1
    fsdp: int = 1
    tensor: int = 1

    @classmethod
    def from_mapping(cls, sizes) -> MeshConfig:
        return cls(**{axis: int(sizes[axis]) for axis in MESH_AXES if axis in sizes})

    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """Axis sizes with -1 filled in; raises ShardingError when they cannot cover the devices."""
        sizes = self.sizes()
        named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
        if any(s == 0 or s < -1 for s in sizes):
            raise ShardingError(f"mesh axes must be positive or -1, got {named}")
        if sizes.count(-1) > 1:
            raise ShardingError(f"at most one mesh axis may be -1 (fill), got {named}")
        fixed = math.prod(s for s in sizes if s != -1)
        if fixed > num_devices or num_devices % fixed:
            raise ShardingError(
                f"mesh {named} needs {fixed} devices but {num_devices} are available; "
                f"choose axis sizes whose product divides {num_devices} (or use -1 for one axis)"
            )
        if -1 in sizes:
            sizes = tuple(num_devices // fixed if s == -1 else s for s in sizes)
        if math.prod(sizes) != num_devices:
            raise ShardingError(
                f"mesh {named} uses {math.prod(sizes)} of {num_devices} devices; "
                f"make the product equal {num_devices} or set one axis to -1"
            )
        return sizes


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh over `devices` (default: all), axis types Auto so logical constraints steer XLA."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    if devices == list(jax.devices()):
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices)
    else:
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
