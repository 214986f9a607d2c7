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


def _transposed_specs(spec: str) -> tuple[str, str, str]:
    """For `x,w->y`: the einsums giving dx from (dy, w), and dw from (x, dy) or from (dy, x)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    for index in set(x + w + out):
        if (index in x) + (index in w) + (index in out) < 2:
            raise ValueError(f"matmul spec {spec!r}: index {index!r} must appear in two or three terms")
    return f"{out},{w}->{x}", f"{x},{out}->{w}", f"{out},{x}->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(spec: str, out_dtype, x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _matmul_fwd(spec, out_dtype, x, w):
    return _matmul(spec, out_dtype, x, w), (x, w)


def _matmul_bwd(spec, out_dtype, residuals, dy):
    x, w = residuals
    # The cotangent is cast to the compute dtype so both backward matmuls run on the same
    # (fast, low-precision) units with float32 accumulation as the forward one.
    dy = dy.astype(x.dtype)
    dx_spec, dw_spec, dw_spec_swapped = _transposed_specs(spec)
    dx = jnp.einsum(dx_spec, dy, w, preferred_element_type=jnp.float32).astype(x.dtype)
    # XLA:CPU transposes a weight-gradient matmul's first operand (and refuses to materialise
    # what produced it, recomputing it inside the transpose); so the smaller operand goes first.
    if x.size > dy.size:
        dw = jnp.einsum(dw_spec_swapped, dy, x, preferred_element_type=jnp.float32)
    else:
        dw = jnp.einsum(dw_spec, x, dy, preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


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
        return _matmul(spec, out_dtype, x, w)
