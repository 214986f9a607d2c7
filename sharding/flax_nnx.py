"""Flax NNX modules placed by logical-axis rules: abstract state, its shardings, sharded creation.

A module annotates its variables with logical names (`nnx.Param(..., out_sharding=names)` or
`nnx.with_partitioning(init, names)`); these helpers turn flax's eager sharding off, so the rule
table alone decides placement, and build the module with every array born on its devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from sharding.rules import DEFAULT_RULES, Rules, tree_shardings


def abstract_module(make: Callable[[], nnx.Module]) -> nnx.Module:
    """`make()` traced, not run: shapes, dtypes and annotations, no memory."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(make)


def logical_axes(module_or_state) -> dict:
    """Pure dict of each variable's logical axis names (empty for unannotated ones)."""
    state = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(module_or_state)
    return nnx.to_pure_dict(nnx.get_partition_spec(state))


def state_shardings(module_or_state, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict:
    """Pure dict of NamedShardings for a module's state, or part of it (abstract will do)."""
    state = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(module_or_state)
    return tree_shardings(nnx.to_pure_dict(state), logical_axes(state), mesh, rules)


def create_sharded(make: Callable[[], nnx.Module], mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """`make()` with every variable created directly in its shards: no device holds it whole."""
    abstract = abstract_module(make)

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.to_pure_dict(nnx.state(make()))

    state = jax.jit(init, out_shardings=state_shardings(abstract, mesh, rules))()
    return nnx.merge(nnx.graphdef(abstract), state)
