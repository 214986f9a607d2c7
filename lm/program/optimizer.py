"""The optax chain from config: global-norm clipping, then AdamW with warm-up + cosine decay,
wrapped in `optax.apply_if_finite` so that an update from non-finite gradients is never applied.

Weight decay applies where `decay_mask` says (a tree of booleans shaped like the parameters;
`lm.program.steps.decay_mask` derives it from the model's logical axes: matmul weights only).
"""

from __future__ import annotations

import jax
import optax


def schedule(c) -> optax.Schedule:
    """Linear warm-up to `optim.lr`, then cosine decay to `lr * min_lr_ratio` at `decay_steps`."""
    o = c.optim
    decay_steps = o.decay_steps or c.train.steps
    warmup = min(o.warmup_steps, max(decay_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=o.lr / (warmup + 1),
        peak_value=o.lr,
        warmup_steps=warmup,
        decay_steps=max(decay_steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def optimizer(c, decay_mask) -> optax.GradientTransformation:
    o = c.optim
    adamw = optax.adamw(
        schedule(c), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask,
        mu_dtype=c.precision.mu_dtype,  # optax keeps the second moment in the parameters' dtype
    )
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw) if o.clip_norm else adamw
    tx = in_gradient_dtype(tx)
    # Skipped steps are counted in the state (`notfinite_count` in a row, `total_notfinite`); the
    # train loop, not optax, decides when too many in a row end the run, so never let one through.
    return optax.apply_if_finite(tx, max_consecutive_errors=NEVER)


NEVER = 2**31 - 1


def in_gradient_dtype(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with its updates cast back to the gradients' dtype: the float32 learning rate promotes
    bfloat16 ones, and `apply_if_finite`'s skipped branch (zeros like the gradients) must have the
    same type. The state is `tx`'s own, so checkpoints keep their structure."""

    def update(grads, state, params=None):
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads), state

    return optax.GradientTransformation(tx.init, update)
