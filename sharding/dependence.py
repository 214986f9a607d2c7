"""Which results of a function depend on its arguments, read from its jaxpr.

A split backward (`sharding.pipeline_zero_bubble`) gives every parameter a gradient from both
halves, and each half's is zeros for the parameters the other half owns: B gives zeros for the
matmul weights (W makes those), W zeros for the rest, and adding them is a pass over the
float32 sums (XLA cannot see they are zeros where a layer scan stacked them). A result that
depends on no argument of the half that makes it is such a constant, found here at trace time
from jax's own dead-code elimination (which knows every primitive: scans, conditionals, remat).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public equivalent (jax 0.10 - 0.12)


def depends_on_arguments(fn: Callable, *args) -> object:
    """`fn(*args)`'s result structure with, per leaf, whether it depends on any of `args` (values
    `fn` closes over count as constants). `args` may be `jax.ShapeDtypeStruct`s."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr, outputs = closed.jaxpr, len(closed.jaxpr.outvars)
    flags = [any(pe.dce_jaxpr(jaxpr, [k == i for k in range(outputs)])[1]) for i in range(outputs)]
    return jax.tree.unflatten(jax.tree.structure(shape), flags)
