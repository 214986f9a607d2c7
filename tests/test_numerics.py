"""Number formats: bf16, float16 with dynamic loss scaling and fp8 train as well as float32; the
loss scaler and the fp8 delayed scaling behave as specified; the numerics report counts exactly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fast_config, recipe, train_run

from lm.config import UserError
from lm.config_checks import validate
from lm.model.fp8 import Fp8Recipe, MatmulSite, tensor_stats, update_fp8
from lm.model.precision import Policy
from lm.program.checkpoint import Checkpointer
from lm.program.faults import Faults
from lm.program.spec import RunSpec
from lm.program.steps import setup
from lm.training.loop import _nonfinite_verdict, train
from lm.training.ranges import advice, report

FORMATS = {
    "bfloat16": dict(precision__compute_dtype="bfloat16"),
    "float16": dict(precision__compute_dtype="float16", precision__loss_scale="dynamic"),
    "fp8": dict(precision__compute_dtype="bfloat16", precision__fp8="delayed"),
}


@pytest.mark.slow
def test_bf16_fp16_and_fp8_end_within_3_percent_of_float32_on_shakespeare(tmp_path, shakespeare):
    def final_loss(name, **overrides):
        rows = train_run(tmp_path / name, "shakespeare_char", data__path=shakespeare, train__steps=200, train__eval_every=200,
                         train__eval_batches=2, checkpoint__every_steps=200, optim__warmup_steps=50, **overrides)
        rows = [r for r in rows if "loss" in r]
        return rows[-1]["loss"], rows  # the mean over the last 50 steps

    reference, _ = final_loss("float32", precision__compute_dtype="float32")
    assert reference < 2.6  # it learned: from ~5.5
    for name, overrides in FORMATS.items():
        loss, rows = final_loss(name, **overrides)
        assert abs(loss - reference) <= 0.03 * reference, (name, loss, reference)
        if name == "float16":
            assert all(r["loss_scale"] >= 1.0 for r in rows)


def _steps(trainer, n, seed=0):
    """Runs n steps on random tokens; returns the state and each step's metrics."""
    rng, out = np.random.default_rng(seed), []
    c = trainer.config.train
    state = trainer.init_state(0)
    for _ in range(n):
        state, metrics = trainer.train_step(state, trainer.global_batch(rng.integers(0, 256, (c.batch_size, c.seq_len + 1), dtype=np.int32)))
        out.append(jax.device_get(metrics))
    return state, out


def test_float16_overflow_backs_off_skips_the_step_and_the_scale_grows_back(small_corpus):
    c = fast_config(small_corpus, precision__compute_dtype="float16", precision__loss_scale_initial=1024.0,
                    precision__loss_scale_growth_interval=3)
    trainer = setup(c, 256, jax.devices()[:1], Faults(overflow_steps=(2,)))
    state, metrics = _steps(trainer, 7)
    assert [float(m["loss_scale"]) for m in metrics] == [1024, 1024, 512, 512, 512, 1024, 1024]
    assert [int(m["skipped_steps"]) for m in metrics] == [0, 1, 1, 1, 1, 1, 1]
    assert np.isfinite(metrics[1]["loss"]) and not np.isfinite(metrics[1]["grad_norm"])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))
    assert float(state.loss_scale["scale"]) == 1024 and int(state.loss_scale["good_steps"]) == 2
    # The loop reports the overflow and carries on, even with on_nonfinite=stop.
    said = []
    stop = fast_config(small_corpus, precision__compute_dtype="float16", train__on_nonfinite="stop")
    assert _nonfinite_verdict(RunSpec.parse(stop, 256), 1, metrics[:2], said.append) is None
    assert said == ["step 2: gradients overflowed at loss scale 1024, update skipped and the scale lowered (1 skipped in all)"]


def test_fp8_scales_move_restore_bit_exactly_and_only_follow_the_amax_history(tmp_path, small_corpus):
    # A huge weight decay and learning rate: had the optimizer touched the fp8 state, it would show.
    c = fast_config(small_corpus, precision__fp8="delayed", precision__fp8_history=4, optim__weight_decay=10.0,
                    optim__lr=0.1, optim__clip_norm=0.01)
    trainer = setup(c, 256, jax.devices()[:1])
    rng = np.random.default_rng(0)
    batch = lambda: trainer.global_batch(rng.integers(0, 256, (8, 33), dtype=np.int32))  # noqa: E731
    state = trainer.init_state(0)
    assert not [p for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0] if "_site" in jax.tree_util.keystr(p)]
    scales = []
    for _ in range(6):
        tokens = batch()
        before = jax.device_get(state.fp8)
        _, _, stats = trainer.grads(state.params, tokens, state.fp8)
        expected = jax.device_get(update_fp8(before, stats, trainer.policy.fp8))
        state, _ = trainer.train_step(state, tokens)
        # The delayed-scaling rule applied to this step's amaxes: nothing else. (The amaxes come
        # from `grads`, a program compiled apart from the step's: XLA may fuse the loss's
        # backward differently there, so a gradient's amax can differ in its last bit.)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), jax.device_get(state.fp8), expected)
        scales.append(np.asarray(state.fp8["blocks"]["mlp"]["w_in_site"]["scale"]))
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    ckpt.save(6, state)
    restored, _ = ckpt.restore(trainer.abstract_sharded_state(), 6)
    ckpt.close()
    assert not np.array_equal(scales[0], scales[-1]) and not np.array_equal(scales[0], np.ones_like(scales[0]))
    assert all((s > 0).all() for s in scales)
    history = np.asarray(state.fp8["blocks"]["mlp"]["w_in_site"]["amax_history"])
    assert history.shape == (2, 3, 4) and (history > 0).all()  # 6 steps filled the 4 slots
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored.fp8, state.fp8)


@pytest.mark.parametrize("capability, plugin_takes_it, fp8_gemm", [("9.0", True, True), ("8.9", True, True), ("8.0", True, False), (None, True, False),
                                                                   ("9.0", False, False)])
def test_fp8_sites_name_fp8_gemms_only_for_gpus_that_have_them(monkeypatch, capability, plugin_takes_it, fp8_gemm):
    """H100 / Ada: a bf16 result with the fp8 dot algorithm (float32 accumulation); an A100 (which
    XLA would refuse that algorithm), a GPU of unknown capability, or a GPU plugin that cannot
    take the algorithm (jax 0.12.0.1's): a float32 result, as on CPUs."""
    from types import SimpleNamespace

    import sharding
    from lm.model import matmul

    monkeypatch.setattr(sharding, "platform", lambda: "gpu")
    monkeypatch.setattr(sharding, "device", lambda: SimpleNamespace(platform="gpu", compute_capability=capability))
    monkeypatch.setattr(matmul, "fp8_algorithm_compiles", lambda device: plugin_takes_it)
    x, w = jnp.ones((4, 8), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float8_e4m3fn)
    dot = next(e for e in jax.make_jaxpr(lambda x, w: matmul.einsum("bd,df->bf", x, w, jnp.bfloat16, jnp.float32(2.0)))(x, w).eqns
               if e.primitive.name == "dot_general")
    assert (dot.params["preferred_element_type"] == jnp.bfloat16) == fp8_gemm
    assert ("ANY_F8_ANY_F8_F32" in str(dot.params["precision"])) == fp8_gemm


def test_fp8_matmul_stays_within_the_e4m3_error_bound():
    policy = Policy(compute_dtype=jnp.float32, fp8=Fp8Recipe())
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 256)) * jnp.exp(jax.random.normal(kx, (64, 256)))  # wide dynamic range
    w = jax.random.normal(kw, (256, 96)) * 0.02
    site = MatmulSite(policy)
    site.scale[...] = jnp.array([jnp.abs(x).max() / 448, jnp.abs(w).max() / 448, 1.0])
    y = policy.matmul("bd,df->bf", x, w, site=site)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # Each e4m3 value is off by at most 2^-4 relative (3 mantissa bits), or half the smallest
    # subnormal 2^-9 (times the scale) near zero; the bound sums those errors over the products.
    def unit_error(t, scale):
        return np.maximum(2.0**-4 * np.abs(t), 2.0**-10 * float(scale))

    ex, ew = unit_error(np.asarray(x, np.float64), site.scale[0]), unit_error(np.asarray(w, np.float64), site.scale[1])
    bound = np.abs(np.asarray(x)) @ ew + ex @ np.abs(np.asarray(w)) + ex @ ew
    error = np.abs(np.asarray(y, np.float64) - exact)
    assert (error <= bound * (1 + 1e-5) + 1e-6).all()
    assert error.max() > 1e-4 * np.abs(exact).max()  # it really was quantised
    # And the gradients flow through fp8 too: dy (all ones) is exact in e5m2 at scale 1, so dx =
    # dy @ w_q^T is off from dy @ w^T by at most the sum of w's e4m3 errors along the row.
    dx = np.asarray(jax.grad(lambda x: policy.matmul("bd,df->bf", x, w, site=site).sum())(x), np.float64)
    dx_error = np.abs(dx - np.ones((64, 96)) @ np.asarray(w, np.float64).T)
    assert (dx_error <= np.ones((64, 96)) @ ew.T * (1 + 1e-5) + 1e-6).all()
    assert dx_error.max() > 0  # w really was quantised on the way back too


def test_report_fractions_are_exact_on_crafted_values():
    t = jnp.array([0.0, 1.0, 500.0, 1e-4, 7e4, 1e-8, 3.4e38, -2.0])
    stats = np.asarray(tensor_stats(t, jnp.float8_e4m3fn, jnp.float32(1.0), observe=True))
    assert stats[0] == np.float32(3.4e38) and stats[1] == 0
    # e4m3 at scale 1 (max 448, half the smallest subnormal 2^-10): 500, 7e4, 3.4e38 overflow; 1e-4, 1e-8 flush.
    # e5m2 takes the same scale stretched to its range (x 57344 / 448 = 128): 500 -> 64000, 7e4
    #   and 3.4e38 overflow (max 57344); 1e-8 -> 1.28e-6 flushes (below 2^-17).
    # float16, unscaled: 7e4 and 3.4e38 overflow, 1e-8 flushes; bfloat16: only 3.4e38 overflows.
    np.testing.assert_array_equal(stats[2:], np.array([3, 2, 3, 1, 2, 1, 1, 0], np.float32) / 8)
    # Without a scale in use (zero), each tensor is scaled to its own amax: nothing overflows.
    jit = np.asarray(tensor_stats(jnp.array([896.0, 1.0, 0.001, 0.0]), jnp.float8_e4m3fn, jnp.float32(0.0), observe=True))
    np.testing.assert_array_equal(jit[2:4], [0.0, 0.25])  # 0.001 / 2 -> 5e-4 < 2^-10 flushes
    # Values already inf / nan are counted apart; the absmax is over the finite ones.
    broken = np.asarray(tensor_stats(jnp.array([jnp.inf, jnp.nan, 3.0, 1.0]), jnp.float8_e5m2, None, observe=True))
    assert broken[0] == 3.0 and broken[1] == 0.5 and broken[6] == 0  # float16 overflow: none new
    def row(layer, tensor, fp8, fp16):
        fmt = "e5m2" if tensor.endswith(".g") else "e4m3"
        return {"layer": layer, "tensor": tensor, fmt: dict(zip(("overflow", "underflow"), fp8)), "float16": dict(zip(("overflow", "underflow"), fp16))}

    rows = [row(0, "attn.wq.x", (1e-5, 0.001), (0, 0)),  # a value above the delayed amax: clipped, fine
            row(1, "mlp.w_in.g", (0, 0.02), (0.3, 0)),  # e5m2 flushes 2%; fp16 gradient overflow: the scaler's
            row(2, "attn.wo.x", (1e-3, 0), (1e-6, 0)),  # fp8 clips 0.1%; fp16 activation overflow: inf
            row(3, "mlp.w_out.w", (0, 0), (0, 0.05))]  # fp16 flushes 5% of a weight
    assert advice(rows, underflow_limit=0.01, overflow_limit=1e-4) == {"fp8": [1, 2], "float16": [2, 3]}


@pytest.mark.slow
def test_numerics_report_writes_json_and_heat_map(tmp_path, small_corpus):
    # A float32 run, reported on as float16 + fp8: its parameters and optimizer state carry over.
    train(fast_config(small_corpus, train__steps=2), tmp_path, jax.devices()[:1])
    c = fast_config(small_corpus, precision__compute_dtype="float16", precision__fp8="delayed")
    result = report(c, tmp_path, steps=2, devices=jax.devices()[:1])
    assert result["from_step"] == 2
    saved = json.loads((tmp_path / "numerics.json").read_text())
    assert (tmp_path / "numerics.png").stat().st_size > 10_000
    assert saved["keep_out"] == result["keep_out"] and saved["steps"] == 2
    tensors = {r["tensor"] for r in saved["rows"]}
    assert {r["layer"] for r in saved["rows"]} == {0, 1} and len(tensors) == 3 * 7  # q k v o in gate out, x w g
    assert all(np.isfinite(r["absmax"]) and r["absmax"] > 0 and set(r) >= {"nonfinite", "e4m3", "e5m2", "float16", "bfloat16"} for r in saved["rows"])


@pytest.mark.parametrize("overrides, message", [
    (dict(precision__fp8_skip="0,7"), "'7' is not a layer index"),
    (dict(precision__loss_scale="big"), "loss_scale='big' is not one of"),
    (dict(precision__compute_dtype="float8"), "is not one of float32, bfloat16, float16"),
])
def test_precision_mistakes_are_one_line_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        validate(recipe("tiny", **overrides))


def test_fp8_skip_layers_and_bf16_moments_train(small_corpus):
    c = fast_config(small_corpus, precision__compute_dtype="bfloat16", precision__fp8="delayed", precision__fp8_skip="0,-1",
                    precision__mu_dtype="bfloat16", model__num_layers=3)
    trainer = setup(c, 256, jax.devices()[:1])
    state, metrics = _steps(trainer, 3)
    assert state.opt_state.inner_state[1][0].mu["blocks"]["mlp"]["w_in"].dtype == jnp.bfloat16
    history = np.asarray(state.fp8["blocks"]["attn"]["wq_site"]["amax_history"])
    assert (history[[0, 2]] == 0).all() and (history[1, :, :3] > 0).all()  # only the middle layer ran in fp8
    assert all(np.isfinite(m["loss"]) and m["skipped_steps"] == 0 for m in metrics)


def test_current_scaling_takes_each_scale_from_the_tensors_own_amax():
    """precision.fp8=current: x and w quantised under max|x| / 448 and max|w| / 448 of this very
    call, the output gradient under max|dy| / 57344 (e4m3's and e5m2's largest values), with no
    state kept: the hand computation, forward and backward, bit for bit on the CPU emulation."""
    from lm.model.fp8 import E4M3, E5M2

    policy = Policy.from_config(recipe("tiny", precision__compute_dtype="float32", precision__fp8="current").precision)
    assert policy.fp8.scaling == "current" and not policy.fp8_state
    site = MatmulSite(policy)
    assert not hasattr(site, "scale") and not hasattr(site, "amax_history")  # nothing in the train state
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (32, 64)) * 3.0
    w = jax.random.normal(kw, (64, 48)) * 0.05
    dy = jax.random.normal(kg, (32, 48)) * 1e-3

    def q(t, dtype, scale):  # quantise, then back to real values
        return (jnp.clip(t / scale, -float(jnp.finfo(dtype).max), float(jnp.finfo(dtype).max)).astype(dtype).astype(jnp.float32) * scale)

    sx, sw, sg = jnp.abs(x).max() / 448, jnp.abs(w).max() / 448, jnp.abs(dy).max() / 57344
    y, vjp = jax.vjp(lambda x, w: policy.matmul("bd,df->bf", x, w, site=site), x, w)
    # Equal to float32 summation order (the GEMM applies the scales to its result, the hand
    # computation to its inputs), far inside the quantisation error itself:
    def close(actual, expected):  # to 1e-5 of the result's size
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))

    close(y, q(x, E4M3, sx) @ q(w, E4M3, sw))
    assert np.abs(y - x @ w).max() > 1e-3 * np.abs(x @ w).max()  # really quantised
    dx, dw = vjp(dy)
    close(dx, q(dy, E5M2, sg) @ q(w, E4M3, sw).T)
    close(dw, q(x, E4M3, sx).T @ q(dy, E5M2, sg))
    # Negative control: delayed scaling at its fresh scales (1) quantises differently.
    delayed = Policy(compute_dtype=jnp.float32, fp8=Fp8Recipe())
    y_delayed = delayed.matmul("bd,df->bf", x, w, site=MatmulSite(delayed))
    assert np.abs(y_delayed - y).max() > 1e-3 * np.abs(y).max()


@pytest.mark.slow
def test_current_scaling_trains_sharded_as_on_one_device():
    from conftest import run_steps, small_config

    # Each amax is a maximum over every shard, so the scales are one device's: two steps' losses
    # equal to 1e-5 (later ones drift apart as fp8 rounding magnifies float32's last-bit
    # differences, as delayed scaling's do, tests/test_context.py).
    fp8 = dict(precision__compute_dtype="float32", precision__fp8="current")
    ref_losses, ref_params = run_steps(small_config({}, **fp8), jax.devices()[:1], steps=2, params_after=1)
    losses, params = run_steps(small_config({"fsdp": 2, "tensor": 2}, **fp8), jax.devices()[:4], steps=2, params_after=1)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] != losses[0]
    # After the first step the weights are one device's within 1e-4 but for a few: where a
    # float32 last-bit difference moves a gradient across an e5m2 rounding boundary, Adam's first
    # step (the gradient's sign times the learning rate) can move a near-zero one the other way.
    # Seen: none under jax 0.10.2; 10 of ~100k, by up to 1.3e-3, under jax 0.12.
    moved = [np.abs(a - b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)]
    outliers = sum(int((m > 1e-4).sum()) for m in moved)
    assert outliers <= 1e-3 * sum(m.size for m in moved) and max(float(m.max()) for m in moved) <= 2 * small_config({}).optim.lr
    # And it is not the float32 run: the fp8 rounding shows in the losses.
    plain, _ = run_steps(small_config({}, precision__compute_dtype="float32"), jax.devices()[:1], steps=2)
    assert not np.allclose(plain, ref_losses, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling, mesh, observe", [
    ("delayed", {}, False), ("current", {}, False),
    pytest.param("delayed", {"data": 2, "fsdp": 2, "tensor": 2}, False, marks=pytest.mark.slow), pytest.param("delayed", {}, True, marks=pytest.mark.slow),
], ids=["delayed", "current", "delayed-data2-fsdp2-tensor2", "delayed-observed"])
def test_fp8_weights_quantised_once_a_step_train_bit_for_bit_as_per_microbatch(monkeypatch, scaling, mesh, observe):
    """With gradient accumulation the fp8 weights are quantised before the microbatches
    (`lm.model.fp8_weights`), once a step: the same fp8 values, scales and statistics as each
    microbatch quantising them again, so 3 steps' losses, metrics (the numerics report's
    statistics too, observed), parameters, moments and fp8 state are bitwise the same. Scanned
    layers, as the recipes run them (the copies are sliced layer by layer)."""
    from conftest import small_config

    from lm.model import fp8_weights
    from lm.program.steps import Program

    def run(once):
        c = small_config(mesh, precision__compute_dtype="bfloat16", precision__fp8=scaling, train__grad_accum=2, model__scan_layers=True)
        program = setup(c, 256, jax.devices()[:max(1, int(np.prod(list(mesh.values()))))], observe=observe)
        assert program._fp8_weights_once()
        with monkeypatch.context() as m:
            if not once:
                m.setattr(Program, "_fp8_weights_once", lambda self: False)
            calls = []
            m.setattr(fp8_weights, "quantised_once", lambda *a, f=fp8_weights.quantised_once: calls.append(1) or f(*a))
            rng, state, metrics = np.random.default_rng(0), program.init_state(0), []
            for _ in range(3):
                tokens = rng.integers(0, 256, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)
                state, step_metrics = program.train_step(state, program.global_batch(tokens))
                metrics.append(step_metrics)
            assert bool(calls) == once  # traced once, for the step's one compile
            return jax.device_get((metrics, state.params, state.opt_state, state.fp8))

    once, per_microbatch = run(True), run(False)
    assert jax.tree.structure(once) == jax.tree.structure(per_microbatch)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(per_microbatch), strict=True):
        np.testing.assert_array_equal(a, b)
    assert once[0][0]["loss"] != once[0][-1]["loss"]  # it trained


@pytest.mark.slow
def test_sites_reading_one_input_quantise_it_under_one_scale_and_train_bit_for_bit_as_apart(monkeypatch):
    """fp8 delayed: k and v quantise their input under q's x scale, gate under up's
    (`Policy.matmul(shares_input=...)`), which lets XLA write its fp8 copy once. Exact because
    every site reading one x records the same amax each step: 3 steps' x histories of k, v and
    gate equal q's and up's, and losses, parameters and fp8 state are bitwise those of each site
    quantising under its own scale (sharing turned off)."""
    from conftest import small_config

    from lm.model.precision import Policy

    def run(shared):
        with monkeypatch.context() as m:
            if not shared:
                m.setattr(Policy, "quantising_site", lambda self, *a: None)
            c = small_config({}, precision__compute_dtype="bfloat16", precision__fp8="delayed", train__grad_accum=2, model__scan_layers=True)
            program = setup(c, 256, jax.devices()[:1])
            rng, state, losses = np.random.default_rng(0), program.init_state(0), []
            for _ in range(3):
                tokens = rng.integers(0, 256, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)
                state, metrics = program.train_step(state, program.global_batch(tokens))
                losses.append(metrics["loss"])
            return jax.device_get((losses, state.params, state.opt_state, state.fp8))

    shared, apart = run(True), run(False)
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(apart), strict=True):
        np.testing.assert_array_equal(a, b)
    blocks = shared[3]["blocks"]
    attention, mlp = blocks["attn"], blocks["mlp"]
    x_history = lambda site: np.asarray(site["amax_history"])[..., 0, :]  # noqa: E731  [layers, history]
    assert x_history(attention["wq_site"]).max() > 0  # recorded
    for follower, leader in ((attention["wk_site"], attention["wq_site"]), (attention["wv_site"], attention["wq_site"]), (mlp["w_gate_site"], mlp["w_in_site"])):
        np.testing.assert_array_equal(x_history(follower), x_history(leader))


@pytest.mark.parametrize("mesh, overrides", [({}, {"model__scan_layers": True}), ({}, {"model__scan_layers": False}),
                                             ({"fsdp": 2, "tensor": 2}, {"model__scan_layers": True}),
                                             pytest.param({}, {"lora__rank": 4, "lora__targets": "all", "model__kv_lora_rank": 16, "model__q_lora_rank": 24,
                                                               "model__qk_nope_head_dim": 16, "model__qk_rope_head_dim": 8, "model__v_head_dim": 12},
                                                          marks=pytest.mark.slow)],
                         ids=["scanned", "unrolled", "fsdp2-tensor2", "lora-latent"])
def test_weights_cast_once_a_step_train_bit_for_bit_as_per_microbatch(monkeypatch, mesh, overrides):
    """With gradient accumulation in bf16 the block matmuls' weights are cast before the
    microbatches (`lm.model.cast_weights`), once a step, their gradient the cast's: 3 steps'
    losses, metrics, parameters and moments are bitwise those of each microbatch casting them
    again (the negative control: the cast is made, and the program does run differently: it is
    traced with the copies)."""
    from conftest import small_config

    from lm.model import cast_weights
    from lm.program.steps import Program

    def run(once):
        c = small_config(mesh, precision__compute_dtype="bfloat16", train__grad_accum=2, **overrides)
        program = setup(c, 256, jax.devices()[:max(1, int(np.prod(list(mesh.values()))))])
        assert program._weights_cast_once()
        with monkeypatch.context() as m:
            if not once:
                m.setattr(Program, "_weights_cast_once", lambda self: False)
            made = []
            m.setattr(cast_weights, "cast_once", lambda *a, f=cast_weights.cast_once: made.append(f(*a)) or made[-1])
            rng, state, metrics = np.random.default_rng(0), program.init_state(0), []
            for _ in range(3):
                tokens = rng.integers(0, 256, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)
                state, step_metrics = program.train_step(state, program.global_batch(tokens))
                metrics.append(step_metrics)
            assert bool(made) == once and (not once or len(made[0]) >= 4)  # the attention's and the MLP's weights
            return jax.device_get((metrics, state.params, state.opt_state))

    once, per_microbatch = run(True), run(False)
    assert jax.tree.structure(once) == jax.tree.structure(per_microbatch)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(per_microbatch), strict=True):
        np.testing.assert_array_equal(a, b)
    assert once[0][0]["loss"] != once[0][-1]["loss"]  # it trained


@pytest.mark.parametrize("mesh, overrides", [({}, {"train__grad_accum": 2}), ({"fsdp": 2, "tensor": 2}, {}),
                                             ({"stage": 2, "data": 2}, {"pipeline__schedule": "1f1b", "pipeline__microbatches": 2}),
                                             ({}, {"precision__compute_dtype": "float16"})],
                         ids=["accumulated", "fsdp2-tensor2", "1f1b-stage2-data2", "float16-loss-scaled"])
def test_the_chunked_loss_trains_as_the_plain_one(mesh, overrides):
    """`model.loss_chunks=4` against 1: three steps' losses equal in float32 (1e-6 relative) and
    the parameters after them to 3e-5 (AdamW moves a weight whose gradient is near zero by up to
    the learning rate on a last-bit difference, as the pipelines' tests allow); under float16
    with dynamic loss scaling, within float16's rounding. The chunked head is given the backward's seed (the
    loss scale over the microbatches) and the plain one its cotangent: the same gradients."""
    from conftest import small_config

    def run(chunks):
        c = small_config(mesh, model__loss_chunks=chunks, **overrides)
        program = setup(c, 256, jax.devices()[:max(1, int(np.prod(list(mesh.values()))))])
        rng, state, losses = np.random.default_rng(0), program.init_state(0), []
        for _ in range(3):
            tokens = rng.integers(0, 256, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)
            state, metrics = program.train_step(state, program.global_batch(tokens))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params)

    (chunked, params), (plain, plain_params) = run(4), run(1)
    half = overrides.get("precision__compute_dtype") == "float16"
    np.testing.assert_allclose(chunked, plain, rtol=1e-3 if half else 1e-6)
    assert chunked[0] != chunked[-1]
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(plain_params), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3 if half else 3e-5)
