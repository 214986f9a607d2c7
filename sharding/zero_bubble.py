"""Zero-bubble pipeline schedules as plain data (Qi et al., "Zero Bubble Pipeline Parallelism",
2024): each backward split into B (the input gradient) and W (the weights' gradients, which can
wait), tables of which stage runs which F, B or W of which microbatch's chunk in each slot,
their dependency check, what they keep and their bubble costed per kind of work. The program
that runs ZB-H1 is `sharding.pipeline_zero_bubble`; the backward's split itself is
`lm.model.split_backward`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sharding.schedules import Step, check


class Op(NamedTuple):
    """What a stage does in a slot of a split-backward table: the forward (F), the input
    gradient (B: on the critical path, its cotangent goes one stage back) or the weight gradient
    (W: needs only its own B, so it can wait) of a microbatch's chunk."""

    kind: str  # "F" | "B" | "W"; balanced tables: "B1" (B of the chunk's later half of layers), "B2" (its earlier half)
    microbatch: int
    chunk: int


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


def needs(op: Op, chunks: int, balanced: bool = False) -> list[Op]:
    """What must have run, in an earlier slot, before `op` of a pipeline of `chunks` chunks: an
    F the previous chunk's F (its input); a B (B1) its own F and the next chunk's B (B2: its
    cotangent); a B2 its own B1; a W its own B (B2)."""
    last_part = "B2" if balanced else "B"
    if op.kind == "F":
        return [Op("F", op.microbatch, op.chunk - 1)] if op.chunk > 0 else []
    if op.kind in ("B", "B1"):
        return [Op("F", op.microbatch, op.chunk)] + ([Op(last_part, op.microbatch, op.chunk + 1)] if op.chunk < chunks - 1 else [])
    if op.kind == "B2":
        return [Op("B1", op.microbatch, op.chunk)]
    return [Op(last_part, op.microbatch, op.chunk)]


def is_balanced(table: Sequence[Sequence[Op | None]]) -> bool:
    return any(op is not None and op.kind == "B1" for row in table for op in row)


def _slots(orders: Sequence[Sequence[Op]], stages: int) -> list[list[Op | None]]:
    """Per-stage orders placed in slots: each stage runs its next op at the first slot after
    everything it needs has run."""
    chunks = 1 + max(op.chunk for order in orders for op in order)
    balanced = any(op.kind == "B1" for order in orders for op in order)
    done: dict[Op, int] = {}
    at, table = [0] * stages, []
    while any(at[s] < len(orders[s]) for s in range(stages)):
        t = len(table)
        row = [orders[s][at[s]] if at[s] < len(orders[s]) and all(done.get(n, t) < t for n in needs(orders[s][at[s]], chunks, balanced)) else None
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
    chunks, balanced = sum(len(c) for c in chunks_of), is_balanced(table)
    done: dict[Op, int] = {}
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            if op.chunk not in chunks_of[s]:
                raise ValueError(f"slot {t}, stage {s}: {op} is of a chunk the stage does not hold ({list(chunks_of[s])})")
            if op in done:
                raise ValueError(f"slot {t}, stage {s}: {op} ran before, at slot {done[op]}")
            missing = [n for n in needs(op, chunks, balanced) if done.get(n, t) >= t]
            if missing:
                raise ValueError(f"slot {t}, stage {s}: {op} runs before {missing[0]}")
        for s, op in enumerate(row):
            if op is not None:
                done[op] = t
    kinds = ("F", "B1", "B2", "W") if balanced else ("F", "B", "W")
    left = [Op(k, m, c) for k in kinds for m in range(microbatches) for c in range(chunks) if Op(k, m, c) not in done]
    if left:
        raise ValueError(f"the table never runs {left[0]} ({len(left)} ops left out)")


def held_until_w(table: Sequence[Sequence[Op | None]]) -> list[int]:
    """Per stage, the most chunks whose F has run and whose W has not: what it keeps for its
    backward, the B / W split's stash (B's cotangents wait with them for W)."""
    held, most = [0] * len(table[0]), [0] * len(table[0])
    for row in table:
        for s, op in enumerate(row):
            if op is not None:
                held[s] += {"F": 1, "W": -1}.get(op.kind, 0)
                most[s] = max(most[s], held[s])
    return most


def waiting_for_w(table: Sequence[Sequence[Op | None]]) -> list[int]:
    """Per stage, the most chunks whose B has run and whose W has not: how many sets of B's
    matmul inputs and output gradients it keeps for W."""
    held, most = [0] * len(table[0]), [0] * len(table[0])
    for row in table:
        for s, op in enumerate(row):
            if op is not None and op.kind in ("B", "B1", "W"):
                held[s] += -1 if op.kind == "W" else 1
                most[s] = max(most[s], held[s])
    return most


def costed_bubble(table: Sequence[Sequence[Op | None]], cost: dict[str, float]) -> float:
    """Idle time over all time of a table's stages, with each op taking `cost[kind]` (kinds F, B,
    W, or BW for an unsplit backward: B + W, which needs the next chunk's B, or BW, before it;
    a balanced table's B1 and B2 take half of B each unless `cost` names them):
    every stage runs its ops in the table's order, each as soon as the stage is free and what it
    needs has finished (transfers free). Equal to the slot count's bubble when costs are equal."""
    stages = len(table[0])
    chunks, balanced = 1 + max(op.chunk for row in table for op in row if op is not None), is_balanced(table)
    cost = {"B1": cost.get("B", 0) / 2, "B2": cost.get("B", 0) / 2, **cost}
    finish: dict[tuple[str, int, int], float] = {}
    free, busy = [0.0] * stages, [0.0] * stages
    for row in table:  # slots are in dependency order, so one pass sees every input's finish
        for s, op in enumerate(row):
            if op is None:
                continue
            kind = "B" if op.kind == "BW" else op.kind
            inputs = [finish.get((n.kind, n.microbatch, n.chunk), finish.get(("BW", n.microbatch, n.chunk), 0.0))
                      for n in needs(Op(kind, op.microbatch, op.chunk), chunks, balanced)]
            start = max([free[s], *inputs])
            free[s] = finish[(op.kind, op.microbatch, op.chunk)] = start + cost[op.kind]
            busy[s] += cost[op.kind]
    return 1 - sum(busy) / (stages * max(free))


def slotted_bubble(table: Sequence[Sequence[Op | None]], cost: dict[str, float], costliest_everywhere: bool = False) -> float:
    """Idle time over all time when the stages run the table slot by slot in step, each slot as
    long as its longest op (`sharding.pipeline_zero_bubble`: one SPMD program, a `shard_map` per
    slot): what the program pays where `costed_bubble` lets each stage run ahead. With
    `costliest_everywhere`, every slot as long as the costliest kind of op in the table: the
    bound the kernel model gives (a conditional's costliest branch, as if it ran every time)
    and the planner prices the per-stage 1F1B by."""
    cost = {"B1": cost.get("B", 0) / 2, "B2": cost.get("B", 0) / 2, **cost}
    busy = sum(cost[op.kind] for row in table for op in row if op is not None)
    longest = max(cost[op.kind] for row in table for op in row if op is not None)
    total = len(table) * longest if costliest_everywhere else sum(
        max((cost[op.kind] for op in row if op is not None), default=0.0) for row in table)
    return 1 - busy / (len(table[0]) * total)


def per_stage_ops(table: Sequence[Sequence[Step]]) -> list[list[Op | None]]:
    """A per-stage 1F1B table (`schedule_1f1b_per_stage`, unbalanced) as ops, its backwards
    unsplit (BW), for `costed_bubble`."""
    return [[Op("F", *step.forward) if step.forward else Op("BW", *step.backward) if step.backward else None for step in row]
            for row in table]
