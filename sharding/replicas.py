"""Data parallelism that combines the replicas once a step, however many passes the step makes.

Under automatic partitioning a gradient computed from rows split over `data` is all-reduced
where it is made: in a step of several passes (gradient accumulation, a pipeline's
microbatches) every pass's gradients cross the replicas, M times the bytes of one reduction
(`llama_8b` on `{stage 4, data 2}`, 8 microbatches: 77 GiB per step and GPU where 7.5 do).
`per_replica` runs a step's passes in a `jax.shard_map` that makes `data` manual: each replica
sums its own rows' gradients, and they are combined once, at the end (as Megatron-LM does, and
PyTorch DDP's `no_sync`). The other mesh axes stay automatic, so FSDP, tensor, context and
pipeline parallelism inside are partitioned as before (the rules drop the manual axis:
`sharding.constraints`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

COMBINE = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax}


def per_replica(fn: Callable, mesh: Mesh, split: Sequence[bool], combine: Sequence[str], axis: str = "data") -> Callable:
    """`fn(*args)` (returning a tuple) run by each `axis` replica on its own share of the
    arguments marked in `split` (their leading dimension divided over `axis`; the others alike on
    every replica), each output then combined over the replicas by `combine`'s operation for it:
    "sum" (gradients of a loss the caller divided by the replica count, so that every cotangent
    inside is the one the whole batch gives: fp8's gradient amaxes, float16's overflow), "mean"
    (a loss: the replicas' shares are equal) or "max" (amaxes). The results are alike on every
    replica; a sum placed over `axis` afterwards (ZeRO-1's gradients) is compiled as a
    reduce-scatter."""
    if mesh.shape.get(axis, 1) == 1:
        return fn

    def local(*args):
        return tuple(jax.tree.map(lambda a, op=COMBINE[how]: op(a, axis), out) for out, how in zip(fn(*args), combine))

    in_specs = tuple(PartitionSpec(axis) if s else PartitionSpec() for s in split)
    out_specs = (PartitionSpec(),) * len(combine)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={axis}, check_vma=False)
