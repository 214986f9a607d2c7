import json
import re

import jax
import pytest
from conftest import fast_config, run_module

from lm.config import UserError
from lm.model.sampling import generate
from lm.program.restore import load
from lm.training.loop import train


def test_sample_from_a_trained_run(tmp_path, small_corpus):
    train(fast_config(small_corpus, train__steps=30), tmp_path, jax.devices()[:1])
    _, tokenizer, model = load(tmp_path)
    text = generate(model, tokenizer, "def ", max_new_tokens=40, temperature=0.8, top_k=40)
    assert text.startswith("def ") and len(text.encode()) >= 40
    greedy = [generate(model, tokenizer, "import ", 20, temperature=0.0) for _ in range(2)]
    assert greedy[0] == greedy[1]
    result = run_module("lm.generate", f"--workdir={tmp_path}", "--prompt=def ", "--max_new_tokens=20", "--top_k=5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")
    # Sampling arguments with no meaning are one-line errors (a traceback, or silent nonsense for
    # a negative temperature, before).
    for bad, fragment in [({"max_new_tokens": -5}, "ask for at least one token"), ({"temperature": -1.0}, "use 0 (greedy)"),
                          ({"temperature": float("nan")}, "use 0 (greedy)"), ({"top_k": -2}, "use 0 (every token)")]:
        with pytest.raises(UserError, match=re.escape(fragment)):
            generate(model, tokenizer, "def ", **{"max_new_tokens": 4, **bad})


def test_a_run_that_named_cudnn_attention_samples_on_a_cpu(tmp_path, small_corpus):
    """A run trained on GPUs with `model.attention=cudnn`, sampled on a laptop: it runs, with the
    kernel `auto` picks here (decoding never names cuDNN; it once did, and failed on a CPU)."""
    train(fast_config(small_corpus, train__steps=5, model__attention="xla"), tmp_path, jax.devices()[:1])
    saved = json.loads((tmp_path / "config.json").read_text())

    def greedy(attention):
        (tmp_path / "config.json").write_text(json.dumps({**saved, "model": {**saved["model"], "attention": attention}}))
        _, tokenizer, model = load(tmp_path)
        return generate(model, tokenizer, "def ", 12, temperature=0.0)

    assert greedy("cudnn") == greedy("auto")  # as written on a GPU host
