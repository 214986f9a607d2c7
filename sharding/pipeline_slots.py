"""What the per-stage pipeline programs (`sharding.pipeline_per_stage`: 1F1B,
`sharding.pipeline_zero_bubble`: ZB-H1, `sharding.pipeline_zbv`: ZB-V) share: their rings of
per-microbatch arrays, numbered ahead of time from a table (`Rings`, `number_op`) and read and
written in place (`get`; `put` for arrivals, `put_entry` for what a slot's op keeps); a split backward's gradients into the stage's sums
(`into_sums`, `halves_make`); their set-up (`stage_mesh`, `over_stages`, `microbatches`,
`stage_zeros`, `ring_zeros`); and the loop over the table's slots with the pipeline's ends around
each (`run_slots`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sharding.conditions import known_share
from sharding.constraints import active_mesh, constrain, constrain_leading, manual_axes
from sharding.dependence import depends_on_arguments
from sharding.mesh import ShardingError
from sharding.pipeline import end_add, end_zeros, loss_cotangent, microbatch, split_microbatches, with_ends, zero_loss
from sharding.schedules import PipelinePlan, check

STAGE, WHOLE = PartitionSpec("stage"), PartitionSpec()  # an array split over the stages, or whole on each


class Rings:
    """Per stage, numbered slots holding one microbatch's array each: `take` gives the lowest free
    one, `release` frees it; `depth` is the most slots a stage ever needed."""

    def __init__(self, stages: int):
        self.held, self.free, self.depth = [{} for _ in range(stages)], [[] for _ in range(stages)], 0

    def take(self, stage: int, microbatch: int) -> int:
        free = self.free[stage]
        slot = min(free) if free else len(self.held[stage])  # no free slot: 0 .. n-1 are all held
        self.free[stage] = [f for f in free if f != slot]
        self.held[stage][microbatch] = slot
        self.depth = max(self.depth, slot + 1)
        return slot

    def release(self, stage: int, microbatch: int) -> int:
        slot = self.held[stage].pop(microbatch)
        self.free[stage].append(slot)
        return slot


def number_op(out: dict[str, np.ndarray], rings: dict[str, Rings], t: int, s: int, key, reads: list[tuple],
              fills: list[str]) -> list[tuple[str, int, object]]:
    """Stage s's op in slot t: the ring entries it `<ring>_get`s (`reads`: (ring, whether it reads
    it last, so it is returned to be freed after the slot[, the column to name the entry in,
    where two ops of a slot read one ring])) and the ones it `<ring>_put`s, held under `key`."""
    frees = []
    for ring, last_use, *column in reads:
        out[column[0] if column else f"{ring}_get"][t, s] = rings[ring].held[s][key]
        if last_use:
            frees.append((ring, s, key))
    for ring in fills:
        out[f"{ring}_put"][t, s] = rings[ring].take(s, key)
    return frees


def put(ring, slot, x):
    """Entry `slot` of a ring (leading axis) set to `x`, in place; slot -1: none. (A conditional
    around the update copies the ring whole, and a scatter that drops an update past the ring's
    end compiles to the same select inside the update, with more rematerialised: both seen in the
    deviceless H100 program.)"""
    at = jnp.maximum(slot, 0)
    return jax.tree.map(lambda r, a: r.at[at].set(jnp.where(slot >= 0, a, r[at])), ring, x)


def put_entry(ring, slot, x):
    """Entry `slot` of a ring set to `x`, in place, unconditionally (slot -1: entry 0). Where no
    op fills an entry, `x` is the entry already at that slot (`get(ring, slot)`, given back by the
    slot's switch), so the write changes nothing: two passes over the entry, where `put`'s select
    takes five."""
    return jax.tree.map(lambda r, a: jax.lax.dynamic_update_index_in_dim(r, a.astype(r.dtype), jnp.maximum(slot, 0), 0), ring, x)


def get(ring, slot):
    return jax.tree.map(lambda r: r[jnp.maximum(slot, 0)], ring)


def into_sums(sums, dparams, made, rows: tuple[int, int] | None = None):
    """Half of a split backward's gradients and probes' statistics (`dparams`) into a stage's
    sums (float32 gradients, statistics' maxima), in place: all its layers, or `rows` (the first,
    how many). Only the gradients that half makes (`made`, per leaf: B's depend on the
    cotangent, W's on the taps, `sharding.dependence`): the other half's are zeros, and adding
    them would be a pass over the float32 sums (B's over every matmul weight's). Every statistic
    goes into its maximum (zero is no maximum's neutral element)."""

    def into(combine):
        def one(total, d, made=True):  # (statistics: every one)
            if not made:
                return total
            if rows is None:
                return combine(total, d.astype(jnp.float32))
            part = jax.lax.dynamic_slice_in_dim(total, rows[0], rows[1])
            return jax.lax.dynamic_update_slice_in_dim(total, combine(part, d.astype(jnp.float32)), rows[0], 0)
        return one

    dchunk, dprobes = dparams
    return jax.tree.map(into(jnp.add), sums[0], dchunk, made), sums[1] if dprobes is None else jax.tree.map(into(jnp.maximum), sums[1], dprobes)


def halves_make(split: Callable, x, taps_ring) -> tuple:
    """Which of a piece's parameters' gradients its B and its W make (`into_sums`'s `made`):
    `split(x)` is the piece's `split_vjp` at input `x`, `taps_ring` the ring of its taps (each
    entry what W takes)."""
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    entry = jax.tree.map(lambda r: jax.ShapeDtypeStruct(r.shape[1:], r.dtype), taps_ring)
    return (depends_on_arguments(lambda dy: split(x)[1](dy)[0][0], like),
            depends_on_arguments(lambda taps: split(x)[2](taps)[0], entry))


def stage_mesh(plan: PipelinePlan, params) -> dict:
    """`jax.shard_map`'s mesh argument for a per-stage program (none nested in a manual `data`,
    `sharding.per_replica`: the mesh in context), once the mesh in force is found to have the
    plan's stages and the plan buildable over `params`' stacked layers."""
    mesh = active_mesh()
    if mesh is None or mesh.shape.get("stage") != plan.stages:
        raise ShardingError(f"pipeline.schedule={plan.schedule} runs under a mesh whose `stage` axis has the plan's {plan.stages} stages")
    check(plan.stages, plan.microbatches, plan.repeats, jax.tree.leaves(params)[0].shape[0], schedule=plan.schedule,
          context=mesh.shape.get("context", 1))
    return {} if manual_axes() else {"mesh": mesh}


def over_stages(fn: Callable, in_mesh: dict, split: int, whole: int = 0) -> Callable:
    """`fn` run by each stage (`stage` manual): its first `split` arguments and its results split
    over `stage`, the next `whole` arguments whole."""
    return jax.shard_map(fn, **in_mesh, axis_names={"stage"}, check_vma=False, in_specs=(STAGE,) * split + (WHOLE,) * whole,
                         out_specs=STAGE)


class Microbatches(NamedTuple):
    inputs: jax.Array  # [M, ...]
    targets: jax.Array  # [M, ...]
    x_like: jax.ShapeDtypeStruct  # one microbatch embedded


def microbatches(inputs, targets, m: int, batch_axes: Sequence[str | None], embed_fn: Callable, embed_params) -> Microbatches:
    in_m = split_microbatches(inputs, m, batch_axes, "pipeline inputs")
    return Microbatches(in_m, split_microbatches(targets, m, batch_axes, "pipeline targets"),
                        jax.eval_shape(lambda: embed_fn(embed_params, in_m[0])))


def stage_zeros(stages: int, shape: Sequence[int], dtype) -> jax.Array:
    """Zeros `[stages, *shape]`, split over `stage`: a per-stage program's state."""
    return constrain_leading(jnp.zeros((stages, *shape), dtype), "stages", "pipeline per-stage state")


def ring_zeros(stages: int, depth: int, like) -> jax.Array:
    """A ring per stage `[stages, depth, ...]` of entries shaped like `like` (`[1, ...]`: one stage's)."""
    return stage_zeros(stages, (max(depth, 1), *like.shape[1:]), like.dtype)


def run_slots(staged: Callable, arrays: dict, state, *, column: str, head_on: Sequence[int], dx_on: Sequence[int], params, params_axes,
              probes, probes_axes, embed_fn: Callable, embed_params, mb: Microbatches, loss_fn: Callable, loss_params, seed,
              x_axes: Sequence[str | None], head_stage: int = -1, embed_column: str = "microbatch"):
    """A per-stage pipeline's slots (`staged`: every stage's work in one slot, the `shard_map`),
    with its ends around them: stage 0's embedding, the head and loss when the last stage's
    `column` is one of `head_on` (a forward), the embedding's gradient when stage 0's is one of
    `dx_on` (its backward's last part; `head_stage` 0: the head follows stage 0's, as in a V
    of chunks, `sharding.pipeline_zbv`; stage 0's `embed_column` names the microbatch the embedding
    feeds, where a slot holds two ops): outside the `shard_map`, so the vocabulary stays split
    over `stage` (as in the lockstep pipelines), under conditions the same on every device (the
    ends' columns of the table). The gradients are summed in float32, placed as `params` and
    `probes` (the probes' statistics: maxima). The loss and every gradient, as `owning_backward`
    takes them."""
    in_m, t_m, x_like = mb
    m, state_axes = in_m.shape[0], ("stages", *x_axes)
    placed = lambda tree, axes, fill=0.0: None if tree is None else jax.tree.map(  # noqa: E731
        lambda a, ax: constrain(jnp.full(a.shape, fill, jnp.float32), tuple(ax), "pipeline gradient sums"), tree, axes)
    sums = placed(params, params_axes), placed(probes, probes_axes, -jnp.inf)
    # The sums pass through the conditions (a branch that made fresh zeros would leave them
    # unplaced, which XLA refuses inside a manual `data`: sharding.per_replica).
    mb_placed = lambda x_mb: constrain(x_mb, x_axes, "pipeline microbatch")  # noqa: E731
    among = lambda value, kinds: functools.reduce(jnp.logical_or, [value == k for k in kinds])  # noqa: E731
    ends, head_end = with_ends(arrays), "first" if head_stage == 0 else "last"

    def slot(c, row):
        first, ending = row["first"], row[head_end]
        tokens = in_m[first[embed_column]]
        embedded, embed_pull = jax.vjp(lambda ep: embed_fn(ep, tokens).astype(x_like.dtype), embed_params)
        state, y, dx, sums = staged(c["state"], c["sums"], params, probes, {k: v for k, v in row.items() if k not in ("first", "last")},
                                    embedded, c["seed_dy"])
        y, dx = (constrain(a, state_axes, "pipeline stage outputs") for a in (y, dx))

        def head(loss, dloss, seed_dy):
            mb_loss, pull = jax.vjp(lambda lp, y: loss_fn(lp, y, microbatch(t_m, ending["microbatch"])), loss_params, y[head_stage])
            d_mb, dy = pull(loss_cotangent(mb_loss, seed / m))
            return loss + mb_loss.astype(jnp.float32) / m, end_add(dloss, d_mb), mb_placed(dy.astype(x_like.dtype))

        no_head = lambda loss, dloss, seed_dy: (loss, dloss, mb_placed(seed_dy))  # noqa: E731
        with known_share(np.isin(ends[head_end][column], head_on)):
            loss, dloss, seed_dy = jax.lax.cond(among(ending[column], head_on), head, no_head, c["loss"], c["dloss"], c["seed_dy"])
        with known_share(np.isin(ends["first"][column], dx_on)):
            dembed = jax.lax.cond(among(first[column], dx_on), lambda total: end_add(total, embed_pull(dx[0])[0]), lambda total: total,
                                  c["dembed"])
        return {"state": state, "sums": sums, "seed_dy": seed_dy, "loss": loss, "dloss": dloss, "dembed": dembed}, None

    c = {"state": state, "sums": sums, "seed_dy": jnp.zeros(x_like.shape, x_like.dtype), "loss": zero_loss(loss_fn, loss_params, x_like, t_m),
         "dloss": end_zeros(loss_params), "dembed": end_zeros(embed_params)}
    c, _ = jax.lax.scan(slot, c, jax.tree.map(jnp.asarray, ends))
    like = lambda tree, ref: jax.tree.map(lambda g, p: g.astype(p.dtype), tree, ref)  # noqa: E731
    dparams, stats = c["sums"]
    stats = None if probes is None else like(stats, probes)
    return c["loss"], (like(dparams, params), stats, like(c["dembed"], embed_params), like(c["dloss"], loss_params))
