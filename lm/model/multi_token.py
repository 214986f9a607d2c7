"""DeepSeek-V3's multi-token prediction (MTP): `model.mtp_depth` modules after the last layer.

Module d (0-based) takes the previous module's normalised output h (the model's final norm's
output for d = 0, as Megatron-Core and vLLM take it) and the embedding of the token d + 1 places
ahead, both RMS-normalised (`hnorm`, `enorm`), concatenated (embedding first, as Megatron-Core and
vLLM read DeepSeek's `eh_proj`) and projected back to the model's width; one more Transformer
block; its own norm (`shared_head.norm`), whose output goes on to the next depth and into the
model's head, which, like the embedding, it shares. It predicts the token d + 2 places ahead; the
positions whose target is past the window's end are out of its loss. Training only: generation
and evaluation run the model alone.

Shape suffixes: b batch, t positions, d embed, D depth, l = t + 1 tokens in a window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lm.model.block import Block
from lm.model.config import ModelConfig
from lm.model.cross_entropy import token_cross_entropy
from lm.model.layers import RESIDUAL_AXES, Norm, _param, gather_length
from lm.model.precision import Policy
from sharding import constrain


class MtpModule(nnx.Module):
    """One depth: norms on the hidden state and on the next embedding, their projection, a block,
    and the norm before the shared head (`shared_head.norm` in the checkpoints)."""

    def __init__(self, cfg: ModelConfig, policy: Policy, rngs: nnx.Rngs):
        self.policy = policy
        d = cfg.embed_dim
        self.enorm = Norm(cfg, policy)
        self.hnorm = Norm(cfg, policy)
        self.eh_proj = _param(rngs.params(), (2 * d, d), (None, "embed"), 0.02, policy.param_dtype)
        self.block = Block(cfg.mtp_block, policy, rngs)
        self.head_norm = Norm(cfg, policy)

    def __call__(self, h_btd, next_embedded_btd, positions_bt=None, segments_bt=None) -> jax.Array:
        both = jnp.concatenate([gather_length(self.enorm(next_embedded_btd)), gather_length(self.hnorm(h_btd))], axis=-1)
        x = constrain(self.policy.matmul("btc,cd->btd", both, self.eh_proj[...]), RESIDUAL_AXES, "mtp input")
        return self.block(x, positions_bt, None, None, segments_bt)[0]


def shifted(tokens_bl: jax.Array, depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the tokens each depth embeds [D, b, t], the tokens it predicts [D, b, t], whether that
    target is inside the window [D, b, t]) of a window of l = t + 1 tokens: depth d at position i
    embeds token i + d + 1 and predicts token i + d + 2 (zeros past the end, out of the loss)."""
    t = tokens_bl.shape[1] - 1
    padded = jnp.pad(tokens_bl, ((0, 0), (0, depth + 1)))
    inputs = jnp.stack([padded[:, d + 1 : d + 1 + t] for d in range(depth)])
    targets = jnp.stack([padded[:, d + 2 : d + 2 + t] for d in range(depth)])
    valid = jnp.stack([jnp.broadcast_to(jnp.arange(t) + d + 2 <= t, tokens_bl[:, 1:].shape) for d in range(depth)])
    return inputs, targets, valid


def mtp_loss(logits_dbtv: list[jax.Array], targets_dbt: jax.Array, valid_dbt: jax.Array) -> jax.Array:
    """The modules' cross entropies, each the mean over its positions inside the window, averaged
    over the depths (DeepSeek-V3's L_MTP before its weight)."""
    losses = []
    for logits_btv, targets_bt, valid_bt in zip(logits_dbtv, targets_dbt, valid_dbt):
        ce = token_cross_entropy(logits_btv, targets_bt)
        losses.append(jnp.sum(jnp.where(valid_bt, ce, 0.0)) / jnp.maximum(jnp.sum(valid_bt), 1))
    return jnp.mean(jnp.stack(losses))
