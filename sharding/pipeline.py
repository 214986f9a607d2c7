"""Pipeline parallelism over the 'stage' mesh axis, as one SPMD program: GPipe and circular
(`pipeline`, differentiated by autodiff); the 1F1B table (`schedule_1f1b`), whose program, which
runs its own backward, is `sharding.pipeline_1f1b`.

The stacked layer parameters `[layers, ...]` are viewed as `[repeats, stages, layers_per_chunk,
...]` with `stages` placed on the `stage` mesh axis: chunk `c = r * stages + s` (layers
`c * layers_per_chunk ...`) lives on stage `s`. A `lax.scan` runs `repeats * microbatches +
stages - 1` ticks; at each tick every stage applies its current chunk to the microbatch it holds
(a `vmap` over stages, which XLA partitions over the mesh axis), then activations shift one
stage on (`jnp.roll` along the stage axis, compiled to a collective-permute). A microbatch's
output of the last stage returns to stage 0 for the next repeat (circular / interleaved), or is
the result after the last. Gradients come from autodiff through the scan; each tick's stage
computation can be rematerialised.

GPipe is `repeats=1`, with bubble `(S-1)/(M+S-1)`; `repeats=R` gives `(S-1)/(R*M+S-1)`.
The schedule is also plain data (`schedule`), so it can be checked, drawn and its bubble read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharding.mesh import ShardingError
from sharding.remat import remat
from sharding.rules import constrain


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
    whatever M (GPipe keeps all RM).
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
            "or pipeline.schedule=1f1b for interleaved 1F1B"
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


def table_arrays(table: Sequence[Sequence[Work | None]], stages: int) -> dict[str, np.ndarray]:
    """The schedule as [ticks, stages] integer arrays the scan steps through: `microbatch`,
    `repeat` (which of a stage's chunks) and `active` (0 where the stage idles)."""
    cell = lambda w, f: 0 if w is None else f(w)  # noqa: E731
    return {
        "microbatch": np.array([[cell(w, lambda w: w.microbatch) for w in row] for row in table], np.int32),
        "repeat": np.array([[cell(w, lambda w: w.chunk // stages) for w in row] for row in table], np.int32),
        "active": np.array([[w is not None for w in row] for row in table], np.bool_),
    }


def with_ends(arrays: dict[str, np.ndarray]) -> dict:
    """`arrays` ([ticks, stages]) and, under "first" and "last", the first and the last stage's
    columns as [ticks] arrays of their own: the ends of the pipeline (embedding, head) read them
    without indexing a per-tick row the compiler has split over `stage`, which costs a broadcast
    from one device per read (and XLA hoists the constant ones out of the loop)."""
    return {**arrays, "first": {k: v[:, 0] for k, v in arrays.items()}, "last": {k: v[:, -1] for k, v in arrays.items()}}


def split_microbatches(x, count: int, axes: Sequence[str | None], name: str = "microbatches"):
    """`[batch, ...]` -> `[count, batch // count, ...]`. Microbatch j holds rows j, j + count, ...:
    every data-parallel shard holds part of each, so no rows move between devices."""
    b = x.shape[0]
    if b % count:
        raise ShardingError(f"batch {b} is not divisible into {count} microbatches")
    x_m = x.reshape(b // count, count, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x_m, (None, *axes), name)


def merge_microbatches(x_m):
    """The inverse of `split_microbatches`."""
    return x_m.swapaxes(0, 1).reshape(-1, *x_m.shape[2:])


def stage_chunks(params, params_axes, stages: int, repeats: int):
    """`[layers, ...]` -> `[repeats, stages, layers_per_chunk, ...]`, stages on the `stage` axis."""

    def one(p, axes):
        p = p.reshape(repeats, stages, p.shape[0] // (repeats * stages), *p.shape[1:])
        return constrain(p, (None, "stages", None, *tuple(axes)[1:]), "pipeline chunk")

    return jax.tree.map(one, params, params_axes)


def _per_tick(chunks, ticks: dict[str, np.ndarray], repeats: int):
    """`chunks` (`[repeats, stages, ...]` leaves) handed to every tick: `[ticks, repeats, stages,
    ...]`. Their gradient back is the maximum, not the sum, over the ticks at which stage s ran
    its repeat r: statistics (amaxes) of the work a stage did, bubble ticks excluded."""
    used = ticks["active"][:, None, :] & (ticks["repeat"][:, None, :] == np.arange(repeats)[None, :, None])  # [T, R, S]
    count = used.shape[0]

    @jax.custom_vjp
    def spread(chunks):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (count, *a.shape)), chunks)

    def backward(_, grads):
        def one(g):  # every (repeat, stage) runs at some tick: no -inf is left
            mask = used.reshape(*used.shape, *([1] * (g.ndim - used.ndim)))
            return jnp.max(jnp.where(mask, g, -jnp.inf), axis=0)

        return (jax.tree.map(one, grads),)

    spread.defvjp(lambda chunks: (spread(chunks), None), backward)
    return spread(chunks)


def pipeline(stage_fn: Callable, params, params_axes, x, x_axes: Sequence[str | None], plan: PipelinePlan, probes=None, probes_axes=None):
    """`stage_fn(chunk_params, chunk_probes, x_mb, chunk) -> y_mb` applied to every microbatch of
    `x` through all chunks; `chunk` (traced) is which one: layers `chunk * layers_per_chunk ...`.

    `params`: pytree of stacked layer parameters (leading axis: layers); `params_axes`: the same
    tree of logical-axis tuples; `x`: `[batch, ...]` with logical axes `x_axes`. Returns `[batch,
    ...]`, the same as applying all layers in order to `x`. The scan steps through the rows of
    `schedule(...)`, the same table the tests check and the notebook draws. `probes` (stacked
    like `params`, or None): zero inputs whose gradients are statistics, such as fp8 amaxes;
    every tick gets its own, and their gradients combine by maximum over the ticks that did
    real work (autodiff would sum them over microbatches and add the bubble's).
    """
    m, s, r = plan.microbatches, plan.stages, plan.repeats
    layers = jax.tree.leaves(params)[0].shape[0]
    check(s, m, r, layers)
    chunks = stage_chunks(params, params_axes, s, r)
    x_m = split_microbatches(x, m, x_axes, "pipeline microbatches")
    state_axes = ("stages", *x_axes)
    ticks = table_arrays(schedule(s, m, r), s)
    rows = jax.tree.map(jnp.asarray, with_ends(ticks))
    if probes is not None:
        rows["probes"] = _per_tick(stage_chunks(probes, probes_axes, s, r), ticks, r)

    def run_stage(chunk_params_r, probes_r, repeat, stage, x_mb):
        # The stage's chunk for this repeat, chosen by a select (a gather indexed per stage made
        # the XLA GPU compiler fail, "Failed after batched_gather_scatter_normalizer").
        pick = lambda p: p[0] if r == 1 else jax.lax.select_n(repeat, *(p[i] for i in range(r)))  # noqa: E731
        return stage_fn(jax.tree.map(pick, chunk_params_r), jax.tree.map(pick, probes_r), x_mb, repeat * s + stage)

    run_stage = remat(run_stage, plan.remat)

    def tick(carry, row):
        held, outputs = carry  # held: [stages, mb, ...] what each stage works on at this tick
        first, last = row["first"], row["last"]
        # Stage 0 takes a fresh microbatch in the first repeat, the last stage's output after.
        first_in = jnp.where(first["repeat"] == 0, x_m[first["microbatch"]], outputs[first["microbatch"]])
        held = held.at[0].set(first_in)
        held = constrain(held, state_axes, "pipeline stage inputs")
        out = jax.vmap(run_stage, in_axes=(1, 1, 0, 0, 0))(chunks, row.get("probes"), row["repeat"], jnp.arange(s), held)
        out = constrain(out, state_axes, "pipeline stage outputs")
        leaving = jnp.where(last["active"], out[-1], outputs[last["microbatch"]])
        outputs = outputs.at[last["microbatch"]].set(leaving)
        # Each stage's result moves to the next stage (a collective-permute over `stage`).
        return (jnp.roll(out, 1, axis=0), outputs), None

    held = constrain(jnp.zeros((s, *x_m.shape[1:]), x.dtype), state_axes, "pipeline stage inputs")
    outputs = jnp.zeros_like(x_m)
    (_, outputs), _ = jax.lax.scan(tick, (held, outputs), rows)
    return merge_microbatches(outputs)
