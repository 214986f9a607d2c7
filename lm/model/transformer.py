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
from lm.model import attention, lora, moe, multi_token
from lm.model.block import Block
from lm.model.config import ModelConfig, shortest_period
from lm.model.cross_entropy import chunked_cross_entropy
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
from sharding.pipeline import Statistics, pipeline, pipeline_loss
from sharding.pipeline_1f1b import pipeline_1f1b
from sharding.pipeline_per_stage import pipeline_per_stage
from sharding.pipeline_zbv import pipeline_zbv
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

        def stacked(block_cfg, count, module=Block, axis="layers"):
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
            def stacked_blocks(layer_rngs):
                return module(block_cfg, policy, layer_rngs)

            return stacked_blocks(rngs.split(count))

        # A mixture of experts with dense layers among its sparse ones (`model.moe_layers`): those
        # in a stack of their own, each stack in model order (`layer_segments` runs them).
        if cfg.moe and cfg.dense_layers:
            # (Leading ones, DeepSeek's first K: run before a pipeline's stages, not split over them.)
            axis = "unstaged_layers" if cfg.dense_prefix else "layers"
            self.dense_blocks = stacked(dataclasses.replace(cfg, num_experts=0), cfg.dense_layers, axis=axis)
        self.blocks = stacked(cfg, cfg.sparse_layers if cfg.moe else cfg.num_layers)
        self.final_norm = Norm(cfg, policy)
        if not cfg.tie_embeddings:
            self.head = _param(rngs.params(), (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), 0.02, dt)
        if cfg.mtp_depth:  # made last: the model's own parameters are drawn as without them
            self.mtp = stacked(cfg, cfg.mtp_depth, MtpModule, axis="unstaged_layers")  # a pipeline runs them with the head

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
        positions_bt, segments_bt = placed_positions(positions_bt, segments_bt)
        if positions_bt is None and cache is not None:
            positions_bt = cache_index + jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        # positions_bt None from here: in order from 0, attention causal by index
        x = self._embed(tokens_bt, positions_bt)
        x, cache = self._layers(x, positions_bt, cache, cache_index, segments_bt)
        return self._head(self.final_norm(x), self._head_weight()), cache

    def train_loss(self, loss_fn, targets_bt, seed, tokens_bt, segments_bt=None, positions_bt=None) -> jax.Array:
        """`loss_fn(self(tokens_bt, ...)[0], targets_bt)` through `_head_loss`; `seed`: the
        cotangent the caller's backward starts from."""
        positions_bt, segments_bt = placed_positions(positions_bt, segments_bt)
        x, _ = self._layers(self._embed(tokens_bt, positions_bt), positions_bt, None, 0, segments_bt)
        return self._head_loss(loss_fn, self.final_norm(x), self._head_weight(), targets_bt, seed)

    def _head_loss(self, loss_fn, normed_btd, head_weight, targets_bt, seed) -> jax.Array:
        """`loss_fn` (the mean cross entropy) of the head's logits; with `model.loss_chunks` > 1 the
        head and cross entropy a piece of each sequence at a time (`chunked_cross_entropy`: the
        float32 logits never whole), its backward told it starts from `seed`."""
        if self.cfg.loss_chunks > 1:
            return chunked_cross_entropy(self._head, normed_btd, head_weight, targets_bt, self.cfg.loss_chunks, seed)
        return loss_fn(self._head(normed_btd, head_weight), targets_bt)

    def train_logits(self, tokens_bt, mtp_tokens_dbt, segments_bt=None, positions_bt=None) -> tuple[jax.Array, list[jax.Array]]:
        """(the model's float32 logits [b, t, v], each multi-token prediction depth's [b, t, v]):
        depth d given the tokens d + 1 places ahead, `mtp_tokens_dbt[d]` (`multi_token.shifted`),
        in the order and positions of `tokens_bt`."""
        positions_bt, segments_bt = placed_positions(positions_bt, segments_bt)
        tables, head_weight = self._embed_tables(), self._head_weight()
        x, _ = self._layers(self._embed(tokens_bt, positions_bt, tables), positions_bt, None, 0, segments_bt)
        h = self.final_norm(x)  # what each depth passes on is normalised, as Megatron-Core and vLLM take it
        return self._head(h, head_weight), self._mtp_logits(h, nnx.split(self.mtp), tables, head_weight, mtp_tokens_dbt, positions_bt, segments_bt)

    def _mtp_logits(self, h_btd, mtp: tuple, tables, head_weight, mtp_tokens_dbt, positions_bt, segments_bt) -> list[jax.Array]:
        """Each multi-token prediction depth's float32 logits [b, t, v] after the normalised last
        layer's output `h_btd`; `mtp`: the stacked modules' (graphdef, *states)."""
        graphdef, *states = mtp

        def depth(h, params, next_tokens_bt):  # one module: its normalised output
            module = nnx.merge(graphdef, *params)
            return module.head_norm(module(h, self._embed(next_tokens_bt, positions_bt, tables), positions_bt, segments_bt))

        # Rematerialised as a layer is; the head outside it, as the model's own (not run again in the backward).
        depth = remat(depth, self.cfg.remat)
        mtp_logits = []
        with moe.loss_weighted(self.cfg.mtp_loss_weight / self.cfg.mtp_depth):  # as each depth's loss counts
            for d in range(self.cfg.mtp_depth):
                with lora.in_layer(self.cfg.num_layers + d):  # (LoRA dropout's masks: after the model's layers)
                    h_btd = depth(h_btd, jax.tree.map(lambda a: a[d], states), mtp_tokens_dbt[d])  # noqa: B023
                mtp_logits.append(self._head(h_btd, head_weight))
        return mtp_logits

    @property
    def _runner(self) -> StackRunner:
        return StackRunner(self.cfg, self.policy)

    @property
    def _stage_runner(self) -> StackRunner:
        """How a pipeline stage runs its chunk's layers: as the model does, but scanned where the
        stage keeps its backward's residuals (`pipeline.remat` not `full`). Unrolled, each layer's
        weights reach the pullback as slices of the chunk's stack, which `Pullbacks` cannot know
        for parameters, and the stash kept a copy of every one per microbatch in flight; a scan's
        backward keeps the stack itself."""
        if self.pipeline.remat == "full" or self.cfg.scan_layers:
            return self._runner
        return StackRunner(dataclasses.replace(self.cfg, scan_layers=True), self.policy)

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

    def _head(self, normed_btd, head_weight) -> jax.Array:
        cfg = self.cfg
        x = gather_length(normed_btd)
        spec = "btd,vd->btv" if cfg.tie_embeddings else "btd,dv->btv"
        logits = self.policy.matmul(spec, x, head_weight, out_dtype=jnp.float32)
        if cfg.used_vocab < cfg.vocab_size:  # padding ids: out of the loss's softmax and of sampling
            logits = jnp.where(jnp.arange(cfg.vocab_size) < cfg.used_vocab, logits, jnp.finfo(jnp.float32).min)
        return constrain(logits, ("batch", "length", "vocab"), "logits")

    def pipelined_loss(self, loss_fn, tokens_bt, targets_bt, positions_bt=None, loss_scale=1.0, differentiated=True, ahead=None) -> jax.Array:
        """`loss_fn(logits, targets)` averaged over the pipeline's microbatches. The 1F1B pipelines
        embed each microbatch on their first stage, apply the head and loss on their last and
        compute their own gradients (`sharding.pipeline_1f1b`, `sharding.pipeline_per_stage`);
        GPipe / circular apply them after the pipeline, one microbatch at a time
        (`sharding.pipeline.pipeline_loss`). The backward runs at `loss_scale` (differentiate
        `loss * loss_scale`). `differentiated=False` (evaluation): GPipe's forward under every
        schedule, no backward computed. Leading dense layers (`dense_prefix`) run with the
        embedding; multi-token prediction with the head, given `ahead` (`multi_token.shifted`'s
        tokens, targets and validity, [depth, b, t] each): then the losses are a vector, [the
        objective (cross entropy + weight x mtp_loss), the cross entropy, mtp_loss]."""
        stage, stacked, stacked_axes, probes, probes_axes = self._pipeline_stage(positions_bt)
        norm_graph, norm_state = nnx.split(self.final_norm)
        prefix_graph, prefix_probes, prefix = nnx.split(self.dense_blocks, Probe, ...) if self.cfg.dense_prefix else (None, None, None)
        mtp_graph, mtp_probes, mtp = nnx.split(self.mtp, Probe, ...) if ahead is not None else (None, None, None)
        tables, head_weight = self._embed_tables(), self._head_weight()
        rows = lambda x_mb: None if positions_bt is None else positions_bt[: x_mb.shape[0]]  # noqa: E731  the same in every row

        def head_loss(head_params, y_btd, targets_mb):  # and multi-token prediction: on the last stage
            norm, weight, mtp_params = head_params
            h = nnx.merge(norm_graph, norm)(y_btd)
            if mtp_params is None:  # each microbatch's backward starts from loss_scale / microbatches
                return self._head_loss(loss_fn, h, weight, targets_mb, loss_scale / self.pipeline.microbatches)
            targets, mtp_tokens_dbt, mtp_targets_dbt, valid_dbt = targets_mb
            modules, statistics, mtp_tables = mtp_params
            mtp_logits = self._mtp_logits(h, (mtp_graph, modules, statistics.probes), mtp_tables, weight, mtp_tokens_dbt, rows(y_btd), None)
            ce, mtp_ce = loss_fn(self._head(h, weight), targets), multi_token.mtp_loss(mtp_logits, mtp_targets_dbt, valid_dbt)
            return jnp.stack([ce + self.cfg.mtp_loss_weight * mtp_ce, ce, mtp_ce])

        def embed(embed_params, tokens_mb):  # and the leading dense layers: on the first stage
            tables, prefix_params = embed_params
            x = self._embed(tokens_mb, rows(tokens_mb), tables)
            if prefix_params is None:
                return x
            layers, statistics = prefix_params
            return self._runner.run_stack(prefix_graph, (layers, statistics.probes), x, rows(tokens_mb), None, None)[0]

        if not differentiated:
            run = functools.partial(pipeline_loss, differentiated=False)
        else:
            run = {"gpipe": pipeline_loss, "1f1b": pipeline_1f1b, "1f1b_per_stage": pipeline_per_stage,
                   "zero_bubble": functools.partial(pipeline_zero_bubble, split_vjp=split_vjp),
                   "zbv": functools.partial(pipeline_zbv, split_vjp=split_vjp),
                   "dualpipev": functools.partial(pipeline_zbv, split_vjp=split_vjp)}[self.pipeline.schedule]
        targets = targets_bt if ahead is None else (targets_bt, *(tuple(part) for part in ahead))  # [b, t] leaves
        with moe.loss_seed(loss_scale / self.pipeline.microbatches):  # as each microbatch's loss is
            return run(
                stage, stacked, stacked_axes, self.pipeline, embed_fn=embed, inputs=tokens_bt,
                embed_params=(tables, None if prefix is None else (prefix, Statistics(prefix_probes))),
                loss_fn=head_loss, loss_params=(norm_state, head_weight, None if mtp is None else (mtp, Statistics(mtp_probes), tables)),
                targets=targets, x_axes=RESIDUAL_AXES, batch_axes=("batch", "length"), probes=probes, probes_axes=probes_axes,
                seed=loss_scale,
            )

    def _pipeline_stage(self, positions_bt):
        """The stacked layers as a pipeline takes them: (stage fn, their states and logical axes,
        the statistics probes and theirs, None without any). The probes are apart because the
        pipeline gives each tick its own (`sharding.pipeline`). Dense layers among sparse ones
        (`model.moe_layers='every:N'`): both stacks, each chunk whole repeats of the pattern
        (`moe_problem` says where it is not), run as `StackRunner.run_periods` runs the model.
        Leading dense layers (`dense_prefix`, DeepSeek's first K): the sparse ones alone, the
        dense run before them (with the embedding: `pipelined_loss`, `_layers`)."""
        first = self.cfg.dense_prefix
        if hasattr(self, "dense_blocks") and not first:
            return self._pipeline_periods(positions_bt)
        graphdef, probes, stacked = nnx.split(self.blocks, Probe, ...)

        def stage(chunk, chunk_probes, x_btd, chunk_index):  # a chunk of consecutive layers on one microbatch
            positions = None if positions_bt is None else positions_bt[: x_btd.shape[0]]  # the same in every row
            with attention.mapped():  # GPipe and 1F1B vmap this over the stages
                run = self._stage_runner.run_stack
                return run(graphdef, (chunk, chunk_probes), x_btd, positions, None, None, chunk=chunk_index, first=first)[0]

        axes = nnx.get_partition_spec
        probes_given = (probes, axes(probes)) if jax.tree.leaves(probes) else (None, None)
        return stage, stacked, axes(stacked), *probes_given

    def _pipeline_periods(self, positions_bt):
        fp8 = self.policy.fp8_layer_mask(self.cfg.num_layers)
        if len(set(fp8)) > 1:
            raise UserError("precision.fp8 skip keeps some layers out of fp8, which a pipeline of dense and sparse layers cannot stage alike; "
                            "use mesh.stage=1 or skip none")
        split = {kind: nnx.split(getattr(self, kind), Probe, ...) for kind in ("blocks", "dense_blocks")}
        graphdefs = {kind: graphdef for kind, (graphdef, _, _) in split.items()}
        probes, stacked = ({kind: parts[i] for kind, parts in split.items()} for i in (1, 2))
        kinds = self._layer_kinds()
        period = tuple(kinds[: shortest_period(kinds)])

        def stage(chunk, chunk_probes, x_btd, chunk_index):  # whole repeats of the pattern on one microbatch
            positions = None if positions_bt is None else positions_bt[: x_btd.shape[0]]
            stacks = {kind: (graphdefs[kind], (chunk_probes[kind], chunk[kind])) for kind in graphdefs}
            with attention.mapped():
                return self._stage_runner.run_periods(period, stacks, x_btd, positions, None, None, None, in_fp8=fp8[0])[0]

        axes = nnx.get_partition_spec
        return stage, stacked, axes(stacked), probes, axes(probes)

    def _layer_kinds(self) -> list[str]:
        """Each layer's stack: `blocks` (every layer of a dense model; a mixture of experts'
        sparse ones), `dense_blocks` (its dense ones)."""
        in_blocks = set(self.cfg.sparse_layer_ids) if self.cfg.moe else set(range(self.cfg.num_layers))
        return ["blocks" if i in in_blocks else "dense_blocks" for i in range(self.cfg.num_layers)]

    def _layers(self, x, positions_bt, cache, cache_index, segments_bt=None):
        if self.pipeline.stages > 1 and cache is None:
            stage, stacked, stacked_axes, probes, probes_axes = self._pipeline_stage(positions_bt)
            if self.cfg.dense_prefix:  # the leading dense layers before the pipeline, on the whole batch
                graphdef, layers = nnx.split(self.dense_blocks)
                x = self._runner.run_stack(graphdef, (layers,), x, positions_bt, None, None, segments_bt)[0]
            return pipeline(stage, stacked, stacked_axes, x, RESIDUAL_AXES, self.pipeline, probes, probes_axes), None
        fp8 = self.policy.fp8_layer_mask(self.cfg.num_layers)
        stacks = {kind: nnx.split(getattr(self, kind)) for kind in ("blocks", "dense_blocks") if hasattr(self, kind)}
        kinds = self._layer_kinds()
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


def placed_positions(positions_bt, segments_bt) -> tuple:
    """(positions, segment ids) as the layers take them, placed: the positions derived from the
    segments where only those are given (None: in order from 0)."""
    if segments_bt is not None:
        segments_bt = constrain(segments_bt, ("batch", "length"), "segment ids")
    if positions_bt is not None:
        positions_bt = constrain(positions_bt, ("batch", "length"), "positions")
    elif segments_bt is not None:
        positions_bt = segment_positions(segments_bt)
    return positions_bt, segments_bt


def segment_positions(segments_bt: jax.Array) -> jax.Array:
    """Each token's position within its document: 0 at every change of segment id."""
    index = jnp.broadcast_to(jnp.arange(segments_bt.shape[1]), segments_bt.shape)
    starts = jnp.concatenate([jnp.ones_like(segments_bt[:, :1], bool), segments_bt[:, 1:] != segments_bt[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
