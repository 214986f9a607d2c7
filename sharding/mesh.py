"""A device mesh with the axes ('data', 'stage', 'context', 'expert', 'fsdp', 'tensor'), built from plain sizes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# Outermost (slowest link) to innermost (fastest link).
MESH_AXES = ("data", "stage", "context", "expert", "fsdp", "tensor")


class ShardingError(ValueError):
    """A user-facing mistake in a mesh, rule table or sharded shape; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; one of them may be -1, meaning "all remaining devices"."""

    data: int = -1
    stage: int = 1
    context: int = 1
    expert: int = 1  # a mixture of experts' experts split over it; elsewhere it splits the batch
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


def split_over_granules(sizes: Sequence[int], granules: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(per-granule sizes, across-granule sizes) of the mesh axes.

    A granule is a host (or a TPU slice): devices inside one share the fast links. The slow
    links are given to the outermost axes first (`data`, then `stage`, ...), so `fsdp` and
    `tensor` stay inside a host whenever the sizes allow.
    """
    across, left = [], granules
    for size in sizes:
        shared = math.gcd(size, left)
        across.append(shared)
        left //= shared
    if left != 1:
        named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
        raise ShardingError(
            f"mesh {named} cannot be split over {granules} hosts: the product of whole axes "
            f"placed across hosts must equal {granules}; make data (or stage) a multiple of {granules}"
        )
    return tuple(s // a for s, a in zip(sizes, across)), tuple(across)


def _granule_key(device) -> str:
    """Devices of one TPU slice share fast links; elsewhere, devices of one process do."""
    return "slice_index" if getattr(device, "slice_index", None) is not None else "process_index"


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh over `devices` (default: all), axis types Auto so logical constraints steer XLA.

    Over several hosts the mesh is hybrid (`mesh_utils.create_hybrid_device_mesh`): `data` spans
    the hosts and the inner axes stay on each host's fast links where the sizes allow.
    """
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    key = _granule_key(devices[0])
    granules = len({getattr(d, key) for d in devices})
    if granules > 1:
        per_granule, across = split_over_granules(shape, granules)
        grid = mesh_utils.create_hybrid_device_mesh(
            per_granule, across, devices, process_is_granule=key == "process_index"
        )
    elif devices == list(jax.devices()):
        grid = mesh_utils.create_device_mesh(shape, devices)
    else:
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
