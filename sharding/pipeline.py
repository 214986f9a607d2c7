"""Pipeline parallelism over the 'stage' mesh axis, as one SPMD program: GPipe and circular
(`pipeline`, differentiated by autodiff). The tables every schedule steps through are plain data
in `sharding.schedules`; the 1F1B programs, which run their own backward, are
`sharding.pipeline_1f1b` (lockstep) and `sharding.pipeline_per_stage`.

The stacked layer parameters `[layers, ...]` are viewed as `[repeats, stages, layers_per_chunk,
...]` with `stages` placed on the `stage` mesh axis: chunk `c = r * stages + s` (layers
`c * layers_per_chunk ...`) lives on stage `s`. A `lax.scan` runs `repeats * microbatches +
stages - 1` ticks; at each tick every stage applies its current chunk to the microbatch it holds
(a `vmap` over stages, which XLA partitions over the mesh axis), then activations shift one
stage on (`jnp.roll` along the stage axis, compiled to a collective-permute). A microbatch's
output of the last stage returns to stage 0 for the next repeat (circular / interleaved), or is
the result after the last. Gradients come from autodiff through the scan; each tick's stage
computation can be rematerialised. With a loss (`pipeline_loss`, what training runs), the head
and loss follow one microbatch at a time (`microbatch_loss`), so only a microbatch's logits are
ever alive, and the head's gradients add up per microbatch as gradient accumulation's do.
`owning_backward` is the custom VJP this and the 1F1B programs compute their gradients under.

GPipe is `repeats=1`, with bubble `(S-1)/(M+S-1)`; `repeats=R` gives `(S-1)/(R*M+S-1)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.constraints import constrain, vmap_over
from sharding.mesh import ShardingError
from sharding.remat import remat
from sharding.schedules import PipelinePlan, Work, check, schedule


@jax.tree_util.register_pytree_node_class
class Statistics:
    """Marks probes among the ends' parameters (`embed_params`, `loss_params`: layers run with the
    embedding or the head): their gradients are statistics, combined by maximum over the
    microbatches (as the chunks' `probes` are) and never scaled (`end_zeros`, `end_add`)."""

    def __init__(self, probes):
        self.probes = probes

    def tree_flatten(self):
        return (self.probes,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def _per_end_leaf(plain: Callable, statistic: Callable, *trees):
    """`plain` on every leaf of `trees`, `statistic` on those under a `Statistics`."""
    def one(*nodes):
        return jax.tree.map(statistic, *nodes) if isinstance(nodes[0], Statistics) else jax.tree.map(plain, *nodes)

    return jax.tree.map(one, *trees, is_leaf=lambda n: isinstance(n, Statistics))


def end_zeros(tree):
    """Float32 sums for the gradients of an end's parameters: zeros, statistics at -inf."""
    return _per_end_leaf(lambda a: jnp.zeros(a.shape, jnp.float32), lambda a: jnp.full(a.shape, -jnp.inf, jnp.float32), tree)


def end_add(total, d):
    """One microbatch's gradients of an end's parameters into `total` (`end_zeros`): statistics
    by maximum, the rest summed in float32."""
    return _per_end_leaf(lambda g, x: g + x.astype(jnp.float32), lambda g, x: jnp.maximum(g, x.astype(jnp.float32)), total, d)


def microbatch(tree, index):
    """Microbatch `index` of `split_microbatches`' result (a tree of them)."""
    return jax.tree.map(lambda a: a[index], tree)


def loss_cotangent(loss, seed):
    """What a microbatch's loss is differentiated at: `seed`; where `loss_fn` gives a vector of
    losses, on its first entry (the objective) alone, the others only reported beside it."""
    seed = jnp.asarray(seed, loss.dtype)
    return seed if loss.ndim == 0 else jnp.zeros_like(loss).at[0].set(seed)


def zero_loss(loss_fn: Callable, loss_params, y_like, targets_m):
    """Float32 zeros shaped as `loss_fn`'s loss (a scalar or a vector of losses): the sum over microbatches starts there."""
    shape = jax.eval_shape(lambda: loss_fn(loss_params, jnp.zeros(y_like.shape, y_like.dtype), microbatch(targets_m, 0))).shape
    return jnp.zeros(shape, jnp.float32)


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
    """`[batch, ...]` -> `[count, batch // count, ...]` (every leaf of a tree of them, each
    with leading axes `axes`). Microbatch j holds rows j, j + count, ...: every data-parallel
    shard holds part of each, so no rows move between devices."""
    def one(x):
        b = x.shape[0]
        if b % count:
            raise ShardingError(f"batch {b} is not divisible into {count} microbatches")
        x_m = x.reshape(b // count, count, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x_m, (None, *axes), name)

    return jax.tree.map(one, x)


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


def pipeline_microbatches(stage_fn: Callable, params, params_axes, x, x_axes: Sequence[str | None], plan: PipelinePlan,
                          probes=None, probes_axes=None):
    """`stage_fn(chunk_params, chunk_probes, x_mb, chunk) -> y_mb` applied to every microbatch of
    `x` through all chunks; `chunk` (traced) is which one: layers `chunk * layers_per_chunk ...`.

    `params`: pytree of stacked layer parameters (leading axis: layers); `params_axes`: the same
    tree of logical-axis tuples; `x`: `[batch, ...]` with logical axes `x_axes`. Returns its
    microbatches `[M, batch / M, ...]` (`split_microbatches`), each the same as applying all
    layers in order to it. The scan steps through the rows of `schedule(...)`, the same table the
    tests check and the notebook draws. `probes` (stacked
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
        out = vmap_over(run_stage, "stages", in_axes=(1, 1, 0, 0, 0))(chunks, row.get("probes"), row["repeat"], jnp.arange(s), held)
        out = constrain(out, state_axes, "pipeline stage outputs")
        leaving = jnp.where(last["active"], out[-1], outputs[last["microbatch"]])
        outputs = outputs.at[last["microbatch"]].set(leaving)
        # Each stage's result moves to the next stage (a collective-permute over `stage`).
        return (jnp.roll(out, 1, axis=0), outputs), None

    held = constrain(jnp.zeros((s, *x_m.shape[1:]), x.dtype), state_axes, "pipeline stage inputs")
    outputs = jnp.zeros_like(x_m)
    (_, outputs), _ = jax.lax.scan(tick, (held, outputs), rows)
    return outputs


def pipeline(stage_fn: Callable, params, params_axes, x, x_axes: Sequence[str | None], plan: PipelinePlan, probes=None, probes_axes=None):
    """The stacked layers applied to `x` by GPipe / circular (`pipeline_microbatches`), the
    microbatches merged back into `[batch, ...]`."""
    return merge_microbatches(pipeline_microbatches(stage_fn, params, params_axes, x, x_axes, plan, probes, probes_axes))


def pipeline_loss(stage_fn: Callable, params, params_axes, plan: PipelinePlan, *, embed_fn: Callable, embed_params, inputs,
                  loss_fn: Callable, loss_params, targets, x_axes: Sequence[str | None], batch_axes: Sequence[str | None],
                  probes=None, probes_axes=None, seed=1.0, differentiated: bool = True):
    """GPipe / circular with the arguments of `pipeline_1f1b`: the mean over microbatches of
    `loss_fn(loss_params, y_mb, targets_mb)`, `y_mb` the layers applied to `embed_fn(embed_params,
    inputs)`'s microbatch. The head and loss run after the pipeline one microbatch at a time
    (`microbatch_loss`), as on the 1F1B pipelines' last stage. `differentiated=False`
    (evaluation, under any schedule: the chunks are laid out alike): the forward alone, nothing
    kept for a backward."""
    x = embed_fn(embed_params, inputs)
    y_m = pipeline_microbatches(stage_fn, params, params_axes, x, x_axes, plan, probes, probes_axes)
    targets_m = split_microbatches(targets, plan.microbatches, batch_axes, "pipeline targets")
    if not differentiated:
        mean = lambda total, mb: (total + loss_fn(loss_params, *mb) / plan.microbatches, None)  # noqa: E731
        return jax.lax.scan(mean, zero_loss(loss_fn, loss_params, y_m[0], targets_m), (y_m, targets_m))[0]
    return microbatch_loss(loss_fn, loss_params, y_m, targets_m, seed, x_axes)


def microbatch_loss(loss_fn: Callable, loss_params, y_m, targets_m, seed=1.0, y_axes: Sequence[str | None] | None = None):
    """The mean over microbatches of `loss_fn(loss_params, y_mb, targets_mb)` (`y_m`,
    `targets_m`: microbatches on the leading axis), one microbatch at a time: a scan that also
    differentiates each microbatch's loss as it goes (at cotangent `seed / M`, `owning_backward`),
    so one microbatch's logits exist at once, forward or backward, nothing is recomputed, and
    `loss_params`' gradients add up microbatch by microbatch in float32, as gradient
    accumulation adds them."""
    m = y_m.shape[0]

    def run(loss_params, y_m, seed, targets_m):
        def one(carry, microbatch):
            total, grads = carry
            y_mb, targets_mb = microbatch
            loss, pull = jax.vjp(lambda lp, y: loss_fn(lp, y, targets_mb), loss_params, y_mb)
            dloss_params, dy_mb = pull(loss_cotangent(loss, seed / m))
            return (total + loss / m, end_add(grads, dloss_params)), dy_mb

        zeros = (zero_loss(loss_fn, loss_params, y_m[0], targets_m), end_zeros(loss_params))
        (loss, grads), dy_m = jax.lax.scan(one, zeros, (y_m, targets_m))
        if y_axes is not None:
            dy_m = constrain(dy_m, (None, *y_axes), "pipeline output cotangents")
        return loss, (jax.tree.map(lambda g, p: g.astype(p.dtype), grads, loss_params), dy_m)

    return owning_backward(run, (loss_params, y_m), seed, (targets_m,))


def owning_backward(run: Callable, differentiable: tuple, seed, integers: tuple = (), statistics: Sequence[int] = ()):
    """`run(*differentiable, seed, *integers)[0]`, a loss, as a function JAX differentiates
    through what `run` found along with it: `(loss, gradients)`, one per `differentiable`
    argument, all taken at cotangent `seed`. A custom VJP whose backward scales them by the
    loss's cotangent over `seed` (a float16 loss scale goes into `seed`, so the activations'
    cotangents are scaled where they would overflow or underflow, as under autodiff); those at
    positions `statistics` (amaxes) are returned as they are."""
    n = len(differentiable)

    @jax.custom_vjp
    def owned(*args):
        return run(*args)[0]

    def forward_rule(*args):
        loss, found = run(*args)
        return loss, (found, args[n:])

    def backward_rule(residuals, g):
        found, (seed, *integer_args) = residuals
        ratio = (g if g.ndim == 0 else g[0]) / seed  # 1 when the loss is differentiated with the seed's own scale
        scale = lambda tree: _per_end_leaf(lambda a: (a * ratio).astype(a.dtype), lambda a: a, tree)  # noqa: E731
        grads = tuple(f if i in statistics else scale(f) for i, f in enumerate(found))
        none = tuple(jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), a) for a in integer_args)
        return *grads, jnp.zeros_like(seed), *none

    owned.defvjp(forward_rule, backward_rule)
    return owned(*differentiable, jnp.asarray(seed, jnp.float32), *integers)
