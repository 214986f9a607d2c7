"""The full-size recipes build (abstractly: no memory is allocated) with the sizes they claim."""

import jax
import numpy as np
import pytest
from conftest import recipe
from flax import nnx

from lm.data.corpus import nominal_vocab_size
from lm.model.config import ModelConfig
from lm.model.flops import matmul_params
from lm.model.transformer import Transformer


def abstract_params(name: str) -> int:
    config = recipe(name)
    cfg = ModelConfig.from_config(config, nominal_vocab_size(config.data))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize(
    "name, low, high",
    [("tiny", 0.8e6, 1.0e6), ("shakespeare_char", 0.8e6, 0.9e6), ("gpt2_124m", 123e6, 125e6), ("llama_1b", 1.0e9, 1.3e9), ("llama_1b_long", 1.0e9, 1.3e9), ("llama_8b", 8.0e9, 8.1e9), ("llama_70b", 70.5e9, 70.6e9),
     ("mixtral_8x7b", 46.6e9, 46.8e9), ("qwen3_30b_a3b", 30.4e9, 30.6e9),
     # DeepSeek-V3's 671B and its multi-token prediction module's 11.6B; Moonlight's card: 15.29B without the embedding and head.
     ("deepseek_v3", 682.6e9, 682.7e9), ("moonlight_16b", 15.9e9, 16.0e9)],
)
def test_recipe_sizes(name, low, high):
    assert low <= abstract_params(name) <= high


@pytest.mark.parametrize("name, active", [("mixtral_8x7b", 12.9e9), ("qwen3_30b_a3b", 3.35e9), ("moe_tiny", 0.856e6), ("deepseek_v3", 37.55e9),
                                          ("moonlight_16b", 2.915e9)])
def test_mixtures_of_experts_count_their_active_parameters(name, active):
    """The weights a token goes through (embedding and head included), as their model cards
    state them (Mixtral 12.9B, Qwen3-30B-A3B 3.3B, DeepSeek-V3 37B, Moonlight 2.24B without its
    0.67B of embedding and head); moe_tiny's equal tiny's. (DeepSeek-V3's without multi-token
    prediction, whose module counts as a layer with the head again: 1.6B more.)"""
    config = recipe(name, **({"model__mtp_depth": 0} if name == "deepseek_v3" else {}))
    cfg = ModelConfig.from_config(config, nominal_vocab_size(config.data))
    assert abs(matmul_params(cfg) + cfg.embed_dim * cfg.vocab_size - active) < 0.01 * active
    if name == "moe_tiny":
        dense = ModelConfig.from_config(recipe("tiny"), nominal_vocab_size(config.data))
        assert matmul_params(cfg) - matmul_params(dense) == cfg.num_layers * cfg.embed_dim * cfg.num_experts  # the routers
