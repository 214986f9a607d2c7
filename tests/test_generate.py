import jax
from conftest import fast_config, run_module

from lm.generate import generate, load
from lm.train import train


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
