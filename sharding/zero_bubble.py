"""Zero-bubble pipeline schedules as plain data (Qi et al., "Zero Bubble Pipeline Parallelism",
2024; DeepSeek-V3's DualPipeV): each backward split into B (the input gradient) and W (the
weights' gradients, which can wait) or run whole (BW), tables of which stage runs which F, B, W or
BW of which microbatch's chunk in each slot (a cell: one op, or DualPipeV's pair of one chunk's F
beside the other's BW), their dependency check, what they keep and their bubble costed per kind
of work. The programs that run them are `sharding.pipeline_zero_bubble` (ZB-H1) and
`sharding.pipeline_zbv` (ZB-V, DualPipeV); the backward's split itself is
`lm.model.split_backward`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sharding.schedules import Step, check, least_microbatches


class Op(NamedTuple):
    """What a stage does in a slot of a split-backward table: the forward (F), the input
    gradient (B: on the critical path, its cotangent goes one stage back) or the weight gradient
    (W: needs only its own B, so it can wait) of a microbatch's chunk."""

    kind: str  # "F" | "B" | "W" | "BW" (B and W at once); balanced tables: "B1" (B of the chunk's later half of layers), "B2" (its earlier half)
    microbatch: int
    chunk: int


Cell = Op | tuple[Op, ...] | None  # what a stage runs in a slot: nothing, an op, or ops side by side (DualPipeV's F beside a BW)


def ops_of(cell: Cell) -> tuple[Op, ...]:
    return () if cell is None else (cell,) if isinstance(cell, Op) else cell


def _record(done: dict, op: Op, value) -> None:
    """`op` done at `value`; a whole backward (BW) counts as its B and its W, for what needs them
    and for the check that nothing runs twice."""
    done[op] = value
    if op.kind == "BW":
        done[Op("B", op.microbatch, op.chunk)] = done[Op("W", op.microbatch, op.chunk)] = value


def v_chunks(stages: int) -> list[list[int]]:
    """Per stage, the two chunks of a V (ZB-V, DualPipeV): stage s runs chunk s going down and
    chunk 2S - 1 - s coming back, so the last stage turns a microbatch round in place and stage
    0 holds both the first chunk and the last (with the loss)."""
    return [[s, 2 * stages - 1 - s] for s in range(stages)]


def schedule_zero_bubble(stages: int, microbatches: int, balanced: bool = False) -> list[list[Op | None]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): per-stage 1F1B with each
    backward split into B and W, every stage running in its steady state F(x), B(x - (S-1-s)),
    W(x - (S-1)) in turn. The W a stage defers fill the bubbles 1F1B leaves at the end; no stage
    keeps more than S microbatches from its F to its W (1F1B's stage 0: `held_until_w`). With F,
    B and W of equal cost, the bubble is (S - 1) / (3M + S - 1), a third of 1F1B's for large M.
    `balanced`: each B in two halves in consecutive slots, B1 (the chunk's later layers) then B2
    (its earlier ones), so a slot holds about one forward's work where B is two (one SPMD
    program's slots last their longest op)."""
    check(stages, microbatches, 1)
    backward = ("B1", "B2") if balanced else ("B",)
    orders = []
    for s in range(stages):
        order = []
        for x in range(microbatches + stages - 1):
            steps = [("F", x)] + [(b, x - (stages - 1 - s)) for b in backward] + [("W", x - (stages - 1))]
            order += [Op(kind, k, s) for kind, k in steps if 0 <= k < microbatches]
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


def schedule_dualpipev(stages: int, microbatches: int) -> list[list[Cell]]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, as its authors publish it): the chunks of
    ZB-V's V (`v_chunks`), each stage running its eight phases in order: forwards of its chunk
    going down, then of both; B (W deferred) with W and F coming back; the main phase, where each
    slot pairs one chunk's F with the other's whole backward (BW: in DualPipe the pair's compute
    hides the other's transfers, expert parallelism's all-to-alls above all); BW and pairs; B of
    both chunks, the later half's W deferred; deferred W with B going down; the last W. Needs
    M >= 2S. Each stage's order is placed in slots as its inputs arrive."""
    check(stages, microbatches, 1)
    if microbatches < least_microbatches("dualpipev", stages):
        raise ValueError(f"DualPipeV needs at least 2 x {stages} stages = {2 * stages} microbatches, got {microbatches}")
    return _slots([_dualpipev_order(stages, microbatches, s) for s in range(stages)], stages)


def _dualpipev_order(stages: int, microbatches: int, s: int) -> list[Cell]:
    chunk, at, deferred = v_chunks(stages)[s], {}, []  # chunk[0] going down, chunk[1] coming back

    def op(kind: str, v: int) -> Op:  # the next microbatch of `kind` on the stage's chunk v (B and BW counted together)
        key = (kind[0], v)
        at[key] = at.get(key, -1) + 1
        if kind == "B":
            deferred.append(Op("W", at[key], chunk[v]))
        return Op(kind, at[key], chunk[v])

    last, ahead = s == stages - 1, stages - s - 1
    order: list[Cell] = [op("F", 0) for _ in range(2 * ahead)]
    for _ in range(s + 1):
        order += [op("F", 0), op("F", 1)]
    for _ in range(ahead):
        order += [op("B", 1), deferred.pop(0), op("F", 1)]
    for i in range(microbatches - 2 * stages + s + 1):
        order += [op("F", 0), op("BW", 1)] if i == 0 and last else [(op("F", 0), op("BW", 1))]
        order.append((op("F", 1), op("BW", 0)))
    for _ in range(ahead):
        order += [op("BW", 1), (op("F", 1), op("BW", 0))]
    split = False  # the second half of these backwards defer their W
    for i in range(s + 1):
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        order.append(op("B" if split else "BW", 1))
        split = split or i == (s + 1) // 2
        order.append(op("B" if split else "BW", 0))
    for _ in range(ahead):
        order += [deferred.pop(0), op("B", 0)]
    return order + [deferred.pop(0) for _ in range(s + 1)]


V_TABLES = {"zbv": schedule_zbv, "dualpipev": schedule_dualpipev}  # the schedules of a V's chunks, by name


def needs(op: Op, chunks: int, balanced: bool = False) -> list[Op]:
    """What must have run, in an earlier slot, before `op` of a pipeline of `chunks` chunks: an
    F the previous chunk's F (its input); a B (B1) its own F and the next chunk's B (B2: its
    cotangent); a B2 its own B1; a W its own B (B2); a BW what a B needs (`_record` counts a
    BW as the B and W it is)."""
    last_part = "B2" if balanced else "B"
    if op.kind == "F":
        return [Op("F", op.microbatch, op.chunk - 1)] if op.chunk > 0 else []
    if op.kind in ("B", "B1", "BW"):
        return [Op("F", op.microbatch, op.chunk)] + ([Op(last_part, op.microbatch, op.chunk + 1)] if op.chunk < chunks - 1 else [])
    if op.kind == "B2":
        return [Op("B1", op.microbatch, op.chunk)]
    return [Op(last_part, op.microbatch, op.chunk)]


def is_balanced(table: Sequence[Sequence[Cell]]) -> bool:
    return any(op.kind == "B1" for row in table for cell in row for op in ops_of(cell))


def _slots(orders: Sequence[Sequence[Cell]], stages: int) -> list[list[Cell]]:
    """Per-stage orders placed in slots: each stage runs its next cell at the first slot after
    everything its ops need has run."""
    chunks = 1 + max(op.chunk for order in orders for cell in order for op in ops_of(cell))
    balanced = any(op.kind == "B1" for order in orders for cell in order for op in ops_of(cell))
    done: dict[Op, int] = {}
    at, table = [0] * stages, []
    ready = lambda cell, t: all(done.get(n, t) < t for op in ops_of(cell) for n in needs(op, chunks, balanced))  # noqa: E731
    while any(at[s] < len(orders[s]) for s in range(stages)):
        t = len(table)
        row = [orders[s][at[s]] if at[s] < len(orders[s]) and ready(orders[s][at[s]], t) else None for s in range(stages)]
        if not any(row):
            raise ValueError(f"the stages' orders wait on each other at slot {t}: {[orders[s][at[s]] for s in range(stages) if at[s] < len(orders[s])]}")
        for s, cell in enumerate(row):
            if cell is not None:
                for op in ops_of(cell):
                    _record(done, op, t)
                at[s] += 1
        table.append(row)
    return table


def check_table(table: Sequence[Sequence[Cell]], microbatches: int, chunks_of: Sequence[Sequence[int]]) -> None:
    """A ValueError naming the first cell of a split-backward table that breaks a dependency
    (`needs`: no F before its input, no B before its cotangent, no W before its B) or runs an op
    twice (a BW counts as a B and a W), on a stage that does not hold its chunk, or leaves one out."""
    chunks, balanced = sum(len(c) for c in chunks_of), is_balanced(table)
    done: dict[Op, int] = {}
    for t, row in enumerate(table):
        for s, op in ((s, op) for s, cell in enumerate(row) for op in ops_of(cell)):
            if op.chunk not in chunks_of[s]:
                raise ValueError(f"slot {t}, stage {s}: {op} is of a chunk the stage does not hold ({list(chunks_of[s])})")
            twice = [o for o in (op, *(Op(k, op.microbatch, op.chunk) for k in ("B", "W") if op.kind == "BW")) if o in done]
            if twice:
                raise ValueError(f"slot {t}, stage {s}: {op} runs {twice[0]} again (it ran at slot {done[twice[0]]})")
            missing = [n for n in needs(op, chunks, balanced) if done.get(n, t) >= t]
            if missing:
                raise ValueError(f"slot {t}, stage {s}: {op} runs before {missing[0]}")
        for cell in row:
            for op in ops_of(cell):
                _record(done, op, t)
    kinds = ("F", "B1", "B2", "W") if balanced else ("F", "B", "W")
    left = [Op(k, m, c) for k in kinds for m in range(microbatches) for c in range(chunks) if Op(k, m, c) not in done]
    if left:
        raise ValueError(f"the table never runs {left[0]} ({len(left)} ops left out)")


def _most_held(table: Sequence[Sequence[Cell]], change: dict[str, int]) -> list[int]:
    """Per stage, the most of something a cell's ops add to or take from (`change` per kind),
    counted after each slot (a pair's F and BW together)."""
    held, most = [0] * len(table[0]), [0] * len(table[0])
    for row in table:
        for s, cell in enumerate(row):
            held[s] += sum(change.get(op.kind, 0) for op in ops_of(cell))
            most[s] = max(most[s], held[s])
    return most


def held_until_w(table: Sequence[Sequence[Cell]]) -> list[int]:
    """Per stage, the most chunks whose F has run and whose W (or BW) has not: what it keeps
    for its backward, the B / W split's stash (B's cotangents wait with them for W)."""
    return _most_held(table, {"F": 1, "W": -1, "BW": -1})


def waiting_for_w(table: Sequence[Sequence[Cell]]) -> list[int]:
    """Per stage, the most chunks whose B has run and whose W has not: how many sets of B's
    matmul inputs and output gradients it keeps for W."""
    return _most_held(table, {"B": 1, "B1": 1, "W": -1})


def costed_bubble(table: Sequence[Sequence[Cell]], cost: dict[str, float]) -> float:
    """Idle time over all time of a table's stages, with each op taking `cost[kind]` (kinds F, B,
    W; BW, a whole backward, B + W unless named; a balanced table's B1 and B2 half of B each
    unless named; a cell's ops one after the other): every stage runs its cells in the table's
    order, each as soon as the stage is free and what it needs has finished (transfers free).
    Equal to the slot count's bubble when costs are equal."""
    stages = len(table[0])
    chunks, balanced = 1 + max(op.chunk for row in table for cell in row for op in ops_of(cell)), is_balanced(table)
    cost = _with_parts(cost)
    finish: dict[Op, float] = {}
    free, busy = [0.0] * stages, [0.0] * stages
    for row in table:  # slots are in dependency order, so one pass sees every input's finish
        for s, cell in enumerate(row):
            if cell is None:
                continue
            start = max([free[s], *(finish.get(n, 0.0) for op in ops_of(cell) for n in needs(op, chunks, balanced))])
            free[s] = start + _cell_cost(cell, cost)
            busy[s] += _cell_cost(cell, cost)
            for op in ops_of(cell):
                _record(finish, op, free[s])
    return 1 - sum(busy) / (stages * max(free))


def _with_parts(cost: dict[str, float]) -> dict[str, float]:
    b = cost.get("B", 0.0)
    return {"B1": b / 2, "B2": b / 2, "BW": b + cost.get("W", 0.0), **cost}


def _cell_cost(cell: Cell, cost: dict[str, float]) -> float:
    return sum(cost[op.kind] for op in ops_of(cell))


def slotted_bubble(table: Sequence[Sequence[Cell]], cost: dict[str, float]) -> float:
    """Idle time over all time when the stages run the table slot by slot in step, each slot as
    long as its longest cell (`sharding.pipeline_zero_bubble`: one SPMD program, a `shard_map` per
    slot): what the program pays where `costed_bubble` lets each stage run ahead, and what the
    kernel model charges it (`sharding.conditions.known_branches`)."""
    cost = _with_parts(cost)
    cells = [_cell_cost(cell, cost) for row in table for cell in row if cell is not None]
    total = sum(max((_cell_cost(cell, cost) for cell in row if cell is not None), default=0.0) for row in table)
    return 1 - sum(cells) / (len(table[0]) * total)


def per_stage_ops(table: Sequence[Sequence[Step]]) -> list[list[Op | None]]:
    """A per-stage 1F1B table (`schedule_1f1b_per_stage`, unbalanced) as ops, its backwards
    unsplit (BW), for `costed_bubble`."""
    return [[Op("F", *step.forward) if step.forward else Op("BW", *step.backward) if step.backward else None for step in row]
            for row in table]
