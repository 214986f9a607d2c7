"""What `lm.bench`, `lm.layout` and the planner say of a pipeline plan: its schedule's name,
bubble and stash, read from the schedule's table (`sharding.schedules`, `sharding.zero_bubble`).
"""

from __future__ import annotations

from sharding.schedules import (
    PipelinePlan,
    balanced_slots,
    balanced_zero_bubble,
    bubble_fraction,
    held_per_stage,
    in_flight,
    schedule,
    schedule_1f1b,
    schedule_1f1b_per_stage,
    V_SHAPED,
)
from sharding.zero_bubble import V_TABLES, costed_bubble, held_until_w, schedule_zero_bubble, slotted_bubble, waiting_for_w


def split_costs(plan: PipelinePlan, costs: dict[str, float] | None = None) -> dict[str, float]:
    """The time of a chunk's F, B and W relative to each other (`costs`: their FLOPs, or a
    kernel model's times; default equal), B with the chunk's forward again when the plan
    recomputes it (remat `full`)."""
    costs = dict(costs or {"F": 1.0, "B": 1.0, "W": 1.0})
    if plan.remat == "full":
        costs["B"] += costs["F"]
    return costs


def report(plan: PipelinePlan, layers: int = 0, costs: dict[str, float] | None = None) -> dict:
    """The schedule's name, its bubble (idle time over all time of the stages: the idle share of
    the work slots; for the split-backward schedules each op costed by `split_costs`, a scale on
    which 1F1B's stays (S-1)/(M+S-1): `bubble` with each stage running ahead as its inputs allow,
    `slot_bubble` as the one SPMD program runs the table, each slot as long as its longest op on
    any stage, as the kernel model and the planner price it),
    its stash depth (how many microbatch chunks each stage
    keeps for its backward: every tick's for GPipe / circular, the most in flight for 1F1B,
    (R + 1)S - 1 when M is large enough, S for the per-stage 1F1B and for ZB-H1 from F to W) and
    what it keeps of each (`stash`: the stage inputs, recomputing the rest, with remat `full`;
    else residuals; the zero-bubble ones also B's matmul inputs and output gradients until W, for
    `w_stash_depth` microbatches at most; ZB-V's depths count chunks of half a stage, `chunk_share`)."""
    if plan.stages == 1:
        return {"schedule": "none", "bubble": 0.0, "stash_depth": 0, "stash": "none"}
    kept = "stage inputs" if plan.remat == "full" else "residuals"
    if plan.schedule == "zero_bubble":
        balanced = balanced_zero_bubble(plan, layers)
        table, costs = schedule_zero_bubble(plan.stages, plan.microbatches, balanced), split_costs(plan, costs)
        return {"schedule": "balanced zero_bubble" if balanced else plan.schedule, "bubble": costed_bubble(table, costs),
                "slot_bubble": slotted_bubble(table, costs),
                "stash_depth": max(held_until_w(table)), "stash": f"{kept}; matmul inputs and output gradients from B to W",
                "w_stash_depth": max(waiting_for_w(table))}
    if plan.schedule in V_SHAPED:  # two chunks a stage, each half its layers: depths counted in chunks
        table, costs = V_TABLES[plan.schedule](plan.stages, plan.microbatches), split_costs(plan, costs)
        return {"schedule": plan.schedule, "bubble": costed_bubble(table, costs), "slot_bubble": slotted_bubble(table, costs),
                "stash_depth": max(held_until_w(table)),
                "stash": f"{kept} of half-stage chunks; matmul inputs and output gradients from B to W", "w_stash_depth": max(waiting_for_w(table)),
                "chunk_share": 0.5}
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
