"""Whether a mesh can split a run as its rules say: the batch, the sequence, context
parallelism and the pipeline's microbatches, each refused with a one-line UserError that says
how to fix it, before anything is compiled."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

import sharding
import sharding.schedules
from lm.config import UserError
from lm.program.spec import RunSpec


def check_batch_split(spec: RunSpec, mesh: Mesh) -> None:
    """UserErrors for a batch or sequence the mesh cannot split as the rules say."""
    c = spec.config
    b, accum = c.train.batch_size, c.train.grad_accum
    dp = sharding.axis_size(mesh, spec.rules, "batch")
    if b % (dp * accum):
        axes = " x ".join(sharding.rule_axes(spec.rules, "batch")) or "none"
        raise UserError(
            f"train.batch_size={b} is not divisible by the data-parallel size {dp} (mesh {axes})"
            + (f" times train.grad_accum={accum}" if accum > 1 else "")
            + f"; use a multiple of {dp * accum} or change the mesh"
        )
    seq = sharding.axis_size(mesh, spec.rules, "norm_length")
    if c.train.seq_len % seq:
        axes = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in sharding.rule_axes(spec.rules, "norm_length"))
        raise UserError(
            f"sequence parallelism splits the sequence over {axes}, which does not "
            f"divide train.seq_len={c.train.seq_len}; change one of them"
        )
    _check_context(spec, mesh)
    plan = spec.pipeline
    if plan.stages > 1:
        per_replica = b // (dp * accum)
        sharding.schedules.check(plan.stages, plan.microbatches, plan.repeats, spec.model.pipelined_layers, per_replica, plan.schedule,
                                mesh.shape["context"])
    if b % jax.process_count():
        raise UserError(f"train.batch_size={b} is not divisible by the {jax.process_count()} processes")


def _check_context(spec: RunSpec, mesh: Mesh) -> None:
    """UserErrors for context parallelism the sequence or the rules cannot carry."""
    shards, seq_len = sharding.axis_size(mesh, spec.rules, "length"), spec.config.train.seq_len
    if shards > 1 and seq_len % (2 * shards):
        raise UserError(
            f"context parallelism splits each sequence over {shards} shards as 2 x {shards} equal chunks "
            f"(load balance for causal attention), which train.seq_len={seq_len} does not divide; "
            f"use a multiple of {2 * shards}"
        )
    if mesh.shape["context"] > 1 and "context" not in sharding.rule_axes(spec.rules, "length"):
        raise UserError(
            f"mesh.context={mesh.shape['context']} but the sharding rules do not split the sequence "
            "('length') over 'context', so its devices would repeat each other's work; drop "
            "sharding.rules' 'length' entry or set mesh.context=1"
        )
