"""Loss scaling for float16: the loss is multiplied before differentiation so that small
gradients stay above float16's smallest values, and the gradients are divided back before the
optimizer sees them.

Dynamic scaling (PyTorch's GradScaler semantics): a step whose gradients overflow is skipped (the
optimizer's `apply_if_finite` drops it) and the scale is multiplied by `backoff` (not below
`minimum`); after `growth_interval` finite steps in a row it is multiplied by `growth_factor`.
Written here rather than taken from `jmp`, whose `DynamicLossScale` has one factor for growth and
back-off, or flax's `DynamicScale`, whose update is fused to its own `value_and_grad` and so
cannot serve gradient accumulation without keeping every microbatch's activations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossScaling:
    kind: str = "none"  # none | static | dynamic
    initial: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff: float = 0.5
    minimum: float = 1.0

    @classmethod
    def from_config(cls, precision) -> LossScaling:
        """`precision.loss_scale`: none | dynamic | auto (dynamic for float16) | a number."""
        setting = str(precision.loss_scale)
        if setting == "auto":
            setting = "dynamic" if precision.compute_dtype == "float16" else "none"
        if setting in ("none", "dynamic"):
            return cls(
                setting,
                float(precision.loss_scale_initial),
                int(precision.loss_scale_growth_interval),
                float(precision.loss_scale_growth_factor),
                float(precision.loss_scale_backoff),
                float(precision.loss_scale_min),
            )
        return cls("static", float(setting))

    def init(self) -> dict | None:
        """The train state's `loss_scale` entry (None: no state to keep)."""
        if self.kind != "dynamic":
            return None
        return {"scale": jnp.asarray(self.initial, jnp.float32), "good_steps": jnp.zeros((), jnp.int32)}

    def current(self, state: dict | None) -> jax.Array:
        if self.kind == "dynamic":
            return state["scale"]
        return jnp.asarray(self.initial if self.kind == "static" else 1.0, jnp.float32)

    def update(self, state: dict | None, grads_finite: jax.Array) -> dict | None:
        """After a step: back off on overflow, grow after `growth_interval` good steps in a row."""
        if self.kind != "dynamic":
            return state
        good = jnp.where(grads_finite, state["good_steps"] + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(
            grads_finite,
            jnp.where(grow, state["scale"] * self.growth_factor, state["scale"]),
            jnp.maximum(state["scale"] * self.backoff, self.minimum),
        )
        return {"scale": scale, "good_steps": jnp.where(grow, 0, good)}
