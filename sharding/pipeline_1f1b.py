"""1F1B pipeline parallelism as one SPMD program that runs its own backward pass.

The table is `sharding.schedules.schedule_1f1b` (interleaved with `repeats` > 1); `pipeline_1f1b`
steps through it, one scan per phase (`sharding.schedules.phases`) so that ticks where no stage
runs a forward (or a backward) do not compute one: the step time of GPipe (circular with
repeats). Where GPipe (`sharding.pipeline.pipeline`, differentiated by autodiff) keeps every
microbatch's stage inputs, this keeps the table's in-flight count per stage, whatever the
number of microbatches: their inputs (recomputing each tick, `remat` full) or their backward
residuals (no recompute, as Megatron-LM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from sharding.pipeline import end_add, end_zeros, loss_cotangent, microbatch, owning_backward, split_microbatches, stage_chunks, with_ends, zero_loss
from sharding.remat import remat
from sharding.conditions import known_share
from sharding.constraints import constrain, constrain_leading, vmap_over
from sharding.schedules import PipelinePlan, Step, check, phases, schedule_1f1b


def stash_slots(table: Sequence[Sequence[Step]]) -> tuple[np.ndarray, np.ndarray, int]:
    """Where each stage keeps each forward's input until its backward: [ticks, stages] slot
    indices for the forward that stores and the backward that reads (0 where none), and how many
    slots a stage needs, the most in flight. A backward frees its slot before the tick's forward
    takes the lowest free one."""
    ticks, stages = len(table), len(table[0])
    store, read = np.zeros((ticks, stages), np.int32), np.zeros((ticks, stages), np.int32)
    held, free, depth = [{} for _ in range(stages)], [[] for _ in range(stages)], 0
    for t, row in enumerate(table):
        for s, step in enumerate(row):
            if step.backward is not None:
                read[t, s] = held[s].pop(step.backward)
                free[s].append(int(read[t, s]))
            if step.forward is not None:
                slot = min(free[s]) if free[s] else len(held[s])
                free[s] = [f for f in free[s] if f != slot]
                held[s][step.forward] = store[t, s] = slot
                depth = max(depth, slot + 1)
    return store, read, depth


def _table_arrays(table: Sequence[Sequence[Step]]) -> tuple[dict[str, np.ndarray], int]:
    """A 1F1B table as [ticks, stages] arrays the scans step through: per half (`forward`,
    `backward`), the microbatch (-1: none), the repeat (which of the stage's chunks) and the stash
    slot; and the stash's depth."""
    arrays = {}
    for half in ("forward", "backward"):
        work = [[getattr(step, half) for step in row] for row in table]
        arrays[half] = np.array([[-1 if w is None else w.microbatch for w in row] for row in work], np.int32)
        arrays[f"{half}_repeat"] = np.array([[0 if w is None else w.chunk // len(row) for w in row] for row in work], np.int32)
    arrays["forward_slot"], arrays["backward_slot"], depth = stash_slots(table)
    return arrays, depth


class Pullbacks:
    """A stage forward's pullback (`jax.vjp`'s) as arrays a scan can carry: its residuals apart
    from the stage's own parameters (which the backward passes in again rather than stash a
    copy per microbatch), and back. Every trace of the same forward has the same structure, so
    the one recorded by the latest `split` rebuilds any of them."""

    def __init__(self):
        self.treedef, self.where, self.constant = None, None, None

    def split(self, pull, params) -> list:
        leaves, self.treedef = jax.tree.flatten(pull)
        own = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
        self.where = tuple(own.get(id(leaf)) for leaf in leaves)  # index of the parameter, or None
        return [leaf for leaf, w in zip(leaves, self.where) if w is None]

    def join(self, saved, params) -> Callable:
        own, saved = jax.tree.leaves(params), iter(saved)
        return jax.tree.unflatten(self.treedef, [next(saved) if w is None else own[w] for w in self.where])

    def mark_constants(self, forward: Callable, *example) -> None:
        """Which residuals of `forward` (returning `(y, self.split(...))`) depend on none of its
        inputs (an attention mask from static positions, say): those are computed once rather
        than stashed per microbatch, and reach the backward unbatched, as they left the forward."""
        closed = jax.make_jaxpr(forward)(*example)
        depends = set(closed.jaxpr.invars)
        for eqn in closed.jaxpr.eqns:
            if any(isinstance(v, jax_core.Var) and v in depends for v in eqn.invars):
                depends.update(eqn.outvars)
        outputs = closed.jaxpr.outvars[1:]  # after y
        self.constant = tuple(not (isinstance(v, jax_core.Var) and v in depends) for v in outputs)

    def stashed(self, residuals: Sequence) -> list:
        return [r for r, constant in zip(residuals, self.constant) if not constant]

    def merge(self, stashed: Sequence, constants: Sequence) -> list:
        stashed, constants = iter(stashed), iter(constants)
        return [next(constants) if constant else next(stashed) for constant in self.constant]


def pipeline_1f1b(stage_fn: Callable, params, params_axes, plan: PipelinePlan, *, embed_fn: Callable, embed_params, inputs,
                  loss_fn: Callable, loss_params, targets, x_axes: Sequence[str | None], batch_axes: Sequence[str | None],
                  probes=None, probes_axes=None, seed=1.0):
    """The mean over microbatches of `loss_fn(loss_params, y_mb, targets_mb)`, where `y_mb` is
    the layers (stacked `params`, `stage_fn` as in `pipeline`) applied to
    `embed_fn(embed_params, inputs_mb)`: the 1F1B table's memory bound, whatever the number of
    microbatches.

    The pipeline owns its backward pass: `lax.scan`s over `schedule_1f1b`'s ticks run, on every
    stage, one forward (its input stashed, `stash_slots`) and one backward (the chunk recomputed
    from the stashed input by `jax.vjp`, the incoming cotangent applied, weight gradients summed
    in float32, the input's cotangent handed one stage back), each on the stage's chunk for that
    repeat. With `plan.remat` other than `full` the stash keeps, instead of the input, the
    forward's pullback residuals under that policy (`Pullbacks`; `none`: what `stage_fn`'s own
    remat keeps), and the backward applies them without recomputing. Stage 0 embeds each microbatch as it enters its first chunk and takes the
    embedding's gradient as it leaves; the last stage applies `loss_fn` after the last chunk and
    seeds the cotangent. Nothing the size of the batch's activations is kept. It is a custom VJP
    whose forward does all of this and whose backward scales what it found by the loss's
    cotangent over `seed`, the cotangent the pipeline's own backward starts from: a float16 loss
    scale goes there, so the activations' cotangents are scaled where they would overflow or
    underflow, as under autodiff. `probes` (as in `pipeline`): their gradients are the maximum
    over the ticks whose backward did real work. `inputs` and `targets` have leading axes
    `batch_axes` (e.g. tokens `[batch, length]`).
    """
    m, s, r = plan.microbatches, plan.stages, plan.repeats
    check(s, m, r, jax.tree.leaves(params)[0].shape[0], schedule="1f1b")
    table = schedule_1f1b(s, m, r)
    arrays, slots = _table_arrays(table)
    state_axes, stash_axes = ("stages", *x_axes), ("stages", None, *x_axes)
    # remat `full`: stash each stage input and recompute the chunk in the backward; otherwise
    # stash what the forward's pullback keeps under that policy (no recompute, more memory).
    keep_residuals, tick_fn, pullbacks = plan.remat != "full", remat(stage_fn, plan.remat), Pullbacks()
    stash_constraint = lambda ring: constrain_leading(ring, "stages", "pipeline stash")  # noqa: E731
    f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
    mb_placed = lambda x_mb: constrain(x_mb, x_axes, "pipeline microbatch")  # noqa: E731
    swap = lambda tree: jax.tree.map(lambda a: a.swapaxes(0, 1), tree)  # noqa: E731  [repeats, stages, ...] <-> [stages, repeats, ...]
    # A stage's chunk for a repeat, chosen by a select (a gather indexed per stage made the XLA
    # GPU compiler fail, see `pipeline`).
    pick = lambda tree, repeat: jax.tree.map(lambda p: p[0] if r == 1 else jax.lax.select_n(repeat, *p), tree)  # noqa: E731

    def into(total, d, repeat, on, combine=jnp.add, fill=0.0):
        """A stage's `total` ([repeats, ...] leaves) with `d` combined into that repeat's entry."""
        hit = (jnp.arange(r) == repeat) & on
        return jax.tree.map(lambda g, x: combine(g, jnp.where(hit.reshape(-1, *([1] * x.ndim)), x[None].astype(g.dtype), fill)), total, d)

    def placed(tree, axes):
        """`[stages, repeats, layers per chunk, ...]` leaves placed as the chunks are: without it
        XLA splits a per-tick update's repeats over the stage devices and gathers it back, every tick."""
        return jax.tree.map(lambda a, ax: constrain(a, ("stages", None, None, *tuple(ax)[1:]), "pipeline chunk gradients"), tree, axes)

    def run(params, probes, embed_params, loss_params, seed, inputs, targets):
        chunks = swap(stage_chunks(params, params_axes, s, r))  # [stages, repeats, layers per chunk, ...]
        probe_chunks = None if probes is None else swap(stage_chunks(probes, probes_axes, s, r))
        in_m = split_microbatches(inputs, m, batch_axes, "pipeline inputs")
        t_m = split_microbatches(targets, m, batch_axes, "pipeline targets")
        stages = jnp.arange(s)

        def own(chunk_r, probes_r, repeat):
            return pick(chunk_r, repeat), pick(probes_r, repeat)

        def stage_vjp(chunk_r, probes_r, repeat, stage, x_mb, dy_mb):
            run_chunk = lambda c, p, x: stage_fn(c, p, x, repeat * s + stage)  # noqa: E731
            return jax.vjp(run_chunk, *own(chunk_r, probes_r, repeat), x_mb)[1](dy_mb)

        def stage_forward(chunk_r, probes_r, repeat, stage, x_mb):
            return stage_fn(*own(chunk_r, probes_r, repeat), x_mb, repeat * s + stage)

        def stage_forward_saving(chunk_r, probes_r, repeat, stage, x_mb):
            """The forward, and the residuals its backward needs (as `plan.remat` keeps them)."""
            params = own(chunk_r, probes_r, repeat)
            y, pull = jax.vjp(lambda c, p, x: tick_fn(c, p, x, repeat * s + stage), *params, x_mb)
            return y, pullbacks.split(pull, params)

        def stage_backward_saved(chunk_r, probes_r, repeat, saved, dy_mb):
            return pullbacks.join(pullbacks.merge(saved, constants), own(chunk_r, probes_r, repeat))(dy_mb)

        def head(loss_params, y_mb, targets_mb):
            loss, pull = jax.vjp(lambda lp, y: loss_fn(lp, y, targets_mb), loss_params, y_mb)
            return loss, *pull(loss_cotangent(loss, seed / m))

        # The ends' conditions, on a row of the table's columns (traced) or on a phase's rows (numpy: their share of true).
        leaves_first_chunk = lambda row: (row["first"]["backward"] >= 0) & (row["first"]["backward_repeat"] == 0)  # noqa: E731
        entering = lambda row: (row["first"]["forward"] >= 0) & (row["first"]["forward_repeat"] == 0)  # noqa: E731
        leaving = lambda row: (row["last"]["forward"] >= 0) & (row["last"]["forward_repeat"] == r - 1)  # noqa: E731

        def backward_half(c, row, rows):
            """Every stage's backward of its microbatch (masked where it has none); the input
            cotangents one stage back (stage 0's to the last stage, for its previous repeat)."""
            on, repeat, first = row["backward"] >= 0, row["backward_repeat"], row["first"]
            # It reads its stashed input before this tick's forward may reuse the slot.
            saved = jax.vmap(lambda ring, slot: jax.tree.map(lambda a: a[slot], ring))(c["stash"], row["backward_slot"])
            if keep_residuals:
                dchunk, dprobes, dx = vmap_over(stage_backward_saved, "stages")(chunks, probe_chunks, repeat, saved, c["bwd_in"])
            else:
                dchunk, dprobes, dx = vmap_over(stage_vjp, "stages")(chunks, probe_chunks, repeat, stages, saved, c["bwd_in"])
            c["grads"] = placed(jax.vmap(into)(c["grads"], dchunk, repeat, on), params_axes)
            if probes is not None:
                stats = jax.vmap(functools.partial(into, combine=jnp.maximum, fill=-jnp.inf))(c["stats"], dprobes, repeat, on)
                c["stats"] = placed(stats, probes_axes)
            # Stage 0's input cotangent after its first chunk: the embedding's gradient. The
            # ends run under conditions on the table's first and last columns (alike on every
            # device), only at the ticks that need them: the table's other ticks (most of an
            # interleaved one's) would run them for nothing, vocabulary-split all-reduces included.
            def embed_grads(total):
                (d_embed,) = jax.vjp(lambda ep: embed_fn(ep, in_m[jnp.maximum(first["backward"], 0)]), embed_params)[1](dx[0])
                return end_add(total, d_embed)

            with known_share(leaves_first_chunk(rows)):
                c["embed_grads"] = jax.lax.cond(leaves_first_chunk(row), embed_grads, lambda total: total, c["embed_grads"])
            c["bwd_in"] = constrain(jnp.roll(dx, -1, axis=0), state_axes, "pipeline stage cotangents")  # a collective-permute
            return c

        def forward_half(c, row, rows):
            """Stage 0 embeds a microbatch entering its first chunk, every stage runs its forward
            and stashes its input, the last applies the head and loss after the last chunk and
            seeds the cotangent its backward starts from next tick; activations one stage on."""
            on, repeat, first, last = row["forward"] >= 0, row["forward_repeat"], row["first"], row["last"]
            # (Both branches' results placed alike: XLA refuses a conditional whose do not match.)
            embedded = lambda: embed_fn(embed_params, in_m[jnp.maximum(first["forward"], 0)]).astype(c["fwd_in"].dtype)  # noqa: E731
            with known_share(entering(rows)):
                entered = jax.lax.cond(entering(row), lambda: mb_placed(embedded()), lambda: mb_placed(c["fwd_in"][0]))
            fwd_in = c["fwd_in"].at[0].set(entered)
            keep = lambda ring, slot, x_mb, on: ring.at[slot].set(jnp.where(on, x_mb, ring[slot]))  # noqa: E731
            if keep_residuals:
                y, residuals = vmap_over(stage_forward_saving, "stages")(chunks, probe_chunks, repeat, stages, fwd_in)
                residuals = pullbacks.stashed(residuals)
                c["stash"] = [stash_constraint(jax.vmap(keep)(ring, row["forward_slot"], res, on)) for ring, res in zip(c["stash"], residuals)]
            else:
                y = vmap_over(stage_forward, "stages")(chunks, probe_chunks, repeat, stages, fwd_in)
                c["stash"] = constrain(jax.vmap(keep)(c["stash"], row["forward_slot"], fwd_in, on), stash_axes, "pipeline stash")
            y = constrain(y, state_axes, "pipeline stage outputs")

            def head_and_seed(loss, loss_grads, seeded):
                mb_loss, dloss_params, dy = head(loss_params, y[-1], microbatch(t_m, jnp.maximum(last["forward"], 0)))
                return loss + mb_loss.astype(jnp.float32) / m, end_add(loss_grads, dloss_params), mb_placed(dy.astype(seeded.dtype))

            unchanged = lambda loss, loss_grads, seeded: (loss, loss_grads, mb_placed(seeded))  # noqa: E731
            with known_share(leaving(rows)):
                c["loss"], c["loss_grads"], seeded = jax.lax.cond(leaving(row), head_and_seed, unchanged, c["loss"], c["loss_grads"],
                                                                  c["bwd_in"][-1])
            c["bwd_in"] = constrain(c["bwd_in"].at[-1].set(seeded), state_axes, "pipeline stage cotangents")
            c["fwd_in"] = constrain(jnp.roll(y, 1, axis=0), state_axes, "pipeline stage inputs")  # a collective-permute
            return c

        def tick(c, row, rows, forwards: bool, backwards: bool):
            c = backward_half(dict(c), row, rows) if backwards else c
            return (forward_half(dict(c), row, rows) if forwards else c), None

        x_like = jax.eval_shape(lambda: embed_fn(embed_params, in_m[0]))
        held = constrain(jnp.zeros((s, *x_like.shape), x_like.dtype), state_axes, "pipeline stage inputs")
        constants = ()
        if keep_residuals:  # a ring per residual array that varies, [stages, slots, ...]; the constants once
            forward_args = (chunks, probe_chunks, jnp.zeros(s, jnp.int32), stages, held)
            pullbacks.mark_constants(vmap_over(stage_forward_saving, "stages"), *forward_args)
            _, residuals = vmap_over(stage_forward_saving, "stages")(*forward_args)  # what is not used: dead code
            constants = [r[0] for r, constant in zip(residuals, pullbacks.constant) if constant]  # one stage's: all alike
            stash = [stash_constraint(jnp.zeros((s, slots, *a.shape[1:]), a.dtype)) for a in pullbacks.stashed(residuals)]
        else:
            stash = constrain(jnp.zeros((s, slots, *x_like.shape), x_like.dtype), stash_axes, "pipeline stash")
        c = {
            "fwd_in": held, "bwd_in": held, "stash": stash,
            "grads": f32(chunks), "embed_grads": end_zeros(embed_params), "loss_grads": end_zeros(loss_params), "loss": zero_loss(loss_fn, loss_params, x_like, t_m),
            "stats": None if probes is None else jax.tree.map(lambda a: jnp.full(a.shape, -jnp.inf, jnp.float32), probe_chunks),
        }
        # One scan per phase of the table: ticks with forwards only, with both, with backwards only,
        # each tick running only the halves some stage works in (the schedule's own bubble).
        columns = with_ends(arrays)
        for start, stop, forwards, backwards in phases(table):
            rows = jax.tree.map(lambda v: v[start:stop], columns)
            c, _ = jax.lax.scan(functools.partial(tick, rows=rows, forwards=forwards, backwards=backwards), c, jax.tree.map(jnp.asarray, rows))
        like = lambda tree, ref: jax.tree.map(lambda g, p: g.reshape(p.shape).astype(p.dtype), tree, ref)  # noqa: E731
        stats = None if probes is None else like(swap(c["stats"]), probes)
        found = like(swap(c["grads"]), params), stats, like(c["embed_grads"], embed_params), like(c["loss_grads"], loss_params)
        return c["loss"], found

    return owning_backward(run, (params, probes, embed_params, loss_params), seed, (inputs, targets), statistics=(1,))
