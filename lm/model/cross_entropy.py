"""Next-token cross entropy per token from float32 logits, with a hand-written backward.

Autodiff of the usual form (optax's: the maximum subtracted, log-sum-exp, the label's logit
gathered) passes over the [tokens, vocabulary] logits several times in the backward: the
softmax saved or made again, the labels' one-hot scattered into the cotangent, the sum cast to
the head's compute dtype. Here the backward is one expression, `(softmax - one-hot) x g`, whose
only reader is the head matmul's backward, so XLA writes it once, in the compute dtype (the
llama_1b recipe on one H100: three of the four vocabulary-wide passes gone, PERFORMANCE.md). The
label's logit is a masked sum over the vocabulary rather than a gather, so logits split over
`tensor` stay split (a sum over the shards, as the log-sum-exp's).

Shape suffixes: b batch, t positions, v vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per token, float32 [b, t]."""
    return _forward(logits_btv, targets_bt)[0]


def _is_target(targets_bt, vocab: int):
    return jnp.arange(vocab, dtype=targets_bt.dtype) == targets_bt[..., None]


def _forward(logits_btv, targets_bt):
    """(the losses, the logits' maxima, log-sum-exp of the logits less their maxima): the
    maxima subtracted first, as optax does, for float32's precision in the softmax."""
    logits = logits_btv.astype(jnp.float32)
    max_bt = jnp.max(logits, axis=-1)
    shifted = logits - max_bt[..., None]
    log_sum_bt = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    target_bt = jnp.sum(jnp.where(_is_target(targets_bt, logits.shape[-1]), shifted, 0.0), axis=-1)
    return log_sum_bt - target_bt, max_bt, log_sum_bt


def _fwd(logits_btv, targets_bt):
    losses_bt, max_bt, log_sum_bt = _forward(logits_btv, targets_bt)
    return losses_bt, (logits_btv, max_bt, log_sum_bt, targets_bt)


def _bwd(residuals, g_bt):
    logits_btv, max_bt, log_sum_bt, targets_bt = residuals
    softmax = jnp.exp(logits_btv.astype(jnp.float32) - max_bt[..., None] - log_sum_bt[..., None])
    d_logits = (softmax - _is_target(targets_bt, logits_btv.shape[-1])) * g_bt[..., None]
    return d_logits.astype(logits_btv.dtype), None


token_cross_entropy.defvjp(_fwd, _bwd)


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array | tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean next-token cross entropy in float32; `targets_bt` may be (targets, weights), each
    token's loss then multiplied by its weight (a loss mask, `lm.program.steps.loss_weights`)."""
    if isinstance(targets_bt, tuple):
        targets_bt, weights_bt = targets_bt
        return jnp.mean(token_cross_entropy(logits_btv, targets_bt) * weights_bt)
    return jnp.mean(token_cross_entropy(logits_btv, targets_bt))
