import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST, fast_config, losses, metrics_rows, recipe, run_module

from lm.config import UserError
from lm.program.steps import setup
from lm.training.loop import train


def test_loss_falls_and_everything_is_written(tmp_path, small_corpus):
    last = train(fast_config(small_corpus, train__steps=40), tmp_path, jax.devices()[:1])
    rows = metrics_rows(tmp_path)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 41))
    assert {"step", "loss", "perplexity", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "mfu"} <= set(train_rows[0])
    assert np.mean([r["loss"] for r in train_rows[-5:]]) < train_rows[0]["loss"] - 1.5
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30, 40] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert last["eval_loss"] == evals[-1]["eval_loss"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["40"]


def test_data_parallel_over_8_devices_matches_one_device(tmp_path, small_corpus):
    one = train(fast_config(small_corpus, train__steps=5, mesh__data=1), tmp_path / "one", jax.devices()[:1])
    eight = train(fast_config(small_corpus, train__steps=5), tmp_path / "eight")
    a, b = losses(tmp_path / "one"), losses(tmp_path / "eight")
    np.testing.assert_allclose([b[s] for s in range(1, 6)], [a[s] for s in range(1, 6)], rtol=1e-5)
    assert one["eval_loss"] == pytest.approx(eight["eval_loss"], rel=1e-5)


def test_gradient_accumulation_matches_the_full_batch(tmp_path, small_corpus):
    train(fast_config(small_corpus, train__steps=4), tmp_path / "full", jax.devices()[:1])
    train(fast_config(small_corpus, train__steps=4, train__grad_accum=4), tmp_path / "accum", jax.devices()[:1])
    a, b = losses(tmp_path / "full"), losses(tmp_path / "accum")
    np.testing.assert_allclose([b[s] for s in range(1, 5)], [a[s] for s in range(1, 5)], rtol=1e-5)


@pytest.mark.slow
def test_resume_after_kill_logs_the_same_losses(tmp_path, small_corpus):
    args = ["lm.train", "--config=configs/tiny.py", f"--config.data.path={small_corpus}", "--config.train.steps=20",
            "--config.checkpoint.every_steps=10"] + [f"--config.{k.replace('__', '.')}={v}" for k, v in FAST.items()]
    # Compiled programs are kept there, and reused (those that compile in under a second too: at -O0, the step).
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    straight = run_module(*args, f"--workdir={tmp_path / 'straight'}", env_extra=cache)
    assert straight.returncode == 0, straight.stderr
    assert any(p.name.startswith("jit__train_step") for p in (tmp_path / "cache" / "meshlm" / "xla").iterdir())
    killed = run_module(*args, f"--workdir={tmp_path / 'resumed'}", "--debug_kill_at_step=13", env_extra=cache)
    assert killed.returncode == -9, killed.stderr  # SIGKILL
    assert sorted(losses(tmp_path / "resumed")) == list(range(1, 14))
    resumed = run_module(*args, f"--workdir={tmp_path / 'resumed'}", env_extra=cache)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 10" in resumed.stdout
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    np.testing.assert_array_equal([b[s] for s in range(11, 21)], [a[s] for s in range(11, 21)])


def test_incompatible_workdir_is_refused_and_left_intact(tmp_path, small_corpus):
    train(fast_config(small_corpus, train__steps=2), tmp_path, jax.devices()[:1])
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match=r"incompatible config \(model.embed_dim: 64 saved, 96 now\)"):
        train(fast_config(small_corpus, train__steps=4, model__embed_dim=96), tmp_path, jax.devices()[:1])
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_weight_decay_moves_matmul_weights_only_on_the_real_model():
    # GPT-2 style with every kind of parameter: biases (per-head q/k/v ones too), layer norms,
    # learned positions, an untied head. Zero gradients: AdamW's update is decay alone.
    c = recipe("tiny", model__norm="layernorm", model__position="learned", model__mlp="gelu", model__use_bias=True,
               model__num_layers=2, model__embed_dim=64, model__mlp_dim=128, optim__weight_decay=0.5, mesh__data=1)
    program = setup(c, 256, jax.devices()[:1])
    params = program.init_state(0).params
    updates, _ = program.tx.update(jax.tree.map(jnp.zeros_like, params), program.tx.init(params), params)
    moved = {jax.tree_util.keystr(p, simple=True, separator="/") for p, u in jax.tree_util.tree_flatten_with_path(updates)[0] if np.abs(u).max() > 0}
    weights = {f"blocks/attn/{w}" for w in ("wq", "wk", "wv", "wo")} | {"blocks/mlp/w_in", "blocks/mlp/w_out", "head"}
    assert moved == weights
    assert {jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]} > weights | {
        "embedding", "pos_embedding", "blocks/attn/bq", "blocks/mlp/b_in", "blocks/attn_norm/bias", "final_norm/scale"}


@pytest.mark.slow
def test_muon_orthogonalises_the_block_matmuls_adamw_the_rest_and_trains_sharded_like_one_device(tmp_path, small_corpus):
    """optim.name=muon: the block matmul weights get Muon (one momentum, an update whose singular
    values are near one per layer's matrix), the embedding, head and norms AdamW (two moments), by
    the logical-axes rule weight decay uses; {fsdp 2, tensor 2} trains like one device."""
    from lm.program.optimizer import muon_dimensions

    c = fast_config(small_corpus, optim__name="muon", optim__weight_decay=0.0)
    program = setup(c, 256, jax.devices()[:1])
    dims = muon_dimensions(program.abstract_model.decay_mask, program.abstract_model.logical_axes)
    is_dim = lambda d: d is None or hasattr(d, "reduction_axis")  # noqa: E731
    muon = {jax.tree_util.keystr(p, simple=True, separator="/") for p, d in jax.tree_util.tree_flatten_with_path(dims, is_leaf=is_dim)[0] if d is not None}
    assert muon == {f"blocks/attn/{w}" for w in ("wq", "wk", "wv", "wo")} | {f"blocks/mlp/{w}" for w in ("w_gate", "w_in", "w_out")}
    params = program.init_state(0).params
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
    updates, opt_state = program.tx.update(grads, program.tx.init(params), params)
    shapes = {x.shape for x in jax.tree.leaves(params)}
    moments = [x for x in jax.tree.leaves(opt_state) if getattr(x, "ndim", 0) >= 1 and x.shape in shapes]
    n_adamw = sum(x.size for k, x in _flat(params).items() if k not in muon)
    n_muon = sum(x.size for k, x in _flat(params).items() if k in muon)
    assert sum(x.size for x in moments) == n_muon + 2 * n_adamw  # Muon: momentum only; AdamW: mu and nu
    w_in = np.asarray(_flat(updates)["blocks/mlp/w_in"][0])  # layer 0's (embed, mlp) update
    singular = np.linalg.svd(w_in / np.abs(w_in).max(), compute_uv=False)
    assert singular.min() > 0.3 * singular.max()  # orthogonalised: a flat spectrum (a raw gradient's spreads widely)
    raw = np.linalg.svd(np.asarray(_flat(grads)["blocks/mlp/w_in"][0]), compute_uv=False)
    assert raw.min() < 0.3 * raw.max()

    # Under FSDP each layer's matrix is orthogonalised whole where its momentum lives (layers split
    # over fsdp): the step gathers no more than AdamW's (it gathered 10x more when XLA gathered the
    # sharded matrices inside each Newton-Schulz iteration).
    from conftest import compiled_train_step

    from lm.compiler.hlo import collective_traffic

    gathered = {}
    for name in ("adamw", "muon"):
        fsdp = setup(fast_config(small_corpus, optim__name=name, model__num_layers=4, mesh__fsdp=4), 256, jax.devices()[:4])
        text = compiled_train_step(fsdp).as_text()
        gathered[name] = sum(b for (op, _), b in collective_traffic(text).items() if op == "all-gather")
    assert gathered["muon"] <= 1.01 * gathered["adamw"], gathered

    train(fast_config(small_corpus, optim__name="muon", train__steps=6), tmp_path / "one", jax.devices()[:1])
    train(fast_config(small_corpus, optim__name="muon", train__steps=6, mesh__fsdp=2, mesh__tensor=2), tmp_path / "sharded", jax.devices()[:4])
    one, sharded = losses(tmp_path / "one"), losses(tmp_path / "sharded")
    np.testing.assert_allclose([sharded[s] for s in range(1, 7)], [one[s] for s in range(1, 7)], rtol=1e-5)
    assert one[6] < one[1]


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_bfloat16_parameters_train():
    """precision.param_dtype=bfloat16: the float32 learning rate promoted AdamW's updates to float32,
    and the step failed (apply_if_finite's skipped branch is zeros like the bfloat16 gradients)."""
    c = recipe("tiny", precision__param_dtype="bfloat16", precision__compute_dtype="bfloat16", model__num_layers=2,
               model__embed_dim=64, model__mlp_dim=128, train__batch_size=4, train__seq_len=32, mesh__data=1)
    program = setup(c, 256, jax.devices()[:1])
    state = program.init_state(0)
    batch = program.global_batch(np.random.default_rng(0).integers(0, 256, (4, 33), dtype=np.int32))
    losses = []
    for _ in range(4):  # the same batch: the loss falls
        state, metrics = program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert int(metrics["skipped_steps"]) == 0 and losses[-1] < losses[0]


def test_document_masking_trains_sharded_like_one_device(tmp_path, docs_corpus):
    kw = dict(data__document_masking=True, train__steps=4, train__grad_accum=2)
    train(fast_config(docs_corpus, mesh__data=1, **kw), tmp_path / "one", jax.devices()[:1])
    train(fast_config(docs_corpus, mesh__data=2, mesh__tensor=2, sharding__sequence_parallel=True, **kw), tmp_path / "sharded", jax.devices()[:4])
    train(fast_config(docs_corpus, mesh__data=1, train__steps=4, train__grad_accum=2), tmp_path / "unmasked", jax.devices()[:1])
    a, b, c = losses(tmp_path / "one"), losses(tmp_path / "sharded"), losses(tmp_path / "unmasked")
    np.testing.assert_allclose([b[s] for s in range(1, 5)], [a[s] for s in range(1, 5)], rtol=1e-5)
    assert max(abs(a[s] - c[s]) for s in range(1, 5)) > 1e-4  # the masks change what the model sees
    assert "tokens_from/" + docs_corpus.name in metrics_rows(tmp_path / "one")[0]


def test_training_from_a_prepared_store_uses_its_tokenizer(tmp_path, docs_corpus, capsys):
    from conftest import run_cli

    from lm import prepare
    from lm.config import load_run
    from lm.model.sampling import generate
    from lm.program.restore import load

    result = run_cli(capsys, prepare.main, f"--out={tmp_path / 'store'}", f"--config.data.path={docs_corpus}",
                     "--config.data.tokenizer=bpe", "--config.data.vocab_size=300", "--workers=2")
    assert result.returncode == 0 and "600 documents" in result.stdout, result.stderr
    train(fast_config(tmp_path / "store", train__steps=3), tmp_path / "run", jax.devices()[:1])
    saved = load_run(tmp_path / "run")
    assert saved.data.tokenizer == str((tmp_path / "store" / "tokenizer.json").absolute())
    _, tokenizer, model = load(tmp_path / "run")
    assert tokenizer.vocab_size == 300 and model.cfg.used_vocab == 300
    assert generate(model, tokenizer, "def ", 8).startswith("def ")
    # Again into the finished store: checked and left as it is.
    result = run_cli(capsys, prepare.main, f"--out={tmp_path / 'store'}", f"--config.data.path={docs_corpus}",
                     "--config.data.tokenizer=bpe", "--config.data.vocab_size=300")
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1].startswith("already prepared")
