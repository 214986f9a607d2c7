"""Meshes and logical-axis sharding rules for JAX programs.

Reusable on its own: imports jax (and flax.nnx metadata helpers) only, never `lm`.
"""

from sharding.mesh import MESH_AXES, MeshConfig, ShardingError, make_mesh
from sharding.rules import (
    DEFAULT_RULES,
    activate,
    constrain,
    logical_to_spec,
    named_sharding,
    tree_shardings,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "MeshConfig",
    "ShardingError",
    "activate",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "named_sharding",
    "tree_shardings",
]
