"""A decoder-only Transformer in Flax NNX, Llama-style or GPT-2-style by config.

`ModelConfig` (`lm.model.config`) says what the model *is*; the dtype policy (`lm.model.precision`) and the pipeline plan
(`sharding.schedules.PipelinePlan`) are given to `Transformer` beside it. The layers are stacked
along a leading `layers` axis and run by `lax.scan` (`lm.model.layer_stack`): one compiled block whatever the depth. The
blocks themselves are in `lm.model.layers`. Shape suffixes as there; `n` is the number of layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lm.errors import UserError
from lm.model import attention, moe
from lm.model.block import Block
from lm.model.config import ModelConfig, layer_period
from lm.model.fp8 import Probe
from lm.model.latent_attention import init_latent_cache
from lm.model.layer_stack import StackRunner, layer_segments
from lm.model.layers import (
    RESIDUAL_AXES,
    Embedding,
    Norm,
    _param,
    gather_length,
    lookup,
)
from lm.model.multi_token import MtpModule
from lm.model.precision import Policy
from lm.model.split_backward import split_vjp
from sharding import constrain
from sharding.pipeline import pipeline, pipeline_loss
from sharding.pipeline_1f1b import pipeline_1f1b
from sharding.pipeline_per_stage import pipeline_per_stage
from sharding.pipeline_zero_bubble import pipeline_zero_bubble
from sharding.remat import remat
from sharding.schedules import PipelinePlan


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, policy: Policy = Policy(), pipeline: PipelinePlan = PipelinePlan()):
        self.cfg, self.policy, self.pipeline = cfg, policy, pipeline
        dt = policy.param_dtype
        self.embedding = _param(rngs.params(), (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), 0.02, dt, kind=Embedding)
        if cfg.position == "learned":
            self.pos_embedding = _param(rngs.params(), (cfg.max_len, cfg.embed_dim), (None, "embed"), 0.01, dt, kind=Embedding)

        def stacked(block_cfg, count, module=Block):
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked_blocks(layer_rngs):
                return module(block_cfg, policy, layer_rngs)

            return stacked_blocks(rngs.split(count))

        # A mixture of experts with dense layers among its sparse ones (`model.moe_layers`): those
        # in a stack of their own, each stack in model order (`layer_segments` runs them).
        if cfg.moe and cfg.dense_layers:
            self.dense_blocks = stacked(dataclasses.replace(cfg, num_experts=0), cfg.dense_layers)
        self.blocks = stacked(cfg, cfg.sparse_layers if cfg.moe else cfg.num_layers)
        self.final_norm = Norm(cfg, policy)
        if not cfg.tie_embeddings:
            self.head = _param(rngs.params(), (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), 0.02, dt)
        if cfg.mtp_depth:  # made last: the model's own parameters are drawn as without them
            self.mtp = stacked(cfg, cfg.mtp_depth, MtpModule)

    def init_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
        """An empty KV cache for `length` positions: {'k', 'v'} of shape [n, b, s, g, k] (latent
        attention: `lm.model.latent_attention.init_latent_cache`)."""
        c, dtype = self.cfg, self.policy.compute_dtype
        if c.latent_attention:
            return init_latent_cache(c, batch, length, dtype)
        shape = (c.num_layers, batch, length, c.num_kv_heads, c.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def __call__(self, tokens_bt: jax.Array, cache=None, cache_index=0, segments_bt=None, positions_bt=None):
        """Float32 logits [b, t, v] and the updated cache (None when not decoding).

        With a cache, `tokens_bt` continues the sequence at position `cache_index`. With
        `segments_bt` (which document each token is from, packed windows), attention stays
        within a document and positions restart at each document's first token. `positions_bt`
        given: the tokens' positions, in whatever order they come (context parallelism's
        load-balanced order, `sharding.context`); attention's mask is built from them.
        """
        if segments_bt is not None:
            segments_bt = constrain(segments_bt, ("batch", "length"), "segment ids")
        if positions_bt is not None:
            positions_bt = constrain(positions_bt, ("batch", "length"), "positions")
        elif segments_bt is not None:
            positions_bt = segment_positions(segments_bt)
        elif cache is not None:
            positions_bt = cache_index + jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        # positions_bt None from here: in order from 0, attention causal by index
        x = self._embed(tokens_bt, positions_bt)
        x, cache = self._layers(x, positions_bt, cache, cache_index, segments_bt)
        return self._logits(x, self.final_norm, self._head_weight()), cache

    def train_logits(self, tokens_bt, mtp_tokens_dbt, segments_bt=None, positions_bt=None) -> tuple[jax.Array, list[jax.Array]]:
        """(the model's float32 logits [b, t, v], each multi-token prediction depth's [b, t, v]):
        depth d given the tokens d + 1 places ahead, `mtp_tokens_dbt[d]` (`multi_token.shifted`),
        in the order and positions of `tokens_bt`."""
        if positions_bt is not None:
            positions_bt = constrain(positions_bt, ("batch", "length"), "positions")
        elif segments_bt is not None:
            positions_bt = segment_positions(segments_bt)
        if segments_bt is not None:
            segments_bt = constrain(segments_bt, ("batch", "length"), "segment ids")
        tables, head_weight = self._embed_tables(), self._head_weight()
        x, _ = self._layers(self._embed(tokens_bt, positions_bt, tables), positions_bt, None, 0, segments_bt)
        h = self.final_norm(x)  # what each depth passes on is normalised, as Megatron-Core and vLLM take it
        logits = self._head(h, head_weight)
        graphdef, stacked = nnx.split(self.mtp)

        def depth(h, params, next_tokens_bt):  # one module: its normalised output
            module = nnx.merge(graphdef, params)
            return module.head_norm(module(h, self._embed(next_tokens_bt, positions_bt, tables), positions_bt, segments_bt))

        # Rematerialised as a layer is; the head outside it, as the model's own (not run again in the backward).
        depth = remat(depth, self.cfg.remat)
        mtp_logits = []
        with moe.loss_weighted(self.cfg.mtp_loss_weight / self.cfg.mtp_depth):  # as each depth's loss counts
            for d in range(self.cfg.mtp_depth):
                h = depth(h, jax.tree.map(lambda a: a[d], stacked), mtp_tokens_dbt[d])  # noqa: B023
                mtp_logits.append(self._head(h, head_weight))
        return logits, mtp_logits

    @property
    def _runner(self) -> StackRunner:
        return StackRunner(self.cfg, self.policy)

    def _embed_tables(self) -> tuple:
        return self.embedding[...], self.pos_embedding[...] if self.cfg.position == "learned" else None

    def _embed(self, tokens_bt, positions_bt=None, tables=None) -> jax.Array:
        """The embedded tokens (and positions); `tables` given: (token table, position table)."""
        table_vd, positions_td = tables or self._embed_tables()
        x = lookup(table_vd, tokens_bt, self.policy.compute_dtype)
        if self.cfg.position == "learned":
            table_td = constrain(positions_td, (None, None), "position table")
            in_order = jnp.arange(tokens_bt.shape[1])[None] if positions_bt is None else positions_bt
            x = x + self.policy.cast(jnp.take(table_td, in_order, axis=0))
        return constrain(x, RESIDUAL_AXES, "embeddings")

    def _head_weight(self) -> jax.Array:
        return self.embedding[...] if self.cfg.tie_embeddings else self.head[...]

    def _logits(self, x_btd, final_norm: Norm, head_weight) -> jax.Array:
        """Float32 logits of the last layer's output (norm and weight given: the 1F1B pipeline
        differentiates them explicitly)."""
        return self._head(final_norm(x_btd), head_weight)

    def _head(self, normed_btd, head_weight) -> jax.Array:
        cfg = self.cfg
        x = gather_length(normed_btd)
        spec = "btd,vd->btv" if cfg.tie_embeddings else "btd,dv->btv"
        logits = self.policy.matmul(spec, x, head_weight, out_dtype=jnp.float32)
        if cfg.used_vocab < cfg.vocab_size:  # padding ids: out of the loss's softmax and of sampling
            logits = jnp.where(jnp.arange(cfg.vocab_size) < cfg.used_vocab, logits, jnp.finfo(jnp.float32).min)
        return constrain(logits, ("batch", "length", "vocab"), "logits")

    def pipelined_loss(self, loss_fn, tokens_bt, targets_bt, positions_bt=None, loss_scale=1.0, differentiated=True) -> jax.Array:
        """`loss_fn(logits, targets)` averaged over the pipeline's microbatches. The 1F1B pipelines
        embed each microbatch on their first stage, apply the head and loss on their last and
        compute their own gradients (`sharding.pipeline_1f1b`, `sharding.pipeline_per_stage`);
        GPipe / circular apply them after the pipeline, one microbatch at a time
        (`sharding.pipeline.pipeline_loss`). The backward runs at `loss_scale` (differentiate
        `loss * loss_scale`). `differentiated=False` (evaluation): GPipe's forward under every
        schedule, no backward computed."""
        stage, stacked, stacked_axes, probes, probes_axes = self._pipeline_stage(positions_bt)
        norm_graph, norm_state = nnx.split(self.final_norm)

        def head_loss(head_params, y_btd, targets_mb):
            norm, weight = head_params
            return loss_fn(self._logits(y_btd, nnx.merge(norm_graph, norm), weight), targets_mb)

        def embed(tables, tokens_mb):
            positions = None if positions_bt is None else positions_bt[: tokens_mb.shape[0]]
            return self._embed(tokens_mb, positions, tables)

        if not differentiated:
            run = functools.partial(pipeline_loss, differentiated=False)
        else:
            run = {"gpipe": pipeline_loss, "1f1b": pipeline_1f1b, "1f1b_per_stage": pipeline_per_stage,
                   "zero_bubble": functools.partial(pipeline_zero_bubble, split_vjp=split_vjp)}[self.pipeline.schedule]
        with moe.loss_seed(loss_scale / self.pipeline.microbatches):  # as each microbatch's loss is
            return run(
                stage, stacked, stacked_axes, self.pipeline, embed_fn=embed, embed_params=self._embed_tables(), inputs=tokens_bt,
                loss_fn=head_loss, loss_params=(norm_state, self._head_weight()), targets=targets_bt,
                x_axes=RESIDUAL_AXES, batch_axes=("batch", "length"), probes=probes, probes_axes=probes_axes,
                seed=loss_scale,
            )

    def _pipeline_stage(self, positions_bt):
        """The stacked layers as a pipeline takes them: (stage fn, their states and logical axes,
        the statistics probes and theirs, None without any). The probes are apart because the
        pipeline gives each tick its own (`sharding.pipeline`). Dense layers among sparse ones
        (`model.moe_layers='every:N'`): both stacks, each chunk whole repeats of the pattern
        (`moe_problem` says where it is not), run as `StackRunner.run_periods` runs the model."""
        if hasattr(self, "dense_blocks"):
            return self._pipeline_periods(positions_bt)
        graphdef, probes, stacked = nnx.split(self.blocks, Probe, ...)

        def stage(chunk, chunk_probes, x_btd, chunk_index):  # a chunk of consecutive layers on one microbatch
            positions = None if positions_bt is None else positions_bt[: x_btd.shape[0]]  # the same in every row
            with attention.mapped():  # GPipe and 1F1B vmap this over the stages
                return self._runner.run_stack(graphdef, (chunk, chunk_probes), x_btd, positions, None, None, chunk=chunk_index)[0]

        axes = nnx.get_partition_spec
        probes_given = (probes, axes(probes)) if jax.tree.leaves(probes) else (None, None)
        return stage, stacked, axes(stacked), *probes_given

    def _pipeline_periods(self, positions_bt):
        cfg, fp8 = self.cfg, self.policy.fp8_layer_mask(self.cfg.num_layers)
        if len(set(fp8)) > 1:
            raise UserError("precision.fp8 skip keeps some layers out of fp8, which a pipeline of dense and sparse layers cannot stage alike; "
                            "use mesh.stage=1 or skip none")
        split = {kind: nnx.split(getattr(self, kind), Probe, ...) for kind in ("blocks", "dense_blocks")}
        graphdefs = {kind: graphdef for kind, (graphdef, _, _) in split.items()}
        probes, stacked = ({kind: parts[i] for kind, parts in split.items()} for i in (1, 2))
        kinds = ["blocks" if i in set(cfg.sparse_layer_ids) else "dense_blocks" for i in range(cfg.num_layers)]
        period = tuple(kinds[: layer_period(cfg.sparse_layer_ids, cfg.num_layers)])

        def stage(chunk, chunk_probes, x_btd, chunk_index):  # whole repeats of the pattern on one microbatch
            positions = None if positions_bt is None else positions_bt[: x_btd.shape[0]]
            stacks = {kind: (graphdefs[kind], (chunk_probes[kind], chunk[kind])) for kind in graphdefs}
            with attention.mapped():
                return self._runner.run_periods(period, stacks, x_btd, positions, None, None, None, in_fp8=fp8[0])[0]

        axes = nnx.get_partition_spec
        return stage, stacked, axes(stacked), probes, axes(probes)

    def _layers(self, x, positions_bt, cache, cache_index, segments_bt=None):
        if self.pipeline.stages > 1 and cache is None:
            stage, stacked, stacked_axes, probes, probes_axes = self._pipeline_stage(positions_bt)
            return pipeline(stage, stacked, stacked_axes, x, RESIDUAL_AXES, self.pipeline, probes, probes_axes), None
        cfg, fp8 = self.cfg, self.policy.fp8_layer_mask(self.cfg.num_layers)
        # Each layer's stack: `blocks` (every layer of a dense model; a mixture of experts' sparse
        # ones), `dense_blocks` (its dense ones).
        stacks = {kind: nnx.split(getattr(self, kind)) for kind in ("blocks", "dense_blocks") if hasattr(self, kind)}
        in_blocks = set(cfg.sparse_layer_ids) if cfg.moe else set(range(cfg.num_layers))
        kinds = ["blocks" if i in in_blocks else "dense_blocks" for i in range(cfg.num_layers)]
        ids = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in stacks}
        caches = []
        for start, stop, period in layer_segments(kinds, periodic=len(set(fp8)) == 1):
            part = None if cache is None else jax.tree.map(lambda a: a[start:stop], cache)  # noqa: B023
            if len(period) > 1:
                states = {kind: (graphdef, (stacked,)) for kind, (graphdef, stacked) in stacks.items()}
                x, part = self._runner.run_periods(period, states, x, positions_bt, part, cache_index, segments_bt, in_fp8=fp8[0])
            else:
                graphdef, stacked = stacks[period[0]]
                first = ids[period[0]].index(start)  # the run's place in its stack
                run = jax.tree.map(lambda a: a[first : first + stop - start], stacked)  # noqa: B023
                x, part = self._runner.run_stack(graphdef, (run,), x, positions_bt, part, cache_index, segments_bt, first=start)
            caches.append(part)
        return x, None if cache is None else jax.tree.map(lambda *a: jnp.concatenate(a), *caches)


def segment_positions(segments_bt: jax.Array) -> jax.Array:
    """Each token's position within its document: 0 at every change of segment id."""
    index = jnp.broadcast_to(jnp.arange(segments_bt.shape[1]), segments_bt.shape)
    starts = jnp.concatenate([jnp.ones_like(segments_bt[:, :1], bool), segments_bt[:, 1:] != segments_bt[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
