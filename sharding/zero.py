"""ZeRO-1: the optimizer state spread over the data-parallel replicas.

Plain data parallelism keeps a whole optimizer state on every replica. Spreading each of its
arrays over the `data` mesh axis too (DeepSpeed's ZeRO stage 1, Megatron-LM's distributed
optimizer, MaxText's `shard_optimizer_over_data`) divides that memory by the replica count,
while the parameters stay as the rules place them: the gradients are reduce-scattered over
`data` instead of all-reduced, each replica updates its share, and the new parameters are
all-gathered (in a ring, the same bytes as the all-reduce it replaces).

Each array takes the extra axis on one dimension: the largest one it divides once the axes
already there have split it. An array it divides nowhere (a scalar, a small bias) stays as it
was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import NamedSharding

from sharding.rules import axes_spec, spec_axes

Axes = tuple[tuple[str, ...], ...]  # the mesh axes of each dimension


def spread_axes(shape: Sequence[int], axes: Axes, sizes: Mapping[str, int], axis: str = "data") -> Axes:
    """`axes` with mesh axis `axis` (of `sizes[axis]` devices) added to the dimension that takes it."""
    ways = sizes.get(axis, 1)
    if ways == 1 or any(axis in a for a in axes):
        return tuple(axes)
    local = [n // math.prod(sizes[a] for a in dim) for n, dim in zip(shape, axes)]
    fitting = [d for d, n in enumerate(local) if n % ways == 0]
    if not fitting:
        return tuple(axes)
    chosen = max(fitting, key=lambda d: local[d])  # the first of equals
    return tuple((*dim, axis) if d == chosen else dim for d, dim in enumerate(axes))


def spread_sharding(sharding: NamedSharding, shape: Sequence[int], axis: str = "data") -> NamedSharding:
    """`sharding` with `axis` added as `spread_axes` chooses."""
    spread = spread_axes(shape, spec_axes(sharding.spec, len(shape)), dict(sharding.mesh.shape), axis)
    return NamedSharding(sharding.mesh, axes_spec(spread))
