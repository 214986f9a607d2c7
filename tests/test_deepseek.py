"""The DeepSeek-V3 family's own parts: multi-head latent attention (`lm.model.latent_attention`)
and the sigmoid, group-limited router (`lm.model.moe.route`): routing by hand, the absorbed
decoding against the expanded forward, and training sharded as on one device. (Checkpoints in
and out: test_hf.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import VOCAB, run_steps, small_config

from lm.model import moe
from lm.program.steps import setup

# 8 heads of latent attention (low-rank queries), 8 experts in 4 groups with 2 chosen, a shared expert.
LATENT = dict(model__kv_lora_rank=16, model__q_lora_rank=24, model__qk_nope_head_dim=16, model__qk_rope_head_dim=8, model__v_head_dim=12)
ROUTING = dict(model__num_experts=8, model__experts_per_token=2, model__expert_mlp_dim=32, model__shared_experts=1, model__router_score="sigmoid",
               model__router_groups=4, model__router_groups_chosen=2, model__router_scale=2.5, model__expert_bias_rate=0.01,
               model__router_aux_loss_coef=0.01, model__router_aux_loss_per="sequence")
DEEPSEEK = {**LATENT, **ROUTING}
MTP = dict(model__mtp_depth=1, model__mtp_loss_weight=0.3)


def test_group_limited_sigmoid_routing_by_hand():
    """Groups are scored by their best two choosing scores (score + bias); experts are chosen only
    within the best groups; the weights are the scores (no bias), normalised, then scaled."""
    logits = jnp.asarray([[3.0, -4.0, 2.0, 1.8, 0.0, 0.5, -1.0, -2.0]])  # groups {0,1} {2,3} {4,5} {6,7}
    bias = jnp.asarray([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9])
    s = np.asarray(jax.nn.sigmoid(logits[0]))  # .953 .018 .881 .858 .5 .622 .269 .119
    # Groups by their best two (expert 7 with its bias: 1.019): {0,1} .971, {2,3} 1.739, {4,5} 1.122, {6,7} 1.288.
    # Within {2,3} and {6,7}: 7 (1.019) and 2 (.881). Expert 0 (.953), second best alone, is out.
    routing = moe.route(logits, 2, True, bias, "sigmoid", groups=4, groups_chosen=2, scale=2.5)
    assert routing.ids_nk[0].tolist() == [7, 2]
    np.testing.assert_allclose(routing.weights_nk[0], 2.5 * np.asarray([s[7], s[2]]) / (s[7] + s[2]), rtol=1e-6)
    ungrouped = moe.route(logits, 2, True, bias, "sigmoid")
    assert ungrouped.ids_nk[0].tolist() == [7, 0]  # the negative control: without the group limit expert 0 is in


def test_the_selection_bias_chooses_but_never_weights():
    logits = jnp.asarray([[1.0, 0.0, -1.0, -2.0]])
    plain = moe.route(logits, 1, False, None, "sigmoid")
    biased = moe.route(logits, 1, False, jnp.asarray([0.0, 0.0, 0.0, 5.0]), "sigmoid")
    assert plain.ids_nk.tolist() == [[0]] and biased.ids_nk.tolist() == [[3]]
    np.testing.assert_allclose(biased.weights_nk[0, 0], jax.nn.sigmoid(-2.0), rtol=1e-6)


def test_sequence_wise_balance_loss_by_hand():
    """DeepSeek-V3's (eq. 17-20): per sequence, (E / k) x sum over experts of (its share of the
    sequence's tokens' choices x k) x (its mean normalised score), averaged over the sequences."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (2 * 5, 4))  # 2 sequences of 5 tokens, 4 experts
    routing = moe.route(logits, 2, True, None, "sigmoid")
    _, _, aux, _ = moe.balancing_losses(logits, routing, 4, sequences=2)
    ids, s = np.asarray(routing.ids_nk).reshape(2, 5, 2), np.asarray(jax.nn.sigmoid(logits)).reshape(2, 5, 4)
    by_hand = []
    for seq in range(2):
        f = [4 / (2 * 5) * np.sum(ids[seq] == e) for e in range(4)]
        p = (s[seq] / s[seq].sum(-1, keepdims=True)).mean(0)
        by_hand.append(np.sum(np.asarray(f) * p))
    np.testing.assert_allclose(aux, np.mean(by_hand), rtol=1e-6)
    _, _, whole, _ = moe.balancing_losses(logits, routing, 4)
    assert abs(float(whole) / 2 - float(aux)) > 1e-4  # per sequence is not the batch's


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_absorbed_decoding_equals_the_expanded_forward(lora):
    """Token by token through the latent cache (the absorbed form) against one forward over the
    whole sequence (keys and values expanded per head): the same logits. With LoRA on every
    latent-attention matmul (B made nonzero): kv_b's adapter taken through the absorbed form too."""
    options = dict(lora__rank=4, lora__targets="all") if lora else {}
    program = setup(small_config({}, **LATENT, **options), VOCAB, jax.devices()[:1])
    params = program.init_state(0).params
    if lora:  # B at zero would hide the adapters
        params = jax.tree_util.tree_map_with_path(
            lambda path, p: p + 0.3 * jax.random.normal(jax.random.key(len(path)), p.shape) if "lora_" in jax.tree_util.keystr(path) else p, params)
        assert {k for k in params["blocks"]["attn"] if k.startswith("lora_")} == {"lora_q_a", "lora_q_b", "lora_kv_a", "lora_kv_b", "lora_o"}
    model = program.abstract_model.model(params)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).astype(np.int32)
    whole = np.asarray(model(tokens)[0])
    cache = model.init_cache(2, 12)
    assert set(cache) == {"latent", "k_rope"} and cache["latent"].shape[-1] + cache["k_rope"].shape[-1] == 16 + 8
    steps = []
    for i in range(12):
        logits, cache = model(tokens[:, i : i + 1], cache=cache, cache_index=i)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-5, atol=1e-5)
    assert np.abs(whole).max() > 0.1


@pytest.fixture(scope="module")
def one_device():
    return run_steps(small_config({}, **DEEPSEEK, **MTP), jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh, options",
    [({"expert": 2, "fsdp": 2, "tensor": 2}, {}), ({"context": 2, "tensor": 2, "data": 2}, {"sharding__sequence_parallel": True}),
     # The bias moves by the sign of (1/E - load): a load at exactly 1/E summed in another order flips it, so frozen here.
     ({"expert": 4, "data": 2}, {"train__grad_accum": 2, "model__expert_bias_rate": 0.0})],
    ids=["expert2-fsdp2-tensor2", "context2-tensor2-data2-sp", "expert4-data2-accum2"],
)
@pytest.mark.slow
def test_deepseek_trains_sharded_as_on_one_device(one_device, mesh, options):
    losses, params = run_steps(small_config(mesh, **{**DEEPSEEK, **MTP, **options}))
    ref_losses, ref_params = one_device if "model__expert_bias_rate" not in options else run_steps(
        small_config({}, **{**DEEPSEEK, **MTP, **options, "train__grad_accum": 1}), jax.devices()[:1])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] != losses[0]  # the parameters did move
    # The selection bias moved (loss-free balancing), alike everywhere; multi-token prediction's too.
    assert np.abs(params["blocks"]["mlp"]["router_bias"]).max() > 0 or "model__expert_bias_rate" in options
    assert np.abs(params["mtp"]["block"]["mlp"]["router_bias"]).max() > 0 or "model__expert_bias_rate" in options
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zero_bubble", marks=pytest.mark.slow)])
def test_latent_attention_pipelines_as_on_one_device(schedule):
    ref_losses, ref_params = run_steps(small_config({}, **LATENT, train__grad_accum=2), jax.devices()[:1])
    losses, params = run_steps(small_config({"stage": 2, "data": 2, "tensor": 2}, **LATENT, pipeline__schedule=schedule))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # The tensor split reorders float32 sums: one parameter in 16384 differed by 2.07e-5 on an
    # AVX-512 host (at the code before and after 2026-12-02's taps change alike).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-5), params, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, layers, accumulated", [("1f1b", 3, 2), ("dualpipev", 5, 4)])
def test_deepseek_pipelines_with_its_leading_dense_layer_and_multi_token_prediction(schedule, layers, accumulated):
    """DeepSeek's whole layout on `{stage 2, expert 2, data 2}`: its first layer dense (run with
    the embedding on the first stage), the sparse layers in the stages (DualPipeV: 4, one per
    chunk of its V), the MTP module (with the head on the last stage; DualPipeV's on the first);
    the same losses and parameters, the selection biases included, as one device accumulating
    over as many microbatches."""
    extra = dict(DEEPSEEK, **MTP, model__moe_layers="from:1", model__num_layers=layers)
    ref_losses, ref_params = run_steps(small_config({}, train__grad_accum=accumulated, **extra), jax.devices()[:1], steps=3)
    losses, params = run_steps(small_config({"stage": 2, "expert": 2, "data": 2}, pipeline__schedule=schedule, **extra), steps=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert np.abs(params["mtp"]["block"]["mlp"]["router_bias"]).max() > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps) * scale


def _cross_entropy(logits, targets, valid):
    logits = logits - logits.max(-1, keepdims=True)
    nll = np.log(np.exp(logits).sum(-1)) - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(np.sum(nll * valid) / np.sum(valid))


@pytest.mark.parametrize("order", ["embedding-first", "hidden-first"])
def test_multi_token_prediction_loss_equals_a_hand_computation(order):
    """Two depths: depth d at position i embeds token i + d + 1 and predicts token i + d + 2, from
    the previous depth's normalised output (the final norm's for d = 0): norms, the embedding and
    hidden state concatenated in that order, `eh_proj`, the module's block, its norm, the shared
    head; each depth's cross entropy over its positions inside the window, averaged, times the
    weight, joins the model's. Concatenating the other way round (the negative control) differs."""
    import sharding
    from flax import nnx

    c = small_config({}, **DEEPSEEK, model__mtp_depth=2, model__mtp_loss_weight=0.3)
    program = setup(c, VOCAB, jax.devices()[:1])
    params = program.init_state(0).params
    tokens = np.random.default_rng(0).integers(0, VOCAB, (c.train.batch_size, c.train.seq_len + 1)).astype(np.int32)
    objective, losses = sharding.jit(program._loss, program.mesh, program.rules)(params, tokens)
    cfg, t = program.model_cfg, c.train.seq_len
    model, p = program.abstract_model.model(params), jax.device_get(params)
    with sharding.activate(program.mesh, program.rules):
        x = jax.jit(lambda m, tok: m._layers(m._embed(tok), None, None, 0)[0])(model, tokens[:, :-1])
        h = _rms(np.asarray(x), p["final_norm"]["scale"], cfg.norm_eps)
        by_hand = []
        for d in range(2):
            m = jax.tree.map(lambda a: a[d], p["mtp"])  # noqa: B023
            ahead = np.pad(tokens, ((0, 0), (0, 3)))
            e = _rms(p["embedding"][ahead[:, d + 1 : d + 1 + t]], m["enorm"]["scale"], cfg.norm_eps)
            hn = _rms(h, m["hnorm"]["scale"], cfg.norm_eps)
            both = np.concatenate([e, hn] if order == "embedding-first" else [hn, e], axis=-1)
            graphdef, state = nnx.split(model.mtp.block)
            block = jax.jit(lambda s, a: nnx.merge(graphdef, jax.tree.map(lambda v: v[d], s))(a)[0])  # noqa: B023
            y = np.asarray(block(state, jnp.asarray(both @ m["eh_proj"])))
            h = _rms(y, m["head_norm"]["scale"], cfg.norm_eps)
            valid = (np.arange(t) + d + 2 <= t)[None].repeat(len(tokens), 0)
            by_hand.append(_cross_entropy(h @ p["head"], ahead[:, d + 2 : d + 2 + t], valid))
    mtp = np.mean(by_hand)
    if order == "embedding-first":
        assert float(losses["mtp_loss"]) == pytest.approx(mtp, rel=2e-5)
        assert float(objective) == pytest.approx(float(losses["loss"]) + 0.3 * mtp, rel=2e-5)
    else:
        assert abs(float(losses["mtp_loss"]) - mtp) > 1e-3


@pytest.mark.slow
def test_multi_token_prediction_at_weight_zero_trains_as_without_it():
    """Its modules exist (kept in checkpoints and exports) but are not run: the model's loss and
    gradients bit for bit, and three steps of training alike (to 1e-6: the train step with the
    modules' parameters in it is another XLA program, whose fusions round the optimizer's
    arithmetic differently)."""
    with_mtp = small_config({}, **DEEPSEEK, model__mtp_depth=1, model__mtp_loss_weight=0.0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (with_mtp.train.batch_size, with_mtp.train.seq_len + 1)).astype(np.int32)
    first = []
    for c in (with_mtp, small_config({}, **DEEPSEEK)):
        program = setup(c, VOCAB, jax.devices()[:1])
        first.append(jax.device_get(program.grads(program.init_state(0).params, tokens)[:2]))
    (losses_0, grads), (ref_losses_0, ref_grads) = first
    assert losses_0 == ref_losses_0  # {'loss': ..}: no multi-token prediction loss when it is not run
    assert np.abs(grads["mtp"]["eh_proj"]).max() == 0
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in grads.items() if k != "mtp"}, ref_grads)
    losses, params = run_steps(with_mtp, jax.devices()[:1], steps=3)
    ref_losses, ref_params = run_steps(small_config({}, **DEEPSEEK), jax.devices()[:1], steps=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), {k: v for k, v in params.items() if k != "mtp"}, ref_params)
    weighted, _ = run_steps(small_config({}, **DEEPSEEK, model__mtp_depth=1, model__mtp_loss_weight=0.3), jax.devices()[:1], steps=3)
    assert np.abs(weighted - ref_losses).max() > 1e-4  # the control: weighted, it does reach the model


@pytest.mark.slow
def test_deepseek_lora_on_latent_attention_and_experts_trains_sharded_as_on_one_device():
    """LoRA on every matmul (q_a, q_b, the fused kv_a and kv_b, o, the dense MLP, the shared and
    routed experts) on {expert 2, fsdp 2, tensor 2}: one device's losses; only adapters move."""
    options = dict(DEEPSEEK, lora__rank=4, lora__targets="all", optim__lr=0.03)
    one, after = run_steps(small_config({}, **options), jax.devices()[:1], steps=3)
    split, _ = run_steps(small_config({"expert": 2, "fsdp": 2, "tensor": 2}, **options), jax.devices()[:8], steps=3)
    np.testing.assert_allclose(split, one, rtol=2e-5)
    program = setup(small_config({}, **options), VOCAB, jax.devices()[:1])
    before = jax.tree_util.tree_flatten_with_path(jax.device_get(program.init_state(0).params))[0]
    moved = {jax.tree_util.keystr(p) for (p, a), b in zip(before, jax.tree.leaves(after)) if not np.array_equal(a, b)}
    assert moved and all("lora_" in p for p in moved)
    assert any("lora_kv_b" in p for p in moved) and any("lora_experts" in p for p in moved)
