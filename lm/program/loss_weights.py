"""A loss mask's weights: which targets of a batch the loss is on, and how each is weighed so
that the step's loss is the mean over all its trained tokens whatever passes and replicas it is
computed in."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def trained_targets(batch: dict) -> jax.Array:
    """[b, l - 1] bool: the targets the loss is on, a batch's loss mask where the target is in
    its input's segment (packed rows: never a conversation's first token after another's last)."""
    trained = batch["mask"][:, 1:].astype(bool)
    if "segments" in batch:
        trained &= batch["segments"][:, 1:] == batch["segments"][:, :-1]
    return trained


def loss_weights(batch):
    """A batch with a loss mask ('mask' [b, l]) with 'weights' [b, l] instead: each trained
    target's weight (targets in the batch) / (trained targets in the batch), others 0, so that a
    pass's mean over its tokens, averaged over the step's passes and replicas (equal sizes), is
    the whole step's mean over its trained tokens, not a mean of each microbatch's mean."""
    if not isinstance(batch, dict) or "mask" not in batch:
        return batch
    trained = trained_targets(batch)
    scale = trained.size / jnp.maximum(jnp.sum(trained), 1).astype(jnp.float32)
    weights_bl = jnp.pad(trained.astype(jnp.float32) * scale, ((0, 0), (1, 0)))
    return {**{k: v for k, v in batch.items() if k != "mask"}, "weights": weights_bl}
