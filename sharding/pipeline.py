"""Pipeline parallelism over the 'stage' mesh axis, as one SPMD program (GPipe and circular).

The stacked layer parameters `[layers, ...]` are viewed as `[repeats, stages, layers_per_chunk,
...]` with `stages` placed on the `stage` mesh axis: chunk `c = r * stages + s` (layers
`c * layers_per_chunk ...`) lives on stage `s`. A `lax.scan` runs `repeats * microbatches +
stages - 1` ticks; at each tick every stage applies its current chunk to the microbatch it holds
(a `vmap` over stages, which XLA partitions over the mesh axis), then activations shift one
stage on (`jnp.roll` along the stage axis, compiled to a collective-permute). A microbatch's
output of the last stage returns to stage 0 for the next repeat (circular / interleaved), or is
the result after the last. Gradients come from autodiff through the scan; each tick's stage
computation can be rematerialised.

GPipe is `repeats=1`, with bubble `(S-1)/(M+S-1)`; `repeats=R` gives `(S-1)/(R*M+S-1)`.
The schedule is also plain data (`schedule`), so it can be checked, drawn and its bubble read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharding.mesh import ShardingError
from sharding.rules import constrain


class Work(NamedTuple):
    microbatch: int
    chunk: int  # layer chunk, 0 .. repeats * stages - 1, in the order a microbatch visits them


def schedule(stages: int, microbatches: int, repeats: int = 1) -> list[list[Work | None]]:
    """For each tick and stage, the (microbatch, chunk) it works on, or None when idle."""
    check(stages, microbatches, repeats)
    ticks = repeats * microbatches + stages - 1
    table = []
    for t in range(ticks):
        row = []
        for s in range(stages):
            item = t - s  # the item-th piece of work this stage does
            if 0 <= item < repeats * microbatches:
                row.append(Work(microbatch=item % microbatches, chunk=(item // microbatches) * stages + s))
            else:
                row.append(None)
        table.append(row)
    return table


def bubble_fraction(table: Sequence[Sequence[Work | None]]) -> float:
    """Idle (tick, stage) cells over all cells."""
    cells = [cell for row in table for cell in row]
    return sum(cell is None for cell in cells) / len(cells)


def check(stages: int, microbatches: int, repeats: int, layers: int | None = None, batch: int | None = None) -> None:
    """ShardingErrors for a pipeline that cannot be built; `batch` is the per-replica batch."""
    if min(stages, microbatches, repeats) < 1:
        raise ShardingError(f"pipeline stages, microbatches and repeats must be positive, got {stages}, {microbatches}, {repeats}")
    if stages > 1 and microbatches < stages:
        raise ShardingError(
            f"pipeline.microbatches={microbatches} is fewer than the {stages} stages; use at least {stages} "
            "(more shrinks the bubble)"
        )
    if layers is not None and layers % (stages * repeats):
        raise ShardingError(
            f"{layers} layers do not split into mesh.stage={stages} x pipeline.repeats={repeats} equal chunks; "
            f"make the layer count a multiple of {stages * repeats}"
        )
    if batch is not None and batch % microbatches:
        raise ShardingError(
            f"the per-replica batch of {batch} sequences is not divisible by pipeline.microbatches={microbatches}"
        )


def _chunked(params, params_axes, stages: int, repeats: int):
    """`[layers, ...]` -> `[repeats, stages, layers_per_chunk, ...]`, stages on the `stage` axis."""

    def one(p, axes):
        p = p.reshape(repeats, stages, p.shape[0] // (repeats * stages), *p.shape[1:])
        return constrain(p, (None, "stages", None, *tuple(axes)[1:]), "pipeline chunk")

    return jax.tree.map(one, params, params_axes)


def pipeline(
    stage_fn: Callable,
    params,
    params_axes,
    x,
    x_axes: Sequence[str | None],
    *,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    remat_policy: Callable | None | str = "none",
):
    """`stage_fn(chunk_params, x_mb) -> y_mb` applied to every microbatch of `x` through all chunks.

    `params`: pytree of stacked layer parameters (leading axis: layers); `params_axes`: the same
    tree of logical-axis tuples; `x`: `[batch, ...]` with logical axes `x_axes`. Returns `[batch,
    ...]`, the same as applying all layers in order to `x`. `remat_policy`: "none", None (save
    nothing inside a tick) or a `jax.checkpoint` policy.
    """
    m, s, r = microbatches, stages, repeats
    layers = jax.tree.leaves(params)[0].shape[0]
    check(s, m, r, layers)
    b = x.shape[0]
    if b % m:
        raise ShardingError(f"batch {b} is not divisible by pipeline.microbatches={m}")
    chunks = _chunked(params, params_axes, s, r)
    # Microbatch j holds rows j, j + m, ...: every data-parallel shard holds part of each.
    x_m = x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
    x_m = constrain(x_m, (None, *x_axes), "pipeline microbatches")
    state_axes = ("stages", *x_axes)

    def run_stage(chunk_params_r, repeat, x_mb):
        chunk = jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, repeat, 0, keepdims=False), chunk_params_r)
        return stage_fn(chunk, x_mb)

    if remat_policy != "none":
        run_stage = jax.checkpoint(run_stage, policy=remat_policy)
    stage_ids = jnp.arange(s)

    def tick(carry, t):
        held, outputs = carry  # held: [stages, mb, ...] what each stage works on at this tick
        item = t - stage_ids
        valid = (item >= 0) & (item < r * m)
        micro, repeat = jnp.clip(item, 0, r * m - 1) % m, jnp.clip(item, 0, r * m - 1) // m
        # Stage 0 takes a fresh microbatch in the first repeat, the last stage's output after.
        first_in = jnp.where(repeat[0] == 0, x_m[micro[0]], outputs[micro[0]])
        held = held.at[0].set(first_in)
        held = constrain(held, state_axes, "pipeline stage inputs")
        out = jax.vmap(run_stage, in_axes=(1, 0, 0))(chunks, repeat, held)
        out = constrain(out, state_axes, "pipeline stage outputs")
        last = jnp.where(valid[-1], out[-1], outputs[micro[-1]])
        outputs = outputs.at[micro[-1]].set(last)
        # Each stage's result moves to the next stage (a collective-permute over `stage`).
        return (jnp.roll(out, 1, axis=0), outputs), None

    held = constrain(jnp.zeros((s, *x_m.shape[1:]), x.dtype), state_axes, "pipeline stage inputs")
    outputs = jnp.zeros_like(x_m)
    (_, outputs), _ = jax.lax.scan(tick, (held, outputs), jnp.arange(r * m + s - 1))
    return outputs.swapaxes(0, 1).reshape(x.shape)
