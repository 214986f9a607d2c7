"""Dtype policies: which dtype parameters are kept in, which dtype the matmuls compute in, and
whether the Transformer blocks' dense matmuls run in fp8, with delayed or current scaling
(`lm.model.fp8`).

The model takes its matmul (`Policy.matmul`) and dtypes from the policy, so switching number
formats never touches model code. Softmax, normalisation statistics, the logits fed to the loss
and the loss itself stay float32 whatever the policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lm.model.fp8 import (
    ROLES,
    Fp8Recipe,
    MatmulSite,
    SiteMode,
    is_suspended,
    site_matmul,
)
from lm.model.cast_weights import CastWeight, compute_copy
from lm.model.fp8_weights import QuantisedWeight, prequantised_site_matmul
from lm.model.matmul import F32, has_batch_dims
from lm.model.matmul import matmul as plain_matmul
from sharding.remat import name_matmul

try:  # jax's layout API is still experimental: where it moved or changed, weights go unpinned
    from jax.experimental.layout import Layout, with_layout_constraint

    Layout(major_to_minor=(0,))
except (ImportError, TypeError):
    Layout = with_layout_constraint = None


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    fp8: Fp8Recipe | None = None
    observe: bool = False  # every site records OBSERVED_STATS for the numerics report (`lm.numerics`)
    # precision.fp8_sites=auto: (einsum, x shape, w shape) -> does fp8 pay at this site? Set by the
    # program for its GPU target (`lm.compiler.steptime.Fp8SiteChoice`); None: every site.
    fp8_choice: Callable[[str, tuple, tuple, bool], bool] | None = None
    # An fp8 GEMM reads its weight with the contracted axes minor; left free, XLA gives the layer
    # loop the float32 weight stack in that layout (a transposed copy of every weight, each
    # step). Pinned to the stored layout, each weight is transposed as it is quantised. Set by the
    # program where each device holds whole weights: XLA then gathered split weights before
    # quantising them (in float32, not fp8), so under fsdp / tensor / context it stays unset.
    pin_weight_layouts: bool = False

    @classmethod
    def from_config(cls, precision) -> Policy:
        fp8 = None
        if precision.fp8 in ("delayed", "current"):
            skip = tuple(int(i) for i in str(precision.fp8_skip).replace(" ", "").split(",") if i)
            fp8 = Fp8Recipe(precision.fp8_history, precision.fp8_margin, skip, precision.fp8)
        return cls(jnp.dtype(precision.param_dtype), jnp.dtype(precision.compute_dtype), fp8)

    def cast(self, x: jax.Array) -> jax.Array:
        """An input or weight in the compute dtype."""
        return x.astype(self.compute_dtype)

    def site(self) -> MatmulSite | None:
        """The state of one dense matmul in a block (None when the policy keeps none)."""
        return MatmulSite(self) if self.fp8 or self.observe else None

    @property
    def fp8_state(self) -> bool:
        """Whether the train state holds fp8 scales and histories (delayed scaling)."""
        return self.fp8 is not None and self.fp8.stateful

    def fp8_layer_mask(self, num_layers: int) -> list[bool]:
        """Per layer of the stack: does it compute in fp8?"""
        return self.fp8.layer_mask(num_layers) if self.fp8 else [False] * num_layers

    def quantises(self, spec: str, x: jax.Array, w, site: MatmulSite | None, shares_input: MatmulSite | None = None) -> bool:
        """Whether `matmul(spec, x, w, site=site, shares_input=...)` runs in fp8."""
        return (self.fp8 is not None and site is not None and not is_suspended()
                and (self.fp8_choice is None or self.fp8_choice(spec, x.shape, w.shape, shares_input is not None)))

    def quantising_site(self, spec: str, x: jax.Array, w, site: MatmulSite | None) -> MatmulSite | None:
        """`site` where its matmul quantises `x` (what the sites after it reading the same x share)."""
        return site if self.quantises(spec, x, w, site) else None

    def matmul(self, spec: str, x: jax.Array, w: jax.Array, out_dtype=None, site: MatmulSite | None = None,
               weight: bool = True, shares_input: MatmulSite | None = None) -> jax.Array:
        """`einsum(spec, x, w)` on compute-dtype inputs, accumulated in float32 forward and
        backward; the result is in `out_dtype` (default: the compute dtype). At a `site`, in fp8
        when the policy says so (and no `fp8_suspended()` is in force). `weight`: whether w is a
        weight, whose gradient a split backward defers (`lm.model.split_backward`), or an
        activation (attention's keys and values). `shares_input`: the site before this one that
        quantised the same x (q's for k and v, up's for gate: `quantising_site`); under delayed
        scaling x is quantised under its scale (their histories of x are the same), so XLA writes
        x's fp8 copy once for both, and the choice prices x's passes as shared."""
        out_dtype = jnp.dtype(out_dtype or self.compute_dtype)
        quantize = self.quantises(spec, x, w, site, shares_input)
        prepared = w if isinstance(w, QuantisedWeight) and quantize else None  # quantised once a step (`lm.model.fp8_weights`)
        w = w.master if isinstance(w, QuantisedWeight) else compute_copy(w) if isinstance(w, CastWeight) else w
        if quantize and prepared is None and self.pin_weight_layouts and with_layout_constraint is not None:
            w = with_layout_constraint(w, Layout(tuple(range(w.ndim))))
        x, w = self.cast(x), self.cast(w)
        if site is None or not (quantize or self.observe):
            y = plain_matmul(spec, out_dtype, x, w, weight)
        else:
            stateful = self.fp8 is not None and self.fp8.stateful
            current = self.fp8 is not None and not stateful
            if stateful:  # one stack of the scales this call uses: XLA sees x's as the very value the sharing sites use
                own = site.scale[...]
                x_scale = (shares_input if shares_input is not None and quantize else site).scale[...][0]
                scales = jnp.stack([x_scale, own[1] if prepared is None else prepared.scale, own[2]])
            else:  # zero: each tensor's own amax (the weight's came with its copy)
                scales = jnp.zeros(len(ROLES), F32) if prepared is None else jnp.zeros(len(ROLES), F32).at[1].set(prepared.scale)
            mode = SiteMode(quantize, self.observe, self.compute_dtype, current, self.fp8.margin if current else 0)
            if prepared is None:
                y = site_matmul(spec, out_dtype, mode, x, w, scales, site.probe[...])
            else:
                y = prequantised_site_matmul(spec, out_dtype, mode, x, w, prepared.q, prepared.stats, scales, site.probe[...])
        return name_matmul(y, batched=has_batch_dims(spec))  # what remat `dots` saves
