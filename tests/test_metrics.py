"""FLOPs per token, checked against the matmuls the model really runs (read off its jaxpr)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lm.metrics import flops_per_token
from lm.model import ModelConfig, Transformer


def dot_flops(jaxpr, length: int) -> tuple[int, int]:
    """(weight-matmul FLOPs, attention-matmul FLOPs) of every dot_general in a forward jaxpr,
    nested ones (scan bodies times their trip count, custom-VJP functions) included. Attention
    matmuls are the ones whose operands carry the sequence length twice (T x T)."""
    weights = attention = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            flops = 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[d] for d in lhs_contracting]))
            if sum(d == length for shape in (lhs, rhs) for d in shape) >= 2:
                attention += flops
            else:
                weights += flops
        trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    w, a = dot_flops(inner, length)
                    weights, attention = weights + trips * w, attention + trips * a
    return weights, attention


@pytest.mark.parametrize("style", [dict(num_kv_heads=2), dict(mlp="gelu", num_kv_heads=4, tie_embeddings=True)], ids=["llama-gqa", "gpt2-tied"])
def test_flops_per_token_counts_the_matmuls_the_model_runs(style):
    # Sizes that differ from the context (128), so attention matmuls are told apart by shape.
    cfg = ModelConfig(vocab_size=512, max_len=128, num_layers=2, embed_dim=64, num_heads=4, head_dim=16, mlp_dim=256, **style)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda tokens: model(tokens)[0])(jnp.zeros((1, 128), jnp.int32))
    weights, attention = dot_flops(jaxpr.jaxpr, 128)
    assert weights > 0 and attention > 0
    # Training is forward + backward = 3x the forward; causal attention counts half the T x T work.
    assert flops_per_token(cfg, 128) == 3 * (weights + attention / 2) / 128
