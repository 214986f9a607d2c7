"""1F1B pipeline parallelism as one SPMD program that runs its own backward pass.

The table is `sharding.pipeline.schedule_1f1b`; `pipeline_1f1b` steps through it, one scan per
phase (`sharding.pipeline.phases`) so that ticks where no stage runs a forward (or a backward)
do not compute one: GPipe's step time. Where GPipe (`sharding.pipeline.pipeline`,
differentiated by autodiff) keeps every microbatch's stage inputs, this keeps 2S - 1 per stage,
whatever the number of microbatches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.pipeline import (
    PipelinePlan,
    Step,
    check,
    phases,
    schedule_1f1b,
    split_microbatches,
    stage_chunks,
)
from sharding.rules import constrain


def _table_arrays(table: Sequence[Sequence[Step]]) -> dict[str, np.ndarray]:
    """A 1F1B table as [ticks, stages] arrays: `forward` / `backward` microbatch (-1: none)."""
    as_int = lambda m: -1 if m is None else m  # noqa: E731
    return {
        "forward": np.array([[as_int(step.forward) for step in row] for row in table], np.int32),
        "backward": np.array([[as_int(step.backward) for step in row] for row in table], np.int32),
    }


def pipeline_1f1b(stage_fn: Callable, params, params_axes, plan: PipelinePlan, *, embed_fn: Callable, embed_params, inputs,
                  loss_fn: Callable, loss_params, targets, x_axes: Sequence[str | None], batch_axes: Sequence[str | None],
                  probes=None, probes_axes=None, seed=1.0):
    """The mean over microbatches of `loss_fn(loss_params, y_mb, targets_mb)`, where `y_mb` is
    the layers (stacked `params`, as in `pipeline`) applied to `embed_fn(embed_params,
    inputs_mb)`: the 1F1B table's memory bound, whatever the number of microbatches.

    The pipeline owns its backward pass: `lax.scan`s over `schedule_1f1b`'s ticks run, on every
    stage, one forward (its input stashed in a ring of 2S - 1 slots) and one backward
    (the chunk recomputed from the stashed input by `jax.vjp`, the incoming cotangent applied,
    weight gradients summed in float32, the input's cotangent handed one stage back). Stage 0
    embeds each microbatch as it enters and takes the embedding's gradient as it leaves; the last
    stage applies `loss_fn` and seeds the cotangent. Nothing the size of the batch's activations
    is kept. It is a custom VJP whose forward does all of this and whose backward scales what it
    found by the loss's cotangent over `seed`, the cotangent the pipeline's own backward starts
    from: a float16 loss scale goes there, so the activations' cotangents are scaled where they
    would overflow or underflow, as under autodiff. `probes` (as in `pipeline`): their gradients are the maximum
    over the ticks whose backward did real work. `inputs` and `targets` have leading axes
    `batch_axes` (e.g. tokens `[batch, length]`).
    """
    m, s = plan.microbatches, plan.stages
    check(s, m, 1, jax.tree.leaves(params)[0].shape[0])
    table = schedule_1f1b(s, m)
    arrays = _table_arrays(table)
    slots = 2 * s - 1
    state_axes, stash_axes = ("stages", *x_axes), ("stages", None, *x_axes)
    f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
    per_stage = lambda on, a: on.reshape(-1, *([1] * (a.ndim - 1)))  # noqa: E731
    add = lambda total, d, on: jax.tree.map(lambda g, x: g + jnp.where(on, x.astype(jnp.float32), 0.0), total, d)  # noqa: E731

    def run(params, probes, embed_params, loss_params, seed, inputs, targets):
        chunks = jax.tree.map(lambda c: c[0], stage_chunks(params, params_axes, s, 1))  # [stages, layers / stages, ...]
        probe_chunks = None if probes is None else jax.tree.map(lambda c: c[0], stage_chunks(probes, probes_axes, s, 1))
        in_m = split_microbatches(inputs, m, batch_axes, "pipeline inputs")
        t_m = split_microbatches(targets, m, batch_axes, "pipeline targets")

        def stage_vjp(chunk, chunk_probes, x_mb, index, dy_mb):
            return jax.vjp(lambda c, p, x: stage_fn(c, p, x, index), chunk, chunk_probes, x_mb)[1](dy_mb)

        def head(loss_params, y_mb, targets_mb):
            loss, pull = jax.vjp(lambda lp, y: loss_fn(lp, y, targets_mb), loss_params, y_mb)
            return loss, *pull((seed / m).astype(loss.dtype))

        def backward_half(c, row):
            """Every stage's backward of its microbatch (masked where it has none); the input
            cotangents one stage back."""
            bwd, bwd_on = jnp.maximum(row["backward"], 0), row["backward"] >= 0
            # It reads its stashed input before this tick's forward may reuse the slot.
            saved = jax.vmap(lambda ring, b: ring[b % slots])(c["stash"], bwd)
            dchunk, dprobes, dx = jax.vmap(stage_vjp)(chunks, probe_chunks, saved, jnp.arange(s), c["bwd_in"])
            c["grads"] = jax.tree.map(lambda g, d: g + jnp.where(per_stage(bwd_on, d), d.astype(jnp.float32), 0.0), c["grads"], dchunk)
            if probes is not None:
                c["stats"] = jax.tree.map(lambda a, d: jnp.maximum(a, jnp.where(per_stage(bwd_on, d), d, -jnp.inf)), c["stats"], dprobes)
            # Stage 0's input cotangent: the embedding's gradient for that microbatch.
            (d_embed,) = jax.vjp(lambda ep: embed_fn(ep, in_m[bwd[0]]), embed_params)[1](dx[0])
            c["embed_grads"] = add(c["embed_grads"], d_embed, bwd_on[0])
            c["bwd_in"] = constrain(jnp.roll(dx, -1, axis=0), state_axes, "pipeline stage cotangents")  # a collective-permute
            return c

        def forward_half(c, row):
            """Stage 0 embeds a fresh microbatch, every stage runs its forward and stashes its
            input, the last applies the head and loss and seeds the cotangent its backward starts
            from next tick; activations one stage on."""
            fwd, fwd_on = jnp.maximum(row["forward"], 0), row["forward"] >= 0
            fwd_in = c["fwd_in"].at[0].set(embed_fn(embed_params, in_m[fwd[0]]).astype(c["fwd_in"].dtype))
            y = constrain(jax.vmap(stage_fn)(chunks, probe_chunks, fwd_in, jnp.arange(s)), state_axes, "pipeline stage outputs")
            keep = lambda ring, f, x_mb, on: ring.at[f % slots].set(jnp.where(on, x_mb, ring[f % slots]))  # noqa: E731
            c["stash"] = constrain(jax.vmap(keep)(c["stash"], fwd, fwd_in, fwd_on), stash_axes, "pipeline stash")
            mb_loss, dloss_params, dy = head(loss_params, y[-1], t_m[fwd[-1]])
            c["loss"] = c["loss"] + jnp.where(fwd_on[-1], mb_loss, 0.0) / m
            c["loss_grads"] = add(c["loss_grads"], dloss_params, fwd_on[-1])
            c["bwd_in"] = constrain(c["bwd_in"].at[-1].set(dy.astype(c["bwd_in"].dtype)), state_axes, "pipeline stage cotangents")
            c["fwd_in"] = constrain(jnp.roll(y, 1, axis=0), state_axes, "pipeline stage inputs")  # a collective-permute
            return c

        def tick(c, row, forwards: bool, backwards: bool):
            c = backward_half(dict(c), row) if backwards else c
            return (forward_half(dict(c), row) if forwards else c), None

        x_like = jax.eval_shape(lambda: embed_fn(embed_params, in_m[0]))
        held = constrain(jnp.zeros((s, *x_like.shape), x_like.dtype), state_axes, "pipeline stage inputs")
        c = {
            "fwd_in": held, "bwd_in": held,
            "stash": constrain(jnp.zeros((s, slots, *x_like.shape), x_like.dtype), stash_axes, "pipeline stash"),
            "grads": f32(chunks), "embed_grads": f32(embed_params), "loss_grads": f32(loss_params), "loss": jnp.zeros((), jnp.float32),
            "stats": None if probes is None else jax.tree.map(lambda a: jnp.full(a.shape, -jnp.inf, jnp.float32), probe_chunks),
        }
        # One scan per phase of the table: ticks with forwards only, with both, with backwards only,
        # each tick running only the halves some stage works in (the schedule's own bubble).
        for start, stop, forwards, backwards in phases(table):
            rows = {k: jnp.asarray(v[start:stop]) for k, v in arrays.items()}
            c, _ = jax.lax.scan(functools.partial(tick, forwards=forwards, backwards=backwards), c, rows)
        like = lambda tree, ref: jax.tree.map(lambda g, p: g.reshape(p.shape).astype(p.dtype), tree, ref)  # noqa: E731
        stats = None if probes is None else like(c["stats"], probes)
        return c["loss"], (like(c["grads"], params), stats, like(c["embed_grads"], embed_params), like(c["loss_grads"], loss_params))

    @jax.custom_vjp
    def pipelined(params, probes, embed_params, loss_params, seed, inputs, targets):
        return run(params, probes, embed_params, loss_params, seed, inputs, targets)[0]

    def forward_rule(*args):
        loss, found = run(*args)
        return loss, (found, args[-3:])

    def backward_rule(residuals, g):
        (dparams, stats, dembed, dloss_params), (seed, *integer_args) = residuals
        ratio = g / seed  # 1 when the loss is differentiated with the seed's own scale
        scale = lambda tree: jax.tree.map(lambda a: (a * ratio).astype(a.dtype), tree)  # noqa: E731
        none = tuple(jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), a) for a in integer_args)
        return scale(dparams), stats, scale(dembed), scale(dloss_params), jnp.zeros_like(seed), *none  # statistics are not scaled

    pipelined.defvjp(forward_rule, backward_rule)
    return pipelined(params, probes, embed_params, loss_params, jnp.asarray(seed, jnp.float32), inputs, targets)
