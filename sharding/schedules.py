"""Pipeline schedules as plain data: the plan (`PipelinePlan`, `check`), and for every
schedule its table of which stage does what when, so it can be tested, drawn and its bubble and
stash read (`report`) apart from the programs that step through it (`sharding.pipeline`:
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


class Op(NamedTuple):
    """What a stage does in a slot of a split-backward table: the forward (F), the input
    gradient (B: on the critical path, its cotangent goes one stage back) or the weight gradient
    (W: needs only its own B, so it can wait) of a microbatch's chunk."""

    kind: str  # "F" | "B" | "W"
    microbatch: int
    chunk: int


def v_chunks(stages: int) -> list[list[int]]:
    """Per stage, the two chunks of a V (ZB-V, DualPipeV): stage s runs chunk s going down and
    chunk 2S - 1 - s coming back, so the last stage turns a microbatch round in place and stage
    0 holds both the first chunk and the last (with the loss)."""
    return [[s, 2 * stages - 1 - s] for s in range(stages)]


def schedule_zero_bubble(stages: int, microbatches: int) -> list[list[Op | None]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): per-stage 1F1B with each
    backward split into B and W, every stage running in its steady state F(x), B(x - (S-1-s)),
    W(x - (S-1)) in turn. The W a stage defers fill the bubbles 1F1B leaves at the end; no stage
    keeps more than S microbatches from its F to its W (1F1B's stage 0: `held_until_w`). With F,
    B and W of equal cost, the bubble is (S - 1) / (3M + S - 1), a third of 1F1B's for large M."""
    check(stages, microbatches, 1)
    orders = []
    for s in range(stages):
        order = []
        for x in range(microbatches + stages - 1):
            order += [Op(kind, k, s) for kind, k in (("F", x), ("B", x - (stages - 1 - s)), ("W", x - (stages - 1)))
                      if 0 <= k < microbatches]
        orders.append(order)
    return _slots(orders, stages)


def schedule_zbv(stages: int, microbatches: int) -> list[list[Op | None]]:
    """ZB-V: two chunks per stage in a V (`v_chunks`), backwards split into B and W. Each slot a
    stage runs a B whose cotangent has arrived (its earlier chunk first: that one is nearer the
    start of the pipeline's way back), else an F whose input has arrived (its later chunk first,
    to turn microbatches round), while it keeps fewer than 2S chunks from F to W (1F1B's peak,
    S microbatches of a whole stage), else its oldest deferred W."""
    check(stages, microbatches, 1)
    chunks, last = v_chunks(stages), 2 * stages - 1
    done: dict[Op, int] = {}
    next_f, next_b = [0] * (last + 1), [0] * (last + 1)
    held, deferred, table = [0] * stages, [[] for _ in range(stages)], []

    def ready(op: Op, t: int) -> bool:
        return all(done.get(need, t) < t for need in needs(op, last + 1))

    while len(done) < 3 * microbatches * (last + 1):
        t, row = len(table), [None] * stages
        for s in range(stages):
            backward = [Op("B", next_b[c], c) for c in chunks[s] if next_b[c] < microbatches and ready(Op("B", next_b[c], c), t)]
            forward = [Op("F", next_f[c], c) for c in reversed(chunks[s])
                       if next_f[c] < microbatches and held[s] < 2 * stages and ready(Op("F", next_f[c], c), t)]
            row[s] = next(iter(backward + forward + deferred[s][:1]), None)
        for s, op in enumerate(row):
            if op is not None:
                done[op] = t
                if op.kind == "F":
                    next_f[op.chunk], held[s] = next_f[op.chunk] + 1, held[s] + 1
                elif op.kind == "B":
                    next_b[op.chunk] += 1
                    deferred[s].append(Op("W", op.microbatch, op.chunk))
                else:
                    deferred[s].pop(0)
                    held[s] -= 1
        table.append(row)
    return table


def needs(op: Op, chunks: int) -> list[Op]:
    """What must have run, in an earlier slot, before `op` of a pipeline of `chunks` chunks: an
    F the previous chunk's F (its input); a B its own F and the next chunk's B (its cotangent);
    a W its own B."""
    if op.kind == "F":
        return [Op("F", op.microbatch, op.chunk - 1)] if op.chunk > 0 else []
    if op.kind == "B":
        return [Op("F", op.microbatch, op.chunk)] + ([Op("B", op.microbatch, op.chunk + 1)] if op.chunk < chunks - 1 else [])
    return [Op("B", op.microbatch, op.chunk)]


def _slots(orders: Sequence[Sequence[Op]], stages: int) -> list[list[Op | None]]:
    """Per-stage orders placed in slots: each stage runs its next op at the first slot after
    everything it needs has run."""
    chunks = 1 + max(op.chunk for order in orders for op in order)
    done: dict[Op, int] = {}
    at, table = [0] * stages, []
    while any(at[s] < len(orders[s]) for s in range(stages)):
        t = len(table)
        row = [orders[s][at[s]] if at[s] < len(orders[s]) and all(done.get(n, t) < t for n in needs(orders[s][at[s]], chunks)) else None
               for s in range(stages)]
        if not any(row):
            raise ValueError(f"the stages' orders wait on each other at slot {t}: {[orders[s][at[s]] for s in range(stages) if at[s] < len(orders[s])]}")
        for s, op in enumerate(row):
            if op is not None:
                done[op], at[s] = t, at[s] + 1
        table.append(row)
    return table


def check_table(table: Sequence[Sequence[Op | None]], microbatches: int, chunks_of: Sequence[Sequence[int]]) -> None:
    """A ValueError naming the first cell of a split-backward table that breaks a dependency
    (`needs`: no F before its input, no B before its cotangent, no W before its B) or runs an op
    twice, on a stage that does not hold its chunk, or leaves one out."""
    chunks = sum(len(c) for c in chunks_of)
    done: dict[Op, int] = {}
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            if op.chunk not in chunks_of[s]:
                raise ValueError(f"slot {t}, stage {s}: {op} is of a chunk the stage does not hold ({list(chunks_of[s])})")
            if op in done:
                raise ValueError(f"slot {t}, stage {s}: {op} ran before, at slot {done[op]}")
            missing = [n for n in needs(op, chunks) if done.get(n, t) >= t]
            if missing:
                raise ValueError(f"slot {t}, stage {s}: {op} runs before {missing[0]}")
        for s, op in enumerate(row):
            if op is not None:
                done[op] = t
    left = [Op(k, m, c) for k in "FBW" for m in range(microbatches) for c in range(chunks) if Op(k, m, c) not in done]
    if left:
        raise ValueError(f"the table never runs {left[0]} ({len(left)} ops left out)")


def held_until_w(table: Sequence[Sequence[Op | None]]) -> list[int]:
    """Per stage, the most chunks whose F has run and whose W has not: what it keeps for its
    backward, the B / W split's stash (B's cotangents wait with them for W)."""
    held, most = [0] * len(table[0]), [0] * len(table[0])
    for row in table:
        for s, op in enumerate(row):
            if op is not None:
                held[s] += {"F": 1, "B": 0, "W": -1}[op.kind]
                most[s] = max(most[s], held[s])
    return most


def costed_bubble(table: Sequence[Sequence[Op | None]], cost: dict[str, float]) -> float:
    """Idle time over all time of a table's stages, with each op taking `cost[kind]` (kinds F, B,
    W, or BW for an unsplit backward: B + W, which needs the next chunk's B, or BW, before it):
    every stage runs its ops in the table's order, each as soon as the stage is free and what it
    needs has finished (transfers free). Equal to the slot count's bubble when costs are equal."""
    stages = len(table[0])
    chunks = 1 + max(op.chunk for row in table for op in row if op is not None)
    finish: dict[tuple[str, int, int], float] = {}
    free, busy = [0.0] * stages, [0.0] * stages
    for row in table:  # slots are in dependency order, so one pass sees every input's finish
        for s, op in enumerate(row):
            if op is None:
                continue
            kind = "B" if op.kind == "BW" else op.kind
            inputs = [finish.get((n.kind, n.microbatch, n.chunk), finish.get(("BW", n.microbatch, n.chunk), 0.0))
                      for n in needs(Op(kind, op.microbatch, op.chunk), chunks)]
            start = max([free[s], *inputs])
            free[s] = finish[(op.kind, op.microbatch, op.chunk)] = start + cost[op.kind]
            busy[s] += cost[op.kind]
    return 1 - sum(busy) / (stages * max(free))


def per_stage_ops(table: Sequence[Sequence[Step]]) -> list[list[Op | None]]:
    """A per-stage 1F1B table (`schedule_1f1b_per_stage`, unbalanced) as ops, its backwards
    unsplit (BW), for `costed_bubble`."""
    return [[Op("F", *step.forward) if step.forward else Op("BW", *step.backward) if step.backward else None for step in row]
            for row in table]


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


def balanced_slots(plan: PipelinePlan, layers: int) -> bool:
    """Whether the per-stage 1F1B runs `balanced` slots: when it keeps residuals (its backward
    is then two forwards' work) and each stage's `layers` (0: not known) halve."""
    return plan.schedule == "1f1b_per_stage" and plan.remat != "full" and layers > 0 and layers % (2 * plan.stages) == 0


def report(plan: PipelinePlan, layers: int = 0) -> dict:
    """What `lm.bench` and `lm.layout` say of a plan: the schedule's name, its bubble (the idle
    share of the stages' work slots), its stash depth (how many microbatch chunks each stage
    keeps for its backward: every tick's for GPipe / circular, the most in flight for 1F1B,
    (R + 1)S - 1 when M is large enough, S for the per-stage 1F1B) and what it keeps of each (`stash`: the stage inputs,
    recomputing the rest, with remat `full`; else residuals)."""
    if plan.stages == 1:
        return {"schedule": "none", "bubble": 0.0, "stash_depth": 0, "stash": "none"}
    kept = "stage inputs" if plan.remat == "full" else "residuals"
    if plan.schedule == "1f1b_per_stage":
        balanced = balanced_slots(plan, layers)
        table = schedule_1f1b_per_stage(plan.stages, plan.microbatches, balanced)
        depth = max(held_per_stage(table) if plan.remat == "full" else in_flight(table))  # inputs from arrival; residuals from the forward
        name = "balanced 1f1b_per_stage" if balanced else plan.schedule
        return {"schedule": name, "bubble": bubble_fraction(table), "stash_depth": depth, "stash": kept}
    if plan.schedule == "1f1b":
        table = schedule_1f1b(plan.stages, plan.microbatches, plan.repeats)
        name = "interleaved 1f1b" if plan.repeats > 1 else "1f1b"
        return {"schedule": name, "bubble": bubble_fraction(table), "stash_depth": max(in_flight(table)), "stash": kept}
    table = schedule(plan.stages, plan.microbatches, plan.repeats)
    name = "circular" if plan.repeats > 1 else "gpipe"
    return {"schedule": name, "bubble": bubble_fraction(table), "stash_depth": len(table), "stash": kept}


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
    if schedule == "1f1b_per_stage" and repeats > 1:
        raise ShardingError(
            f"pipeline.schedule=1f1b_per_stage does not interleave; use pipeline.repeats=1 (got {repeats}), "
            "or pipeline.schedule=1f1b for interleaved 1F1B (which already keeps Megatron-LM's interleaved count)"
        )
    if schedule == "1f1b_per_stage" and context > 1:  # its attention's collective-permutes would sit in one stage's branch
        raise ShardingError(f"pipeline.schedule=1f1b_per_stage does not run with context parallelism (mesh.context={context}); "
                            "use pipeline.schedule=1f1b")
    if layers is not None and layers % (stages * repeats):
        raise ShardingError(
            f"{layers} layers do not split into mesh.stage={stages} x pipeline.repeats={repeats} equal chunks; "
            f"make the layer count a multiple of {stages * repeats}"
        )
    if batch is not None and batch % microbatches:
        raise ShardingError(
            f"the per-replica batch of {batch} sequences is not divisible by pipeline.microbatches={microbatches}"
        )
