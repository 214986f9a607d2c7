"""Zero-bubble schedules as tables (`sharding.zero_bubble`): ZB-H1, ZB-V and DualPipeV keep every
dependency, keep no more than 1F1B's peak (DualPipeV: a chunk more) from an F to its W, and cut
the bubble as the papers say when F, B and W are costed alike; 1F1B's costed bubble stays
(S - 1) / (M + S - 1); a hand-broken table is refused."""

import pytest

from sharding import schedules, zero_bubble
from sharding.zero_bubble import Op

SIZES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 13), (4, 32), (6, 9), (8, 8), (8, 16)]
ALIKE = {"F": 1, "B": 1, "W": 1, "BW": 2}


def one_stage_each(stages):
    return [[s] for s in range(stages)]


def one_f1b(stages, microbatches):
    return zero_bubble.per_stage_ops(schedules.schedule_1f1b_per_stage(stages, microbatches))


def refusal(table, microbatches, chunks_of, edit) -> str:
    """What `check_table` says of a copy of `table` after `edit(copy)` (it must refuse it)."""
    copy = [list(row) for row in table]
    edit(copy)
    with pytest.raises(ValueError) as refused:
        zero_bubble.check_table(copy, microbatches, chunks_of)
    return str(refused.value)


def is_pair(cell) -> bool:
    return len(zero_bubble.ops_of(cell)) == 2


@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_zero_bubble_tables_keep_their_dependencies_memory_and_bubble(stages, microbatches):
    zb = zero_bubble.schedule_zero_bubble(stages, microbatches)
    zero_bubble.check_table(zb, microbatches, one_stage_each(stages))
    assert zero_bubble.costed_bubble(zb, ALIKE) == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))
    assert max(zero_bubble.held_until_w(zb)) == min(stages, microbatches)  # 1F1B's stage 0 keeps S

    zbv = zero_bubble.schedule_zbv(stages, microbatches)
    zero_bubble.check_table(zbv, microbatches, zero_bubble.v_chunks(stages))
    assert max(zero_bubble.held_until_w(zbv)) <= 2 * stages  # chunks of half a stage: S stages' worth
    assert zero_bubble.costed_bubble(zbv, ALIKE) < zero_bubble.costed_bubble(zb, ALIKE)

    # 1F1B's figure under the same costing, whatever the backward costs against the forward.
    for backward in (2, 3, 4.5):
        assert zero_bubble.costed_bubble(one_f1b(stages, microbatches), {"F": 1, "BW": backward}) == pytest.approx(
            (stages - 1) / (microbatches + stages - 1))


def test_at_4_stages_and_8_microbatches_zb_h1_halves_1f1bs_bubble_and_zb_v_quarters_it():
    f1b = zero_bubble.costed_bubble(one_f1b(4, 8), ALIKE)
    assert f1b == pytest.approx(3 / 11)
    assert zero_bubble.costed_bubble(zero_bubble.schedule_zero_bubble(4, 8), ALIKE) <= f1b / 2
    assert zero_bubble.costed_bubble(zero_bubble.schedule_zbv(4, 8), ALIKE) <= f1b / 4


def test_a_hand_broken_table_is_refused_naming_the_cell():
    table = [list(row) for row in zero_bubble.schedule_zero_bubble(2, 2)]
    zero_bubble.check_table(table, 2, one_stage_each(2))  # the control: intact, it passes
    stages = one_stage_each(2)

    def cell(op):
        return next((t, s) for t, row in enumerate(table) for s, x in enumerate(row) if x == op)

    def broken(edit):
        return refusal(table, 2, stages, edit)

    def swap(copy, a, b):
        (ta, sa), (tb, sb) = cell(a), cell(b)
        copy[ta][sa], copy[tb][sb] = copy[tb][sb], copy[ta][sa]

    # Stage 1's W of microbatch 0 swapped with its B: the W runs first.
    assert "runs before Op(kind='B', microbatch=0, chunk=1)" in broken(lambda c: swap(c, Op("B", 0, 1), Op("W", 0, 1)))
    # Stage 0's B of microbatch 0 moved to the slot of its own F: before its cotangent arrives.
    t_f, _ = cell(Op("F", 1, 0))
    t_b, _ = cell(Op("B", 0, 0))
    assert f"slot {t_f}, stage 0: Op(kind='B', microbatch=0, chunk=0) runs before Op(kind='B', microbatch=0, chunk=1)" in broken(
        lambda c: c[t_f].__setitem__(0, Op("B", 0, 0)) or c[t_b].__setitem__(0, Op("F", 1, 0)))
    assert "of a chunk the stage does not hold" in broken(lambda c: c[0].__setitem__(1, Op("F", 0, 0)))
    assert "never runs Op(kind='W', microbatch=1, chunk=0)" in broken(lambda c: c[cell(Op("W", 1, 0))[0]].__setitem__(0, None))
    assert "Op(kind='W', microbatch=0, chunk=0) runs Op(kind='W', microbatch=0, chunk=0) again (it ran at slot" in broken(
        lambda c: c.append([Op("W", 0, 0), None]))


@pytest.mark.parametrize("stages, microbatches", [(s, m) for s, m in SIZES if m >= 2 * s] + [(2, 4), (3, 6), (4, 9), (8, 24)])
def test_dualpipev_tables_keep_their_dependencies_and_pair_forwards_with_whole_backwards(stages, microbatches):
    table = zero_bubble.schedule_dualpipev(stages, microbatches)
    zero_bubble.check_table(table, microbatches, zero_bubble.v_chunks(stages))
    pairs = [cell for row in table for cell in row if is_pair(cell)]
    # The main phase: each of a stage's pairs one chunk's F beside the other chunk's whole backward.
    assert pairs and all(sorted(op.kind for op in pair) == ["BW", "F"] and pair[0].chunk != pair[1].chunk for pair in pairs)
    assert len(pairs) == sum(2 * (microbatches - 2 * stages + s + 1) + (stages - s - 1) - (s == stages - 1) for s in range(stages))
    assert max(zero_bubble.held_until_w(table)) == 2 * stages + 1  # the last stage: one chunk more than 1F1B's S stages' worth
    assert zero_bubble.costed_bubble(table, ALIKE) < zero_bubble.costed_bubble(one_f1b(stages, microbatches), ALIKE)


def test_at_4_stages_and_8_microbatches_dualpipev_halves_1f1bs_bubble():
    f1b = zero_bubble.costed_bubble(one_f1b(4, 8), ALIKE)
    assert zero_bubble.costed_bubble(zero_bubble.schedule_dualpipev(4, 8), ALIKE) <= f1b / 2
    with pytest.raises(ValueError, match="DualPipeV needs at least 2 x 4 stages = 8 microbatches, got 7"):
        zero_bubble.schedule_dualpipev(4, 7)


def test_a_hand_broken_dualpipev_table_is_refused():
    table = zero_bubble.schedule_dualpipev(2, 4)
    chunks = zero_bubble.v_chunks(2)
    zero_bubble.check_table(table, 4, chunks)  # the control: intact, it passes
    t, s = next((t, s) for t, row in enumerate(table) for s, cell in enumerate(row) if is_pair(cell))
    f, bw = sorted(table[t][s], key=lambda op: op.kind != "F")

    def refused(edit):
        return refusal(table, 4, chunks, edit)

    # The pair's whole backward moved a slot earlier (the F left where it was): before what it needs.
    early = refused(lambda c: (c[t - 1].__setitem__(s, (c[t - 1][s], bw) if c[t - 1][s] is not None else bw), c[t].__setitem__(s, f)))
    assert f"stage {s}: {bw} runs before" in early
    # A whole backward is its B and its W: a W of it later runs W again.
    assert f"runs Op(kind='W', microbatch={bw.microbatch}, chunk={bw.chunk}) again" in refused(
        lambda c: c.append([Op("W", bw.microbatch, bw.chunk) if k == s else None for k in range(2)]))
