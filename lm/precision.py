"""Dtype policies: which dtype parameters are kept in, and which dtype the matmuls compute in.

The model takes its matmul (`Policy.matmul`) and dtypes from the policy, so switching number
formats never touches model code. Softmax, normalisation statistics, the logits fed to the loss
and the loss itself stay float32 whatever the policy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.lru_cache(maxsize=None)
def _transposed_specs(spec: str) -> tuple[str, str]:
    """For `x,w->y`: the einsums giving dx from (dy, w) and dw from (x, dy)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    for index in set(x + w + out):
        if (index in x) + (index in w) + (index in out) < 2:
            raise ValueError(f"matmul spec {spec!r}: index {index!r} must appear in two or three terms")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _low_precision_matmul(spec: str, out_dtype, x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _matmul_fwd(spec, out_dtype, x, w):
    return _low_precision_matmul(spec, out_dtype, x, w), (x, w)


def _matmul_bwd(spec, out_dtype, residuals, dy):
    # The cotangent is cast to the compute dtype so both backward matmuls run on the fast
    # low-precision units with float32 accumulation, as the forward one does.
    x, w = residuals
    dy = dy.astype(x.dtype)
    dx_spec, dw_spec = _transposed_specs(spec)
    dx = jnp.einsum(dx_spec, dy, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum(dw_spec, x, dy, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


_low_precision_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32

    @classmethod
    def from_config(cls, precision) -> Policy:
        return cls(param_dtype=jnp.dtype(precision.param_dtype), compute_dtype=jnp.dtype(precision.compute_dtype))

    def cast(self, x: jax.Array) -> jax.Array:
        """An input or weight in the compute dtype."""
        return x.astype(self.compute_dtype)

    def matmul(self, spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
        """`einsum(spec, x, w)` on compute-dtype inputs, accumulated in float32 forward and
        backward; the result is in `out_dtype` (default: the compute dtype)."""
        x, w = self.cast(x), self.cast(w)
        out_dtype = jnp.dtype(out_dtype or self.compute_dtype)
        if self.compute_dtype == jnp.float32:
            return jnp.einsum(spec, x, w).astype(out_dtype)
        return _low_precision_matmul(spec, out_dtype, x, w)
