"""Mixture of experts (lm.model.moe, lm.model.experts): the grouped path against a dense reference, capacity dropping by hand,
expert parallelism against one device, balancing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    VOCAB,
    assert_one_line_error,
    compiled_train_step,
    recipe,
    run_cli,
    run_steps,
    small_config,
)

from lm import train as lm_train
from lm.compiler.hlo import collective_traffic
from lm.model import expert_exchange, experts, moe
from lm.program.steps import setup
from sharding import report

MOE = dict(model__num_experts=4, model__experts_per_token=2, model__expert_mlp_dim=64)


def _layer(seed=0, b=2, t=8, d=16, e=4, f=32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (b, t, d))
    weights = [jax.random.normal(k, shape) * 0.1 for k, shape in zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)])]
    return x, weights, jax.random.normal(keys[4], (d, e))


def _experts(x, w_in, w_gate, w_out, router, k=2, factor=0.0, reference=False):
    b, t, _ = x.shape
    routing = moe.route(jnp.einsum("btd,de->bte", x, router).reshape(b * t, -1), k, True)
    if reference:
        return experts.dense_reference(x, routing.ids_nk, routing.weights_nk, w_in, w_gate, w_out), 0.0
    ids, weights = routing.ids_nk.reshape(b, t, k), routing.weights_nk.reshape(b, t, k)
    return experts.apply_experts(x, ids, weights, w_in, w_gate, w_out, num_experts=w_in.shape[0], capacity_factor=factor, dtype=jnp.float32)


@pytest.mark.parametrize("factor", [0.0, 4.0], ids=["dropless", "capacity-ample"])
def test_grouped_and_capacity_paths_equal_the_dense_reference_with_gradients(factor):
    x, (w_in, w_gate, w_out), router = _layer()
    y, dropped = _experts(x, w_in, w_gate, w_out, router, factor=factor)
    ref, _ = _experts(x, w_in, w_gate, w_out, router, reference=True)
    assert float(dropped) == 0.0
    np.testing.assert_allclose(y, ref, atol=1e-6)
    grads = jax.grad(lambda *a: jnp.sum(_experts(*a, factor=factor)[0] ** 2), argnums=(0, 1, 2, 3, 4))(x, w_in, w_gate, w_out, router)
    ref_grads = jax.grad(lambda *a: jnp.sum(_experts(*a, reference=True)[0] ** 2), argnums=(0, 1, 2, 3, 4))(x, w_in, w_gate, w_out, router)
    for g, r in zip(grads, ref_grads):
        assert float(jnp.abs(r).max()) > 0
        np.testing.assert_allclose(g, r, atol=1e-6)


def test_a_small_capacity_drops_exactly_the_hand_counted_assignments():
    """8 tokens, 4 experts, 2 each; capacity factor 0.5: ceil(0.5 x 8 x 2 / 4) = 2 slots per
    expert, first choices before second ones, earlier tokens first."""
    ids = np.array([[0, 1], [0, 1], [0, 2], [0, 1], [1, 0], [3, 2], [3, 0], [1, 3]])
    # Expert 0: first choices of tokens 0-3 -> tokens 0, 1 kept, 2, 3 dropped; then the second
    # choices of 4 and 6 dropped (4). Expert 1: first choices of 4 and 7 kept; second choices of
    # 0, 1, 3 dropped (3). Expert 2: second choices of 2 and 5 kept. Expert 3: first choices of
    # 5, 6 kept; second choice of 7 dropped (1). 8 dropped in all.
    assert experts.capacity(8, 2, 4, 0.5) == 2
    ranks = np.asarray(experts.slot_ranks(jnp.asarray(ids), 4))
    assert int((ranks >= 2).sum()) == 8
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 16)), jnp.float32)
    _, (w_in, w_gate, w_out), _ = _layer()
    weights = jnp.full((1, 8, 2), 0.5)
    y, dropped = experts.apply_experts(x, jnp.asarray(ids)[None], weights, w_in, w_gate, w_out, num_experts=4, capacity_factor=0.5, dtype=jnp.float32)
    assert float(dropped) == 8
    # A dropped assignment contributes nothing: token 2 kept only its second choice (expert 2).
    kept = experts.apply_experts(x, jnp.asarray(ids)[None], weights.at[0, 2, 0].set(0.0), w_in, w_gate, w_out, num_experts=4, capacity_factor=0.0, dtype=jnp.float32)[0]
    np.testing.assert_allclose(y[0, 2], kept[0, 2], atol=1e-6)
    assert float(jnp.abs(y[0, 3]).max()) == 0.0  # token 3: both choices dropped


@pytest.fixture(scope="module")
def one_device():
    return run_steps(small_config({}, **MOE), jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh, options",
    [({"expert": 4, "data": 2}, {}), ({"expert": 2, "fsdp": 2, "tensor": 2}, {}),
     ({"expert": 2, "context": 2, "tensor": 2}, {"sharding__sequence_parallel": True}),
     ({"expert": 4, "data": 2}, {"model__expert_dispatch_chunks": 2})],
    ids=["expert4-data2", "expert2-fsdp2-tensor2", "expert2-context2-tensor2-sp", "expert4-data2-dispatched-in-chunks"],
)
def test_expert_parallel_training_matches_one_device(one_device, mesh, options):
    losses, params = run_steps(small_config(mesh, **MOE, **options))
    ref_losses, ref_params = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Parameters to 1e-4: an attention weight whose gradient is near 0 moves by Adam's normalised
    # step, which amplifies the sums' float32 order (seen: one element of 4096 off by 3.5e-5).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


def test_the_gpu_exchange_and_its_hand_written_backward_train_as_one_device(one_device, monkeypatch):
    """The GPU path (`ragged_all_to_all`, its buffer marked varying, the custom backward that
    sends the cotangent back) on {expert 4, data 2}, XLA:CPU's missing collective stood in for by
    the emulation: the same losses and parameters as one device."""
    import sharding

    monkeypatch.setattr(sharding, "platform", lambda: "gpu")
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", expert_exchange.emulated_ragged_all_to_all)
    losses, params = run_steps(small_config({"expert": 4, "data": 2}, **MOE))
    ref_losses, ref_params = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


def test_a_dense_first_layer_and_shared_experts_train_expert_parallel_as_on_one_device():
    """moe_layers='from:1' (layer 0 dense, its own stack) with a shared expert, on {expert 4, data 2}."""
    extra = dict(MOE, model__moe_layers="from:1", model__shared_experts=1)
    ref_losses, ref_params = run_steps(small_config({}, **extra), jax.devices()[:1])
    losses, params = run_steps(small_config({"expert": 4, "data": 2}, **extra))
    assert set(params) >= {"dense_blocks", "blocks"} and "w_gate" in params["dense_blocks"]["mlp"] and "shared" in params["blocks"]["mlp"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Parameters to 1e-4: an attention weight whose gradient is near 0 moves by Adam's normalised
    # step, which amplifies the sums' float32 order (seen: one element of 4096 off by 3.5e-5).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


def test_sparse_layers_anywhere_name_their_layers_and_run_as_few_scans():
    from lm.model.config import sparse_layer_ids
    from lm.model.layer_stack import layer_segments

    assert sparse_layer_ids("from:3", 6) == (3, 4, 5) and sparse_layer_ids("every:2", 6) == (1, 3, 5) and sparse_layer_ids("dense:0,4", 6) == (1, 2, 3, 5)
    kinds = lambda ids, n: ["sparse" if i in ids else "dense" for i in range(n)]  # noqa: E731
    # Interleaved over 48 layers (Qwen3-MoE's decoder_sparse_step=2, Llama 4's interleave): one scan of 24 (dense, sparse) repeats.
    assert layer_segments(kinds(sparse_layer_ids("every:2", 48), 48)) == [(0, 48, ("dense", "sparse"))]
    # DeepSeek-V3's first 3 dense: two runs; a dense layer in the middle: three.
    assert layer_segments(kinds(sparse_layer_ids("from:3", 61), 61)) == [(0, 3, ("dense",)), (3, 61, ("sparse",))]
    assert layer_segments(kinds(sparse_layer_ids("dense:1", 3), 3)) == [(0, 1, ("sparse",)), (1, 2, ("dense",)), (2, 3, ("sparse",))]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["every:2", "dense:1"])
def test_interleaved_dense_and_sparse_layers_train_expert_parallel_as_on_one_device(pattern):
    """Layers 1 and 3 sparse (one scan over two (dense, sparse) repeats), or layer 1 dense among
    sparse ones (three runs), on {expert 4, data 2}: the same losses and parameters as one device."""
    extra = dict(MOE, model__moe_layers=pattern, model__num_layers=4, model__scan_layers=True)
    ref_losses, ref_params = run_steps(small_config({}, **extra), jax.devices()[:1])
    losses, params = run_steps(small_config({"expert": 4, "data": 2}, **extra))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


def assert_pipelined_as_accumulating(schedule: str, **extra):
    """On `{stage 2, expert 2, data 2}` under `schedule`: the same losses and parameters as one
    device accumulating over as many microbatches (2)."""
    ref_losses, ref_params = run_steps(small_config({}, train__grad_accum=2, **extra), jax.devices()[:1])
    losses, params = run_steps(small_config({"stage": 2, "expert": 2, "data": 2}, pipeline__schedule=schedule, **extra))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b_per_stage"])
def test_interleaved_dense_and_sparse_layers_pipeline_as_on_one_device(schedule):
    """`every:2` over 4 layers on 2 stages (experts over 2 devices): each stage's chunk one
    (dense, sparse) repeat, the two stacks split over `stage` alike; the same losses and
    parameters as one device accumulating over as many microbatches."""
    extra = dict(MOE, model__moe_layers="every:2", model__num_layers=4, model__router_aux_loss_coef=0.1)
    assert_pipelined_as_accumulating(schedule, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b_per_stage"])
def test_leading_dense_layers_run_with_the_embedding_and_pipeline_as_on_one_device(schedule):
    """DeepSeek's first K dense (`from:1` over 3 layers): the dense layer runs with the embedding
    on the first stage (before the pipeline under GPipe), the 2 sparse layers one per stage
    (experts over 2 devices): the same losses and parameters as one device accumulating over as
    many microbatches. (1F1B and zero-bubble: tests/test_deepseek.py, with multi-token prediction.)"""
    extra = dict(MOE, model__moe_layers="from:1", model__num_layers=3, model__router_aux_loss_coef=0.1)
    assert_pipelined_as_accumulating(schedule, **extra)


@pytest.mark.slow
def test_leading_dense_layers_fp8_amaxes_are_maxima_over_the_microbatches():
    """`from:2` of 4 layers under 1F1B with fp8 delayed scaling: the two dense layers run with
    the embedding, their statistics probes among its parameters (`sharding.pipeline.Statistics`);
    each amax the maximum over the 2 microbatches, as one device accumulating them takes it
    (summed, as the embedding's gradient is, each forward amax would be about 2x: checked to fail)."""
    from test_pipeline import WHOLE_VOCABULARY, assert_fp8_step_equal, fp8_states

    extra = dict(MOE, model__moe_layers="from:2", **WHOLE_VOCABULARY)
    ref = fp8_states({}, jax.devices()[:1], steps=2, train__grad_accum=2, **extra)
    run = fp8_states({"stage": 2}, jax.devices()[:2], steps=2, pipeline__schedule="1f1b", **extra)
    for state, ref_state in zip(run.fp8, ref.fp8, strict=True):
        assert_fp8_step_equal(state["dense_blocks"], ref_state["dense_blocks"], gradient_outliers=1)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-6)


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_expert_parallel_pipeline_matches_one_device_accumulating_alike(schedule):
    """The balancing losses are taken per microbatch (as Megatron does), so the reference
    accumulates over as many microbatches as the pipeline runs."""
    aux = dict(MOE, model__router_aux_loss_coef=0.1, model__router_z_loss_coef=0.01)
    ref_losses, ref_params = run_steps(small_config({}, train__grad_accum=2, **aux), jax.devices()[:1])
    losses, params = run_steps(small_config({"expert": 2, "stage": 2, "data": 2}, pipeline__schedule=schedule, **aux))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


def test_expert_parallel_program_exchanges_tokens_and_no_device_holds_every_expert():
    c = small_config({"expert": 4, "data": 2}, **MOE)
    program = setup(c, VOCAB)
    hlo = compiled_train_step(program).as_text()
    exchanged = {n: b for (op, n), b in collective_traffic(hlo).items() if op == "all-to-all"}
    assert list(exchanged) == [4] and exchanged[4] > 0, exchanged  # over the 4 expert devices
    state = program.init_state(0)
    w_in = state.params["blocks"]["mlp"]["w_in"]
    for device in program.mesh.devices.flat:
        assert report.addressable_bytes(w_in, device) == report.total_bytes(w_in) // 4
    # Negative control: the same model on {data 8} exchanges nothing.
    plain = collective_traffic(compiled_train_step(setup(small_config({"data": 8}, **MOE), VOCAB)).as_text())
    assert not [op for op, _ in plain if op == "all-to-all"]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--config.model.num_experts=6", "--config.mesh.expert=4", "--config.mesh.data=2"], "model.num_experts=6 is not divisible by mesh.expert=4"),
        (["--config.model.experts_per_token=9"], "model.experts_per_token=9 must be between 1 and model.num_experts=8"),
        (["--config.model.expert_capacity_factor=-1"], "model.expert_capacity_factor must be zero or positive"),
        (["--config.model.num_experts=0", "--config.mesh.expert=2", "--config.mesh.data=4"], "the model is dense (model.num_experts=0)"),
        (["--config.model.moe_layers=every:two"], "model.moe_layers='every:two' is not 'all', 'from:K'"),
        (["--config.model.moe_layers=dense:0,1,2,3"], "model.moe_layers='dense:0,1,2,3' leaves none of the 4 layers a mixture of experts"),
        (["--config.model.moe_layers=from:1", "--config.mesh.stage=2", "--config.mesh.data=1"], "the 3 sparse ones are split into mesh.stage x pipeline.repeats = 2 equal chunks"),
        (["--config.model.moe_layers=dense:1", "--config.mesh.stage=2", "--config.mesh.data=1"], "each chunk of 2 layers holds whole repeats of the pattern (4 layers)"),
        (["--config.model.moe_layers=every:2", "--config.mesh.stage=2", "--config.mesh.data=1", "--config.pipeline.schedule=zero_bubble"],
         "and not under pipeline.schedule=zero_bubble"),
        (["--config.model.moe_layers=from:2", "--config.mesh.stage=2", "--config.mesh.data=1", "--config.pipeline.schedule=zbv"],
         "the 2 sparse ones are split into 2 x mesh.stage (zbv) = 4 equal chunks"),
        (["--config.model.mtp_depth=-1"], "model.mtp_depth=-1 and model.mtp_loss_weight=0.1 must be >= 0"),
    ],
    ids=["experts-not-divisible", "too-many-per-token", "negative-capacity", "expert-axis-dense-model", "moe-layers-unreadable", "moe-layers-none",
         "moe-layers-prefix-indivisible", "moe-layers-pipelined", "moe-layers-zero-bubble", "moe-layers-prefix-zbv",
         "mtp-negative"],
)
def test_bad_moe_input_is_one_line(tmp_path, capsys, extra, fragment):
    result = run_cli(capsys, lm_train.main, "--config=configs/moe_tiny.py", f"--workdir={tmp_path / 'run'}", *extra)
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_balancing_evens_the_experts_load(tmp_path, small_corpus):
    """moe_tiny (2 of its layers) for 20 steps with no balancing, the balancing loss (0.05), and
    DeepSeek-V3's bias instead (rate 0.01): the busiest expert's load over the mean (averaged over
    layers) is lower with either (measured: 3.08 off, 1.50 loss, 1.99 bias; 60 steps of the whole
    recipe in PERFORMANCE.md), and the metrics rows carry every layer's loads."""
    from lm.training.loop import train

    loads = {}
    for name, coef, rate in (("off", 0.0, 0.0), ("loss", 0.05, 0.0), ("bias", 0.0, 0.01)):
        c = recipe("moe_tiny", data__path=str(small_corpus), train__steps=20, train__batch_size=8, train__seq_len=64, train__log_every=10, model__num_layers=2,
                   train__eval_every=1000, checkpoint__every_steps=1000, model__router_aux_loss_coef=coef, model__expert_bias_rate=rate)
        train(c, tmp_path / name, jax.devices()[:1])
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in rows if "moe/max_over_mean_load" in r][-1]
        assert len(last["moe/layer1/load"]) == 8 and sum(last["moe/layer1/load"]) == pytest.approx(1.0, abs=1e-5)
        loads[name] = last["moe/max_over_mean_load"]
    print(loads)
    assert loads["loss"] < 0.75 * loads["off"] and loads["bias"] < 0.75 * loads["off"]


def test_experts_gathered_along_their_first_axis_train_as_one_device(one_device, monkeypatch):
    """The layout FSDP gathers the experts in for the Pallas kernels (all three [d, e, f], the
    gradients reduce-scattered along d, the output projection's matrices read transposed), run
    here through `ragged_dot` on {expert 2, fsdp 2, tensor 2}: the same losses and parameters as
    one device."""
    monkeypatch.setattr(experts, "gathers_along_first_axis", lambda implementation: True)
    losses, params = run_steps(small_config({"expert": 2, "fsdp": 2, "tensor": 2}, **MOE))
    ref_losses, ref_params = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)
