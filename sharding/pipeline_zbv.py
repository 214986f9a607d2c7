"""ZB-V and DualPipeV in one SPMD program (`pipeline.schedule=zbv` / `dualpipev`): the layers in
2S chunks, stage s running chunk s on the way down and chunk 2S - 1 - s on the way back
(`sharding.zero_bubble.v_chunks`), each backward as B, then W in a later slot, or whole (BW), and
DualPipeV's pairs (one chunk's F beside the other's BW in a slot), run slot by slot as
`sharding.pipeline_zero_bubble` runs ZB-H1 (on `sharding.pipeline_slots`). The last stage turns
each microbatch round on the device; stage 0 ends it, the head and loss following its output
between the `shard_map`s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.conditions import known_branches
from sharding.constraints import constrain
from sharding.mesh import ShardingError
from sharding.pipeline import owning_backward
from sharding.pipeline_1f1b import Pullbacks
from sharding.pipeline_slots import (Rings, get, halves_make, into_sums, microbatches, number_op, over_stages, put, put_entry, ring_zeros, run_slots,
                                     stage_mesh, stage_zeros)
from sharding.remat import remat
from sharding.schedules import PipelinePlan
from sharding.zero_bubble import V_TABLES, Cell, ops_of, v_chunks

# A V's ops: each kind on the stage's chunk going down (these) or coming back (these + 1); then
# DualPipeV's pairs: the F of the chunk going down beside the BW of the one coming back, and back.
F_DOWN, B_DOWN, W_DOWN, BW_DOWN = 1, 3, 5, 7
F_DOWN_BW_UP, F_UP_BW_DOWN = 9, 10
V_RINGS = ("inbox", "cotangents", "residuals", "taps")


def cell_kind(cell: Cell, down: int) -> int:
    """A cell's `kind` on a stage whose chunk going down is `down`."""
    ops = ops_of(cell)
    if len(ops) == 2:
        return F_DOWN_BW_UP if next(op for op in ops if op.kind == "F").chunk == down else F_UP_BW_DOWN
    return {"F": F_DOWN, "B": B_DOWN, "W": W_DOWN, "BW": BW_DOWN}[ops[0].kind] + (ops[0].chunk != down) if ops else 0


def zbv_arrays(table: Sequence[Sequence[Cell]], keep_residuals: bool) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A V's table (`schedule_zbv`, `schedule_dualpipev`) as [slots, stages] arrays: `kind`
    (`cell_kind`), `microbatch` (the F's, or the op's), `embed_microbatch` (that of the op on the
    stage's chunk going down: on stage 0 the one the embedding feeds), per ring of `V_RINGS` the
    slot the op `<ring>_get`s (`inbox_back_get`: a backward's input, when recomputing) and
    (residuals, taps) `<ring>_put`s, and the slot each of a stage's four
    possible arrivals is put into: `inbox_put_down` (an activation from the stage above, for the
    chunk going down), `inbox_put_up` (from the stage below; on the last stage from its own chunk
    going down: the V's turn), `cotangents_put_down` (from below; on the last stage its own chunk
    coming back's), `cotangents_put_up` (from above; on stage 0 the head's). A stage's two chunks
    share its rings, entries numbered per (microbatch, chunk). Then each ring's depth."""
    slots, stages = len(table), len(table[0])
    arrivals = [f"{ring}_put_{way}" for ring in ("inbox", "cotangents") for way in ("down", "up")]
    names = ["kind", "microbatch", "embed_microbatch", "inbox_get", "inbox_back_get", "cotangents_get", "residuals_put", "residuals_get",
             "taps_put", "taps_get", *arrivals]
    out = {k: np.full((slots, stages), 0 if k in ("kind", "microbatch", "embed_microbatch") else -1, np.int32) for k in names}
    rings = {ring: Rings(stages) for ring in V_RINGS}

    def sent(t: int, s: int, kind: str, chunk: int) -> int | None:  # the microbatch of stage s's `kind` of `chunk` in slot t - 1 (a BW is a B)
        ops = ops_of(table[t - 1][s]) if t > 0 else ()
        return next((op.microbatch for op in ops if op.chunk == chunk and op.kind in (kind, kind + "W")), None)

    for t, row in enumerate(table):
        frees = []
        for s, cell in enumerate(row):
            (down, up), below = v_chunks(stages)[s], min(s + 1, stages - 1)  # the last stage's "below" is itself: the turn
            came = {"inbox_put_down": (sent(t, s - 1, "F", down - 1) if s > 0 else None, down),
                    "inbox_put_up": (sent(t, below, "F", up - 1), up),
                    "cotangents_put_down": (sent(t, below, "B", down + 1), down),
                    "cotangents_put_up": (sent(t, s - 1, "B", up + 1) if s > 0 else sent(t, 0, "F", up), up)}
            for name, (m, chunk) in came.items():
                if m is not None:
                    out[name][t, s] = rings[name.split("_")[0]].take(s, (m, chunk))
            ops = ops_of(cell)
            if not ops:
                continue
            out["kind"][t, s] = cell_kind(cell, down)
            out["microbatch"][t, s] = next((o for o in ops if o.kind == "F"), ops[0]).microbatch
            out["embed_microbatch"][t, s] = next((o for o in ops if o.chunk == down), ops[0]).microbatch
            for o in ops:
                key, from_inbox = (o.microbatch, o.chunk), o.chunk > 0  # chunk 0's input: stage 0's embedding
                kept = [("residuals", True)] if keep_residuals else [("inbox", True, "inbox_back_get")] if from_inbox else []
                backward = ([("cotangents", True), *kept], ["taps"] if o.kind == "B" else [])
                reads, fills = {"F": ([("inbox", keep_residuals)] if from_inbox else [], ["residuals"] if keep_residuals else []),
                                "B": backward, "BW": backward, "W": ([("taps", True)], [])}[o.kind]
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
    """What `pipeline_zero_bubble` computes (same arguments), by `schedule_zbv` (ZB-V) or
    `schedule_dualpipev` (`plan.schedule`): the layers in 2S chunks, stage s running chunk s on
    the way down and chunk 2S - 1 - s on the way back (`v_order` puts them so), the last stage
    turning each microbatch round in place and stage 0 ending it (the head and the loss follow
    its output); each backward as B, then W in a later slot, or whole. Activations and
    cotangents go both ways each slot (four `ppermute`s)."""
    m, s = plan.microbatches, plan.stages
    in_mesh = stage_mesh(plan, params)
    layers = jax.tree.leaves(params)[0].shape[0]
    keep_residuals, tick_fn = plan.remat != "full", remat(stage_fn, plan.remat)
    arrays, depths = zbv_arrays(V_TABLES[plan.schedule](s, m), keep_residuals)
    kinds = np.unique(np.append(arrays["kind"], 0))  # the `switch` holds the kinds the table runs (a branch none takes would still compile)
    arrays["branch"] = np.searchsorted(kinds, arrays["kind"]).astype(np.int32)
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
        # Each ring written in place at its entry after the switch: where the op fills none, the
        # entry it reads (else entry 0) goes back unchanged (as in `pipeline_zero_bubble`).
        entry = {ring: jnp.where(row[f"{ring}_put"] >= 0, row[f"{ring}_put"], row[f"{ring}_get"]) for ring in ("residuals", "taps")}

        def entries():  # read in each branch: read outside, XLA would copy them out first
            return {ring: get(c[ring], at) for ring, at in entry.items()}

        def x_in(v, column="inbox_get"):  # a backward's input: "inbox_back_get"
            waiting = get(c["inbox"], row[column])
            return jnp.where(first, embedded, waiting) if v == 0 else waiting

        # Which gradients each chunk's B and W make; B's and W's added into the chunk's rows.
        b_makes, w_makes = zip(*[halves_make(lambda x: split(v, own, x, stage), embedded, c["taps"]) for v in range(2)])  # noqa: B023
        added = lambda sums, v, dparams, made: into_sums(sums, dparams, made, (v * per_chunk, per_chunk))  # noqa: E731

        def idle(sums):
            return sums, zeros, zeros, entries()

        def forward(v):
            def run(sums):
                if not keep_residuals:
                    return sums, split(v, own, x_in(v), stage)[0], zeros, entries()
                y, saved = forward_saving(v, own, x_in(v), stage)
                return sums, y, zeros, {**entries(), "residuals": pullbacks[v].stashed(saved)}
            return run

        def weight(sums, v, taps):  # probes' statistics all come in B
            dchunk, _ = split(v, own, embedded, stage)[2](taps)  # (W reads only the taps)
            return added(sums, v, (dchunk, None), w_makes[v])

        def backward(v, whole=False):  # B, its W deferred; or B and W at once
            def run(sums):
                dy, kept = get(c["cotangents"], row["cotangents_get"]), entries()
                if keep_residuals:  # its residuals' entry goes back as read (B puts none)
                    kept["residuals"] = get(c["residuals"], row["residuals_get"])
                    pull = pullbacks[v].join(pullbacks[v].merge(kept["residuals"], constants[v]), jax.tree.map(pieces[v], own))
                else:  # recompute the chunk from its input
                    pull = split(v, own, x_in(v, "inbox_back_get"), stage)[1]
                dparams, dx, taps = pull(dy)
                sums = added(sums, v, dparams, b_makes[v])
                return (weight(sums, v, taps), zeros, dx, kept) if whole else (sums, zeros, dx, {**kept, "taps": taps})
            return run

        def weight_backward(v):  # the taps' entry goes back as read (W puts none)
            def run(sums):
                taps = get(c["taps"], row["taps_get"])
                return weight(sums, v, taps), zeros, zeros, {**entries(), "taps": taps}
            return run

        def pair(v):  # chunk v's F beside the other chunk's BW (DualPipeV)
            def run(sums):
                sums, y, _, made_f = forward(v)(sums)
                sums, _, dx, _ = backward(1 - v, whole=True)(sums)
                return sums, y, dx, made_f
            return run

        branches = [idle, forward(0), forward(1), backward(0), backward(1), weight_backward(0), weight_backward(1),
                    backward(0, whole=True), backward(1, whole=True), pair(0), pair(1)]
        with known_branches(arrays["branch"]):  # a slot lasts its costliest branch on any stage
            sums, y, dx, made = jax.lax.switch(row["branch"], [branches[k] for k in kinds], sums)
        c.update({ring: put_entry(c[ring], at, made[ring]) for ring, at in entry.items()})
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
            raise ShardingError(f"pipeline.schedule={plan.schedule} needs a stage's two chunks alike (they share its rings); "
                                "use pipeline.schedule=zero_bubble")
        saved, taps = down_chunk
        state = {"inbox": ring_zeros(s, depths["inbox"], activation), "cotangents": ring_zeros(s, depths["cotangents"], activation),
                 "residuals": jax.tree.map(lambda a: ring_zeros(s, depths["residuals"], a), saved),
                 "taps": jax.tree.map(lambda a: ring_zeros(s, depths["taps"], a), taps),
                 **{k: stage_zeros(s, mb.x_like.shape, mb.x_like.dtype) for k in ("own_y", "own_dx", "x_above", "x_below", "dx_above", "dx_below")}}
        return run_slots(over_stages(stage_work, in_mesh, 5, 2), arrays, state, column="kind", head_on=(F_DOWN + 1, F_UP_BW_DOWN),
                         dx_on=(B_DOWN, BW_DOWN, F_UP_BW_DOWN), head_stage=0, embed_column="embed_microbatch", params=params,
                         params_axes=params_axes, probes=probes, probes_axes=probes_axes, embed_fn=embed_fn, embed_params=embed_params,
                         mb=mb, loss_fn=loss_fn, loss_params=loss_params, seed=seed, x_axes=x_axes)

    ordered = v_order(params, params_axes, s), v_order(probes, probes_axes, s)
    return owning_backward(run, (*ordered, embed_params, loss_params), seed, (inputs, targets), statistics=(1,))
