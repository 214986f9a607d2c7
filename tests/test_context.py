"""Context parallelism: the sequence split over the `context` mesh axis inside attention, in the
load-balanced order for causal attention; the same numbers as one device."""

import math

import jax
import numpy as np
import pytest
from conftest import (
    FAST,
    VOCAB,
    assert_one_line_error,
    compiled_train_step,
    fast_config,
    losses,
    run_cli,
    run_steps,
    small_config,
    step_and_gradients,
)
from hypothesis import given
from hypothesis import strategies as st

import sharding
from lm.compiler.hlo import collective_shapes
from lm.program.steps import setup
from lm.training.loop import train

# -- the order


@given(shards=st.integers(1, 16), chunk=st.integers(1, 64), data=st.data())
def test_load_balanced_order_is_invertible_and_gives_every_shard_the_same_causal_work(shards, chunk, data):
    length = 2 * shards * chunk
    order = sharding.load_balanced_order(length, shards)
    x = np.asarray(data.draw(st.lists(st.integers(), min_size=length, max_size=length)))
    np.testing.assert_array_equal(x[order][sharding.inverse_order(order)], x)
    pairs = sharding.causal_pairs_per_shard(order, shards)
    assert len(set(pairs)) == 1 and pairs.sum() == length * (length + 1) // 2
    for i, part in enumerate(np.split(order, shards)):  # chunk i and its mirror, 2 * shards - 1 - i
        np.testing.assert_array_equal(part // chunk, [i] * chunk + [2 * shards - 1 - i] * chunk)
    if shards > 1:  # the detector: the in-order split is lopsided
        naive = sharding.causal_pairs_per_shard(np.arange(length), shards)
        assert naive[-1] > naive[0]


# -- the model and its training


def _batch(c, rng, segments: bool):
    shape = (c.train.batch_size, c.train.seq_len + 1)
    tokens = rng.integers(0, VOCAB, shape, dtype=np.int32)
    if not segments:
        return tokens
    # Documents of 1 to about 20 tokens packed into each row.
    return {"tokens": tokens, "segments": np.cumsum(rng.random(shape) < 0.1, axis=1).astype(np.int32)}


def _run(mesh: dict, segments: bool, steps: int = 5, **kw):
    """(logits at init in the natural order, gradients at init, losses of `steps` steps, final
    parameters) on `mesh`, from fixed random batches."""
    c = small_config(mesh, **kw)
    program = setup(c, VOCAB, jax.devices()[: math.prod(mesh.values())])
    rng = np.random.default_rng(0)
    state, first = program.init_state(0), program.global_batch(_batch(c, rng, segments))

    def forward(params, batch):
        inputs, _, _ = program.model_inputs(batch)
        return program.abstract_model.model(params)(**inputs)[0]

    logits = np.asarray(sharding.jit(forward, program.mesh, program.rules)(state.params, first))
    if program.sequence_order is not None:  # back to the natural order, to compare
        logits = logits[:, sharding.inverse_order(program.sequence_order)]
    step, out, grads = step_and_gradients(program), [], None
    for batch in [first] + [program.global_batch(_batch(c, rng, segments)) for _ in range(steps - 1)]:
        (state, metrics), (_, applied) = step(state, batch)
        out.append(metrics["loss"])
        grads = jax.device_get(applied) if grads is None else grads  # the first step's, at init
    return logits, grads, np.asarray(jax.device_get(out)), jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device():
    return {segments: _run({"data": 1}, segments) for segments in (False, True)}


# The four meshes with and without packed documents, then sequence parallelism over
# context x tensor and a fused kernel run per shard (without documents: the same paths).
CASES = [  # mesh, overrides, packed documents
    *(
        (mesh, kw, segments)
        for mesh, kw in (
            ({"context": 2}, {}),
            ({"context": 4}, {}),
            ({"context": 2, "tensor": 2, "data": 2}, {}),
            ({"context": 2, "fsdp": 2}, {"sharding__sequence_parallel": True}),
        )
        for segments in (False, True)
    ),
    ({"context": 2, "fsdp": 2, "tensor": 2}, {"sharding__sequence_parallel": True}, False),
    ({"context": 2, "tensor": 2, "data": 2}, {"model__attention": "xla"}, False),
]


@pytest.mark.parametrize(
    "mesh, kw, segments", CASES,
    ids=[f"{'-'.join(f'{k}{v}' for k, v in m.items())}{'-sp' if kw.get('sharding__sequence_parallel') else ''}"
         f"{'-xla' if kw.get('model__attention') else ''}{'-docs' if docs else ''}" for m, kw, docs in CASES],
)
def test_context_parallel_logits_gradients_and_training_match_one_device(one_device, mesh, kw, segments):
    logits, grads, losses_, params = _run(mesh, segments, **kw)
    ref_logits, ref_grads, ref_losses, ref_params = one_device[segments]
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)
    np.testing.assert_allclose(losses_, ref_losses, rtol=1e-5)
    assert losses_[-1] != losses_[0]  # the parameters did move
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), params, ref_params)


def test_document_masks_reach_attention_through_the_reorder(one_device):
    # The detector for the test above: the same tokens without their document masks differ.
    logits, *_ = _run({"context": 2}, segments=False, steps=1)
    assert np.abs(logits - one_device[True][0]).max() > 1e-3


@pytest.mark.slow
def test_context_parallelism_composes_with_the_pipeline_fp8_and_gradient_accumulation():
    reference = run_steps(small_config({"data": 1}), jax.devices()[:1], steps=3)[0]  # one device: no pipeline, no accumulation
    for mesh, kw in (({"stage": 2, "context": 2}, dict(pipeline__microbatches=2)), ({"stage": 2, "context": 2}, dict(pipeline__schedule="1f1b")),
                     ({"context": 2}, dict(train__grad_accum=2))):
        losses_, _ = run_steps(small_config(mesh, **kw), jax.devices()[: math.prod(mesh.values())], steps=3)
        np.testing.assert_allclose(losses_, reference, rtol=1e-5)
    fp8 = dict(precision__fp8="delayed", precision__fp8_history=4)
    states = []
    for mesh in ({"data": 1}, {"context": 4}):
        c = small_config(mesh, **fp8)
        program = setup(c, VOCAB, jax.devices()[: math.prod(mesh.values())])
        state, rng = program.init_state(0), np.random.default_rng(0)
        state, _ = program.train_step(state, program.global_batch(_batch(c, rng, False)))
        states.append(jax.device_get(state.fp8))
    # The amaxes are maxima over every shard of the sequence: the same history and scales after a
    # step. (Later steps drift apart: fp8 rounding magnifies float32's last-bit differences.)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), *states)
    assert any(np.any(h > 0) for h in jax.tree.leaves(states[0]))


def test_keys_and_values_are_gathered_over_context_never_queries_or_the_residual():
    c = small_config({"context": 2})  # data 1: the batch of 16 whole on each device
    program = setup(c, VOCAB, jax.devices()[:2])
    hlo = compiled_train_step(program).as_text()
    gathered = set(collective_shapes(hlo, "all-gather"))
    b, t, h, g, k, d = 16, 32, 8, 4, 8, 64
    assert (b, t, g, k) in gathered  # keys and values: whole sequence, kv heads
    assert not {(b, t, h, k), (b, t, d)} & gathered
    # The detector: gathering the queries shows up as one.
    q = jax.ShapeDtypeStruct((b, t, h, k), np.float32, sharding=sharding.named_sharding(program.mesh, ("batch", "length", "heads", "head_dim"), program.rules))
    whole = sharding.named_sharding(program.mesh, ("batch", "kv_length", "heads", "head_dim"), program.rules)
    control = jax.jit(lambda x: x * 2, out_shardings=whole).lower(q).compile().as_text()
    assert (b, t, h, k) in set(collective_shapes(control, "all-gather"))


def test_resume_and_evaluation_under_context_parallelism(tmp_path, small_corpus):
    kw = dict(train__seq_len=32, optim__decay_steps=6, checkpoint__every_steps=3, train__eval_every=3)
    straight = train(fast_config(small_corpus, mesh__data=1, mesh__context=2, train__steps=6, **kw), tmp_path / "straight", jax.devices()[:2])
    train(fast_config(small_corpus, mesh__data=1, mesh__context=2, train__steps=3, **kw), tmp_path / "resumed", jax.devices()[:2])
    resumed = train(fast_config(small_corpus, mesh__data=1, mesh__context=2, train__steps=6, **kw), tmp_path / "resumed", jax.devices()[:2])
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    np.testing.assert_array_equal([b[s] for s in range(4, 7)], [a[s] for s in range(4, 7)])
    assert resumed["eval_loss"] == straight["eval_loss"]
    one = train(fast_config(small_corpus, mesh__data=1, train__steps=6, **kw), tmp_path / "one", jax.devices()[:1])
    assert one["eval_loss"] == pytest.approx(straight["eval_loss"], rel=1e-5)
    np.testing.assert_allclose([a[s] for s in range(1, 7)], [losses(tmp_path / "one")[s] for s in range(1, 7)], rtol=1e-5)

    from lm.model.sampling import (
        generate,  # decoding: one device, whatever the run's mesh was
    )
    from lm.program.restore import load

    _, tokenizer, model = load(tmp_path / "straight")
    assert generate(model, tokenizer, "def ", 8, temperature=0.0).startswith("def ")


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"mesh.context": 4, "train.seq_len": 36}, ("train.seq_len=36", "use a multiple of 8")),
        ({"mesh.context": 2, "sharding.rules": "(('length', None),)"}, ("mesh.context=2", "'length'")),
        ({"mesh.context": 3}, ("mesh", "context=3")),
    ],
)
def test_context_parallelism_bad_input_is_one_line(tmp_path, capsys, small_corpus, overrides, fragments):
    from lm import train as lm_train

    args = [f"--config.{k.replace('__', '.')}={v}" for k, v in FAST.items()]
    args += [f"--config.{k}={v}" for k, v in overrides.items()]
    result = run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", f"--config.data.path={small_corpus}", *args)
    assert_one_line_error(result, *fragments)
