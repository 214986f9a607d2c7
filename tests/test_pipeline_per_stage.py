"""The per-stage 1F1B pipeline (`pipeline.schedule=1f1b_per_stage`): Megatron-LM's table, at most
S microbatches kept per stage, each stage running its own half of a slot; equal to one device."""

import dataclasses
import re

import pytest
from conftest import VOCAB, small_config
from test_pipeline import (
    DEEP,
    assert_fp8_like_one_device,
    compiled_1f1b_step,
    constant_collectives,
    fp8_one_device,  # noqa: F401  (module fixtures: the one-device reference runs)
    fp8_states,
    full_vocabulary_buffers,
    one_device_deep,  # noqa: F401
    trains_like_one_device,
)

from lm.program.steps import setup
from sharding import ShardingError
from sharding.pipeline_per_stage import BACKWARD, FORWARD, slot_arrays
from sharding.schedule_report import report
from sharding.schedules import (
    PipelinePlan,
    bubble_fraction,
    held_per_stage,
    in_flight,
    schedule_1f1b_per_stage,
)

PER_STAGE = dict(pipeline__schedule="1f1b_per_stage")


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 32), (8, 8), (8, 20)])
def test_per_stage_table_is_megatrons_1f1b_with_at_most_s_in_flight(stages, microbatches):
    table = schedule_1f1b_per_stage(stages, microbatches)
    assert len(table) == 2 * (microbatches + stages - 1)
    at = {}  # (microbatch, stage, "F" / "B") -> slot
    for t, row in enumerate(table):
        for s, step in enumerate(row):
            assert step.forward is None or step.backward is None  # one half per stage and slot
            for kind, work in (("F", step.forward), ("B", step.backward)):
                if work is not None:
                    assert (work.microbatch, s, kind) not in at and work.chunk == s
                    at[(work.microbatch, s, kind)] = t
    assert len(at) == 2 * stages * microbatches
    for m in range(microbatches):
        forwards = [at[(m, s, "F")] for s in range(stages)]
        backwards = [at[(m, s, "B")] for s in range(stages)]
        assert all(b > f for f, b in zip(forwards, backwards))  # on every stage, forward first
        assert all(nxt > cur for cur, nxt in zip(forwards, forwards[1:]))  # down the stages
        assert all(cur - nxt == 1 for cur, nxt in zip(backwards, backwards[1:]))  # back up in reverse, each cotangent used at once
        assert backwards[-1] == forwards[-1] + 1  # the last stage seeds the backward the next slot
    for s in range(stages):  # each stage runs its backwards in its forwards' order
        assert sorted(range(microbatches), key=lambda m: at[(m, s, "F")]) == sorted(range(microbatches), key=lambda m: at[(m, s, "B")])
    # Megatron's bound, S - s in flight at stage s; counted from their arrival, at most S kept.
    assert in_flight(table) == [min(microbatches, stages - s) for s in range(stages)]
    assert max(held_per_stage(table)) <= stages and held_per_stage(table)[0] == 0
    arrays, depth, no_residuals = slot_arrays(table)
    assert depth == max(held_per_stage(table)) and no_residuals == 0
    for (m, s, kind), t in at.items():  # a backward reads the slot its input was kept in, untouched meanwhile
        if kind == "B" and s > 0:
            arrived = at[(m, s - 1, "F")] + 1
            slot = arrays["store"][arrived, s]
            assert arrays["read"][t, s] == slot and arrays["half"][t, s] == BACKWARD
            assert slot not in arrays["store"][arrived + 1:t, s]
            forward = at[(m, s, "F")]
            assert arrays["half"][forward, s] == FORWARD and arrays["read"][forward, s] == (-1 if forward == arrived else slot)
    # Keeping residuals: each forward's residuals in a slot its backward reads, at most S - s of
    # them (Megatron's bound, stage 0 included); an input waits in the inbox only until its forward.
    arrays, inbox, stash = slot_arrays(table, keep_residuals=True)
    assert stash == min(microbatches, stages) and inbox <= depth
    for (m, s, kind), t in at.items():
        if kind == "B":
            forward = at[(m, s, "F")]
            slot = arrays["keep"][forward, s]
            assert arrays["use"][t, s] == slot and slot not in arrays["keep"][forward + 1:t, s]
    assert bubble_fraction(table) == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert report(PipelinePlan(stages, microbatches, 1, "full", "1f1b_per_stage")) == {
        "schedule": "1f1b_per_stage", "bubble": pytest.approx((stages - 1) / (microbatches + stages - 1)), "stash_depth": depth,
        "stash": "stage inputs"}


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 8), (8, 20)])
def test_balanced_slots_split_each_backward_into_two_forwards_worth(stages, microbatches):
    """Keeping residuals, a backward is two forwards' work: run as two parts (the chunk's later
    layers, then its earlier ones) in consecutive slots, every slot holds about one forward's
    work, and a microbatch's F + B takes three slots per stage, lockstep 1F1B's time, with
    Megatron's bound S - s in flight."""
    table = schedule_1f1b_per_stage(stages, microbatches, balanced=True)
    assert len(table) == 3 * (microbatches + stages - 1)
    at = {}  # (microbatch, stage, 0 forward / 1 later layers / 2 earlier layers) -> slot
    for t, row in enumerate(table):
        for s, step in enumerate(row):
            assert step.forward is None or step.backward is None
            if step.forward is not None:
                at[(step.forward.microbatch, s, 0)] = t
            if step.backward is not None:
                assert step.part in (1, 2) and (step.backward.microbatch, s, step.part) not in at
                at[(step.backward.microbatch, s, step.part)] = t
    assert len(at) == 3 * stages * microbatches
    for m in range(microbatches):
        for s in range(stages):
            assert at[(m, s, 2)] == at[(m, s, 1)] + 1 > at[(m, s, 0)] + 1  # the parts back to back, after the forward
            if s > 0:
                assert at[(m, s, 0)] > at[(m, s - 1, 0)]
                assert at[(m, s - 1, 1)] == at[(m, s, 2)] + 1  # each cotangent used the slot after it is made
        assert at[(m, stages - 1, 1)] == at[(m, stages - 1, 0)] + 1
    assert in_flight(table) == [min(microbatches, stages - s) for s in range(stages)]
    assert bubble_fraction(table) == pytest.approx((stages - 1) / (microbatches + stages - 1))
    arrays, inbox, stash = slot_arrays(table, keep_residuals=True)
    assert stash == min(microbatches, stages) and inbox <= 1  # an input waits at most during the warm-up
    for (m, s, part), t in at.items():  # both parts read the residuals their forward kept, untouched meanwhile
        if part:
            kept = arrays["keep"][at[(m, s, 0)], s]
            assert arrays["half"][t, s] == BACKWARD + part and arrays["use"][t, s] == kept
            assert kept not in arrays["keep"][at[(m, s, 0)] + 1:t, s]
    with pytest.raises(AssertionError, match="stashed residuals"):
        slot_arrays(table)  # recomputing has no parts
    plan = PipelinePlan(stages, microbatches, 1, "none", "1f1b_per_stage")
    assert report(plan, layers=2 * stages)["schedule"] == "balanced 1f1b_per_stage"
    assert report(plan, layers=stages)["schedule"] == "1f1b_per_stage"  # one layer per stage: no halves
    assert report(dataclasses.replace(plan, remat="full"), layers=2 * stages)["schedule"] == "1f1b_per_stage"


@pytest.mark.parametrize(
    "mesh, extra",
    [
        ({"stage": 2}, {}),
        ({"stage": 4}, {"pipeline__microbatches": 8}),
        ({"stage": 2, "data": 2, "tensor": 2}, {"train__grad_accum": 2, "sharding__sequence_parallel": True, "model__remat": "dots"}),
        ({"stage": 2, "fsdp": 4}, {"pipeline__microbatches": 4}),
        # The stash keeps the forward's residuals (what pipeline.remat keeps) instead of recomputing:
        # in balanced slots where each stage's layers halve (2 here), else whole (1 per stage).
        ({"stage": 4}, {"pipeline__microbatches": 8, "pipeline__remat": "none"}),
        ({"stage": 2}, {"pipeline__microbatches": 4, "pipeline__remat": "none", "model__remat": "none"}),
        ({"stage": 2, "data": 2, "tensor": 2}, {"train__grad_accum": 2, "sharding__sequence_parallel": True, "model__remat": "full",
                                                "pipeline__remat": "dots"}),
    ],
    ids=["stage2", "stage4", "stage2-data2-tensor2-sp-accum2-dots", "stage2-fsdp4", "stage4-residuals", "stage2-balanced",
         "stage2-data2-tensor2-sp-accum2-balanced-dots"],
)
def test_per_stage_training_matches_one_device(one_device_deep, mesh, extra):  # noqa: F811  (the fixture imported above)
    hlo = trains_like_one_device(one_device_deep, small_config({"data": -1, **mesh}, **DEEP, **PER_STAGE, **extra), loss_rel=1e-5)
    assert " conditional(" in hlo and "collective-permute" in hlo  # each stage its own half; stages hand on
    halves = {len(b.split(",")) for b in re.findall(r"branch_computations=\{([^}]*)\}", hlo)}
    assert max(halves) == (5 if mesh.get("stage") == 2 and extra.get("pipeline__remat") else 3)  # idle, forward, backward (in parts)
    assert not constant_collectives(hlo)
    assert not full_vocabulary_buffers(hlo)  # the head and loss run outside the shard_map, split over the stages


@pytest.mark.slow
def test_per_stage_keeps_memory_flat_in_the_microbatches_and_fewer_residuals_than_lockstep_1f1b():
    def temporaries(microbatches: int, **extra) -> int:
        return compiled_1f1b_step(microbatches, **extra).memory_analysis().temp_size_in_bytes

    per_stage = [temporaries(m, **PER_STAGE) for m in (4, 32)]
    assert max(per_stage) <= 1.1 * min(per_stage)
    # Keeping every layer's activations (model remat none): 2 sets of residuals per stage here
    # (S = 2, balanced slots) against lockstep 1F1B's 3 (2S - 1); measured 6.57 against 7.32 MiB.
    residuals = dict(pipeline__remat="none", model__remat="none")
    kept = [temporaries(m, **PER_STAGE, **residuals) for m in (4, 16)]
    lockstep = temporaries(16, pipeline__schedule="1f1b", **residuals)
    assert max(kept) <= 1.1 * min(kept) and kept[1] < lockstep


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"pipeline__remat": "none"}], ids=["recompute", "balanced"])
def test_fp8_in_the_per_stage_pipeline_takes_each_amax_over_the_slots_that_did_work(fp8_one_device, extra):  # noqa: F811
    ref = fp8_one_device
    assert_fp8_like_one_device(fp8_states({"data": -1, "stage": 2}, forced_from=ref.starts, **PER_STAGE, **extra), ref)


@pytest.mark.parametrize("mesh, extra, message", [
    ({"stage": 2}, {"pipeline__repeats": 2}, "does not interleave; use pipeline.repeats=1"),
    ({"stage": 2, "context": 2}, {}, r"does not run with context parallelism \(mesh.context=2\)"),
])
def test_per_stage_refuses_what_it_cannot_run(mesh, extra, message):
    with pytest.raises(ShardingError, match=message):
        setup(small_config({"data": -1, **mesh}, **DEEP, **PER_STAGE, **extra), VOCAB)
