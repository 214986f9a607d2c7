"""Zero-bubble pipelines (`pipeline.schedule=zero_bubble`, ZB-H1, and `zbv`, ZB-V): each backward
split in B and W, W deferred into the bubbles; the same losses, gradients and parameters as one device, and memory
flat in the microbatches."""

import re

import jax
import numpy as np
import pytest
from conftest import VOCAB, compiled_train_step, run_steps, small_config
from test_moe import MOE
from test_pipeline import (
    DEEP,
    assert_fp8_like_one_device,
    compiled_1f1b_step,
    constant_collectives,
    fp8_one_device,  # noqa: F401  (module fixtures: the one-device reference runs)
    fp8_states,
    full_vocabulary_buffers,
    one_device_deep,  # noqa: F401
    pipelined_run,
)

from lm.model.config import ModelConfig
from sharding.pipeline_1f1b import Pullbacks
from lm.model.flops import flops_per_token, split_backward_flops
from lm.program.steps import setup
from sharding import ShardingError
from sharding.pipeline_zbv import cell_kind, zbv_arrays
from sharding.pipeline_zero_bubble import KIND, RINGS, op_arrays
from sharding.schedule_report import report
from sharding.schedules import PipelinePlan
from sharding.zero_bubble import V_TABLES, held_until_w, ops_of, schedule_zero_bubble, v_chunks

ZB = dict(pipeline__schedule="zero_bubble")
ZBV, EIGHT = dict(pipeline__schedule="zbv"), dict(model__num_layers=8)  # ZB-V on 4 stages: 8 chunks of a layer
DPV = dict(pipeline__schedule="dualpipev")


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 8), (4, 32), (8, 20)])
@pytest.mark.parametrize("keep_residuals", [False, True], ids=["recompute", "residuals"])
@pytest.mark.parametrize("balanced", [False, True], ids=["whole", "balanced"])
def test_each_op_reads_the_ring_slot_its_producer_filled(stages, microbatches, keep_residuals, balanced):
    table = schedule_zero_bubble(stages, microbatches, balanced)
    arrays, depths = op_arrays(table, keep_residuals)
    at = {(op.kind, op.microbatch, s): t for t, row in enumerate(table) for s, op in enumerate(row) if op is not None}
    for (kind, m, s), t in at.items():
        assert arrays["kind"][t, s] == KIND[kind] and arrays["microbatch"][t, s] == m
    first_b, last_b = ("B1", "B2") if balanced else ("B", "B")
    # (ring, who puts it and where: (op, stage offset, slot offset), who reads it last)
    flows = [("taps", (first_b, 0, 0), "W"), ("cotangents", (last_b, +1, 1), first_b)]
    flows += [("residuals", ("F", 0, 0), last_b)] if keep_residuals else []
    flows += [("halfway", ("F", 0, 0), "B1")] if balanced and not keep_residuals else []
    flows += [("inbox", ("F", -1, 1), "F" if keep_residuals else last_b)]
    for ring, (maker, ds, dt), reader in flows:
        for m in range(microbatches):
            for s in range(stages):
                if ring == "inbox" and s == 0:  # stage 0 embeds again
                    assert arrays["inbox_get"][at[(reader, m, s)], s] == -1
                    continue
                made_by = (maker, m, s + ds) if not (ring == "cotangents" and s == stages - 1) else ("F", m, s)
                put_at = at[made_by] + dt
                slot = arrays[f"{ring}_put"][put_at, s]
                read_at = at[(reader, m, s)]
                assert slot >= 0 and arrays[f"{ring}_get"][read_at, s] == slot, (ring, m, s)
                assert slot not in arrays[f"{ring}_put"][put_at + 1:read_at + 1, s], (ring, m, s)  # untouched meanwhile
                if ring == "taps" and balanced:  # B2 fills the earlier half's taps of the slot B1 took
                    assert arrays["taps_put_earlier"][at[("B2", m, s)], s] == slot
    if balanced:  # B2 takes B1's cotangent from the slot before, on the device
        assert all(at[("B2", m, s)] == at[("B1", m, s)] + 1 for m in range(microbatches) for s in range(stages))
    # Kept from F to W: at most S microbatches per stage (1F1B's stage 0), B's taps among them.
    assert max(held_until_w(table)) <= stages
    assert depths["taps"] <= stages and depths["cotangents"] <= 2
    assert depths["inbox"] <= stages
    assert set(depths) == set(RINGS)



V_SIZES = {"zbv": [(2, 2), (2, 5), (3, 7), (4, 4), (4, 8), (4, 32), (8, 20)], "dualpipev": [(2, 4), (2, 5), (3, 7), (4, 8), (4, 9), (4, 32), (8, 20)]}


@pytest.mark.parametrize("schedule, stages, microbatches", [(k, *size) for k, sizes in V_SIZES.items() for size in sizes])
@pytest.mark.parametrize("keep_residuals", [False, True], ids=["recompute", "residuals"])
def test_v_ops_read_the_ring_slot_their_producer_filled_whichever_way_it_came(schedule, stages, microbatches, keep_residuals):
    table = V_TABLES[schedule](stages, microbatches)
    arrays, depths = zbv_arrays(table, keep_residuals)
    chunks, last = v_chunks(stages), 2 * stages - 1
    home = {c: (s, way) for s, pair in enumerate(chunks) for c, way in zip(pair, ("down", "up"))}  # chunk -> (stage, way)
    at, whole = {}, set()  # op -> slot, a BW as its B and its W; the (microbatch, chunk)s run whole
    for t, row in enumerate(table):
        for s, cell in enumerate(row):
            assert arrays["kind"][t, s] == cell_kind(cell, chunks[s][0])
            for op in ops_of(cell):
                kinds = ("B", "W") if op.kind == "BW" else (op.kind,)
                at.update({(k, op.microbatch, op.chunk): t for k in kinds})
                whole |= {(op.microbatch, op.chunk)} if op.kind == "BW" else set()
                if op.kind == "F" or len(ops_of(cell)) == 1:
                    assert arrays["microbatch"][t, s] == op.microbatch
                if op.chunk == chunks[s][0]:
                    assert arrays["embed_microbatch"][t, s] == op.microbatch
    assert schedule == "dualpipev" or not whole
    for (kind, m, c), t in at.items():
        s, way = home[c]
        # (ring, the column it was put by, the slot it was put in, the op reading it last, the column it reads by)
        flows = [] if (m, c) in whole else [("taps", "taps_put", at[("B", m, c)], "W", "taps_get")]
        flows += [("cotangents", f"cotangents_put_{way}", 1 + (at[("F", m, last)] if c == last else at[("B", m, c + 1)]), "B", "cotangents_get")]
        flows += [("residuals", "residuals_put", at[("F", m, c)], "B", "residuals_get")] if keep_residuals else []
        flows += [("inbox", f"inbox_put_{way}", 1 + at[("F", m, c - 1)], "F" if keep_residuals else "B",
                   "inbox_get" if keep_residuals else "inbox_back_get")] if c > 0 else []
        if kind != "F":
            continue
        for ring, column, put_at, reader, read_column in flows:
            slot, read_at = arrays[column][put_at, s], at[(reader, m, c)]
            assert slot >= 0 and arrays[read_column][read_at, s] == slot, (ring, m, c)
            puts = [arrays[k][put_at + (k == column):read_at + 1, s] for k in arrays if k.startswith(f"{ring}_put")]
            assert all(slot not in p for p in puts), (ring, m, c)  # untouched meanwhile
    # ZB-V keeps at most 2S half-stage chunks from F to W (1F1B's S stages' worth), B's taps among
    # them; DualPipeV one chunk more, on its last stage.
    most = 2 * stages + (schedule == "dualpipev")
    assert max(held_until_w(table)) <= most and depths["taps"] <= most
    assert depths["cotangents"] <= 2 and depths["residuals"] == (most if keep_residuals else 0)
    # Recomputing, an input waits from its arrival to its B: at most one more than that count.
    assert depths["inbox"] == (2 if keep_residuals else most + (microbatches > stages)), depths


CASES = [
    pytest.param({"stage": 4, "data": 2}, {"pipeline__microbatches": 4}, marks=pytest.mark.slow),
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {"pipeline__microbatches": 4, "sharding__sequence_parallel": True, "model__remat": "dots"}),
    ({"stage": 2, "data": 4}, {"pipeline__microbatches": 4, "pipeline__remat": "none"}),
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {"pipeline__remat": "dots", "model__remat": "full", "train__grad_accum": 2}),
]


@pytest.mark.parametrize("mesh, extra", CASES, ids=["stage4-data2", "stage2-fsdp2-tensor2-sp-dots", "stage2-data4-residuals",
                                                   "stage2-fsdp2-tensor2-accum2-residuals-dots"])
def test_zero_bubble_trains_like_one_device(one_device_deep, mesh, extra):  # noqa: F811
    ref_losses, ref_params, (ref_loss, ref_grads) = one_device_deep
    losses, params, (loss, grads), hlo = pipelined_run(small_config({"data": -1, **mesh}, **DEEP, **ZB, **extra))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)
    # Parameters to 2e-5: Adam's normalised step amplifies the float32 order of the sums where a
    # gradient is near 0 (seen: one element of 8192 off by 1.2e-5 after 5 steps; 1F1B: 7e-6).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5), params, ref_params)
    branches = {len(b.split(",")) for b in re.findall(r"branch_computations=\{([^}]*)\}", hlo)}
    balanced = 4 // mesh["stage"] % 2 == 0  # 2 layers per stage: B in halves
    assert (6 if balanced else 4) in branches  # each stage its own op: nothing, F, B or W (B1, B2)
    assert "collective-permute" in hlo and not constant_collectives(hlo) and not full_vocabulary_buffers(hlo)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, model, accumulated", [(ZB, {}, 2), (ZBV, DEEP, 2), (DPV, DEEP, 4)], ids=["zero_bubble", "zbv", "dualpipev"])
def test_split_backward_with_experts_matches_one_device_accumulating_alike(schedule, model, accumulated):
    """(As many microbatches as the pipeline runs by default: the balancing losses are per microbatch.)"""
    aux = dict(MOE, **model, model__router_aux_loss_coef=0.1, model__router_z_loss_coef=0.01)
    ref_losses, ref_params = run_steps(small_config({}, train__grad_accum=accumulated, **aux), jax.devices()[:1])
    losses, params = run_steps(small_config({"expert": 2, "stage": 2, "data": 2}, **schedule, **aux))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [ZB, ZBV, DPV], ids=["zero_bubble", "zbv", "dualpipev"])
def test_fp8_in_split_backward_pipelines_takes_each_amax_over_the_slots_that_did_work(fp8_one_device, schedule):  # noqa: F811
    ref = fp8_one_device
    assert_fp8_like_one_device(fp8_states({"data": -1, "stage": 2}, forced_from=ref.starts, **schedule), ref)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [ZB, ZBV, DPV], ids=["zero_bubble", "zbv", "dualpipev"])
def test_split_backward_pipelines_keep_memory_flat_in_the_microbatches(schedule):
    def temporaries(microbatches: int, **extra) -> int:
        return compiled_1f1b_step(microbatches, **schedule, **extra).memory_analysis().temp_size_in_bytes

    for extra in ({}, {"pipeline__remat": "none", "model__remat": "none"}):
        found = [temporaries(m, **extra) for m in (4, 8, 16)]
        assert max(found) <= 1.1 * min(found), (extra, found)




@pytest.fixture(scope="module")
def one_device_eight():
    return pipelined_run(small_config({}, **EIGHT), jax.devices()[:1])[:3]


@pytest.mark.parametrize("mesh, extra", [
    pytest.param({"stage": 4, "data": 2}, {**EIGHT, "pipeline__microbatches": 8}, id="stage4-data2", marks=pytest.mark.slow),
    pytest.param({"stage": 2, "fsdp": 2, "tensor": 2}, {"pipeline__microbatches": 4, "sharding__sequence_parallel": True, "model__remat": "dots",
                                                        "pipeline__remat": "dots"}, id="stage2-fsdp2-tensor2-sp-residuals", marks=pytest.mark.slow),
    pytest.param({"stage": 2, "data": 4}, {"pipeline__microbatches": 4, "pipeline__remat": "none"}, id="stage2-data4-residuals"),
    pytest.param({"stage": 4, "data": 2}, {**EIGHT, **DPV, "pipeline__microbatches": 8}, id="dualpipev-stage4-data2", marks=pytest.mark.slow),
    pytest.param({"stage": 2, "fsdp": 2, "tensor": 2}, {**DPV, "pipeline__microbatches": 4, "sharding__sequence_parallel": True,
                                                        "model__remat": "dots", "pipeline__remat": "dots"},
                 id="dualpipev-stage2-fsdp2-tensor2-sp-residuals", marks=pytest.mark.slow),
    pytest.param({"stage": 2, "data": 4}, {**DPV, "pipeline__microbatches": 4}, id="dualpipev-stage2-data4"),
])
def test_v_schedules_train_like_one_device(request, mesh, extra):
    """ZB-V and DualPipeV: two chunks a stage in a V (the layers put in V order and the gradients
    back), the loss on stage 0, DualPipeV's pairs of one chunk's F beside the other's whole
    backward: the same losses, gradients and parameters as one device."""
    ref_losses, ref_params, (ref_loss, ref_grads) = request.getfixturevalue("one_device_eight" if EIGHT.items() <= extra.items() else "one_device_deep")
    losses, params, (loss, grads), hlo = pipelined_run(small_config({"data": -1, **mesh}, **{**DEEP, **ZBV, **extra}))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5), params, ref_params)
    branches = {len(b.split(",")) for b in re.findall(r"branch_computations=\{([^}]*)\}", hlo)}
    # each stage its own op: nothing, or F, B, W (DualPipeV: BW, F beside BW) of the chunk going down or coming back
    assert (11 if extra.get("pipeline__schedule") == "dualpipev" else 7) in branches
    assert "collective-permute" in hlo and not constant_collectives(hlo) and not full_vocabulary_buffers(hlo)


@pytest.mark.parametrize("schedule, scanned", [("zero_bubble", True), ("zbv", True), pytest.param("zbv", False, marks=pytest.mark.slow),
                                               pytest.param("1f1b", False, marks=pytest.mark.slow)])
def test_keeping_residuals_a_pieces_weights_are_known_to_pullbacks_not_stashed_per_microbatch(monkeypatch, schedule, scanned):
    """The weights of a piece of a stage (ZB-V's chunk, balanced ZB-H1's half) are found among B's
    residuals by identity, so no copy of them is stashed per microbatch (seen: sliced twice, none
    was found, and `llama_8b`'s ZB-V kept 16 GiB of f32 weights in its residual ring). With the
    model's layers unrolled (`model.scan_layers=False`) the stage still scans its chunk
    (`Transformer._stage_runner`). Negative control: the chunk unrolled too, none is found (each
    layer's weights reach the pullback as slices of the stack)."""
    from lm.model.transformer import Transformer

    found = []
    split = Pullbacks.split

    def noting(self, pull, params):
        stashed = split(self, pull, params)
        found.append(sum(w is not None for w in self.where))
        return stashed

    monkeypatch.setattr(Pullbacks, "split", noting)
    if schedule == "zero_bubble":  # ZB-H1 runs B in halves only when recomputing: forced here
        monkeypatch.setattr("sharding.pipeline_zero_bubble.balanced_zero_bubble", lambda plan, layers: True)
    # Scanned layers, whose backward keeps the stacked weights themselves (the remat `full` layer's inputs).
    c = small_config({"data": -1, "stage": 2}, **DEEP, pipeline__schedule=schedule, pipeline__microbatches=4, pipeline__remat="none",
                     model__remat="full", model__scan_layers=scanned, precision__compute_dtype="bfloat16")
    compiled_train_step(setup(c, VOCAB))
    assert found and min(found) == 9, found  # the layer's 9 weights (attention's 4, the MLP's 3, 2 norms), in every piece
    if not scanned:
        found.clear()
        monkeypatch.setattr(Transformer, "_stage_runner", Transformer._runner)
        compiled_train_step(setup(c, VOCAB))
        assert found and max(found) == 0, found


def test_zbv_refuses_layers_that_do_not_make_two_chunks_a_stage():
    with pytest.raises(ShardingError, match=r"zbv runs two chunks a stage: 4 layers do not split into 2 x mesh.stage=4"):
        setup(small_config({"data": -1, "stage": 4}, **DEEP, **ZBV), VOCAB)


@pytest.mark.parametrize("mesh, extra, message", [
    ({"stage": 2}, {"pipeline__repeats": 2}, "zero_bubble does not interleave; use pipeline.repeats=1"),
    ({"stage": 2, "context": 2}, {}, r"zero_bubble does not run with context parallelism \(mesh.context=2\)"),
    ({"stage": 2}, {**ZBV, "pipeline__repeats": 2}, "zbv does not interleave; use pipeline.repeats=1"),
    ({"stage": 2}, {**DPV, "pipeline__microbatches": 3}, r"dualpipev needs at least 2 x mesh.stage = 4 microbatches; got pipeline.microbatches=3"),
])
def test_zero_bubble_refuses_what_it_cannot_run(mesh, extra, message):
    with pytest.raises(ShardingError, match=message):
        setup(small_config({"data": -1, **mesh}, **DEEP, **{**ZB, **extra}), VOCAB)


@pytest.mark.parametrize("pipeline_remat", ["full", "none"])
def test_the_report_costs_f_b_and_w_and_1f1b_stays_on_its_scale(pipeline_remat):
    """Costed alike (F = B = W; recomputing, B with its forward again): at S = 4, M = 8 ZB-H1's
    bubble is at most half of 1F1B's (S - 1)/(M + S - 1), keeping no more microbatches from F to
    W than per-stage 1F1B keeps; the slots the one program runs cost more where B is the longest.
    ZB-V keeping residuals: at most a quarter."""
    plan = lambda schedule: PipelinePlan(4, 8, 1, pipeline_remat, schedule)  # noqa: E731
    one_f_one_b, zero_bubble = report(plan("1f1b_per_stage")), report(plan("zero_bubble"), costs={"F": 1, "B": 1, "W": 1})
    assert one_f_one_b["bubble"] == pytest.approx(3 / 11)
    assert zero_bubble["bubble"] <= one_f_one_b["bubble"] / 2 if pipeline_remat == "none" else zero_bubble["bubble"] < one_f_one_b["bubble"]
    assert zero_bubble["stash_depth"] <= one_f_one_b["stash_depth"] and zero_bubble["w_stash_depth"] <= 4
    if pipeline_remat == "none":
        assert zero_bubble["bubble"] == pytest.approx(3 / 27) == zero_bubble["slot_bubble"]  # (S-1)/(3M+S-1)
    else:
        assert zero_bubble["slot_bubble"] > zero_bubble["bubble"]
    # ZB-V: its depths count half-stage chunks; keeping residuals, a quarter of 1F1B's bubble at
    # 1F1B's memory; recomputing (B a forward more, the table built for equal costs) worse than 1F1B.
    zbv = report(plan("zbv"), costs={"F": 1, "B": 1, "W": 1})
    assert zbv["stash_depth"] * zbv["chunk_share"] <= one_f_one_b["stash_depth"] and zbv["w_stash_depth"] * zbv["chunk_share"] <= 3
    if pipeline_remat == "none":
        assert zbv["bubble"] <= one_f_one_b["bubble"] / 4 and zbv["bubble"] == pytest.approx(zbv["slot_bubble"])
    else:
        assert zbv["bubble"] > one_f_one_b["bubble"]


def test_split_backward_flops_add_up_to_the_layers_training_flops():
    model = ModelConfig.from_config(small_config({}), VOCAB)
    f = split_backward_flops(model, 64)
    assert f["F"] + f["B"] + f["W"] == pytest.approx(flops_per_token(model, 64) - 6 * model.embed_dim * model.vocab_size)
    assert f["B"] > f["W"] and f["F"] > f["W"]  # attention: its backward is all in B


def test_balanced_halves_with_even_layers_per_stage():
    """With an even number of layers per stage, B runs in two halves (each about one forward's
    work when recomputing): the slots the one program runs cost less, the table's own bubble the same."""
    costs = {"F": 1, "B": 1, "W": 1}
    whole, balanced = (report(PipelinePlan(4, 8, 1, "full", "zero_bubble"), layers, costs) for layers in (4, 8))
    assert (whole["schedule"], balanced["schedule"]) == ("zero_bubble", "balanced zero_bubble")
    assert balanced["bubble"] == pytest.approx(whole["bubble"]) and balanced["slot_bubble"] < whole["slot_bubble"]
    kept = report(PipelinePlan(4, 8, 1, "none", "zero_bubble"), 8, costs)  # keeping residuals: halves too
    assert kept["schedule"] == "balanced zero_bubble" and kept["stash"].startswith("residuals")
