"""Pipeline schedules as plain data: the plan (`PipelinePlan`, `check`), and for every
schedule its table of which stage does what when, so it can be tested, drawn and its bubble and
stash read (`sharding.schedule_report`) apart from the programs that step through it (`sharding.pipeline`:
GPipe and circular; `sharding.pipeline_1f1b`: lockstep 1F1B, interleaved with repeats;
`sharding.pipeline_per_stage`: Megatron-LM's per-stage 1F1B, balanced or not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from sharding.mesh import ShardingError


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """How a layer stack is split over the `stage` mesh axis (stages=1: not at all); `remat` is
    what each tick keeps for the backward pass (`sharding.remat`)."""

    stages: int = 1
    microbatches: int = 1
    repeats: int = 1
    remat: str = "full"
    schedule: str = "gpipe"  # gpipe (circular with repeats > 1) | 1f1b (`pipeline_1f1b`)


class Work(NamedTuple):
    microbatch: int
    chunk: int  # layer chunk, 0 .. repeats * stages - 1, in the order a microbatch visits them


def schedule(stages: int, microbatches: int, repeats: int = 1) -> list[list[Work | None]]:
    """For each tick and stage, the (microbatch, chunk) it works on, or None when idle."""
    check(stages, microbatches, repeats)
    ticks = repeats * microbatches + stages - 1
    table = []
    for t in range(ticks):
        row = []
        for s in range(stages):
            item = t - s  # the item-th piece of work this stage does
            if 0 <= item < repeats * microbatches:
                row.append(Work(microbatch=item % microbatches, chunk=(item // microbatches) * stages + s))
            else:
                row.append(None)
        table.append(row)
    return table


class Step(NamedTuple):
    """What a stage does at a tick of a 1F1B table: one forward and one backward (each a `Work`,
    or None when that half idles); `part` says which layers of the chunk the backward covers:
    0 all, 1 the later half, 2 the earlier half (balanced per-stage slots)."""

    forward: Work | None
    backward: Work | None
    part: int = 0


def schedule_1f1b(stages: int, microbatches: int, repeats: int = 1) -> list[list[Step]]:
    """1F1B in lockstep ticks, for one SPMD program; with `repeats` R > 1 chunks per stage,
    interleaved (Megatron's order: microbatches in groups of S, each group through chunk 0 of
    every stage, then chunk 1, ...; M must be a multiple of S).

    Stage s runs its k-th forward at tick k + s and its k-th backward at tick k + RS + S - 1 - s;
    the k-th is microbatch (k // RS) * S + k % S, in repeat (k // S) % R going forward and the
    reverse going back. A tick hands activations one stage on and cotangents one stage back (the
    last stage's output to stage 0 for the next repeat, and stage 0's cotangent to the last
    stage), so every input arrives the tick it is used and a chunk input stays at its stage
    (2R - 2r)S - 1 - 2s ticks: at most (R + 1)S - 1 - 2s in flight at stage s (`in_flight`),
    whatever M (GPipe keeps all RM). Interleaved, that is Megatron-LM's own count (its
    2(S - 1 - s) + (R - 1)S warm-up forwards, plus one), so per-stage slots would keep no less;
    with R = 1 it is 2(S - s) - 1 against Megatron's S - s (`schedule_1f1b_per_stage`).
    RM + RS + S - 1 ticks in three phases (`phases`): RS with forwards only, RM + S - 1 - RS
    with both, RS with backwards only; a program that runs only the halves some stage works in
    takes (RM + S - 1) chunk forward + backward times, the circular schedule's, with its bubble
    (S - 1) / (RM + S - 1). `pipeline_1f1b` runs this table."""
    check(stages, microbatches, repeats, schedule="1f1b")

    def work(k: int, s: int, backward: bool) -> Work | None:  # stage s's k-th forward / backward
        if not 0 <= k < repeats * microbatches:
            return None
        repeat = (k // stages) % repeats
        repeat = repeats - 1 - repeat if backward else repeat
        return Work((k // (stages * repeats)) * stages + k % stages, repeat * stages + s)

    ticks = repeats * (microbatches + stages) + stages - 1
    back = repeats * stages + stages - 1  # stage s's k-th backward is at tick k + back - s
    return [[Step(work(t - s, s, False), work(t - back + s, s, True)) for s in range(stages)] for t in range(ticks)]


def schedule_1f1b_per_stage(stages: int, microbatches: int, balanced: bool = False) -> list[list[Step]]:
    """Megatron-LM's 1F1B in slots where each stage runs one half (a forward or a backward) of
    its own: stage s runs S - 1 - s warm-up forwards, then a forward and a backward in turn, then
    the remaining backwards, each at the first slot after its input is there (the previous
    stage's forward, the next stage's backward; the last stage's forward for its backward).
    2(M + S - 1) slots, bubble (S - 1) / (M + S - 1), at most S - s microbatches in flight at
    stage s (`in_flight`), and every cotangent is used the slot after it is made; an activation
    may wait at its stage (held with those in flight). `balanced`: each backward runs as two
    parts in consecutive slots, the chunk's later layers' then its earlier layers' (`Step.part`
    1, 2), each about a forward's work, so every slot is: 3(M + S - 1) slots, the same bubble
    and bound. `pipeline_per_stage` runs these tables."""
    check(stages, microbatches, 1)
    parts = (1, 2) if balanced else (0,)
    order = []  # per stage, its work in Megatron's order: (part, microbatch), part None for a forward
    for s in range(stages):
        warm = min(stages - 1 - s, microbatches)
        back = lambda k: [(p, k) for p in parts]  # noqa: E731
        steady = [w for k in range(microbatches - warm) for w in [(None, warm + k), *back(k)]]
        order.append([(None, k) for k in range(warm)] + steady + [w for k in range(microbatches - warm, microbatches) for w in back(k)])
    done, table, at = {}, [], [0] * stages  # done[(part, microbatch, stage)] = slot
    while any(at[s] < len(order[s]) for s in range(stages)):
        row = [Step(None, None)] * stages
        for s, (part, k) in ((s, order[s][at[s]]) for s in range(stages) if at[s] < len(order[s])):
            if part is None:
                needs = (None, k, s - 1)
            elif part == 2:
                needs = (1, k, s)
            else:
                needs = (parts[-1], k, s + 1) if s < stages - 1 else (None, k, s)
            if needs[2] < 0 or done.get(needs, len(table)) < len(table):  # not done yet: get() gives this slot
                row[s] = Step(Work(k, s), None) if part is None else Step(None, Work(k, s), part)
                done[(part, k, s)], at[s] = len(table), at[s] + 1
        table.append(row)
    return table


def in_flight(table: Sequence[Sequence[Step]]) -> list[int]:
    """Per stage, the most microbatches whose forward has run there and whose backward has not,
    after a tick: the stage inputs a 1F1B stage keeps (a tick's backward reads its input before
    the tick's forward stores one, so they can share a slot)."""
    held, most = [0] * len(table[0]), [0] * len(table[0])
    for row in table:
        for s, step in enumerate(row):
            held[s] += (step.forward is not None) - (step.backward is not None and step.part != 1)
            most[s] = max(most[s], held[s])
    return most


def held_per_stage(table: Sequence[Sequence[Step]]) -> list[int]:
    """Per stage of a per-stage 1F1B table (`schedule_1f1b_per_stage`), the most stage inputs
    it keeps, each from the slot it arrives (after the previous stage's forward) to the slot of
    its backward (which frees it before that slot's arrival is kept). Stage 0 keeps none: it
    embeds its microbatch again for the backward."""
    most = [0] * len(table[0])
    for s in range(1, len(table[0])):
        held = 0
        for t, row in enumerate(table):
            held -= row[s].backward is not None and row[s].part != 1
            held += t > 0 and table[t - 1][s - 1].forward is not None
            most[s] = max(most[s], held)
    return most


def phases(table: Sequence[Sequence[Step]]) -> list[tuple[int, int, bool, bool]]:
    """A 1F1B table's runs of consecutive ticks as (start, stop, any forward, any backward): the
    halves of a tick some stage works in, all a program need run."""
    kinds = [(any(step.forward is not None for step in row), any(step.backward is not None for step in row)) for row in table]
    starts = [t for t in range(len(kinds)) if t == 0 or kinds[t] != kinds[t - 1]]
    return [(a, b, *kinds[a]) for a, b in zip(starts, [*starts[1:], len(kinds)])]


def bubble_fraction(table: Sequence[Sequence[Work | None]]) -> float:
    """Idle (tick, stage) cells over all cells run. In a lockstep 1F1B table a cell is a tick's
    forward or backward half, and a half no stage works in is not run (see `phases`); in a
    per-stage one (no stage runs both halves of a slot), a cell is a slot."""
    if isinstance(table[0][0], Step) and any(step.forward and step.backward for row in table for step in row):
        halves = lambda row: zip(*((step.forward, step.backward) for step in row))  # noqa: E731
        table = [col for row in table for col in halves(row) if any(m is not None for m in col)]
    elif isinstance(table[0][0], Step):
        table = [[step.forward or step.backward for step in row] for row in table]
    cells = [cell for row in table for cell in row]
    return sum(cell is None for cell in cells) / len(cells)


PER_STAGE = ("1f1b_per_stage", "zero_bubble", "zbv", "dualpipev")  # the schedules whose stages each run their own work per slot
V_SHAPED = ("zbv", "dualpipev")  # two chunks a stage in a V (`sharding.zero_bubble.v_chunks`)
SPLIT_BACKWARD = ("zero_bubble", *V_SHAPED)  # each backward as B and W (`lm.model.split_backward`)


def least_microbatches(schedule: str, stages: int) -> int:
    """The fewest microbatches a schedule runs with (`pipeline.microbatches=0` takes these):
    one a stage; DualPipeV two (its middle pairs each chunk's forward with the other's backward)."""
    return 2 * stages if schedule == "dualpipev" else stages


def balanced_zero_bubble(plan: PipelinePlan, layers: int) -> bool:
    """Whether a zero-bubble pipeline runs each B in two halves (B1, B2): when each stage's
    `layers` (0: not known) halve, so that a slot holds about one forward's work (B is a forward
    and an input gradient when recomputing, an input gradient of about a forward's cost and
    more where attention's backward weighs). Keeping residuals it pays too since a piece's
    weights are no longer stashed per microbatch: deviceless H100 `llama_8b` {stage 4, fsdp 2}
    M = 8 (PERFORMANCE.md, "Pipelines"), 5,919 -> 5,560 ms and 73.5 -> 67.0 GiB."""
    return plan.schedule == "zero_bubble" and layers > 0 and layers % (2 * plan.stages) == 0


def balanced_slots(plan: PipelinePlan, layers: int) -> bool:
    """Whether the per-stage 1F1B runs `balanced` slots: when it keeps residuals (its backward
    is then two forwards' work) and each stage's `layers` (0: not known) halve."""
    return plan.schedule == "1f1b_per_stage" and plan.remat != "full" and layers > 0 and layers % (2 * plan.stages) == 0


def check(stages: int, microbatches: int, repeats: int, layers: int | None = None, batch: int | None = None,
          schedule: str = "gpipe", context: int = 1) -> None:
    """ShardingErrors for a pipeline that cannot be built; `batch` is the per-replica batch,
    `context` the mesh's context-parallel size."""
    if min(stages, microbatches, repeats) < 1:
        raise ShardingError(f"pipeline stages, microbatches and repeats must be positive, got {stages}, {microbatches}, {repeats}")
    if stages > 1 and microbatches < stages:
        raise ShardingError(
            f"pipeline.microbatches={microbatches} is fewer than the {stages} stages; use at least {stages} "
            "(more shrinks the bubble)"
        )
    if schedule == "1f1b" and repeats > 1 and microbatches % stages:
        raise ShardingError(
            f"interleaved 1F1B (pipeline.repeats={repeats}) takes microbatches in groups of the {stages} stages; "
            f"make pipeline.microbatches={microbatches} a multiple of {stages}"
        )
    if schedule in PER_STAGE and repeats > 1:
        raise ShardingError(
            f"pipeline.schedule={schedule} does not interleave; use pipeline.repeats=1 (got {repeats}), "
            "or pipeline.schedule=1f1b for interleaved 1F1B (which already keeps Megatron-LM's interleaved count)"
        )
    if schedule in PER_STAGE and context > 1:  # its attention's collective-permutes would sit in one stage's branch
        raise ShardingError(f"pipeline.schedule={schedule} does not run with context parallelism (mesh.context={context}); "
                            "use pipeline.schedule=1f1b")
    if layers is not None and layers % (stages * repeats):
        raise ShardingError(
            f"{layers} layers do not split into mesh.stage={stages} x pipeline.repeats={repeats} equal chunks; "
            f"make the layer count a multiple of {stages * repeats}"
        )
    if schedule in V_SHAPED and layers is not None and layers % (2 * stages):
        raise ShardingError(
            f"pipeline.schedule={schedule} runs two chunks a stage: {layers} layers do not split into 2 x mesh.stage={stages} "
            f"equal chunks; make the layer count a multiple of {2 * stages}"
        )
    if microbatches < least_microbatches(schedule, stages):
        raise ShardingError(f"pipeline.schedule={schedule} needs at least 2 x mesh.stage = {2 * stages} microbatches; "
                            f"got pipeline.microbatches={microbatches}")
    if batch is not None and batch % microbatches:
        raise ShardingError(
            f"the per-replica batch of {batch} sequences is not divisible by pipeline.microbatches={microbatches}"
        )
