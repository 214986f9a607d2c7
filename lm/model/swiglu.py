"""SwiGLU, silu(gate) x up, with its backward written by hand: one sigmoid, float32 maths.

Autodiff of `jax.nn.silu(g) * u` hands XLA silu's derivative as a chain of compute-dtype
expressions, and under fp8 XLA then leaves one of the two gradients out of the pass that makes
them: written in bf16, read again to be quantised in a pass of its own (the `llama_1b` recipe:
1.07 GB more a layer and microbatch, 26 ms of its H100 step). From this one expression XLA
quantises both in that pass (PERFORMANCE.md). The experts' SwiGLU kernels over their real rows
(`lm.model.swiglu_rows`) compute the same expressions in their tiles.

Shape suffixes: none (elementwise, any shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _sigmoid(g):
    return 1.0 / (1.0 + jnp.exp(-g))  # spelled out: Mosaic GPU kernels take it too


def forward(g, u):
    """silu(g) x u in float32."""
    g = g.astype(jnp.float32)
    return g / (1.0 + jnp.exp(-g)) * u.astype(jnp.float32)


def gradients(dh, g, u):
    """The gradients of silu(g) x u with respect to g and u for the output's `dh`, in float32."""
    dh, g, u = (a.astype(jnp.float32) for a in (dh, g, u))
    sig = _sigmoid(g)
    return dh * u * sig * (1.0 + g * (1.0 - sig)), dh * g * sig


@jax.custom_vjp
def swiglu(g, u):
    """silu(g) x u in the inputs' dtype (as `jax.nn.silu(g) * u`); its gradients in theirs."""
    return jax.nn.silu(g) * u


def _swiglu_fwd(g, u):
    return swiglu(g, u), (g, u)


def _swiglu_bwd(residuals, dh):
    g, u = residuals
    dg, du = gradients(dh, g, u)
    return dg.astype(g.dtype), du.astype(u.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
