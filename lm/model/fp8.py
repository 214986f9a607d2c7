"""Matmul sites: the block matmuls that keep state, for fp8 delayed scaling and for the
statistics the numerics report reads.

fp8 (Transformer Engine's HYBRID recipe): activations and weights are quantised to e4m3, output
gradients to e5m2, each with a per-tensor scale: under *delayed* scaling taken from the largest
absolute value seen over the last `history` steps, under *current* scaling (TE's
Float8CurrentScaling, torchao's tensorwise) from the tensor's own largest value in this step
(`current_scale`). Each such matmul is a *site* (`MatmulSite`); under delayed scaling it holds
its scales and amax histories as `Fp8Meta` variables: state, not parameters, so the optimizer,
weight decay, clipping and gradient averaging never see them. Current scaling keeps no state.

Statistics leave a step through the gradient of a zero *probe* input (`Probe`, the only way a
value computed in the backward pass gets out of `jax.grad`): per role (`ROLES`: the input x, the
weight w, the output gradient g) a vector of the fields in `STATS` (just `absmax` unless the
policy *observes*, when `OBSERVED_STATS`). `update_fp8` writes the amaxes into the histories and
recomputes the scales. The GEMMs take the fp8 arrays and scale their results (`site_matmul`):
fp8 GEMMs on GPUs that have them, an exact emulation elsewhere.
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

from lm.model.matmul import F32, backward, einsum
from sharding.remat import name_fp8_scales

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
ROLES = ("x", "w", "g")  # a matmul's input activation, its weight, the gradient of its output
# Formats a tensor's values are checked against by the numerics report, in this order.
REPORT_FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "float16": jnp.dtype(jnp.float16), "bfloat16": jnp.dtype(jnp.bfloat16)}
FP8_FORMATS = ("e4m3", "e4m3", "e5m2")  # per role, HYBRID: e4m3 forward, e5m2 gradients
FP8_DTYPES = tuple(REPORT_FORMATS[name] for name in FP8_FORMATS)
# The fields of a role's statistics vector: always the absmax; observed, also the fraction
# already inf/nan and, per report format, the fractions that overflow and flush to zero.
STATS = ("absmax",)
OBSERVED_STATS = ("absmax", "nonfinite", *(f"{fmt}_{what}" for fmt in REPORT_FORMATS for what in ("overflow", "underflow")))


def named_stats(vector) -> dict[str, float]:
    """A role's statistics vector as {field: value}."""
    names = OBSERVED_STATS if len(vector) == len(OBSERVED_STATS) else STATS
    return {name: float(v) for name, v in zip(names, vector)}


class Fp8Meta(nnx.Variable):
    """Delayed-scaling state of one fp8 matmul (scales, amax histories): never trained."""


class Probe(nnx.Variable):
    """A zero input whose gradient is its matmul's statistics: [roles, stats]."""


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    history: int = 1024  # steps of amax history a scale is taken from
    margin: int = 0  # scales leave 2**margin of headroom below the format's largest value
    skip: tuple[int, ...] = ()  # layer indices (negative from the end) kept in the compute dtype
    scaling: str = "delayed"  # delayed: scales from the amax histories; current: from each tensor's own amax

    @property
    def stateful(self) -> bool:
        """Whether its sites keep scales and histories in the train state (delayed scaling)."""
        return self.scaling == "delayed"

    def layer_mask(self, num_layers: int) -> list[bool]:
        """Per layer of the stack: does it compute in fp8?"""
        skipped = {i % num_layers for i in self.skip}
        return [i not in skipped for i in range(num_layers)]


class MatmulSite(nnx.Module):
    """Per dense matmul: fp8 scales [roles] (multipliers back to real values) and amax histories
    [roles, history] under an fp8 `policy`; and the probe [roles, stats] its statistics come out
    through."""

    def __init__(self, policy):
        def var(kind, value):
            return kind(value, out_sharding=(None,) * value.ndim, eager_sharding=False)

        if policy.fp8 and policy.fp8.stateful:
            self.scale = var(Fp8Meta, jnp.ones(len(ROLES), F32))
            self.amax_history = var(Fp8Meta, jnp.zeros((len(ROLES), policy.fp8.history), F32))
        self.probe = var(Probe, jnp.zeros((len(ROLES), len(OBSERVED_STATS if policy.observe else STATS)), F32))


_FP8_SUSPENDED = contextvars.ContextVar("fp8_suspended", default=False)


@contextlib.contextmanager
def fp8_suspended(suspended: bool = True):
    """Matmuls traced inside compute in the compute dtype (`precision.fp8_skip` layers)."""
    token = _FP8_SUSPENDED.set(suspended)
    try:
        yield
    finally:
        _FP8_SUSPENDED.reset(token)


def is_suspended() -> bool:
    return _FP8_SUSPENDED.get()


# -- delayed scaling


def update_fp8(fp8_state: dict, probe_grads: dict, recipe: Fp8Recipe) -> dict:
    """The fp8 state after a step: each site's amaxes pushed into its histories, scales
    recomputed from the histories' maxima (as Transformer Engine's `max` amax algorithm)."""
    fp8_max = jnp.array([float(jnp.finfo(d).max) for d in FP8_DTYPES], F32)
    absmax = OBSERVED_STATS.index("absmax")

    def site(meta, probe):
        amax = probe[..., absmax]  # [..., roles]
        history = jnp.roll(meta["amax_history"], 1, axis=-1).at[..., 0].set(amax)
        scale = fp8_ops.compute_scale(jnp.max(history, axis=-1), meta["scale"], fp8_max, recipe.margin)
        return {"scale": scale, "amax_history": history}

    return _map_sites(site, fp8_state, probe_grads)


def _map_sites(fn, meta: dict, probes: dict) -> dict:
    if "scale" in meta:
        return fn(meta, probes["probe"])
    return {k: _map_sites(fn, meta[k], probes[k]) for k in meta}


# -- statistics


def tensor_stats(t: jax.Array, fp8_dtype, scale: jax.Array | None, observe: bool) -> jax.Array:
    """`t`'s statistics vector: STATS ([absmax]); observed, OBSERVED_STATS: the absmax of its
    finite values, the fraction already inf/nan, then for each of REPORT_FORMATS the fractions
    of its values that overflow (finite -> inf/nan) and that flush to zero (nonzero -> 0) when
    cast to it.

    fp8 formats see `t / scale` with scale (`fp8_dtype`'s multiplier back to real values) taken
    as in use, and scaled to each format's range; zero or None means just-in-time scaling from
    this tensor's own amax. float16 and bfloat16 see `t` as it is (gradients here already carry
    the loss scale).
    """
    t = t.astype(F32)
    if not observe:
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


# -- the site's matmul


class SiteMode(NamedTuple):
    quantize: bool  # round x and w to e4m3 and g to e5m2 under the site's scales
    observe: bool  # record OBSERVED_STATS rather than STATS
    compute_dtype: jnp.dtype
    current: bool = False  # scales from each tensor's own amax (current scaling), not the site's
    margin: int = 0  # current scaling's headroom, as Fp8Recipe.margin


def current_scale(t: jax.Array, dtype, margin: int = 0) -> jax.Array:
    """Current scaling: `t`'s multiplier back to real values, from its own amax this step (the
    largest value lands on the fp8 format's largest, less 2**margin of headroom; 1 for an
    all-zero or non-finite tensor), as delayed scaling computes it from a history."""
    amax = jnp.max(jnp.abs(t)).astype(F32)
    return fp8_ops.compute_scale(amax, jnp.ones((), F32), float(jnp.finfo(dtype).max), margin)


def quantize(t, dtype, scale, compute_dtype):
    """`t / scale` rounded to the fp8 `dtype` (clipped to its range, never overflowed)."""
    return fp8_ops.quantize(t, dtype, scale, compute_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def site_matmul(spec, out_dtype, mode: SiteMode, x, w, scales, probe):
    """`einsum(spec, x, w)` as `lm.model.matmul.matmul`, quantised and observed as `mode` says; the
    gradient of `probe` is the statistics [roles, stats].

    Quantised, the GEMMs take the fp8 arrays themselves (e4m3 x e4m3 forward, e5m2 x e4m3 for
    dx, e4m3 x e5m2 for dw), accumulate in float32 and apply the two scales to the result
    (`lm.model.matmul.einsum`; on GPUs the forward and dx results leave the GEMM in the compute
    dtype, dw's in float32): the form XLA runs as fp8 GEMMs on GPUs that have them (and
    emulates exactly elsewhere). What the backward pass keeps are the fp8 copies of x and w:
    half the bytes of bf16 ones."""
    return _site_fwd(spec, out_dtype, mode, x, w, scales, probe)[0]


def _site_fwd(spec, out_dtype, mode: SiteMode, x, w, scales, probe):
    del probe  # only its gradient matters
    if mode.quantize and mode.current:  # g's scale comes from the output gradient, in the backward pass
        # Kept through remat: a recomputed forward quantises with them, reducing x and w once a step.
        scales = name_fp8_scales(jnp.stack([current_scale(x, E4M3, mode.margin), current_scale(w, E4M3, mode.margin), scales[2]]))
    stats = [tensor_stats(t, d, s, mode.observe) for t, d, s in ((x, E4M3, scales[0]), (w, E4M3, scales[1]))]
    if not mode.quantize:
        return jnp.einsum(spec, x, w, preferred_element_type=F32).astype(out_dtype), (x, w, scales, stats)
    xq, wq = quantize(x, E4M3, scales[0], mode.compute_dtype), quantize(w, E4M3, scales[1], mode.compute_dtype)
    return einsum(spec, xq, wq, out_dtype, scales[0] * scales[1]), (xq, wq, scales, stats)


def site_backward(spec, out_dtype, mode: SiteMode, residuals, dy):
    x, w, scales, (x_stats, w_stats) = residuals
    dy = dy.astype(mode.compute_dtype)
    if mode.quantize and mode.current:
        scales = scales.at[2].set(current_scale(dy, E5M2, mode.margin))
    g_stats = tensor_stats(dy, E5M2, scales[2], mode.observe)
    if not mode.quantize:
        dx, dw = backward(spec, x, w, dy)
    else:
        gq = quantize(dy, E5M2, scales[2], mode.compute_dtype)
        cd = mode.compute_dtype
        dx, dw = backward(spec, x, w, gq, dtypes=(cd, cd), scales=(scales[2] * scales[1], scales[0] * scales[2]))
    return dx, dw, jnp.zeros_like(scales), jnp.stack([x_stats, w_stats, g_stats])


site_matmul.defvjp(_site_fwd, site_backward)
