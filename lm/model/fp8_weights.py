"""fp8 weights quantised once a step, not once per microbatch (as Transformer Engine keeps its
weights' fp8 copies across a step's microbatches).

With gradient accumulation the microbatches run in a loop, and a block matmul quantising its
weight inside would do it again in every pass (a read of the weight, a write of its fp8 copy, and
its statistics reduced: per layer, per microbatch). The program instead calls `quantised_once`
before the loop: every fp8 site's weight becomes a `QuantisedWeight` (the weight itself, its
e4m3 copy, the scale that copy was rounded under and the weight's statistics vector), which the
layer scans slice as they slice the weight, and `Policy.matmul` hands to
`prequantised_site_matmul`: the same GEMMs on the same fp8 values as `site_matmul`, bit for bit,
with the weight's gradient still the matmul's (`attach_weights` puts the differentiated weights
back in each pass: `lm.model.cast_weights.attach_weights`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lm.model.cast_weights import StepWeight
from lm.model.fp8 import E4M3, MatmulSite, SiteMode, current_scale, quantize, site_backward, tensor_stats
from lm.model.matmul import einsum
from sharding.remat import name_fp8_scales


class QuantisedWeight(StepWeight):
    """A weight with its fp8 copy for the step: `q` (e4m3, `master` in the compute dtype over
    `scale`), `scale` and `stats` (the weight role's statistics vector)."""

    def __init__(self, master, q, scale, stats):
        self.master, self.q, self.scale, self.stats = master, q, scale, stats

    def copies(self) -> tuple:
        return self.q, self.scale, self.stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def prequantised_site_matmul(spec, out_dtype, mode: SiteMode, x, w, wq, w_stats, scales, probe):
    """`lm.model.fp8.site_matmul` (quantising, `mode.quantize`) with the weight's fp8 copy `wq`
    and statistics made beforehand under `scales[1]`: `w` is read by nothing but its gradient."""
    return _prequantised_fwd(spec, out_dtype, mode, x, w, wq, w_stats, scales, probe)[0]


def _prequantised_fwd(spec, out_dtype, mode: SiteMode, x, w, wq, w_stats, scales, probe):
    del w, probe
    if mode.current:  # the weight's scale came with it; g's comes in the backward pass
        scales = name_fp8_scales(jnp.stack([current_scale(x, E4M3, mode.margin), scales[1], scales[2]]))
    xq = quantize(x, E4M3, scales[0], mode.compute_dtype)
    stats = (tensor_stats(x, E4M3, scales[0], mode.observe), w_stats)
    return einsum(spec, xq, wq, out_dtype, scales[0] * scales[1]), (xq, wq, scales, stats)


def _prequantised_bwd(spec, out_dtype, mode: SiteMode, residuals, dy):
    dx, dw, dscales, dprobe = site_backward(spec, out_dtype, mode, residuals, dy)
    _, wq, _, (_, w_stats) = residuals
    return dx, dw, jnp.zeros_like(wq), jnp.zeros_like(w_stats), dscales, dprobe


prequantised_site_matmul.defvjp(_prequantised_fwd, _prequantised_bwd)


def quantised_once(model, policy) -> dict:
    """{path of a weight in the parameters: its `QuantisedWeight`} for the weight of every matmul
    site of `model` (`<name>_site` beside `<name>`) under `policy`: delayed scaling rounds with the
    site's weight scale, current scaling with each layer's own. Sites the policy then leaves in
    the compute dtype (skipped layers, `fp8_sites=auto`) read the weight itself. (The copy's
    layout is XLA's: pinning one for the forward GEMM and another for the input gradient's, as
    Transformer Engine keeps a weight and its transpose, gave more fp8 transposes inside the
    loop on the deviceless H100 program, not fewer.)"""
    current = not policy.fp8.stateful
    out = {}
    for path, site in nnx.iter_graph(model):
        if not isinstance(site, MatmulSite):
            continue
        parent = functools.reduce(lambda node, key: node[key] if isinstance(key, int) else getattr(node, key), path[:-1], model)
        name = path[-1].removesuffix("_site")
        w = getattr(parent, name)[...]
        layers = site.probe.ndim - 2  # the probe is [*layers, roles, stats]

        def one(w, scale):  # one layer's weight, as `site_matmul` would quantise it
            wc = policy.cast(w)
            if current:
                scale = current_scale(wc, E4M3, policy.fp8.margin)
            return quantize(wc, E4M3, scale, policy.compute_dtype), scale, tensor_stats(wc, E4M3, scale, policy.observe)

        for _ in range(layers):
            one = jax.vmap(one)
        q, scale, stats = one(w, jnp.zeros(site.probe.shape[:-2], jnp.float32) if current else site.scale[...][..., 1])
        out[(*path[:-1], name)] = QuantisedWeight(w, q, scale, stats)
    return out
