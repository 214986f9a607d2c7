"""Pipeline parallelism over 'stage': the schedule as data, and training equal to one device."""

import dataclasses
import functools
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    VOCAB,
    compiled_train_step,
    fast_config,
    small_config,
    step_and_gradients,
)

from lm.compiler import hlo
from lm.model.fp8 import ROLES
from lm.program.checkpoint import Checkpointer
from lm.program.steps import setup
from lm.training.loop import train
from sharding import ShardingError
from sharding.pipeline_1f1b import Pullbacks, stash_slots
from sharding.schedule_report import report
from sharding.schedules import (
    PipelinePlan,
    bubble_fraction,
    in_flight,
    phases,
    schedule,
    schedule_1f1b,
)

DEEP = dict(model__num_layers=4)


@pytest.mark.parametrize("scanned", [True, False])
def test_fp8_skip_holds_where_segments_in_and_out_of_fp8_are_alike(scanned):
    """Skipping layers 0 and 1 of 4 makes two segments of two layers, one out of fp8 and one in:
    the same scan body and input types. jax caches a scan's trace by those, so one trace served
    both and layers 2 and 3 ran out of fp8 too (seen scanned: every history 0, the loss the
    unrolled run's to 9e-5 only); each segment now traces its own body (`StackRunner.run_stack`)."""
    run = fp8_states({}, jax.devices()[:1], steps=1, precision__fp8_skip="0,1", model__scan_layers=scanned)
    history = run.fp8[0]["blocks"]["attn"]["wq_site"]["amax_history"]
    assert (history[:2] == 0).all() and (history[2:, :, 0] > 0).all()
    if scanned:
        unrolled = fp8_states({}, jax.devices()[:1], steps=1, precision__fp8_skip="0,1", model__scan_layers=False)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), run.fp8[0], unrolled.fp8[0])
        np.testing.assert_allclose(run.losses, unrolled.losses, rtol=1e-6)


@pytest.mark.parametrize("stages, microbatches, repeats", [(2, 2, 1), (2, 4, 1), (4, 4, 1), (4, 8, 1), (2, 2, 2), (4, 4, 2), (3, 5, 3)])
def test_schedule_visits_every_chunk_once_in_order_and_its_bubble_is_the_formula(stages, microbatches, repeats):
    table = schedule(stages, microbatches, repeats)
    assert len(table) == repeats * microbatches + stages - 1 and all(len(row) == stages for row in table)
    for m in range(microbatches):
        visits = [(t, s, work.chunk) for t, row in enumerate(table) for s, work in enumerate(row) if work and work.microbatch == m]
        assert [chunk for _, _, chunk in visits] == list(range(repeats * stages))  # each chunk once, in order
        assert all(s == chunk % stages for _, s, chunk in visits)  # chunk c lives on stage c mod S
        assert all(t2 > t1 for (t1, *_), (t2, *_) in zip(visits, visits[1:]))  # one after the other
    assert bubble_fraction(table) == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))


def test_pipeline_configuration_errors():
    with pytest.raises(ShardingError, match="6 layers do not split into mesh.stage=4 x pipeline.repeats=1"):
        setup(small_config({"data": 2, "stage": 4}, model__num_layers=6), VOCAB)
    with pytest.raises(ShardingError, match="pipeline.microbatches=2 is fewer than the 4 stages"):
        setup(small_config({"data": 2, "stage": 4}, pipeline__microbatches=2, **DEEP), VOCAB)
    with pytest.raises(ShardingError, match="per-replica batch of 4 sequences is not divisible by pipeline.microbatches=3"):
        setup(small_config({"data": 4, "stage": 2}, pipeline__microbatches=3, **DEEP), VOCAB)
    with pytest.raises(ShardingError, match="make pipeline.microbatches=6 a multiple of 4"):
        setup(small_config({"data": 2, "stage": 4}, pipeline__microbatches=6, pipeline__schedule="1f1b", pipeline__repeats=2,
                           train__batch_size=12, model__num_layers=8), VOCAB)


def pipelined_run(c, devices=None, steps: int = 5):
    """(losses of `steps` train steps on fixed random tokens, final parameters, the first step's
    (loss, gradients) at the initial parameters, the compiled HLO): one compilation per case."""
    program = setup(c, VOCAB, devices)
    rng = np.random.default_rng(0)
    batches = [program.global_batch(rng.integers(0, VOCAB, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)) for _ in range(steps)]
    state = program.init_state(0)
    compiled = step_and_gradients(program).lower(state, batches[0]).compile()
    losses, first = [], None
    for batch in batches:
        (state, metrics), grads = compiled(state, batch)
        losses.append(metrics["loss"])
        if first is None:
            first = jax.device_get(grads)
    return np.asarray(jax.device_get(losses)), jax.device_get(state.params), first, compiled.as_text()


@pytest.fixture(scope="module")
def one_device_deep():
    return pipelined_run(small_config({}, **DEEP), jax.devices()[:1])[:3]


def trains_like_one_device(one_device_deep, c, loss_rel: float = 1e-6) -> str:
    """Asserts that `c`'s first gradients, 5 steps of losses and final parameters equal the
    one-device run's; returns the compiled HLO."""
    ref_losses, ref_params, (ref_loss, ref_grads) = one_device_deep
    losses, params, (loss, grads), hlo = pipelined_run(c)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # After 5 AdamW steps (warming up: 6e-4 of movement at most): Adam moves a weight whose
    # gradient is near zero by its normalised step whatever the gradient's size, so the last bit
    # of float32 rounding (microbatches summed in another order) shows as up to ~1.4e-5 there
    # (one element of 8192 in one stacked weight here, from logits gradients alike to 2e-10); a wrong
    # gradient moves weights by ~1e-4 and more.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-5), params, ref_params)
    assert loss == pytest.approx(ref_loss, rel=loss_rel)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)
    return hlo


@pytest.mark.parametrize(
    "mesh, extra",
    [
        ({"stage": 2}, {}),
        ({"stage": 4}, {}),
        ({"stage": 2}, {"pipeline__repeats": 2}),
        ({"stage": 2, "data": 2, "tensor": 2}, {"train__grad_accum": 2}),  # and gradient accumulation
        ({"stage": 2, "fsdp": 4}, {"pipeline__microbatches": 4}),
        ({"stage": 2}, {"pipeline__schedule": "1f1b"}),
        ({"stage": 4}, {"pipeline__schedule": "1f1b", "pipeline__microbatches": 8}),
        ({"stage": 2, "data": 2, "tensor": 2}, {"pipeline__schedule": "1f1b", "train__grad_accum": 2, "sharding__sequence_parallel": True,
                                                "model__remat": "dots"}),
        ({"stage": 2, "fsdp": 4}, {"pipeline__schedule": "1f1b", "pipeline__microbatches": 4}),
        ({"stage": 2}, {"pipeline__schedule": "1f1b", "pipeline__repeats": 2, "pipeline__microbatches": 4}),
        ({"stage": 2, "data": 2, "tensor": 2}, {"pipeline__schedule": "1f1b", "pipeline__repeats": 2, "sharding__sequence_parallel": True}),
        # The stash keeps the pullbacks' residuals instead of recomputing (pipeline.remat).
        # (These hung full runs of the suite until XLA:CPU's thread pools were sized for the fake
        # devices: PERFORMANCE.md, "The pipeline's ends read their own schedule columns".)
        ({"stage": 4}, {"pipeline__schedule": "1f1b", "pipeline__microbatches": 8, "pipeline__remat": "none"}),
        pytest.param({"stage": 2, "data": 4}, {"pipeline__schedule": "1f1b", "pipeline__microbatches": 4, "pipeline__remat": "none"},
                     marks=pytest.mark.slow),
        ({"stage": 2, "fsdp": 2, "tensor": 2}, {"pipeline__schedule": "1f1b", "pipeline__repeats": 2, "pipeline__remat": "dots",
                                                "model__remat": "full", "sharding__sequence_parallel": True, "train__grad_accum": 2}),
        ({"stage": 2, "data": 4}, {"pipeline__schedule": "1f1b", "sharding__optimizer_over_data": True}),  # ZeRO-1
    ],
    ids=["stage2", "stage4", "stage2-repeats2", "stage2-data2-tensor2-accum2", "stage2-fsdp4",
         "1f1b-stage2", "1f1b-stage4", "1f1b-stage2-data2-tensor2-sp-accum2-dots", "1f1b-stage2-fsdp4",
         "interleaved-1f1b-stage2", "interleaved-1f1b-stage2-data2-tensor2-sp",
         "1f1b-stage4-residuals", "1f1b-stage2-data4-residuals", "interleaved-1f1b-stage2-fsdp2-tensor2-sp-accum2-residuals-dots",
         "1f1b-stage2-data4-zero1"],
)
def test_pipelined_training_matches_one_device(one_device_deep, mesh, extra):
    hlo = trains_like_one_device(one_device_deep, small_config({"data": -1, **mesh}, **DEEP, **extra))
    assert "collective-permute" in hlo  # stages hand activations on, forward and backward
    assert not full_vocabulary_buffers(hlo)  # the head and loss are split over the stages
    assert not constant_collectives(hlo)


def constant_collectives(hlo: str) -> list[str]:
    """Collectives of a compiled program whose operands are all constants: communication of what
    is known at compile time. (The pipelines once read their ends' schedule columns from per-tick
    rows split over `stage`, a broadcast per read, and XLA hoisted the constant ones out of the
    loop, outside the order of the loops' collective-permutes.)"""
    kinds = "all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter"
    found = re.finditer(rf"%(\S+) = [^\n]*? (?:{kinds})(?:-start)?\(([^)]*)\)", hlo)
    return [m.group(1) for m in found if all(o.strip().startswith("%constant") for o in m.group(2).split(","))]


def full_vocabulary_buffers(hlo: str) -> set[str]:
    """[batch, length, vocab]-shaped buffers of the whole vocabulary in a compiled program."""
    return {m.group(0) for m in re.finditer(r"(?:f32|bf16)\[\d+,\d+,(\d+)\]", hlo) if int(m.group(1)) == VOCAB}


def test_no_stage_holds_full_vocabulary_logits_unless_the_rules_say_so():
    def compiled(**kw):
        c = small_config({"data": -1, "stage": 2}, **DEEP, **kw)
        return compiled_train_step(setup(c, VOCAB)).as_text()

    assert not full_vocabulary_buffers(compiled())
    # The detector: with the vocabulary over `tensor` alone, every stage computes the whole head,
    # one microbatch (2 of the replica's 4 sequences) at a time.
    assert full_vocabulary_buffers(compiled(sharding__rules="(('vocab', 'tensor'),)")) == {"f32[2,32,256]"}


def test_evaluation_runs_the_forward_alone_under_every_schedule():
    """The eval step's loss equals one device's, and every schedule compiles the same forward
    (the same FLOPs as GPipe's): before, the 1F1B programs ran their whole backward to evaluate
    (2x the FLOPs)."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, 33)).astype(np.int32)  # SMALL: 16 sequences of 32 + 1

    def evaluated(mesh, devices, **kw):
        program = setup(small_config(mesh, **DEEP, **kw), VOCAB, devices)
        batch = jax.ShapeDtypeStruct(tokens.shape, np.int32, sharding=program.batch_sharding)
        cost = program.eval_step.lower(program.abstract_sharded_state(), batch).compile().cost_analysis()
        return float(program.eval_step(program.init_state(0), tokens)), (cost[0] if isinstance(cost, list) else cost)["flops"]

    reference, _ = evaluated({}, jax.devices()[:1])
    runs = {schedule: evaluated({"stage": 2}, jax.devices()[:2], pipeline__schedule=schedule) for schedule in ("gpipe", "1f1b", "1f1b_per_stage")}
    for loss, flops in runs.values():
        np.testing.assert_allclose(loss, reference, rtol=1e-6)
        assert flops == runs["gpipe"][1]


@pytest.mark.slow
def test_checkpoint_from_a_pipelined_mesh_restores_on_one_device(tmp_path, small_corpus):
    pipelined = dict(model__num_layers=4, mesh__stage=2, mesh__data=4, pipeline__schedule="1f1b")
    train(fast_config(small_corpus, train__steps=2, **pipelined), tmp_path)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    saved = setup(fast_config(small_corpus, **pipelined), 256)
    flat = setup(fast_config(small_corpus, model__num_layers=4, mesh__data=1), 256, jax.devices()[:1])
    a = jax.device_get(ckpt.restore(saved.abstract_sharded_state(), 2)[0])
    b = jax.device_get(ckpt.restore(flat.abstract_sharded_state(), 2)[0])
    assert saved.state_shardings.params["blocks"]["mlp"]["w_in"].spec[0] == "stage"  # layers were split
    jax.tree.map(np.testing.assert_array_equal, a, b)


@dataclasses.dataclass
class Fp8Run:
    """A run's fp8 state after each step, its losses and the train state each step started from;
    `forced`: the fp8 state after each step when it starts from another run's state instead."""

    fp8: list
    losses: np.ndarray
    starts: list
    forced: list | None = None


def fp8_states(mesh: dict, devices=None, steps: int = 5, forced_from: list | None = None, **kw) -> Fp8Run:
    """`steps` train steps with fp8 delayed scaling on fixed random tokens. With `forced_from` (a
    run's `starts`), each step runs once more, by the same compiled program on the same tokens,
    from that run's state before it: each step's update of the fp8 state on its own."""
    c = small_config(mesh, **DEEP, precision__fp8="delayed", precision__fp8_history=8, **kw)
    program = setup(c, VOCAB, devices)
    rng = np.random.default_rng(0)
    shape = (c.train.batch_size, c.train.seq_len + 1)
    batches = [program.global_batch(rng.integers(0, VOCAB, shape, dtype=np.int32)) for _ in range(steps)]
    state, fp8, losses, starts, forced = program.init_state(0), [], [], [], None
    for batch in batches:
        starts.append(jax.device_get(state))
        state, metrics = program.train_step(state, batch)
        fp8.append(jax.device_get(state.fp8))
        losses.append(metrics["loss"])
    if forced_from is not None:
        step = lambda start, batch: program.train_step(jax.device_put(start, program.state_shardings), batch)[0].fp8  # noqa: E731
        forced = [jax.device_get(step(start, batch)) for start, batch in zip(forced_from, batches, strict=True)]
    return Fp8Run(fp8, np.asarray(jax.device_get(losses)), starts, forced)


# Float32's last bits for an amax of summed gradients: sums of the same terms in another order
# (the pipeline's microbatches, the one device's batch) differ by a few ulps, more where terms
# cancel. Seen up to 1.04e-6 (9 ulps) on an AVX-512 Xeon without AMX, under 1e-6 with AMX.
LAST_BITS = 1e-5


def assert_fp8_step_equal(state, ref, gradient_outliers: int = 0):
    """The forward's roles (x, w) bitwise; the output gradients' (g) to float32's last bits (1e-5),
    but for `gradient_outliers` amaxes, each within one e5m2 step (25%). Against a one-device
    run of the whole batch the gradients differ in the last bits from the first backward on:
    that run sums each weight gradient over the batch in one dot, the pipeline adds its
    microbatches' (and splits the loss's logsumexp over the stages). Against one device adding
    the same microbatches, with the vocabulary whole, every schedule is bitwise (the test
    below). Where such a difference rounds an e5m2 value the other way, an amax downstream of
    it moves by more."""
    is_site = lambda x: isinstance(x, Mapping) and "scale" in x  # noqa: E731
    forward, g = [ROLES.index("x"), ROLES.index("w")], ROLES.index("g")
    relative = lambda a, b: np.abs(a - b) / np.maximum(np.abs(b), np.finfo(np.float32).tiny)  # noqa: E731
    gradients = []
    for site, ref_site in zip(jax.tree.leaves(state, is_leaf=is_site), jax.tree.leaves(ref, is_leaf=is_site), strict=True):
        assert site.keys() == ref_site.keys() == {"amax_history", "scale"}
        np.testing.assert_array_equal(site["amax_history"][..., forward, :], ref_site["amax_history"][..., forward, :])
        np.testing.assert_array_equal(site["scale"][..., forward], ref_site["scale"][..., forward])
        gradients.append(relative(site["amax_history"][..., g, :], ref_site["amax_history"][..., g, :]).ravel())
        np.testing.assert_allclose(site["scale"][..., g], ref_site["scale"][..., g], rtol=0.25 if gradient_outliers else 1e-6)
    gradients = np.concatenate(gradients)
    assert (gradients > LAST_BITS).sum() <= gradient_outliers and gradients.max() < 0.25, np.sort(gradients)[-3:]


def assert_fp8_like_one_device(run: Fp8Run, ref: Fp8Run):
    """A pipelined fp8 run against the one-device run on the same tokens (see the test below)."""
    # Each step's update alone, from the one-device run's state before it (so with the same
    # weights, histories and scales): the forward's statistics bitwise at every step, which
    # checks delayed scaling's bookkeeping (each amax the maximum over the ticks that did work,
    # the history rolled once, the scales taken from it) over a history that fills up.
    # (Seen: one output-gradient amax of the 28 a step adds is off by more than 1e-6 at steps 2
    # and 5, by 5.6e-5 and, under GPipe, 1.1%; under jax 0.11 / 0.12, two at one step, by 5.3e-5
    # and 5.6e-5, the same under every schedule: the one-device run's sums, not the pipeline's;
    # on a Xeon without AMX, jax 0.10.2, two by 1.03e-6 and one by 1.7% under GPipe; the
    # forward's all equal.)
    for state, ref_state in zip(run.forced, ref.fp8, strict=True):
        assert_fp8_step_equal(state, ref_state, gradient_outliers=2)
    # Run freely, the two drift apart (fp8 rounding magnifies float32's last-bit differences
    # between the pipelined and the one-device gradient sums), the training does not. An amax
    # downstream of e5m2 gradients moves by up to one e5m2 step (2 mantissa bits: 25%) when one
    # of them rounds the other way (seen: 15.5% on one entry under jax 0.11.2). One device
    # drifts from itself so: with train.grad_accum=2 (the halves' gradients added) its fp8 state
    # equals the plain run's bitwise for three steps and differs by up to 6% at the fourth.
    assert_fp8_step_equal(run.fp8[0], ref.fp8[0])
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0.25), run.fp8[-1], ref.fp8[-1])


@pytest.fixture(scope="module")
def fp8_one_device():
    return fp8_states({}, jax.devices()[:1])


@pytest.mark.parametrize("extra", [pytest.param({}, marks=pytest.mark.slow), {"pipeline__repeats": 2},
                                   pytest.param({"pipeline__schedule": "1f1b"}, marks=pytest.mark.slow), {"pipeline__schedule": "1f1b", "pipeline__repeats": 2},
                                   pytest.param({"pipeline__schedule": "1f1b", "pipeline__remat": "none"}, marks=pytest.mark.slow)],
                         ids=["gpipe", "circular", "1f1b", "interleaved-1f1b", "1f1b-residuals"])
def test_fp8_in_the_pipeline_takes_each_amax_over_the_ticks_that_did_work(fp8_one_device, extra):
    """A step's amaxes are the maxima over the microbatches the stages ran (summed over ticks,
    autodiff's way, they would be 2x: 2 microbatches), so each of 5 steps leaves the one-device
    run's fp8 state (the forward's roles bitwise), from the same state on the same tokens."""
    assert_fp8_like_one_device(fp8_states({"data": -1, "stage": 2}, forced_from=fp8_one_device.starts, **extra), fp8_one_device)


WHOLE_VOCABULARY = dict(sharding__rules="(('vocab', 'tensor'),)")


@pytest.fixture(scope="module")
def fp8_one_device_in_two_microbatches():
    return fp8_states({}, jax.devices()[:1], train__grad_accum=2, **WHOLE_VOCABULARY)


@pytest.mark.parametrize("extra", [pytest.param({}, marks=pytest.mark.slow), {"pipeline__repeats": 2}, {"pipeline__schedule": "1f1b"},
                                   {"pipeline__schedule": "1f1b", "pipeline__repeats": 2}, {"pipeline__schedule": "1f1b_per_stage"}],
                         ids=["gpipe", "circular", "1f1b", "interleaved-1f1b", "per-stage-1f1b"])
def test_fp8_state_under_every_schedule_is_bitwise_the_one_device_runs_at_each_of_5_steps(fp8_one_device_in_two_microbatches, extra):
    """Run freely for 5 steps on `{stage: 2}`, every pipeline leaves the fp8 state (every site's
    amax histories and scales, all three roles) and the losses bitwise equal to one device's
    after every step (GPipe, circular and the per-stage 1F1B: see `REORDERED_STEPS`). The reference adds the same two microbatches' gradients
    (`train.grad_accum=2`), and the vocabulary stays whole, since split over the stages the
    loss's logsumexp adds in another order by design. (Two things made it possible:
    `lm.model.attention.softmax`, and GPipe's head run per microbatch, `microbatch_loss`; with its
    head on the whole batch, its weight gradient summed in another order: equal for 3 steps.)"""
    ref = fp8_one_device_in_two_microbatches
    run = fp8_states({"stage": 2}, jax.devices()[:2], **WHOLE_VOCABULARY, **extra)
    if extra in ({}, {"pipeline__repeats": 2}, {"pipeline__schedule": "1f1b_per_stage"}):  # summed in another order by XLA:CPU at times
        for state, ref_state in zip(run.fp8[:REORDERED_STEPS], ref.fp8, strict=False):
            assert_fp8_step_equal(state, ref_state, gradient_outliers=1)  # the forward bitwise, the gradients to the last bits
        np.testing.assert_array_equal(run.losses[0], ref.losses[0])
        np.testing.assert_allclose(run.losses[:REORDERED_STEPS], ref.losses[:REORDERED_STEPS], rtol=1e-6)
    else:
        for state, ref_state in zip(run.fp8, ref.fp8, strict=True):
            jax.tree.map(np.testing.assert_array_equal, state, ref_state)
        np.testing.assert_array_equal(run.losses, ref.losses)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-4)


# Steps GPipe's and the per-stage 1F1B's fp8 state stays to float32's last bits the one-device
# run's (`assert_fp8_step_equal`): XLA:CPU may sum one of their weight gradients in another
# order (1 float32 ulp in a loss or an amax then, 9e-5 apart by the fifth step, which one varying
# between runs), from the third step on under jaxlib 0.11 / 0.12; under 0.10.2 on a Xeon without
# AMX an output-gradient amax is 5.3e-5 off within the first two per-stage steps (with AMX the
# two stayed bitwise for all 5); circular too since the loss's backward is one fusion
# (`lm.model.cross_entropy`, 2026-11-29). The 1F1B schedules stay bitwise for all 5.
REORDERED_STEPS = 2


def test_gradient_accumulation_keeps_the_whole_batchs_fp8_gradient_statistics(fp8_one_device):
    """Each microbatch's loss is differentiated over the number of microbatches, so the gradients
    the fp8 sites see (and quantise to e5m2) are the whole batch's, not `grad_accum` times them."""
    run = fp8_states({}, jax.devices()[:1], steps=1, train__grad_accum=2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2), run.fp8[0], fp8_one_device.fp8[0])


@pytest.fixture(scope="module")
def fp8_one_device_skipping_the_ends():
    return fp8_states({}, jax.devices()[:1], steps=2, precision__fp8_skip="0,-1")


@pytest.mark.parametrize("extra", [{"pipeline__repeats": 2}, pytest.param({"pipeline__schedule": "1f1b", "pipeline__repeats": 2}, marks=pytest.mark.slow),
                                   pytest.param({"pipeline__schedule": "1f1b_per_stage", "pipeline__remat": "none"}, marks=pytest.mark.slow),
                                   pytest.param({"pipeline__schedule": "zbv", "pipeline__remat": "none"}, marks=pytest.mark.slow)],
                         ids=["circular", "interleaved-1f1b", "balanced-per-stage", "zbv"])
def test_fp8_skip_means_the_models_layer_indices_in_every_schedule(fp8_one_device_skipping_the_ends, extra):
    """Layers 0 and 3 of 4 stay out of fp8: in a pipeline their chunks' positions choose at run
    time, and the skipped layers' histories stay empty exactly as on one device. (Two chunks
    per stage: chunk indices from stage and repeat, in both programs, or from stage and half in
    the balanced per-stage slots, from stage and way in ZB-V's V, code DualPipeV runs too:
    `sharding.pipeline_zbv`; GPipe and plain 1F1B are the one-repeat case of each.)"""
    ref = fp8_one_device_skipping_the_ends
    run = fp8_states({"data": -1, "stage": 2}, steps=2, precision__fp8_skip="0,-1", **extra)
    history = ref.fp8[0]["blocks"]["attn"]["wq_site"]["amax_history"]
    assert (history[[0, 3]] == 0).all() and (history[1:3, :, 0] > 0).all()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), run.fp8[0], ref.fp8[0])
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)


@pytest.mark.parametrize("stages, microbatches, repeats", [(2, 2, 1), (2, 5, 1), (3, 3, 1), (4, 4, 1), (4, 8, 1), (4, 32, 1), (8, 8, 1),
                                                       (8, 20, 1), (2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3), (4, 32, 2)])
def test_1f1b_table_keeps_a_bounded_stash_and_runs_each_backward_after_its_forward(stages, microbatches, repeats):
    table = schedule_1f1b(stages, microbatches, repeats)
    chunks, ticks = repeats * stages, repeats * (microbatches + stages) + stages - 1
    assert len(table) == ticks
    at = {}  # (microbatch, chunk, "F" / "B") -> tick
    for t, row in enumerate(table):
        for s, step in enumerate(row):
            for kind, work in (("F", step.forward), ("B", step.backward)):
                if work is not None:
                    assert (work.microbatch, work.chunk, kind) not in at and work.chunk % stages == s  # once, on its stage
                    at[(work.microbatch, work.chunk, kind)] = t
    assert len(at) == 2 * chunks * microbatches  # every forward and backward of every microbatch and chunk
    for m in range(microbatches):
        forwards = [at[(m, c, "F")] for c in range(chunks)]
        backwards = [at[(m, c, "B")] for c in range(chunks)]
        assert all(b > f for f, b in zip(forwards, backwards))  # on every chunk, forward first
        assert all(nxt - cur == 1 for cur, nxt in zip(forwards, forwards[1:]))  # down the chunks, one tick per hop
        assert all(cur - nxt == 1 for cur, nxt in zip(backwards, backwards[1:]))  # and back up, in reverse
        assert backwards[-1] == forwards[-1] + 1  # the last chunk seeds the backward the next tick
    # The stash is bounded by the stages and repeats, not the microbatches (GPipe keeps all R x M)
    assert in_flight(table) == [min(repeats * microbatches, (repeats + 1) * stages - 1 - 2 * s) for s in range(stages)]
    store, read, depth = stash_slots(table)  # each backward reads the slot its forward filled, never reused meanwhile
    assert depth == max(in_flight(table))
    for (m, c, kind), t in at.items():
        if kind == "F":
            back, s = at[(m, c, "B")], c % stages
            assert read[back, s] == store[t, s]
            assert all(store[u, s] != store[t, s] or row[s].forward is None for u, row in enumerate(table[t + 1:back], t + 1))
    # Forwards only, then both, then backwards only; run that way, the circular schedule's bubble.
    fill, drain = repeats * stages, repeats * microbatches + stages - 1
    assert phases(table) == [(0, fill, True, False), (fill, drain, True, True), (drain, ticks, False, True)]
    assert bubble_fraction(table) == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))


def compiled_1f1b_step(microbatches: int, **extra):
    """The train step of 2 stages with `microbatches` microbatches of 2 sequences, compiled."""
    c = small_config({"data": 1, "stage": 2}, **DEEP, train__batch_size=2 * microbatches, pipeline__microbatches=microbatches, **extra)
    return compiled_train_step(setup(c, VOCAB, jax.devices()[:2]))


@pytest.mark.slow
def test_1f1b_keeps_memory_flat_in_the_microbatches_where_gpipe_grows():
    def temporaries(schedule: str, microbatches: int, repeats: int = 1) -> int:
        compiled = compiled_1f1b_step(microbatches, pipeline__schedule=schedule, pipeline__repeats=repeats)
        return compiled.memory_analysis().temp_size_in_bytes

    gpipe = [temporaries("gpipe", m) for m in (4, 32)]
    one_f_one_b = [temporaries("1f1b", m) for m in (4, 32)]
    assert gpipe[-1] > 2 * gpipe[0]  # GPipe keeps every microbatch's inputs
    assert max(one_f_one_b) <= 1.1 * min(one_f_one_b)  # 1F1B: 2S - 1 stage inputs per stage, whatever M
    interleaved = [temporaries("1f1b", m, repeats=2) for m in (4, 32)]
    assert max(interleaved) <= 1.1 * min(interleaved)  # (R + 1)S - 1 chunk inputs


@pytest.mark.slow
def test_1f1b_keeping_residuals_skips_the_recompute_and_stays_flat_in_the_microbatches():
    """pipeline.remat=none: the stash holds each microbatch's pullback residuals (what the
    layers keep, here everything), not the parameters; the backward half runs no forward again
    (XLA counts a loop body once: the per-tick FLOPs), and memory still does not grow with M."""
    def measure(microbatches: int, pipeline_remat: str):
        compiled = compiled_1f1b_step(microbatches, pipeline__schedule="1f1b", pipeline__remat=pipeline_remat, model__remat="none")
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        return compiled.memory_analysis().temp_size_in_bytes, analysis["flops"]

    (recompute_bytes, recompute_flops), (kept_bytes, kept_flops) = measure(4, "full"), measure(4, "none")
    assert kept_flops < 0.9 * recompute_flops  # forward + backward per tick, not forward twice + backward
    assert kept_bytes > recompute_bytes  # the price: residuals instead of inputs
    assert measure(16, "none")[0] <= 1.1 * kept_bytes


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", pytest.param("dualpipev", marks=pytest.mark.slow)])
def test_1f1b_runs_its_backward_at_the_float16_loss_scale(schedule):
    """The loss scale seeds the pipeline's own backward: an overflowing scale (step 2's, injected)
    makes float16 cotangents infinite there and the step is skipped, as on one device; scaling
    float32 gradients after the fact would have hidden it. (The zero-bubble pipeline's B and W
    alike; DualPipeV's whole backwards too.)"""
    from lm.program.faults import Faults

    def run(mesh, devices=None, **kw):
        c = small_config(mesh, **DEEP, precision__compute_dtype="float16", precision__loss_scale_initial=1024.0,
                         precision__loss_scale_growth_interval=3, **kw)
        program = setup(c, VOCAB, devices, Faults(overflow_steps=(2,)))
        state, rng, out = program.init_state(0), np.random.default_rng(0), []
        for _ in range(6):
            tokens = rng.integers(0, VOCAB, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)
            state, metrics = program.train_step(state, program.global_batch(tokens))
            out.append(jax.device_get(metrics))
        return [(float(m["loss_scale"]), int(m["skipped_steps"])) for m in out], np.array([m["loss"] for m in out])

    ref_scales, ref_losses = run({}, jax.devices()[:1])
    scales, losses = run({"data": -1, "stage": 2}, pipeline__schedule=schedule)
    assert scales == ref_scales == [(1024, 0), (1024, 1), (512, 1), (512, 1), (512, 1), (1024, 1)]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)


def test_pullbacks_stash_residuals_without_the_parameters():
    """`Pullbacks.split` leaves out the residuals that are the parameters themselves (the
    backward hands them in again); `join` rebuilds a pullback that gives `jax.vjp`'s cotangents,
    also in another trace."""
    def layers(w_lij, x_bi):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x_bi, w_lij)[0]

    w_lij = jax.random.normal(jax.random.key(0), (3, 8, 8)) / 3
    x_bi, dy_bi = jax.random.normal(jax.random.key(1), (4, 8)), jax.random.normal(jax.random.key(2), (4, 8))
    pullbacks = Pullbacks()

    @jax.jit
    def forward(w_lij, x_bi):
        y_bi, pull = jax.vjp(layers, w_lij, x_bi)
        return y_bi, pullbacks.split(pull, (w_lij,))

    _, saved = forward(w_lij, x_bi)
    assert pullbacks.where.count(0) == 1 and not any(a.shape == w_lij.shape for a in saved)  # the weights: not stashed
    got = jax.jit(lambda w, saved, dy: pullbacks.join(saved, (w,))(dy))(w_lij, saved, dy_bi)
    want = jax.vjp(layers, w_lij, x_bi)[1](dy_bi)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)

    # A residual built from no input (a mask) is marked constant: kept once, not per microbatch.
    def masked(w_ij, x_bi):
        y_bi, pull = jax.vjp(lambda w, x: jnp.tanh(x @ w) * (jnp.arange(8) < 5), w_ij, x_bi)
        return y_bi, pullbacks.split(pull, (w_ij,))

    pullbacks.mark_constants(masked, w_lij[0], x_bi)
    constant = [r for r, c in zip(masked(w_lij[0], x_bi)[1], pullbacks.constant) if c]
    assert len(constant) == 1 and np.array_equal(np.ravel(constant[0]), np.arange(8) < 5)


def test_the_report_names_the_schedule_its_bubble_and_what_each_stage_keeps():
    assert report(PipelinePlan(4, 8, 1, "full", "gpipe")) == {"schedule": "gpipe", "bubble": pytest.approx(3 / 11), "stash_depth": 11,
                                                              "stash": "stage inputs"}
    assert report(PipelinePlan(4, 8, 1, "full", "1f1b")) == {"schedule": "1f1b", "bubble": pytest.approx(3 / 11), "stash_depth": 7,
                                                             "stash": "stage inputs"}
    assert report(PipelinePlan(4, 8, 2, "none", "1f1b"))["stash"] == "residuals"
    assert report(PipelinePlan())["schedule"] == "none"


@functools.cache
def compiled_interleaved(schedule: str) -> str:
    """The optimized HLO of the train step of 4 stages x 2 chunks each (8 layers), 4 microbatches."""
    c = small_config({"data": 1, "stage": 4}, model__num_layers=8, train__batch_size=8, pipeline__microbatches=4, pipeline__repeats=2,
                     pipeline__schedule=schedule)
    return compiled_train_step(setup(c, VOCAB, jax.devices()[:4])).as_text()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_interleaved_stages_keep_their_chunks_where_they_are(schedule):
    """On a mesh of stages alone nothing is all-gathered: each stage's chunks, and their
    gradients, stay on it. (Interleaved 1F1B once let XLA split the per-tick gradient update's
    repeats over the stages and gather them back every tick: 230 GiB per step and GPU for
    `llama_8b` on 8 stages.)"""
    compiled = compiled_interleaved(schedule)
    assert "collective-permute" in compiled and not hlo.collectives(compiled)["all-gather"]


def test_1f1b_runs_the_ends_only_at_the_ticks_that_use_them():
    """The embedding's lookup and the head's matmuls run inside conditionals on the table's first
    and last columns: of an interleaved table's 11 forward ticks here, 4 take a microbatch in
    and 4 let one out. (They ran masked at every tick until 2026-11-26: for `llama_8b` on 8
    stages x 2 chunks, 71 heads for 32 microbatches, and twice the vocabulary all-reduces.)"""
    names = re.findall(r'op_name="([^"]*)"', compiled_interleaved("1f1b"))
    ends = [n for n in names if "(btd,dv->btv)" in n or "jit(_take)/gather" in n]
    assert ends and all("/cond/" in n for n in ends), [n for n in ends if "/cond/" not in n]
