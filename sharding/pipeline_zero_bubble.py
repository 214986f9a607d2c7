"""Zero-bubble pipelines in one SPMD program: a split-backward table (`sharding.zero_bubble`: F,
B and W in slots) run stage by stage, as `sharding.pipeline_per_stage` runs 1F1B.

A `lax.scan` over the table's slots runs, each slot, a `jax.shard_map` with `stage` manual: each
device picks its op with a `lax.switch` on its column (F, B, W or nothing), then activations go
one stage on and B's input cotangents one stage back (`ppermute`). B gives the stage input's
cotangent and the gradients of everything but the matmul weights, and keeps, per weight matmul,
its input and output gradient (the "taps" of `split_vjp`, which the caller supplies: the model
owns its matmuls, and `sharding` never imports `lm`); W, later, turns those into the weights'
gradients. Every stage keeps four rings of per-microbatch arrays, each slot numbered ahead of
time from the table (`op_arrays`): activations from their arrival until used (until B when
recomputing: `pipeline.remat` full; until F when keeping residuals), cotangents from their
arrival until B, F's residuals until B (keeping them), B's taps until W. The embedding, the head
and the loss run between the `shard_map`s, where `stage` is automatic, as in the per-stage
1F1B: the vocabulary stays split over the stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sharding.constraints import active_mesh, constrain, constrain_leading, manual_axes
from sharding.mesh import ShardingError
from sharding.pipeline import owning_backward, split_microbatches, with_ends
from sharding.pipeline_1f1b import Pullbacks
from sharding.pipeline_per_stage import _Rings
from sharding.remat import remat
from sharding.schedules import PipelinePlan, check
from sharding.zero_bubble import Op, schedule_zero_bubble

IDLE, F, B, W = 0, 1, 2, 3
KIND = {"F": F, "B": B, "W": W}
RINGS = ("inbox", "cotangents", "residuals", "taps")  # what each keeps: see `op_arrays`


def op_arrays(table: Sequence[Sequence[Op | None]], keep_residuals: bool) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A one-chunk-per-stage split-backward table as [slots, stages] arrays: `kind` (IDLE, F, B,
    W), `microbatch`, and per ring of `RINGS` the slot an arrival or a result is `<ring>_put`
    into and the slot the op `<ring>_get`s (-1: none); then each ring's depth. An arriving
    activation or cotangent is put in its ring in the slot it arrives (before the slot's op reads
    it); a slot is free for reuse from the slot after its last reader. Stage 0 embeds its
    microbatch again rather than keep it; the last stage's cotangent comes from the head, the
    slot after its F."""
    slots, stages = len(table), len(table[0])
    names = ["kind", "microbatch"] + [f"{ring}_{way}" for ring in RINGS for way in ("put", "get")]
    out = {k: np.full((slots, stages), 0 if k in ("kind", "microbatch") else -1, np.int32) for k in names}
    rings = {ring: _Rings(stages) for ring in RINGS}
    for t, row in enumerate(table):
        frees = []
        for s, op in enumerate(row):
            before = table[t - 1] if t > 0 else [None] * stages
            sent_x = before[s - 1] if s > 0 else None
            sent_dy = before[s + 1] if s < stages - 1 else before[s]
            if sent_x is not None and sent_x.kind == "F":
                out["inbox_put"][t, s] = rings["inbox"].take(s, sent_x.microbatch)
            if sent_dy is not None and sent_dy.kind == ("B" if s < stages - 1 else "F"):
                out["cotangents_put"][t, s] = rings["cotangents"].take(s, sent_dy.microbatch)
            if op is None:
                continue
            m = op.microbatch
            out["kind"][t, s], out["microbatch"][t, s] = KIND[op.kind], m
            reads = []
            if op.kind == "F":
                if s > 0:
                    reads.append(("inbox", keep_residuals))  # keeping residuals, the input is done with
                if keep_residuals:
                    out["residuals_put"][t, s] = rings["residuals"].take(s, m)
            elif op.kind == "B":
                reads += [("cotangents", True)] + ([("residuals", True)] if keep_residuals else [("inbox", True)] if s > 0 else [])
                out["taps_put"][t, s] = rings["taps"].take(s, m)
            else:
                reads.append(("taps", True))
            for ring, last_use in reads:
                out[f"{ring}_get"][t, s] = rings[ring].held[s][m]
                if last_use:
                    frees.append((ring, s, m))
        for ring, s, m in frees:  # free from the next slot on
            rings[ring].release(s, m)
    return out, {ring: rings[ring].depth for ring in RINGS}


def pipeline_zero_bubble(stage_fn: Callable, params, params_axes, plan: PipelinePlan, *, split_vjp: Callable, embed_fn: Callable,
                         embed_params, inputs, loss_fn: Callable, loss_params, targets, x_axes: Sequence[str | None],
                         batch_axes: Sequence[str | None], probes=None, probes_axes=None, seed=1.0):
    """What `sharding.pipeline_per_stage.pipeline_per_stage` computes (same arguments), by
    `schedule_zero_bubble` (ZB-H1): each stage's backward run as B, then W in a later slot.
    `split_vjp(fn, params, x)` gives `(y, input_backward, weight_backward)` as
    `lm.model.split_backward.split_vjp` does. Needs the mesh in force to have the `stage` axis."""
    m, s = plan.microbatches, plan.stages
    mesh = active_mesh()
    if mesh is None or mesh.shape.get("stage") != s:
        raise ShardingError(f"pipeline.schedule={plan.schedule} runs under a mesh whose `stage` axis has the plan's {s} stages")
    check(s, m, plan.repeats, jax.tree.leaves(params)[0].shape[0], schedule=plan.schedule, context=mesh.shape.get("context", 1))
    keep_residuals, tick_fn = plan.remat != "full", remat(stage_fn, plan.remat)
    in_mesh = {} if manual_axes() else {"mesh": mesh}  # nested in a manual `data` (sharding.per_replica): the mesh in context
    arrays, depths = op_arrays(schedule_zero_bubble(s, m), keep_residuals)
    per_stage, whole = PartitionSpec("stage"), PartitionSpec()
    state_axes = ("stages", *x_axes)
    pullbacks = Pullbacks()
    f32 = lambda tree, fill=0.0: jax.tree.map(lambda a: jnp.full(a.shape, fill, jnp.float32), tree)  # noqa: E731

    def split(own, x, stage):
        """The chunk's forward with its backward in two (`split_vjp`), as `plan.remat` keeps it."""
        fn = tick_fn if keep_residuals else stage_fn
        return split_vjp(lambda p, x: fn(*p, x, stage), own, x)

    def forward_saving(own, x, stage):
        """The forward, and the residuals B needs (the pullback of the split's B, as
        `plan.remat` keeps them)."""
        y, input_backward, _ = split(own, x, stage)
        return y, pullbacks.split(input_backward, own)

    def stage_work(state, sums, chunk, chunk_probes, row, embedded, seed_dy):
        """One slot on one stage (inside the `shard_map`, `stage` manual): its op, then
        activations on and cotangents back; the rings kept in `state` (leading axis 1)."""
        stage = jax.lax.axis_index("stage")
        first, last = stage == 0, stage == s - 1
        state, row = jax.tree.map(lambda a: a[0], (state, row))
        own = chunk, chunk_probes
        c = dict(state)
        constants = []
        if keep_residuals:  # residuals that depend on no input (a mask): computed here, not stashed (dead code but for those)
            saved = forward_saving(own, embedded, stage)[1]
            constants = [r for r, constant in zip(saved, pullbacks.constant) if constant]

        def put(ring, slot, x):  # one entry (maybe none: slot -1) written in place, not the ring selected whole
            at = jnp.maximum(slot, 0)
            return jax.tree.map(lambda r, a: r.at[at].set(jnp.where(slot >= 0, a, r[at])), ring, x)

        def get(ring, slot):
            return jax.tree.map(lambda r: r[jnp.maximum(slot, 0)], ring)

        def added(sums, dchunk, dprobes):  # a gradient-making branch's own addition: no zeros made elsewhere
            return jax.tree.map(lambda g, d: g + d.astype(jnp.float32), sums[0], dchunk), jax.tree.map(
                lambda g, d: jnp.maximum(g, d.astype(jnp.float32)), sums[1], dprobes)

        # This slot's arrivals first (the op may read them at once).
        c["inbox"] = put(c["inbox"], row["inbox_put"], c["recv_x"])
        c["cotangents"] = put(c["cotangents"], row["cotangents_put"], jnp.where(last, seed_dy, c["recv_dx"]))
        x_in = jnp.where(first, embedded, get(c["inbox"], row["inbox_get"]))
        zeros = jnp.zeros_like(embedded)

        # Each branch gives (the sums, y, dx, what F and B keep). The rings are written outside:
        # a conditional that updated one would copy it whole (seen in the deviceless H100 program).
        made = {"residuals": jax.tree.map(lambda r: jnp.zeros_like(r[0]), c["residuals"]),
                "taps": jax.tree.map(lambda r: jnp.zeros_like(r[0]), c["taps"])}

        def idle(sums):
            return sums, zeros, zeros, made

        def forward(sums):
            if not keep_residuals:
                return sums, stage_fn(chunk, chunk_probes, x_in, stage), zeros, made
            y, saved = forward_saving(own, x_in, stage)
            return sums, y, zeros, {**made, "residuals": pullbacks.stashed(saved)}

        def input_backward(sums):
            dy = get(c["cotangents"], row["cotangents_get"])
            if keep_residuals:
                pull = pullbacks.join(pullbacks.merge(get(c["residuals"], row["residuals_get"]), constants), own)
                (dchunk, dprobes), dx, taps = pull(dy)
            else:  # recompute the chunk from its input
                (dchunk, dprobes), dx, taps = split(own, x_in, stage)[1](dy)
            return added(sums, dchunk, dprobes), zeros, dx, {**made, "taps": taps}

        def weight_backward(sums):
            dchunk, _ = split(own, x_in, stage)[2](get(c["taps"], row["taps_get"]))  # probes' statistics all come in B
            return (jax.tree.map(lambda g, d: g + d.astype(jnp.float32), sums[0], dchunk), sums[1]), zeros, zeros, made

        sums, y, dx, made = jax.lax.switch(row["kind"], [idle, forward, input_backward, weight_backward], sums)
        c["residuals"] = put(c["residuals"], row["residuals_put"], made["residuals"])
        c["taps"] = put(c["taps"], row["taps_put"], made["taps"])
        c["recv_x"] = jax.lax.ppermute(y, "stage", [(i, i + 1) for i in range(s - 1)])
        c["recv_dx"] = jax.lax.ppermute(dx, "stage", [(i + 1, i) for i in range(s - 1)])
        return (*jax.tree.map(lambda a: a[None], (c, y, dx)), sums)

    def run(params, probes, embed_params, loss_params, seed, inputs, targets):
        in_m = split_microbatches(inputs, m, batch_axes, "pipeline inputs")
        t_m = split_microbatches(targets, m, batch_axes, "pipeline targets")
        x_like = jax.eval_shape(lambda: embed_fn(embed_params, in_m[0]))
        stacked = lambda shape, dtype: constrain_leading(jnp.zeros((s, *shape), dtype), "stages", "pipeline per-stage state")  # noqa: E731
        ring = lambda depth, a: stacked((max(depth, 1), *a.shape[1:]), a.dtype)  # noqa: E731  [stages, depth, ...] from [1, ...]

        def shapes(chunk, chunk_probes, x):  # one stage's residuals and taps (eval_shape only)
            own = chunk, chunk_probes
            saved = []
            if keep_residuals:
                pullbacks.mark_constants(lambda c, p, x: forward_saving((c, p), x, 0), chunk, chunk_probes, x)
                saved = pullbacks.stashed(forward_saving(own, x, 0)[1])
            taps = split(own, x, 0)[1](jnp.zeros_like(x))[2]
            return jax.tree.map(lambda a: a[None], (saved, taps))

        stage_shard = jax.shard_map(shapes, **in_mesh, axis_names={"stage"}, check_vma=False, in_specs=(per_stage, per_stage, whole),
                                    out_specs=per_stage)
        saved, taps = jax.eval_shape(stage_shard, params, probes, jnp.zeros(x_like.shape, x_like.dtype))
        state = {"inbox": ring(depths["inbox"], jnp.zeros((1, *x_like.shape), x_like.dtype)),
                 "cotangents": ring(depths["cotangents"], jnp.zeros((1, *x_like.shape), x_like.dtype)),
                 "residuals": [ring(depths["residuals"], a) for a in saved],
                 "taps": jax.tree.map(lambda a: ring(depths["taps"], a), taps),
                 **{k: stacked(x_like.shape, x_like.dtype) for k in ("recv_x", "recv_dx")}}
        placed = lambda tree, axes, fill=0.0: None if tree is None else jax.tree.map(  # noqa: E731
            lambda a, ax: constrain(jnp.full(a.shape, fill, jnp.float32), tuple(ax), "pipeline gradient sums"), tree, axes)
        sums = placed(params, params_axes), placed(probes, probes_axes, -jnp.inf)

        staged = jax.shard_map(stage_work, **in_mesh, axis_names={"stage"}, check_vma=False,
                               in_specs=(per_stage,) * 5 + (whole, whole), out_specs=per_stage)

        def slot(c, row):
            """Stage 0's embedding, every stage's op, the head and loss if the last stage ran an
            F, the embedding's gradient if stage 0 ran a B (outside the `shard_map`: see
            `sharding.pipeline_per_stage`)."""
            first, last = row["first"], row["last"]
            tokens = in_m[first["microbatch"]]
            embedded, embed_pull = jax.vjp(lambda ep: embed_fn(ep, tokens).astype(x_like.dtype), embed_params)
            state, y, dx, sums = staged(c["state"], c["sums"], params, probes, {k: v for k, v in row.items() if k not in ("first", "last")},
                                        embedded, c["seed_dy"])
            y, dx = (constrain(a, state_axes, "pipeline stage outputs") for a in (y, dx))
            add = lambda total, d: jax.tree.map(lambda a, b: a + b.astype(jnp.float32), total, d)  # noqa: E731
            mb_placed = lambda x_mb: constrain(x_mb, x_axes, "pipeline microbatch")  # noqa: E731

            def head(loss, dloss, seed_dy):
                mb_loss, pull = jax.vjp(lambda lp, y: loss_fn(lp, y, t_m[last["microbatch"]]), loss_params, y[-1])
                d_mb, dy = pull((seed / m).astype(mb_loss.dtype))
                return loss + mb_loss.astype(jnp.float32) / m, add(dloss, d_mb), mb_placed(dy.astype(x_like.dtype))

            no_head = lambda loss, dloss, seed_dy: (loss, dloss, mb_placed(seed_dy))  # noqa: E731
            loss, dloss, seed_dy = jax.lax.cond(last["kind"] == F, head, no_head, c["loss"], c["dloss"], c["seed_dy"])
            dembed = jax.lax.cond(first["kind"] == B, lambda total: add(total, embed_pull(dx[0])[0]), lambda total: total, c["dembed"])
            return {"state": state, "sums": sums, "seed_dy": seed_dy, "loss": loss, "dloss": dloss, "dembed": dembed}, None

        c = {"state": state, "sums": sums, "seed_dy": jnp.zeros(x_like.shape, x_like.dtype), "loss": jnp.zeros((), jnp.float32),
             "dloss": f32(loss_params), "dembed": f32(embed_params)}
        c, _ = jax.lax.scan(slot, c, jax.tree.map(jnp.asarray, with_ends(arrays)))
        like = lambda tree, ref: jax.tree.map(lambda g, p: g.astype(p.dtype), tree, ref)  # noqa: E731
        dparams, stats = c["sums"]
        stats = None if probes is None else like(stats, probes)
        return c["loss"], (like(dparams, params), stats, like(c["dembed"], embed_params), like(c["dloss"], loss_params))

    return owning_backward(run, (params, probes, embed_params, loss_params), seed, (inputs, targets), statistics=(1,))
