"""1F1B with each stage running its own half of every slot: Megatron-LM's in-flight bound (at most
S - s microbatches at stage s) in one SPMD program.

`sharding.pipeline_1f1b` steps every stage in lockstep (a vmap over stages, which the compiler
splits over `stage`): a microbatch's round trip takes two ticks per stage, so stage s keeps
2(S - s) - 1 inputs. Here a `lax.scan` over the slots of `schedule_1f1b_per_stage` runs, each
slot, a `jax.shard_map` that makes `stage` manual (data, fsdp and tensor stay with the
partitioner, placed by the logical rules inside as everywhere else): each device picks its half
with a `lax.switch` on its column of the table, then activations and cotangents move one stage
(`ppermute`). Recomputing (`pipeline.remat` full), a device keeps at most S stage inputs (stage
0 embeds its microbatch again rather than keep it); keeping residuals (any other policy), at
most S sets of a chunk's pullback residuals, Megatron's own bound. The embedding, the head and
the loss run between the `shard_map`s, where `stage` is automatic: the vocabulary stays split
over the stages as in the lockstep pipelines, under conditions every device evaluates alike
(the table's first and last columns). The cost: a slot lasts as long as the slowest stage's
work, a backward, where a lockstep tick is one forward plus one backward. Keeping residuals
with an even number of layers per stage, slots are balanced (`balanced_slots`): each backward
runs in two parts in consecutive slots, the chunk's later half of layers then its earlier half
(each with its own residuals and `Pullbacks`; the cotangent between them stays on the device,
the gradients go into their half of the sums), so a slot is about one forward everywhere and
F + B takes three, lockstep 1F1B's time. Interleaving (`repeats` > 1) is refused: there lockstep
1F1B already keeps Megatron-LM's interleaved count ((R + 1)S - 1 - 2s chunk inputs at stage s,
its warm-up plus one) with the same bubble, so per-stage slots would only add their fixed cost.
Context parallelism is refused too (its collectives would sit in one stage's branch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.conditions import known_branches
from sharding.pipeline import owning_backward
from sharding.pipeline_1f1b import Pullbacks
from sharding.pipeline_slots import Rings, get, microbatches, over_stages, put, put_entry, ring_zeros, run_slots, stage_mesh, stage_zeros
from sharding.remat import remat
from sharding.schedules import PipelinePlan, Step, balanced_slots, schedule_1f1b_per_stage

# A slot's work: a forward, or a backward piece (BACKWARD + `Step.part`: the whole chunk's, its
# later layers', its earlier layers').
IDLE, FORWARD, BACKWARD, LATER, EARLIER = 0, 1, 2, 3, 4


def f32_of(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def slot_arrays(table: Sequence[Sequence[Step]], keep_residuals: bool = False) -> tuple[dict[str, np.ndarray], int, int]:
    """`schedule_1f1b_per_stage`'s table as [slots, stages] arrays: `half` (IDLE, FORWARD, or
    BACKWARD + the backward's part), `microbatch`, `store` (the inbox slot where the activation
    arriving this slot is kept; -1: none arrives, or it is used at once and not needed again),
    `read` (the inbox slot the half reads its stage input from; -1: the activation that arrived
    this slot), and with `keep_residuals`, `keep` (the residual slot a forward fills) and `use`
    (the one its backward reads); then the inbox's and the residual stash's depths. Recomputing,
    an input stays in the inbox until its backward; keeping residuals, until its forward, and
    the forward's residuals until the backward's last part. Stage 0 embeds its microbatch again
    rather than keep it. A slot's reads free their slots before its arrival takes the lowest
    free one."""
    slots, stages = len(table), len(table[0])
    names = ("half", "microbatch", "store", "read", "keep", "use")
    out = {k: np.full((slots, stages), IDLE if k == "half" else 0 if k == "microbatch" else -1, np.int32) for k in names}
    inbox, residuals = Rings(stages), Rings(stages)
    for t, row in enumerate(table):
        for s, step in enumerate(row):
            arriving = table[t - 1][s - 1].forward if t > 0 and s > 0 else None
            fresh = arriving is not None and step.forward is not None and arriving.microbatch == step.forward.microbatch
            if step.backward is not None:
                m, part, previous = step.backward.microbatch, step.part, table[t - 1]
                if part and not keep_residuals:
                    raise AssertionError("a backward in parts applies stashed residuals: keep_residuals")
                out["half"][t, s], out["microbatch"][t, s] = BACKWARD + part, m
                if keep_residuals:
                    out["use"][t, s] = residuals.held[s][m] if part == 1 else residuals.release(s, m)
                elif s > 0:
                    out["read"][t, s] = inbox.release(s, m)
                # Its cotangent is the one the previous slot made: this stage's later layers' for
                # the earlier layers, else the next stage's last part (the head's on the last stage).
                made, want = (previous[s], 1) if part == 2 else (previous[s + 1] if s < stages - 1 else None, 2 if part else 0)
                if made is not None and (made.backward is None or made.backward.microbatch != m or made.part != want):
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
    keeps at most S stage inputs (or, with `plan.remat` other than `full`, S sets of residuals),
    whatever the number of microbatches. Needs the mesh in force (`sharding.activate`) to have the
    `stage` axis."""
    m, s = plan.microbatches, plan.stages
    in_mesh = stage_mesh(plan, params)
    layers = jax.tree.leaves(params)[0].shape[0]
    keep_residuals, tick_fn = plan.remat != "full", remat(stage_fn, plan.remat)
    balanced = balanced_slots(plan, layers)
    arrays, inbox_depth, stash_depth = slot_arrays(schedule_1f1b_per_stage(s, m, balanced), keep_residuals)
    # The chunk's layers as the forward runs them and the backward's parts take them: all of
    # them, or (balanced) its earlier and its later half, sub-chunks 2s and 2s + 1 of the model.
    half = layers // s // 2
    pieces = [lambda t: t] if not balanced else [lambda t: jax.tree.map(lambda a: a[:half], t), lambda t: jax.tree.map(lambda a: a[half:], t)]
    pullbacks = [Pullbacks() for _ in pieces]
    f32 = lambda tree, fill=0.0: jax.tree.map(lambda a: jnp.full(a.shape, fill, jnp.float32), tree)  # noqa: E731

    def forward_saving(j, chunk, chunk_probes, x, stage):
        """Piece j's forward, and the residuals its backward needs (as `plan.remat` keeps them)."""
        own = pieces[j](chunk), pieces[j](chunk_probes)
        y, pull = jax.vjp(lambda c, p, x: tick_fn(c, p, x, stage * len(pieces) + j), *own, x)
        return y, pullbacks[j].split(pull, own)

    def add_piece(row, sums, dchunk, dprobes):
        """A slot's gradients and statistics into the chunk's sums: all of it, or in balanced
        slots the piece it ran (the later half of the layers, or the earlier; in place)."""
        if not balanced:
            return jax.tree.map(jnp.add, sums[0], dchunk), jax.tree.map(jnp.maximum, sums[1], dprobes)
        start = jnp.where(row["half"] == LATER, half, 0)

        def into(combine):
            return lambda total, d: jax.lax.dynamic_update_slice_in_dim(
                total, combine(jax.lax.dynamic_slice_in_dim(total, start, half), d), start, 0)

        return jax.tree.map(into(jnp.add), sums[0], dchunk), jax.tree.map(into(jnp.maximum), sums[1], dprobes)

    def stage_work(state, sums, chunk, chunk_probes, row, embedded, seed_dy):
        """One slot on one stage (inside the `shard_map`, `stage` manual): its half of the table,
        then activations on and cotangents back. `state`: this stage's inbox, residual rings and
        the arrays in transit, each with a leading axis of 1; `sums`: the gradients of its chunk
        and the maxima of its probes' (its shard of the `[layers, ...]` arrays, as `chunk`)."""
        stage = jax.lax.axis_index("stage")
        first, last = stage == 0, stage == s - 1
        state, row = jax.tree.map(lambda a: a[0], (state, row))
        constants = [()] * len(pieces)
        if keep_residuals:  # residuals that depend on no input (a mask): computed here, not stashed
            x = embedded
            for j in range(len(pieces)):  # dead code but for those
                x, example = forward_saving(j, chunk, chunk_probes, x, stage)
                constants[j] = [r for r, constant in zip(example, pullbacks[j].constant) if constant]
        nothing = {"y": jnp.zeros_like(embedded), "dx": jnp.zeros_like(embedded), "mid": jnp.zeros_like(embedded),
                   "dchunk": f32(pieces[0](chunk)), "dprobes": f32(pieces[0](chunk_probes), -jnp.inf)}  # a piece's
        # The stash is written in place at its entry after the switch: where the op keeps nothing,
        # the entry it reads (else entry 0) goes back unchanged (as in `pipeline_zero_bubble`).
        entry = jnp.where(row["keep"] >= 0, row["keep"], row["use"])

        def entries():  # read in each branch: read outside, XLA would copy them out first
            return [[get(ring, entry) for ring in rings] for rings in state["stash"]]

        def stage_input(c, row, embedded):  # stage 0's is its embedded microbatch
            waiting = c["inbox"][jnp.maximum(row["read"], 0)]
            return jnp.where(first, embedded, jnp.where(row["read"] < 0, c["recv_x"], waiting))

        def forward(c, row, embedded, seed_dy, chunk, chunk_probes):
            x = stage_input(c, row, embedded)
            if not keep_residuals:
                return {**nothing, "y": stage_fn(chunk, chunk_probes, x, stage), "residuals": entries()}
            residuals = []
            for j in range(len(pieces)):
                x, saved = forward_saving(j, chunk, chunk_probes, x, stage)
                residuals.append(pullbacks[j].stashed(saved))
            return {**nothing, "y": x, "residuals": residuals}

        def backward(j, dx_key):
            """The backward of piece j (of the whole chunk when there is one piece)."""

            def run(c, row, embedded, seed_dy, chunk, chunk_probes):
                own = pieces[j](chunk), pieces[j](chunk_probes)
                if j < len(pieces) - 1:  # the earlier layers: the later layers' cotangent, made the slot before
                    cotangent = c["mid"]
                else:  # the last stage's from the head
                    cotangent = jnp.where(last, seed_dy, c["recv_dx"])
                kept = entries()
                if keep_residuals:  # its entry goes back as read (a backward keeps nothing)
                    kept[j] = saved = [get(ring, row["use"]) for ring in c["stash"][j]]
                    pull = pullbacks[j].join(pullbacks[j].merge(saved, constants[j]), own)
                else:  # recompute the chunk from its input
                    pull = jax.vjp(lambda c, p, x: stage_fn(c, p, x, stage), *own, stage_input(c, row, embedded))[1]
                dchunk, dprobes, dx = pull(cotangent)
                return {**nothing, dx_key: dx, "dchunk": f32_of(dchunk), "dprobes": f32_of(dprobes), "residuals": kept}

            return run

        halves = [lambda *_: {**nothing, "residuals": entries()}, forward, backward(0, "dx")]
        if balanced:  # BACKWARD + 1: the later layers (the cotangent kept for the next slot), + 2: the earlier
            halves += [backward(1, "mid"), backward(0, "dx")]
        with known_branches(arrays["half"]):  # a slot lasts its costliest branch on any stage
            out = jax.lax.switch(row["half"], halves, state, row, embedded, seed_dy, chunk, chunk_probes)
        c = dict(state)
        sums = add_piece(row, sums, out["dchunk"], out["dprobes"])
        c["stash"] = [[put_entry(ring, entry, r) for ring, r in zip(rings, made)] for rings, made in zip(c["stash"], out["residuals"])]
        # The activation that arrived this slot waits (after this slot's reads freed their slots).
        c["inbox"] = put(c["inbox"], row["store"], c["recv_x"])
        c["mid"] = out["mid"]
        c["recv_x"] = jax.lax.ppermute(out["y"], "stage", [(i, i + 1) for i in range(s - 1)])
        c["recv_dx"] = jax.lax.ppermute(out["dx"], "stage", [(i + 1, i) for i in range(s - 1)])
        return (*jax.tree.map(lambda a: a[None], (c, out["y"], out["dx"])), sums)

    def run(params, probes, embed_params, loss_params, seed, inputs, targets):
        mb = microbatches(inputs, targets, m, batch_axes, embed_fn, embed_params)
        stash = []
        if keep_residuals:  # per piece, a ring per residual array that varies, its shapes from one stage's forward
            def residuals(chunk, chunk_probes, x):
                out = []
                for j in range(len(pieces)):
                    pullbacks[j].mark_constants(lambda c, p, x: forward_saving(j, c, p, x, 0), chunk, chunk_probes, x)  # noqa: B023
                    x, saved = forward_saving(j, chunk, chunk_probes, x, 0)
                    out.append([r[None] for r in pullbacks[j].stashed(saved)])
                return out
            shapes = jax.eval_shape(over_stages(residuals, in_mesh, 2, 1), params, probes, jnp.zeros(mb.x_like.shape, mb.x_like.dtype))
            stash = [[ring_zeros(s, stash_depth, a) for a in piece] for piece in shapes]
        state = {"inbox": ring_zeros(s, inbox_depth, jnp.zeros((1, *mb.x_like.shape), mb.x_like.dtype)), "stash": stash,
                 **{k: stage_zeros(s, mb.x_like.shape, mb.x_like.dtype) for k in ("recv_x", "recv_dx", "mid")}}
        return run_slots(over_stages(stage_work, in_mesh, 5, 2), arrays, state, column="half", head_on=(FORWARD,), dx_on=(BACKWARD, EARLIER),
                         params=params, params_axes=params_axes, probes=probes, probes_axes=probes_axes, embed_fn=embed_fn,
                         embed_params=embed_params, mb=mb, loss_fn=loss_fn, loss_params=loss_params, seed=seed, x_axes=x_axes)

    return owning_backward(run, (params, probes, embed_params, loss_params), seed, (inputs, targets), statistics=(1,))
