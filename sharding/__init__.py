"""Meshes and logical-axis sharding rules for JAX programs.

Reusable on its own: imports jax (and flax.nnx metadata helpers) only, never `lm`.
"""

from sharding.constraints import (
    activate,
    active_axes,
    bind,
    constrain,
    device,
    jit,
    manual_axes,
    move,
    per_shard,
    platform,
    split_ways,
)
from sharding.context import (
    causal_pairs_per_shard,
    inverse_order,
    load_balanced_order,
    reorder,
)
from sharding.flax_nnx import (
    abstract_module,
    create_sharded,
    logical_axes,
    state_shardings,
)
from sharding.mesh import MESH_AXES, MeshConfig, ShardingError, make_mesh
from sharding.replicas import per_replica
from sharding.rules import (
    DEFAULT_RULES,
    SEQUENCE_PARALLEL_RULES,
    axis_size,
    check_rules,
    logical_to_spec,
    merge_rules,
    named_sharding,
    rule_axes,
    tree_shardings,
)
from sharding.zero import spread_axes, spread_sharding

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "SEQUENCE_PARALLEL_RULES",
    "MeshConfig",
    "ShardingError",
    "abstract_module",
    "activate",
    "active_axes",
    "axis_size",
    "bind",
    "causal_pairs_per_shard",
    "check_rules",
    "constrain",
    "create_sharded",
    "device",
    "inverse_order",
    "jit",
    "load_balanced_order",
    "logical_axes",
    "logical_to_spec",
    "make_mesh",
    "manual_axes",
    "merge_rules",
    "move",
    "named_sharding",
    "per_replica",
    "per_shard",
    "platform",
    "reorder",
    "rule_axes",
    "split_ways",
    "spread_axes",
    "spread_sharding",
    "state_shardings",
    "tree_shardings",
]
