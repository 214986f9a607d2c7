"""Dtype policies: which dtype parameters are kept in, and which dtype the matmuls compute in.

The model takes its matmul (`dot_general`) and dtypes from the policy, so switching number
formats never touches model code. Softmax, normalisation statistics, the logits fed to the loss
and the loss itself stay float32 whatever the policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    dot_general: Callable = jax.lax.dot_general

    @classmethod
    def from_config(cls, precision) -> Policy:
        return cls(param_dtype=jnp.dtype(precision.param_dtype), compute_dtype=jnp.dtype(precision.compute_dtype))

    def cast(self, x: jax.Array) -> jax.Array:
        """An input or weight in the compute dtype."""
        return x.astype(self.compute_dtype)
