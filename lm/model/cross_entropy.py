"""Next-token cross entropy per token from float32 logits, with a hand-written backward.

Autodiff of the usual form (optax's: the maximum subtracted, log-sum-exp, the label's logit
gathered) passes over the [tokens, vocabulary] logits several times in the backward: the
softmax saved or made again, the labels' one-hot scattered into the cotangent, the sum cast to
the head's compute dtype. Here the backward is one expression, `(softmax - one-hot) x g`, whose
only reader is the head matmul's backward, so XLA writes it once, in the compute dtype (the
llama_1b recipe on one H100: three of the four vocabulary-wide passes gone, PERFORMANCE.md). The
label's logit is a masked sum over the vocabulary rather than a gather, so logits split over
`tensor` stay split (a sum over the shards, as the log-sum-exp's).

`chunked_cross_entropy` (`model.loss_chunks`) runs the head and this loss a piece of each
sequence at a time, each piece's gradients made in the forward (as Liger's fused linear cross
entropy), so neither the float32 logits nor their gradient ever exist for the whole batch.

Shape suffixes: b batch, t positions, d model width, v vocabulary, c chunks.
"""

from __future__ import annotations

from typing import Callable

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
    maxima subtracted first, as optax does, for float32's precision in the softmax. (One pass
    through a variadic reduction, as flash attention's online softmax, saved 6.6 ms of the
    `llama_1b` H100 step but cannot be split over the vocabulary's shards: XLA moved the logits
    between stages for it, PERFORMANCE.md.)"""
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


def _targets_and_weights(targets_bt):
    if isinstance(targets_bt, tuple):
        return targets_bt
    return targets_bt, jnp.ones(targets_bt.shape, jnp.float32)


def chunked_cross_entropy(head: Callable, x_btd: jax.Array, w: jax.Array, targets_bt, chunks: int, seed=1.0) -> jax.Array:
    """`cross_entropy(head(x_btd, w), targets_bt)` with the positions in `chunks` pieces: piece j
    holds positions j, j + chunks, j + 2 chunks, ... so that a split of `t` over devices splits
    every piece alike. Differentiated, each piece's gradients for `x_btd` and `w` are made in the
    forward and kept (the logits are not), scaled in the backward by the cotangent over `seed`,
    the cotangent the caller will start from (a float16 loss scale must reach the logits'
    gradients while they are made). `head(x, w)`: float32 logits of the compute-dtype `x`."""
    targets_bt, weights_bt = _targets_and_weights(targets_bt)
    b, t = x_btd.shape[:2]
    count = b * t

    def pieces(a):  # [b, t, ...] -> [c, b, t / c, ...]
        return jnp.moveaxis(a.reshape(b, t // chunks, chunks, *a.shape[2:]), 2, 0)

    def whole(a_cbtd):
        return jnp.moveaxis(a_cbtd, 0, 2).reshape(b, t, *a_cbtd.shape[3:])

    def piece_loss(x, w, targets, weights):
        return jnp.sum(token_cross_entropy(head(x, w), targets) * weights) / count

    @jax.custom_vjp
    def loss(x_btd, w, targets_bt, weights_bt, seed):
        def add(total, piece):
            x, targets, weights = piece
            return total + piece_loss(x, w, targets, weights), None
        return jax.lax.scan(add, jnp.zeros((), jnp.float32), (pieces(x_btd), pieces(targets_bt), pieces(weights_bt)))[0]

    def fwd(x_btd, w, targets_bt, weights_bt, seed):
        def add(carry, piece):
            total, dw = carry
            x, targets, weights = piece
            value, pull = jax.vjp(lambda x, w: piece_loss(x, w, targets, weights), x, w)
            dx, dw_piece = pull(seed)
            return (total + value, dw + dw_piece.astype(jnp.float32)), dx
        zeros = (jnp.zeros((), jnp.float32), jnp.zeros(w.shape, jnp.float32))
        (total, dw), dx = jax.lax.scan(add, zeros, (pieces(x_btd), pieces(targets_bt), pieces(weights_bt)))
        return total, (whole(dx), dw, seed)

    def bwd(residuals, g):
        dx, dw, seed = residuals
        factor = g / seed  # 1 when the caller starts from `seed`, as it said it would
        return (dx * factor.astype(dx.dtype), (dw * factor).astype(w_dtype), None, None, None)

    w_dtype = w.dtype
    loss.defvjp(fwd, bwd)
    return loss(x_btd, w, targets_bt, weights_bt.astype(jnp.float32), jnp.asarray(seed, jnp.float32))
