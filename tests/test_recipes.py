"""The full-size recipes build (abstractly: no memory is allocated) with the sizes they claim."""

import jax
import numpy as np
import pytest
from conftest import recipe
from flax import nnx

from lm.data.corpus import nominal_vocab_size
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer


def abstract_params(name: str) -> int:
    config = recipe(name)
    cfg = ModelConfig.from_config(config, nominal_vocab_size(config.data))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize(
    "name, low, high",
    [("tiny", 0.8e6, 1.0e6), ("shakespeare_char", 0.8e6, 0.9e6), ("gpt2_124m", 123e6, 125e6), ("llama_1b", 1.0e9, 1.3e9), ("llama_1b_long", 1.0e9, 1.3e9), ("llama_8b", 8.0e9, 8.1e9), ("llama_70b", 70.5e9, 70.6e9)],
)
def test_recipe_sizes(name, low, high):
    assert low <= abstract_params(name) <= high
