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
arrival until B, F's residuals until B (keeping them), B's taps until W. With an even number of
layers per stage, B runs in two halves in consecutive slots (B1 the later layers, from F's
residuals of them or, recomputing, from the input F kept for them; B2 the earlier), so a slot
holds about one forward. The embedding, the head
and the loss run between the `shard_map`s, where `stage` is automatic, as in the per-stage
1F1B: the vocabulary stays split over the stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.conditions import known_branches
from sharding.pipeline import owning_backward
from sharding.pipeline_1f1b import Pullbacks
from sharding.pipeline_slots import (Rings, get, halves_make, into_sums, microbatches, number_op, over_stages, put, put_entry, ring_zeros, run_slots,
                                     stage_mesh, stage_zeros)
from sharding.remat import remat
from sharding.schedules import PipelinePlan, balanced_zero_bubble
from sharding.zero_bubble import Op, is_balanced, schedule_zero_bubble

IDLE, F, B, W, B1, B2 = 0, 1, 2, 3, 4, 5
KIND = {"F": F, "B": B, "W": W, "B1": B1, "B2": B2}
# What each ring keeps, from the slot it is put to its last reader: activations arriving, their
# cotangents arriving, F's residuals (keeping them), the later half's input (recomputing,
# balanced), B's taps (per piece: the whole chunk's, or its earlier and its later half's).
RINGS = ("inbox", "cotangents", "residuals", "halfway", "taps")


def _uses(kind: str, s: int, keep_residuals: bool, balanced: bool) -> tuple[list[tuple[str, bool]], list[str]]:
    """(the rings an op reads, each with whether it is their last reader) and the rings it fills."""
    inbox = [] if s == 0 else [("inbox", True)]  # stage 0 embeds its microbatch again
    if kind == "F":
        return ([("inbox", keep_residuals)] if s > 0 else []), (["residuals"] if keep_residuals else ["halfway"] if balanced else [])
    if kind in ("B", "B1"):
        mine = [("residuals", kind == "B")] if keep_residuals else [("halfway", True)] if kind == "B1" else inbox
        return [("cotangents", True)] + mine, ["taps"]
    if kind == "B2":
        return ([("residuals", True)] if keep_residuals else inbox), []
    return [("taps", True)], []


def op_arrays(table: Sequence[Sequence[Op | None]], keep_residuals: bool) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A one-chunk-per-stage split-backward table (`schedule_zero_bubble`, balanced or not) as
    [slots, stages] arrays: `kind` (IDLE, F, B, W, B1, B2), `microbatch`, and per ring of `RINGS`
    the slot an arrival or a result is `<ring>_put` into and the slot the op `<ring>_get`s (-1:
    none); a balanced table's B2 puts its taps into the slot its B1 took (`taps_put_earlier`).
    Then each ring's depth. An arriving activation or cotangent is put in its ring in the slot it
    arrives (before the slot's op reads it); a slot is free for reuse from the slot after its
    last reader. The last stage's cotangent comes from the head, the slot after its F."""
    slots, stages, balanced = len(table), len(table[0]), is_balanced(table)
    names = ["kind", "microbatch", "taps_put_earlier"] + [f"{ring}_{way}" for ring in RINGS for way in ("put", "get")]
    out = {k: np.full((slots, stages), 0 if k in ("kind", "microbatch") else -1, np.int32) for k in names}
    rings = {ring: Rings(stages) for ring in RINGS}
    for t, row in enumerate(table):
        frees = []
        for s, op in enumerate(row):
            before = table[t - 1] if t > 0 else [None] * stages
            sent_x = before[s - 1] if s > 0 else None
            sent_dy = before[s + 1] if s < stages - 1 else before[s]
            if sent_x is not None and sent_x.kind == "F":
                out["inbox_put"][t, s] = rings["inbox"].take(s, sent_x.microbatch)
            if sent_dy is not None and sent_dy.kind == (("B2" if balanced else "B") if s < stages - 1 else "F"):
                out["cotangents_put"][t, s] = rings["cotangents"].take(s, sent_dy.microbatch)
            if op is None:
                continue
            m = op.microbatch
            out["kind"][t, s], out["microbatch"][t, s] = KIND[op.kind], m
            if op.kind == "B2":
                if before[s] != Op("B1", m, op.chunk):  # its cotangent is B1's, kept on the device one slot
                    raise AssertionError(f"stage {s}'s B2 of microbatch {m} at slot {t} does not follow its B1")
                out["taps_put_earlier"][t, s] = rings["taps"].held[s][m]
            frees += number_op(out, rings, t, s, m, *_uses(op.kind, s, keep_residuals, balanced))
        for ring, s, m in frees:  # free from the next slot on
            rings[ring].release(s, m)
    return out, {ring: rings[ring].depth for ring in RINGS}


def pipeline_zero_bubble(stage_fn: Callable, params, params_axes, plan: PipelinePlan, *, split_vjp: Callable, embed_fn: Callable,
                         embed_params, inputs, loss_fn: Callable, loss_params, targets, x_axes: Sequence[str | None],
                         batch_axes: Sequence[str | None], probes=None, probes_axes=None, seed=1.0):
    """What `sharding.pipeline_per_stage.pipeline_per_stage` computes (same arguments), by
    `schedule_zero_bubble` (ZB-H1): each stage's backward run as B, then W in a later slot;
    with an even number of layers per stage, B in halves (`balanced_zero_bubble`: B1 the chunk's
    later layers, B2 its earlier ones, in consecutive slots). `split_vjp(fn, params, x)` gives
    `(y, input_backward, weight_backward)` as `lm.model.split_backward.split_vjp` does. Needs the
    mesh in force to have the `stage` axis."""
    m, s = plan.microbatches, plan.stages
    in_mesh = stage_mesh(plan, params)
    layers = jax.tree.leaves(params)[0].shape[0]
    keep_residuals, tick_fn = plan.remat != "full", remat(stage_fn, plan.remat)
    balanced = balanced_zero_bubble(plan, layers)
    arrays, depths = op_arrays(schedule_zero_bubble(s, m, balanced), keep_residuals)
    # The chunk's layers as its pieces: all of them, or (balanced) its earlier and its later half,
    # sub-chunks 2s and 2s + 1 of the model (as in `sharding.pipeline_per_stage`).
    half = layers // s // 2
    pieces = [lambda t: t] if not balanced else [lambda t: jax.tree.map(lambda a: a[:half], t), lambda t: jax.tree.map(lambda a: a[half:], t)]
    pullbacks = [Pullbacks() for _ in pieces]

    def split(j, own, x, stage, mine=None):
        """Piece j's forward with its backward in two (`split_vjp`), as `plan.remat` keeps it;
        `mine`: the piece's parameters, sliced from `own` already."""
        fn = tick_fn if keep_residuals else stage_fn
        return split_vjp(lambda p, x: fn(*p, x, stage * len(pieces) + j), jax.tree.map(pieces[j], own) if mine is None else mine, x)

    def forward_saving(j, own, x, stage):
        """Piece j's forward, and the residuals its B needs (the pullback of the split's B, as
        `plan.remat` keeps them). The piece's parameters are sliced once: `Pullbacks` knows them
        among the residuals by identity, and stashes any it does not know per microbatch."""
        mine = jax.tree.map(pieces[j], own)
        y, input_backward, _ = split(j, own, x, stage, mine)
        return y, pullbacks[j].split(input_backward, mine)

    def stage_work(state, sums, chunk, chunk_probes, row, embedded, seed_dy):
        """One slot on one stage (inside the `shard_map`, `stage` manual): its op, then
        activations on and cotangents back; the rings kept in `state` (leading axis 1)."""
        stage = jax.lax.axis_index("stage")
        first, last = stage == 0, stage == s - 1
        state, row = jax.tree.map(lambda a: a[0], (state, row))
        own = chunk, chunk_probes
        c = dict(state)
        constants = [[] for _ in pieces]
        if keep_residuals:  # residuals that depend on no input (a mask): computed here, not stashed (dead code but for those)
            x = embedded
            for j in range(len(pieces)):
                x, saved = forward_saving(j, own, x, stage)
                constants[j] = [r for r, constant in zip(saved, pullbacks[j].constant) if constant]

        def added(sums, j, dparams, made):  # piece j's gradients into its rows of the chunk's sums
            return into_sums(sums, dparams, made, None if not balanced else (j * half, half))

        # This slot's arrivals first (the op may read them at once).
        c["inbox"] = put(c["inbox"], row["inbox_put"], c["recv_x"])
        c["cotangents"] = put(c["cotangents"], row["cotangents_put"], jnp.where(last, seed_dy, c["recv_dx"]))
        x_in = jnp.where(first, embedded, get(c["inbox"], row["inbox_get"]))
        zeros = jnp.zeros_like(embedded)
        b_makes, w_makes = zip(*[halves_make(lambda x: split(j, own, x, stage), x_in, c["taps"][j]) for j in range(len(pieces))])  # noqa: B023
        # Each branch gives (the sums, y, dx, mid, what F and B keep), and every ring is then
        # written in place at its entry (`put_entry`): where the op fills none, the entry it
        # reads (else entry 0) goes back unchanged, given back by its branch, so a ring is written
        # only where its op fills it. (A conditional that updated a ring would copy it whole, seen
        # in the deviceless H100 program; a select between the new entry and the old after the
        # switch moved each entry five times.)
        puts = {"residuals": "residuals_put", "halfway": "halfway_put"}
        entry = {ring: jnp.where(row[put] >= 0, row[put], row[f"{ring}_get"]) for ring, put in puts.items()}
        taps_at = [jnp.where(row[put] >= 0, row[put], row["taps_get"])  # B2's into the slot its B1 took
                   for put in ("taps_put_earlier", "taps_put")[2 - len(pieces):]]

        def entries():  # read in each branch: read outside, XLA would copy them out first
            return {**{ring: get(c[ring], entry[ring]) for ring in puts}, "taps": [get(r, at) for r, at in zip(c["taps"], taps_at)]}

        def idle(sums):
            return sums, zeros, zeros, zeros, entries()

        def forward(sums):
            x, residuals = x_in, []
            for j in range(len(pieces)):
                if j == 1 and not keep_residuals:
                    halfway = x
                if keep_residuals:
                    x, saved = forward_saving(j, own, x, stage)
                    residuals.append(pullbacks[j].stashed(saved))
                else:
                    x = stage_fn(*jax.tree.map(pieces[j], own), x, stage * len(pieces) + j)
            kept = {**entries(), "residuals": residuals} if keep_residuals else {**entries(), "halfway": halfway} if balanced else entries()
            return sums, x, zeros, zeros, kept

        def backward(j):
            """B of piece j (of the whole chunk when there is one piece: B; else B1 for the
            later half, B2 for the earlier)."""

            def run(sums):
                later = j == len(pieces) - 1
                dy = get(c["cotangents"], row["cotangents_get"]) if later else c["mid"]
                kept = entries()
                if keep_residuals:  # its residuals' entry goes back as read (B puts none)
                    kept["residuals"] = get(c["residuals"], row["residuals_get"])
                    pull = pullbacks[j].join(pullbacks[j].merge(kept["residuals"][j], constants[j]), jax.tree.map(pieces[j], own))
                else:  # recompute the piece from its input
                    x = get(c["halfway"], row["halfway_get"]) if j == 1 else x_in
                    pull = split(j, own, x, stage)[1]
                dparams, dx, taps = pull(dy)
                to_mid = balanced and j == 1
                kept["taps"][j] = taps  # B (B1): its piece's ring; B2: the earlier's
                return added(sums, j, dparams, b_makes[j]), zeros, (zeros if to_mid else dx), (dx if to_mid else zeros), kept

            return run

        def weight_backward(sums):
            taps = get(c["taps"], row["taps_get"])
            for j in range(len(pieces)):  # probes' statistics all come in B
                dchunk, _ = split(j, own, x_in, stage)[2](taps[j])
                sums = added(sums, j, (dchunk, None), w_makes[j])
            return sums, zeros, zeros, zeros, {**entries(), "taps": taps}  # the taps' entries back as read (W puts none)

        branches = [idle, forward, idle if balanced else backward(0), weight_backward]  # balanced: no whole B
        if balanced:
            branches += [backward(1), backward(0)]  # B1: the later half, B2: the earlier
        with known_branches(arrays["kind"]):  # a slot lasts its costliest branch on any stage
            sums, y, dx, c["mid"], made = jax.lax.switch(row["kind"], branches, sums)
        c.update({ring: put_entry(c[ring], entry[ring], made[ring]) for ring in puts})
        c["taps"] = [put_entry(r, at, x) for r, at, x in zip(c["taps"], taps_at, made["taps"])]
        c["recv_x"] = jax.lax.ppermute(y, "stage", [(i, i + 1) for i in range(s - 1)])
        c["recv_dx"] = jax.lax.ppermute(dx, "stage", [(i + 1, i) for i in range(s - 1)])
        return (*jax.tree.map(lambda a: a[None], (c, y, dx)), sums)

    def run(params, probes, embed_params, loss_params, seed, inputs, targets):
        mb = microbatches(inputs, targets, m, batch_axes, embed_fn, embed_params)
        activation = jnp.zeros((1, *mb.x_like.shape), mb.x_like.dtype)

        def shapes(chunk, chunk_probes, x):  # one stage's residuals and taps, per piece (eval_shape only)
            own, saved, taps = (chunk, chunk_probes), [], []
            for j in range(len(pieces)):
                if keep_residuals:
                    pullbacks[j].mark_constants(lambda c, p, x: forward_saving(j, (c, p), x, 0), chunk, chunk_probes, x)  # noqa: B023
                    saved.append(pullbacks[j].stashed(forward_saving(j, own, x, 0)[1]))
                taps.append(split(j, own, x, 0)[1](jnp.zeros_like(x))[2])
                x = split(j, own, x, 0)[0]
            return jax.tree.map(lambda a: a[None], (saved, taps))

        saved, taps = jax.eval_shape(over_stages(shapes, in_mesh, 2, 1), params, probes, activation[0])
        state = {"inbox": ring_zeros(s, depths["inbox"], activation), "cotangents": ring_zeros(s, depths["cotangents"], activation),
                 "residuals": jax.tree.map(lambda a: ring_zeros(s, depths["residuals"], a), saved),
                 "halfway": ring_zeros(s, depths["halfway"], activation) if balanced and not keep_residuals else [],
                 "taps": jax.tree.map(lambda a: ring_zeros(s, depths["taps"], a), taps),
                 **{k: stage_zeros(s, mb.x_like.shape, mb.x_like.dtype) for k in ("recv_x", "recv_dx", "mid")}}
        return run_slots(over_stages(stage_work, in_mesh, 5, 2), arrays, state, column="kind", head_on=(F,), dx_on=(B, B2), params=params,
                         params_axes=params_axes, probes=probes, probes_axes=probes_axes, embed_fn=embed_fn, embed_params=embed_params,
                         mb=mb, loss_fn=loss_fn, loss_params=loss_params, seed=seed, x_axes=x_axes)

    return owning_backward(run, (params, probes, embed_params, loss_params), seed, (inputs, targets), statistics=(1,))
