"""The model learns real text: baby GPT on tiny Shakespeare."""

import jax
import pytest
from conftest import metrics_rows, recipe

from lm.train import train


@pytest.mark.slow
def test_shakespeare_char_validation_loss_below_2_5_after_500_steps(tmp_path, shakespeare):
    config = recipe("shakespeare_char", data__path=str(shakespeare), train__steps=500, train__eval_every=500, optim__decay_steps=2000)
    last = train(config, tmp_path, jax.devices()[:1])
    first = [r for r in metrics_rows(tmp_path) if "loss" in r][0]
    assert first["loss"] > 4.0  # starts near ln(256) = 5.5
    assert last["eval_loss"] < 2.5
