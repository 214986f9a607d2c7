"""ZB-V in one SPMD program (`pipeline.schedule=zbv`): the layers in 2S chunks, stage s running
chunk s on the way down and chunk 2S - 1 - s on the way back (`sharding.zero_bubble.v_chunks`),
each backward as B, then W in a later slot, run slot by slot as `sharding.pipeline_zero_bubble`
runs ZB-H1 (on `sharding.pipeline_slots`). The last stage turns each microbatch round on the
device; stage 0 ends it, the head and loss following its output between the `shard_map`s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.constraints import constrain
from sharding.mesh import ShardingError
from sharding.pipeline import owning_backward
from sharding.pipeline_1f1b import Pullbacks
from sharding.pipeline_slots import (Rings, get, halves_make, into_sums, microbatches, number_op, over_stages, put, ring_zeros, run_slots,
                                     stage_mesh, stage_zeros)
from sharding.remat import remat
from sharding.schedules import PipelinePlan
from sharding.zero_bubble import Op, schedule_zbv, v_chunks

# ZB-V's ops: each kind on the stage's chunk going down (these) or coming back (these + 1).
F_DOWN, B_DOWN, W_DOWN = 1, 3, 5
V_RINGS = ("inbox", "cotangents", "residuals", "taps")


def zbv_arrays(table: Sequence[Sequence[Op | None]], keep_residuals: bool) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A ZB-V table (`schedule_zbv`) as [slots, stages] arrays: `kind` (IDLE, or F_DOWN, B_DOWN,
    W_DOWN, plus 1 on the chunk coming back), `microbatch`, per ring of `V_RINGS` the slot the op
    `<ring>_get`s and (residuals, taps) `<ring>_put`s, and the slot each of a stage's four
    possible arrivals is put into: `inbox_put_down` (an activation from the stage above, for the
    chunk going down), `inbox_put_up` (from the stage below; on the last stage from its own chunk
    going down: the V's turn), `cotangents_put_down` (from below; on the last stage its own chunk
    coming back's), `cotangents_put_up` (from above; on stage 0 the head's). A stage's two chunks
    share its rings, entries numbered per (microbatch, chunk). Then each ring's depth."""
    slots, stages = len(table), len(table[0])
    arrivals = [f"{ring}_put_{way}" for ring in ("inbox", "cotangents") for way in ("down", "up")]
    names = ["kind", "microbatch", "inbox_get", "cotangents_get", "residuals_put", "residuals_get", "taps_put", "taps_get", *arrivals]
    out = {k: np.full((slots, stages), 0 if k in ("kind", "microbatch") else -1, np.int32) for k in names}
    rings = {ring: Rings(stages) for ring in V_RINGS}

    def sent(t: int, s: int, kind: str, chunk: int) -> int | None:  # the microbatch of stage s's op in slot t - 1, if `kind` of `chunk`
        op = table[t - 1][s] if t > 0 else None
        return op.microbatch if op is not None and op == Op(kind, op.microbatch, chunk) else None

    for t, row in enumerate(table):
        frees = []
        for s, op in enumerate(row):
            (down, up), below = v_chunks(stages)[s], min(s + 1, stages - 1)  # the last stage's "below" is itself: the turn
            came = {"inbox_put_down": (sent(t, s - 1, "F", down - 1) if s > 0 else None, down),
                    "inbox_put_up": (sent(t, below, "F", up - 1), up),
                    "cotangents_put_down": (sent(t, below, "B", down + 1), down),
                    "cotangents_put_up": (sent(t, s - 1, "B", up + 1) if s > 0 else sent(t, 0, "F", up), up)}
            for name, (m, chunk) in came.items():
                if m is not None:
                    out[name][t, s] = rings[name.split("_")[0]].take(s, (m, chunk))
            if op is None:
                continue
            key, from_inbox = (op.microbatch, op.chunk), op.chunk > 0  # chunk 0's input: stage 0's embedding
            out["kind"][t, s], out["microbatch"][t, s] = {"F": F_DOWN, "B": B_DOWN, "W": W_DOWN}[op.kind] + (op.chunk == up), op.microbatch
            kept = [("residuals", True)] if keep_residuals else [("inbox", True)] if from_inbox else []
            reads, fills = {"F": ([("inbox", keep_residuals)] if from_inbox else [], ["residuals"] if keep_residuals else []),
                            "B": ([("cotangents", True), *kept], ["taps"]),
                            "W": ([("taps", True)], [])}[op.kind]
            frees += number_op(out, rings, t, s, key, reads, fills)
        for ring, s, key in frees:  # free from the next slot on
            rings[ring].release(s, key)
    return out, {ring: rings[ring].depth for ring in V_RINGS}


def v_order(tree, axes, stages: int):
    """Stacked layers `[layers, ...]` (the `stage` axis on layers) reordered so that stage s's
    block holds its two chunks of a V (`v_chunks`): chunk s, then chunk 2S - 1 - s. Autodiff
    puts the gradients back in model order."""
    if tree is None:
        return None

    def one(a, ax):
        halves = a.reshape(2, stages, a.shape[0] // (2 * stages), *a.shape[1:])  # [way, stage, layers per chunk, ...]
        return constrain(jnp.stack([halves[0], halves[1][::-1]], axis=1).reshape(a.shape), tuple(ax), "pipeline V order")

    return jax.tree.map(one, tree, axes)


def pipeline_zbv(stage_fn: Callable, params, params_axes, plan: PipelinePlan, *, split_vjp: Callable, embed_fn: Callable,
                 embed_params, inputs, loss_fn: Callable, loss_params, targets, x_axes: Sequence[str | None],
                 batch_axes: Sequence[str | None], probes=None, probes_axes=None, seed=1.0):
    """What `pipeline_zero_bubble` computes (same arguments), by `schedule_zbv` (ZB-V): the layers
    in 2S chunks, stage s running chunk s on the way down and chunk 2S - 1 - s on the way back
    (`v_order` puts them so), the last stage turning each microbatch round in place and stage 0
    ending it (the head and the loss follow its output); every backward as B, then W in a later
    slot. Activations and cotangents go both ways each slot (four `ppermute`s)."""
    m, s = plan.microbatches, plan.stages
    in_mesh = stage_mesh(plan, params)
    layers = jax.tree.leaves(params)[0].shape[0]
    keep_residuals, tick_fn = plan.remat != "full", remat(stage_fn, plan.remat)
    arrays, depths = zbv_arrays(schedule_zbv(s, m), keep_residuals)
    per_chunk = layers // (2 * s)
    pieces = [lambda t: jax.tree.map(lambda a: a[:per_chunk], t), lambda t: jax.tree.map(lambda a: a[per_chunk:], t)]
    pullbacks = [Pullbacks(), Pullbacks()]

    def split(v, own, x, stage, mine=None):
        """Chunk v's (0: going down, 1: coming back) forward with its backward in two."""
        fn, index = tick_fn if keep_residuals else stage_fn, stage if v == 0 else 2 * s - 1 - stage
        return split_vjp(lambda p, x: fn(*p, x, index), jax.tree.map(pieces[v], own) if mine is None else mine, x)

    def forward_saving(v, own, x, stage):  # the chunk's parameters sliced once, known to `Pullbacks` (as in `pipeline_zero_bubble`)
        mine = jax.tree.map(pieces[v], own)
        y, input_backward, _ = split(v, own, x, stage, mine)
        return y, pullbacks[v].split(input_backward, mine)

    def stage_work(state, sums, chunk, chunk_probes, row, embedded, seed_dy):
        """One slot on one stage (inside the `shard_map`, `stage` manual)."""
        stage = jax.lax.axis_index("stage")
        first, last = stage == 0, stage == s - 1
        state, row = jax.tree.map(lambda a: a[0], (state, row))
        own, c = (chunk, chunk_probes), dict(state)
        constants = [[], []]
        if keep_residuals:  # residuals that depend on no input (a mask): computed here, not stashed
            for v in range(2):
                constants[v] = [r for r, constant in zip(forward_saving(v, own, embedded, stage)[1], pullbacks[v].constant) if constant]
        # This slot's arrivals first (the op may read them at once).
        c["inbox"] = put(c["inbox"], row["inbox_put_down"], c["x_above"])
        c["inbox"] = put(c["inbox"], row["inbox_put_up"], jnp.where(last, c["own_y"], c["x_below"]))
        c["cotangents"] = put(c["cotangents"], row["cotangents_put_down"], jnp.where(last, c["own_dx"], c["dx_below"]))
        c["cotangents"] = put(c["cotangents"], row["cotangents_put_up"], jnp.where(first, seed_dy, c["dx_above"]))
        zeros = jnp.zeros_like(embedded)
        made = {ring: jax.tree.map(lambda r: jnp.zeros_like(r[0]), c[ring]) for ring in ("residuals", "taps")}

        def x_in(v):
            waiting = get(c["inbox"], row["inbox_get"])
            return jnp.where(first, embedded, waiting) if v == 0 else waiting

        # Which gradients each chunk's B and W make; B's and W's added into the chunk's rows.
        b_makes, w_makes = zip(*[halves_make(lambda x: split(v, own, x, stage), embedded, c["taps"]) for v in range(2)])  # noqa: B023
        added = lambda sums, v, dparams, made: into_sums(sums, dparams, made, (v * per_chunk, per_chunk))  # noqa: E731

        def idle(sums):
            return sums, zeros, zeros, made

        def forward(v):
            def run(sums):
                if not keep_residuals:
                    return sums, split(v, own, x_in(v), stage)[0], zeros, made
                y, saved = forward_saving(v, own, x_in(v), stage)
                return sums, y, zeros, {**made, "residuals": pullbacks[v].stashed(saved)}
            return run

        def backward(v):
            def run(sums):
                dy = get(c["cotangents"], row["cotangents_get"])
                if keep_residuals:
                    saved = pullbacks[v].merge(get(c["residuals"], row["residuals_get"]), constants[v])
                    pull = pullbacks[v].join(saved, jax.tree.map(pieces[v], own))
                else:  # recompute the chunk from its input
                    pull = split(v, own, x_in(v), stage)[1]
                dparams, dx, taps = pull(dy)
                return added(sums, v, dparams, b_makes[v]), zeros, dx, {**made, "taps": taps}
            return run

        def weight_backward(v):
            def run(sums):  # probes' statistics all come in B
                dchunk, _ = split(v, own, x_in(v), stage)[2](get(c["taps"], row["taps_get"]))
                return added(sums, v, (dchunk, None), w_makes[v]), zeros, zeros, made
            return run

        branches = [idle, forward(0), forward(1), backward(0), backward(1), weight_backward(0), weight_backward(1)]
        sums, y, dx, made = jax.lax.switch(row["kind"], branches, sums)
        c["residuals"] = put(c["residuals"], row["residuals_put"], made["residuals"])
        c["taps"] = put(c["taps"], row["taps_put"], made["taps"])
        c["own_y"], c["own_dx"] = y, dx
        down, up = [(i, i + 1) for i in range(s - 1)], [(i + 1, i) for i in range(s - 1)]
        c["x_above"], c["x_below"] = jax.lax.ppermute(y, "stage", down), jax.lax.ppermute(y, "stage", up)
        c["dx_above"], c["dx_below"] = jax.lax.ppermute(dx, "stage", down), jax.lax.ppermute(dx, "stage", up)
        return (*jax.tree.map(lambda a: a[None], (c, y, dx)), sums)

    def run(params, probes, embed_params, loss_params, seed, inputs, targets):
        mb = microbatches(inputs, targets, m, batch_axes, embed_fn, embed_params)
        activation = jnp.zeros((1, *mb.x_like.shape), mb.x_like.dtype)

        def shapes(chunk, chunk_probes, x):  # each chunk's stashed residuals and taps (eval_shape only)
            own, out = (chunk, chunk_probes), []
            for v in range(2):
                saved = []
                if keep_residuals:
                    pullbacks[v].mark_constants(lambda c, p, x: forward_saving(v, (c, p), x, 0), chunk, chunk_probes, x)  # noqa: B023
                    saved = pullbacks[v].stashed(forward_saving(v, own, x, 0)[1])
                out.append((saved, split(v, own, x, 0)[1](jnp.zeros_like(x))[2]))
            return jax.tree.map(lambda a: a[None], out)

        down_chunk, up_chunk = jax.eval_shape(over_stages(shapes, in_mesh, 2, 1), params, probes, activation[0])
        if jax.tree.structure(down_chunk) != jax.tree.structure(up_chunk) or jax.tree.leaves(down_chunk) != jax.tree.leaves(up_chunk):
            raise ShardingError("pipeline.schedule=zbv needs a stage's two chunks alike (they share its rings); "
                                "use pipeline.schedule=zero_bubble")
        saved, taps = down_chunk
        state = {"inbox": ring_zeros(s, depths["inbox"], activation), "cotangents": ring_zeros(s, depths["cotangents"], activation),
                 "residuals": jax.tree.map(lambda a: ring_zeros(s, depths["residuals"], a), saved),
                 "taps": jax.tree.map(lambda a: ring_zeros(s, depths["taps"], a), taps),
                 **{k: stage_zeros(s, mb.x_like.shape, mb.x_like.dtype) for k in ("own_y", "own_dx", "x_above", "x_below", "dx_above", "dx_below")}}
        return run_slots(over_stages(stage_work, in_mesh, 5, 2), arrays, state, column="kind", head_on=(F_DOWN + 1,), dx_on=(B_DOWN,),
                         head_stage=0, params=params, params_axes=params_axes, probes=probes, probes_axes=probes_axes, embed_fn=embed_fn,
                         embed_params=embed_params, mb=mb, loss_fn=loss_fn, loss_params=loss_params, seed=seed, x_axes=x_axes)

    ordered = v_order(params, params_axes, s), v_order(probes, probes_axes, s)
    return owning_backward(run, (*ordered, embed_params, loss_params), seed, (inputs, targets), statistics=(1,))
