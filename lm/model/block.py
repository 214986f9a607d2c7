"""The pre-norm residual block the Transformer stacks: x + attn(norm(x)), then x + mlp(norm(x)),
the MLP dense or a mixture of experts (`lm.model.moe`) as the config says."""

from __future__ import annotations

import dataclasses

from flax import nnx

from lm.model.config import ModelConfig
from lm.model.layers import (
    RESIDUAL_AXES,
    Attention,
    Mlp,
    Norm,
    gather_length,
    gathered_gradient,
)
from lm.model.latent_attention import LatentAttention
from lm.model.moe import MoeMlp
from lm.model.precision import Policy
from sharding import constrain


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, policy: Policy, rngs: nnx.Rngs):
        self.attn_norm = Norm(cfg, policy)
        self.attn = (LatentAttention if cfg.latent_attention else Attention)(cfg, policy, rngs)
        self.mlp_norm = Norm(cfg, policy)
        if cfg.moe:
            shared = None
            if cfg.shared_experts:
                width = cfg.shared_experts * cfg.expert_width
                shared = Mlp(dataclasses.replace(cfg, mlp_dim=width, mlp="swiglu", use_bias=False), policy, rngs)
            self.mlp = MoeMlp(cfg, policy, rngs, shared)
        else:
            self.mlp = Mlp(cfg, policy, rngs)

    def __call__(self, x_btd, positions_bt=None, cache=None, cache_index=None, segments_bt=None):
        y, cache = self.attn(gather_length(self.attn_norm(x_btd)), positions_bt, cache, cache_index, segments_bt)
        x_btd = constrain(x_btd + gathered_gradient(y), RESIDUAL_AXES, "residual")
        x_btd = x_btd + gathered_gradient(self.mlp(gather_length(self.mlp_norm(x_btd))))
        return constrain(x_btd, RESIDUAL_AXES, "residual"), cache
