"""Dtype policies: which dtype parameters are kept in, which dtype the matmuls compute in, and
whether the Transformer blocks' dense matmuls run in fp8 with delayed scaling.

The model takes its matmul (`Policy.matmul`) and dtypes from the policy, so switching number
formats never touches model code. Softmax, normalisation statistics, the logits fed to the loss
and the loss itself stay float32 whatever the policy.

fp8 (Transformer Engine's HYBRID recipe): activations and weights are quantised to e4m3, output
gradients to e5m2, each with a per-tensor scale taken from the largest absolute value seen over
the last `history` steps (delayed scaling). Each such matmul is a *site* (`MatmulSite`) holding
its scales and amax histories as `Fp8Meta` variables: state, not parameters, so the optimizer,
weight decay, clipping and gradient averaging never see them. The current step's amaxes leave the
step through the gradient of a zero `Probe` input (the only way a value computed in the backward
pass gets out of `jax.grad`); `update_fp8` then writes them into the histories and recomputes the
scales. Quantise-dequantise around an ordinary dot is what XLA rewrites into fp8 GEMMs on GPUs
that have them, and what emulates fp8 exactly on CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

F32 = jnp.float32
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
ROLES = ("x", "w", "g")  # a matmul's input activation, its weight, the gradient of its output
# Formats a tensor's values are checked against by the numerics report, in this order.
REPORT_FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "float16": jnp.dtype(jnp.float16), "bfloat16": jnp.dtype(jnp.bfloat16)}
FP8_FORMATS = ("e4m3", "e4m3", "e5m2")  # per role, HYBRID: e4m3 forward, e5m2 gradients
FP8_DTYPES = tuple(REPORT_FORMATS[name] for name in FP8_FORMATS)
FULL_STATS = 2 + 2 * len(REPORT_FORMATS)  # absmax, non-finite fraction, (overflow, underflow) per format


class Fp8Meta(nnx.Variable):
    """Delayed-scaling state of one fp8 matmul (scales, amax histories): never trained."""


class Probe(nnx.Variable):
    """A zero input whose gradient is its matmul's tensor statistics: [roles, amax (+ report)]."""


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    history: int = 1024  # steps of amax history a scale is taken from
    margin: int = 0  # scales leave 2**margin of headroom below the format's largest value
    skip: tuple[int, ...] = ()  # layer indices (negative from the end) kept in the compute dtype


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    fp8: Fp8Recipe | None = None
    observe: bool = False  # every site records the numerics report's statistics

    @classmethod
    def from_config(cls, precision) -> Policy:
        fp8 = None
        if precision.fp8 == "delayed":
            skip = tuple(int(i) for i in str(precision.fp8_skip).replace(" ", "").split(",") if i)
            fp8 = Fp8Recipe(precision.fp8_history, precision.fp8_margin, skip)
        return cls(jnp.dtype(precision.param_dtype), jnp.dtype(precision.compute_dtype), fp8)

    def cast(self, x: jax.Array) -> jax.Array:
        """An input or weight in the compute dtype."""
        return x.astype(self.compute_dtype)

    def site(self) -> MatmulSite | None:
        """The state of one dense matmul in a block (None when the policy keeps none)."""
        return MatmulSite(self) if self.fp8 or self.observe else None

    def fp8_layers(self, num_layers: int) -> list[bool]:
        """Per layer of the stack: does it compute in fp8?"""
        skipped = {i % num_layers for i in self.fp8.skip} if self.fp8 else set()
        return [self.fp8 is not None and i not in skipped for i in range(num_layers)]

    def matmul(self, spec: str, x: jax.Array, w: jax.Array, out_dtype=None, site: MatmulSite | None = None) -> jax.Array:
        """`einsum(spec, x, w)` on compute-dtype inputs, accumulated in float32 forward and
        backward; the result is in `out_dtype` (default: the compute dtype). At a `site`, in fp8
        when the policy says so (and no `fp8_suspended()` is in force)."""
        x, w = self.cast(x), self.cast(w)
        out_dtype = jnp.dtype(out_dtype or self.compute_dtype)
        fp8 = self.fp8 is not None and not _FP8_SUSPENDED.get()
        if site is None or not (fp8 or self.observe):
            return _matmul(spec, out_dtype, x, w)
        scales = site.scale[...] if self.fp8 else jnp.zeros(len(ROLES), F32)  # zero: current amax
        mode = _Mode(fp8, self.observe, self.compute_dtype)
        return _site_matmul(spec, out_dtype, mode, x, w, scales, site.probe[...])


class MatmulSite(nnx.Module):
    """Per dense matmul: fp8 scales [roles] (multipliers back to real values) and amax histories
    [roles, history]; and the probe [roles, stats] its statistics come out through."""

    def __init__(self, policy: Policy):
        def var(kind, value):
            return kind(value, out_sharding=(None,) * value.ndim, eager_sharding=False)

        if policy.fp8:
            self.scale = var(Fp8Meta, jnp.ones(len(ROLES), F32))
            self.amax_history = var(Fp8Meta, jnp.zeros((len(ROLES), policy.fp8.history), F32))
        self.probe = var(Probe, jnp.zeros((len(ROLES), FULL_STATS if policy.observe else 1), F32))


_FP8_SUSPENDED = contextvars.ContextVar("fp8_suspended", default=False)


@contextlib.contextmanager
def fp8_suspended(suspended: bool = True):
    """Matmuls traced inside compute in the compute dtype (`precision.fp8_skip` layers)."""
    token = _FP8_SUSPENDED.set(suspended)
    try:
        yield
    finally:
        _FP8_SUSPENDED.reset(token)


# -- delayed scaling


def update_fp8(fp8_state: dict, probe_grads: dict, recipe: Fp8Recipe) -> dict:
    """The fp8 state after a step: each site's amaxes pushed into its histories, scales
    recomputed from the histories' maxima (as Transformer Engine's `max` amax algorithm)."""
    fp8_max = jnp.array([float(jnp.finfo(d).max) for d in FP8_DTYPES], F32)

    def site(meta, probe):
        amax = probe[..., 0]  # [..., roles]
        history = jnp.roll(meta["amax_history"], 1, axis=-1).at[..., 0].set(amax)
        scale = fp8_ops.compute_scale(jnp.max(history, axis=-1), meta["scale"], fp8_max, recipe.margin)
        return {"scale": scale, "amax_history": history}

    return _map_sites(site, fp8_state, probe_grads)


def _map_sites(fn, meta: dict, probes: dict) -> dict:
    if "scale" in meta:
        return fn(meta, probes["probe"])
    return {k: _map_sites(fn, meta[k], probes[k]) for k in meta}


# -- statistics


def tensor_stats(t: jax.Array, fp8_dtype, scale: jax.Array | None, full: bool) -> jax.Array:
    """[absmax] of `t`; with `full`, [absmax of its finite values, fraction already inf/nan], then
    for each of REPORT_FORMATS the fractions of its values that overflow (finite -> inf/nan) and
    that flush to zero (nonzero -> 0) when cast to it.

    fp8 formats see `t / scale` with scale (`fp8_dtype`'s multiplier back to real values) taken
    as in use, and scaled to each format's range; zero or None means just-in-time scaling from
    this tensor's own amax. float16 and bfloat16 see `t` as it is (gradients here already carry
    the loss scale).
    """
    t = t.astype(F32)
    if not full:
        return jnp.max(jnp.abs(t))[None]
    if scale is None:
        scale = jnp.zeros((), F32)
    own_max = float(jnp.finfo(fp8_dtype).max)
    finite = jnp.isfinite(t)
    amax = jnp.max(jnp.where(finite, jnp.abs(t), 0.0))
    scale = jnp.where(scale > 0, scale, jnp.where(amax > 0, amax / own_max, 1.0))
    stats = [amax, jnp.mean(~finite)]
    for dtype in REPORT_FORMATS.values():
        fp8 = jnp.finfo(dtype).bits == 8
        v = t * (float(jnp.finfo(dtype).max) / own_max / scale) if fp8 else t
        cast = v.astype(dtype).astype(F32)
        stats.append(jnp.mean(finite & ~jnp.isfinite(cast)))
        stats.append(jnp.mean((v != 0) & (cast == 0)))
    return jnp.stack(stats).astype(F32)


# -- the matmuls


def _transposed_specs(spec: str) -> tuple[str, str, str]:
    """For `x,w->y`: the einsums giving dx from (dy, w), and dw from (x, dy) or from (dy, x)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    for index in set(x + w + out):
        if (index in x) + (index in w) + (index in out) < 2:
            raise ValueError(f"matmul spec {spec!r}: index {index!r} must appear in two or three terms")
    return f"{out},{w}->{x}", f"{x},{out}->{w}", f"{out},{x}->{w}"


def _backward(spec: str, x, w, dy):
    """(dx, dw) of `einsum(spec, x, w)` in x's and w's dtypes, float32 accumulation."""
    dx_spec, dw_spec, dw_spec_swapped = _transposed_specs(spec)
    dx = jnp.einsum(dx_spec, dy, w, preferred_element_type=F32).astype(x.dtype)
    # XLA:CPU transposes a weight-gradient matmul's first operand (and refuses to materialise
    # what produced it, recomputing it inside the transpose); so the smaller operand goes first.
    if x.size > dy.size:
        dw = jnp.einsum(dw_spec_swapped, dy, x, preferred_element_type=F32)
    else:
        dw = jnp.einsum(dw_spec, x, dy, preferred_element_type=F32)
    return dx, dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(spec: str, out_dtype, x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=F32).astype(out_dtype)


def _matmul_fwd(spec, out_dtype, x, w):
    return _matmul(spec, out_dtype, x, w), (x, w)


def _matmul_bwd(spec, out_dtype, residuals, dy):
    x, w = residuals
    # The cotangent is cast to the compute dtype so both backward matmuls run on the same
    # (fast, low-precision) units with float32 accumulation as the forward one.
    return _backward(spec, x, w, dy.astype(x.dtype))


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


class _Mode(NamedTuple):
    fp8: bool
    full_stats: bool
    compute_dtype: jnp.dtype


def _qdq(t, dtype, scale, compute_dtype):
    """`t` rounded to fp8 `dtype` under `scale` (clipped, not overflowed), back in compute dtype."""
    return fp8_ops.dequantize(fp8_ops.quantize(t, dtype, scale, compute_dtype), compute_dtype, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _site_matmul(spec, out_dtype, mode: _Mode, x, w, scales, probe):
    return _site_fwd(spec, out_dtype, mode, x, w, scales, probe)[0]


def _site_fwd(spec, out_dtype, mode: _Mode, x, w, scales, probe):
    del probe  # only its gradient matters
    stats = [tensor_stats(t, d, s, mode.full_stats) for t, d, s in ((x, E4M3, scales[0]), (w, E4M3, scales[1]))]
    if mode.fp8:
        x, w = _qdq(x, E4M3, scales[0], mode.compute_dtype), _qdq(w, E4M3, scales[1], mode.compute_dtype)
    y = jnp.einsum(spec, x, w, preferred_element_type=F32).astype(out_dtype)
    return y, (x, w, scales, stats)


def _site_bwd(spec, out_dtype, mode: _Mode, residuals, dy):
    x, w, scales, (x_stats, w_stats) = residuals
    dy = dy.astype(mode.compute_dtype)
    g_stats = tensor_stats(dy, E5M2, scales[2], mode.full_stats)
    if mode.fp8:
        dy = _qdq(dy, E5M2, scales[2], mode.compute_dtype)
    dx, dw = _backward(spec, x, w, dy)
    return dx, dw, jnp.zeros_like(scales), jnp.stack([x_stats, w_stats, g_stats])


_site_matmul.defvjp(_site_fwd, _site_bwd)
