"""FLOPs per token, checked against the matmuls the model really runs (read off its jaxpr)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from lm.model.config import ModelConfig
from lm.model.flops import flops_per_token
from lm.model.transformer import Transformer


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


def test_tensorboard_metrics_are_written_without_importing_pytorch(tmp_path):
    """tensorboardX imports torch where it is installed (1.2 s and 180 MB per run); meshlm's runs
    do not, and torch still imports afterwards."""
    pytest.importorskip("torch")  # installed with meshlm[test], for the Hugging Face checks
    code = ("import sys; from pathlib import Path; from lm.training.metrics import MetricsWriter\n"
            "w = MetricsWriter(Path(sys.argv[1])); w.write({'step': 1, 'loss': 2.5}); w.close()\n"
            "print('torch' in sys.modules); import torch; print(torch.ones(2).sum().item())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "2.0"]
    assert [p.name for p in (tmp_path / "tb").iterdir()][0].startswith("events.out.tfevents")
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.5}
