"""The model learns real text: baby GPT on tiny Shakespeare."""

import pytest
from conftest import train_run


@pytest.mark.slow
def test_shakespeare_char_validation_loss_below_2_5_after_500_steps(tmp_path, shakespeare):
    rows = train_run(tmp_path / "run", "shakespeare_char", data__path=shakespeare, train__steps=500, train__eval_every=500,
                     optim__decay_steps=2000)
    first = next(r for r in rows if "loss" in r)
    assert first["loss"] > 4.0  # starts near ln(256) = 5.5
    assert [r for r in rows if "eval_loss" in r][-1]["eval_loss"] < 2.5
