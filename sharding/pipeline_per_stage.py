"""1F1B with each stage running its own half of every slot: Megatron-LM's in-flight bound (at most
S - s microbatches at stage s) in one SPMD program.

`sharding.pipeline_1f1b` steps every stage in lockstep (a vmap over stages, which the compiler
splits over `stage`): a microbatch's round trip takes two ticks per stage, so stage s keeps
2(S - s) - 1 inputs. Here a `jax.shard_map` makes `stage` manual (data, fsdp, context and
tensor stay with the partitioner, placed by the logical rules inside as everywhere else), each
device picks its half of the slot with a `lax.switch` on its column of
`schedule_1f1b_per_stage`, and activations and cotangents move one stage per slot
(`ppermute`). Recomputing (`pipeline.remat` full), a device keeps at most S stage inputs (stage 0
embeds its microbatch again rather than keep it); keeping residuals (any other policy), at most
S sets of a chunk's pullback residuals, Megatron's own bound. The cost: a slot lasts as long as
the slowest stage's half, a backward, where a lockstep tick is one forward plus one backward;
and the embedding and head tables are whole on every stage (inside the manual region the
vocabulary cannot be split over `stage`). Interleaving (`repeats` > 1) is not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sharding.mesh import ShardingError
from sharding.pipeline import (
    PipelinePlan,
    Step,
    check,
    schedule_1f1b_per_stage,
    split_microbatches,
)
from sharding.pipeline_1f1b import Pullbacks, owning_backward
from sharding.remat import remat
from sharding.rules import active_mesh

IDLE, FORWARD, BACKWARD = 0, 1, 2


def f32_of(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


class _Rings:
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


def slot_arrays(table: Sequence[Sequence[Step]], keep_residuals: bool = False) -> tuple[dict[str, np.ndarray], int, int]:
    """`schedule_1f1b_per_stage`'s table as [slots, stages] arrays: `half` (IDLE, FORWARD,
    BACKWARD), `microbatch`, `store` (the inbox slot where the activation arriving this slot is
    kept; -1: none arrives, or it is used at once and not needed again), `read` (the inbox slot
    the half reads its stage input from; -1: the activation that arrived this slot), and with
    `keep_residuals`, `keep` (the residual slot a forward fills) and `use` (the one its backward
    reads); then the inbox's and the residual stash's depths. Recomputing, an input stays in the
    inbox until its backward; keeping residuals, until its forward, and the forward's residuals
    until the backward. Stage 0 embeds its microbatch again rather than keep it. A slot's reads
    free their slots before its arrival takes the lowest free one."""
    slots, stages = len(table), len(table[0])
    names = ("half", "microbatch", "store", "read", "keep", "use")
    out = {k: np.full((slots, stages), IDLE if k == "half" else 0 if k == "microbatch" else -1, np.int32) for k in names}
    inbox, residuals = _Rings(stages), _Rings(stages)
    for t, row in enumerate(table):
        for s, step in enumerate(row):
            arriving = table[t - 1][s - 1].forward if t > 0 and s > 0 else None
            fresh = arriving is not None and step.forward is not None and arriving.microbatch == step.forward.microbatch
            if step.backward is not None:
                m = step.backward.microbatch
                out["half"][t, s], out["microbatch"][t, s] = BACKWARD, m
                if keep_residuals:
                    out["use"][t, s] = residuals.release(s, m)
                elif s > 0:
                    out["read"][t, s] = inbox.release(s, m)
                if s < stages - 1 and table[t - 1][s + 1].backward != step.backward._replace(chunk=s + 1):
                    raise AssertionError(f"stage {s}'s backward of microbatch {m} at slot {t} lacks its cotangent")
            if step.forward is not None:
                m = step.forward.microbatch
                out["half"][t, s], out["microbatch"][t, s] = FORWARD, m
                if s > 0 and not fresh:
                    out["read"][t, s] = inbox.release(s, m) if keep_residuals else inbox.held[s][m]
                if keep_residuals:
                    out["keep"][t, s] = residuals.take(s, m)
            if arriving is not None and not (fresh and keep_residuals):
                out["store"][t, s] = inbox.take(s, arriving.microbatch)
    return out, inbox.depth, residuals.depth


def pipeline_per_stage(stage_fn: Callable, params, params_axes, plan: PipelinePlan, *, embed_fn: Callable, embed_params, inputs,
                       loss_fn: Callable, loss_params, targets, x_axes: Sequence[str | None], batch_axes: Sequence[str | None],
                       probes=None, probes_axes=None, seed=1.0):
    """What `sharding.pipeline_1f1b.pipeline_1f1b` computes (same arguments: the mean over
    microbatches of `loss_fn(loss_params, layers(embed_fn(embed_params, inputs_mb)), targets_mb)`,
    differentiable, its own backward run at `seed`), by `schedule_1f1b_per_stage`: every stage
    keeps at most S - 1 stage inputs, whatever the number of microbatches. Needs the mesh in force
    (`sharding.activate`) to have the `stage` axis."""
    del params_axes, probes_axes  # each stage's chunk is its shard of the stacked `[layers, ...]` arrays
    m, s = plan.microbatches, plan.stages
    mesh = active_mesh()
    if mesh is None or mesh.shape.get("stage") != s:
        raise ShardingError(f"pipeline.schedule=1f1b_per_stage runs under a mesh whose `stage` axis has the plan's {s} stages")
    check(s, m, plan.repeats, jax.tree.leaves(params)[0].shape[0], schedule="1f1b_per_stage", context=mesh.shape.get("context", 1))
    keep_residuals, tick_fn, pullbacks = plan.remat != "full", remat(stage_fn, plan.remat), Pullbacks()
    arrays, inbox_depth, stash_depth = slot_arrays(schedule_1f1b_per_stage(s, m), keep_residuals)

    def run(params, probes, embed_params, loss_params, seed, inputs, targets):
        def body(chunk, chunk_probes, embed_params, loss_params, seed, inputs, targets, rows):
            stage = jax.lax.axis_index("stage")
            first, last = stage == 0, stage == s - 1
            in_m = split_microbatches(inputs, m, batch_axes, "pipeline inputs")
            t_m = split_microbatches(targets, m, batch_axes, "pipeline targets")
            f32 = lambda tree, fill=0.0: jax.tree.map(lambda a: jnp.full(a.shape, fill, jnp.float32), tree)  # noqa: E731
            x_like = jax.eval_shape(lambda: embed_fn(embed_params, in_m[0]))
            zero_x = jnp.zeros(x_like.shape, x_like.dtype)

            def forward_saving(chunk, chunk_probes, x):
                """The stage's forward, and the residuals its backward needs (as `plan.remat` keeps them)."""
                y, pull = jax.vjp(lambda c, p, x: tick_fn(c, p, x, stage), chunk, chunk_probes, x)
                return y, pullbacks.split(pull, (chunk, chunk_probes))

            constants, stash = (), []
            if keep_residuals:  # a ring per residual array that varies; those that do not, once
                pullbacks.mark_constants(forward_saving, chunk, chunk_probes, zero_x)
                _, example = forward_saving(chunk, chunk_probes, zero_x)  # shapes only: dead code
                constants = [r for r, constant in zip(example, pullbacks.constant) if constant]
                stash = [jnp.zeros((stash_depth, *a.shape), a.dtype) for a in pullbacks.stashed(example)]
            nothing = {"y": zero_x, "dx": zero_x, "seed_dy": zero_x, "dchunk": f32(chunk), "dprobes": f32(chunk_probes, -jnp.inf),
                       "dloss": f32(loss_params), "loss": jnp.zeros((), jnp.float32), "residuals": [jnp.zeros_like(r[0]) for r in stash]}

            def stage_input(c, row, embedded):  # stage 0's is its embedded microbatch
                waiting = c["inbox"][jnp.maximum(row["read"], 0)]
                return jnp.where(first, embedded, jnp.where(row["read"] < 0, c["recv_x"], waiting))

            def forward(c, row, embedded, chunk, chunk_probes):
                x = stage_input(c, row, embedded)
                if not keep_residuals:
                    return {**nothing, "y": stage_fn(chunk, chunk_probes, x, stage)}
                y, residuals = forward_saving(chunk, chunk_probes, x)
                return {**nothing, "y": y, "residuals": pullbacks.stashed(residuals)}

            def forward_last(c, row, embedded, chunk, chunk_probes):  # and the head and loss, seeding the backward
                out = forward(c, row, embedded, chunk, chunk_probes)
                loss, pull = jax.vjp(lambda lp, y: loss_fn(lp, y, t_m[row["microbatch"]]), loss_params, out["y"])
                dloss, dy = pull((seed / m).astype(loss.dtype))
                return {**out, "seed_dy": dy.astype(zero_x.dtype), "dloss": f32_of(dloss), "loss": loss.astype(jnp.float32) / m}

            def backward(c, row, embedded, chunk, chunk_probes):
                cotangent = jnp.where(last, c["seed_dy"], c["recv_dx"])
                if keep_residuals:
                    saved = [ring[jnp.maximum(row["use"], 0)] for ring in c["stash"]]
                    pull = pullbacks.join(pullbacks.merge(saved, constants), (chunk, chunk_probes))
                else:  # recompute the chunk from its input
                    pull = jax.vjp(lambda c, p, x: stage_fn(c, p, x, stage), chunk, chunk_probes, stage_input(c, row, embedded))[1]
                dchunk, dprobes, dx = pull(cotangent)
                return {**nothing, "dx": dx, "dchunk": f32_of(dchunk), "dprobes": f32_of(dprobes)}

            branches = [lambda *_: nothing, forward, forward_last, backward]

            def slot(c, row):
                row = jax.tree.map(lambda a: a[0], row)  # this stage's entry
                pick = jnp.where(row["half"] == FORWARD, 1 + last, jnp.where(row["half"] == BACKWARD, 3, 0))
                # The embedding (stage 0's) and its gradient run on every stage, outside the
                # branches: the partitioner may move the token ids with a collective-permute,
                # which every device must join (XLA:CPU waits for all of them).
                tokens = in_m[row["microbatch"]]
                embedded, embed_pull = jax.vjp(lambda ep: embed_fn(ep, tokens).astype(zero_x.dtype), embed_params)
                out = jax.lax.switch(pick, branches, c, row, embedded, chunk, chunk_probes)
                (dembed,) = embed_pull(jnp.where(first & (row["half"] == BACKWARD), out["dx"], 0.0).astype(zero_x.dtype))
                c = dict(c)
                c["dembed"] = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), c["dembed"], dembed)
                for name in ("dchunk", "dloss"):
                    c[name] = jax.tree.map(jnp.add, c[name], out[name])
                c["dprobes"] = jax.tree.map(jnp.maximum, c["dprobes"], out["dprobes"])
                c["loss"] = c["loss"] + out["loss"]
                c["seed_dy"] = jnp.where(row["half"] == FORWARD, out["seed_dy"], c["seed_dy"])
                keep = lambda ring, slot, x: jnp.where(slot >= 0, ring.at[jnp.maximum(slot, 0)].set(x), ring)  # noqa: E731
                c["stash"] = [keep(ring, row["keep"], r) for ring, r in zip(c["stash"], out["residuals"])]
                # The activation that arrived this slot waits (after this slot's reads freed their slots).
                c["inbox"] = keep(c["inbox"], row["store"], c["recv_x"])
                c["recv_x"] = jax.lax.ppermute(out["y"], "stage", [(i, i + 1) for i in range(s - 1)])
                c["recv_dx"] = jax.lax.ppermute(out["dx"], "stage", [(i + 1, i) for i in range(s - 1)])
                return c, None

            c = {"inbox": jnp.zeros((max(inbox_depth, 1), *zero_x.shape), zero_x.dtype), "stash": stash, "recv_x": zero_x, "recv_dx": zero_x,
                 "dembed": f32(embed_params), **{k: nothing[k] for k in ("seed_dy", "dchunk", "dprobes", "dloss", "loss")}}
            c, _ = jax.lax.scan(slot, c, rows)
            total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, "stage"), tree)  # noqa: E731  held by one stage
            return (c["dchunk"], c["dprobes"], total(c["dembed"]), total(c["dloss"])), total(c["loss"])

        stage_spec, whole = PartitionSpec("stage"), PartitionSpec()
        mapped = jax.shard_map(
            body, mesh=mesh, axis_names={"stage"}, check_vma=False,
            in_specs=(stage_spec, stage_spec, whole, whole, whole, whole, whole, PartitionSpec(None, "stage")),
            out_specs=((stage_spec, stage_spec, whole, whole), whole),
        )
        (dparams, stats, dembed, dloss), loss = mapped(params, probes, embed_params, loss_params, seed, inputs, targets,
                                                          jax.tree.map(jnp.asarray, arrays))
        like = lambda tree, ref: jax.tree.map(lambda g, p: g.astype(p.dtype), tree, ref)  # noqa: E731
        stats = None if probes is None else like(stats, probes)
        return loss, (like(dparams, params), stats, like(dembed, embed_params), like(dloss, loss_params))

    return owning_backward(run, params, probes, embed_params, loss_params, seed, inputs, targets)
