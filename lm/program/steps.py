"""The compiled program of one training setup: the train state's layout and shardings, and the
pure init / train / eval steps, jitted with the mesh and rules bound in (`sharding.jit`).

Nothing here reads files or loops over steps (that is `lm.train`). `lm.bench`, `lm.layout` and
`lm.numerics` build a `Program`; `lm.generate` needs only `lm.program.abstract_model.AbstractModel`
(no optimizer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sharding
from lm.compiler import steptime, targets
from lm.model import cast_weights, fp8_weights, lora, moe, multi_token
from lm.model.attention import check_cudnn
from lm.model.cross_entropy import cross_entropy
from lm.model.fp8 import Fp8Meta, update_fp8
from lm.model.transformer import segment_positions
from lm.program.abstract_model import AbstractModel, placed
from lm.program.faults import Faults
from lm.program.loss_weights import loss_weights, trained_targets
from lm.program.mesh_checks import check_batch_split
from lm.program.optimizer import optimizer, schedule, state_shardings
from lm.program.spec import RunSpec
from sharding import constrain
from sharding.pipeline import split_microbatches
from sharding.schedules import SPLIT_BACKWARD


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; checkpointed whole (`to_dict`)."""

    step: jax.Array
    params: dict
    opt_state: Any
    fp8: dict | None = None  # delayed scaling's scales and amax histories (precision.fp8=delayed)
    loss_scale: dict | None = None  # {scale, good_steps}, with dynamic loss scaling

    def to_dict(self) -> dict:
        """The checkpoint's form: a dict of the fields in use."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        return cls(**d)


class Program:
    """A training setup compiled for a mesh: the state's shardings and the jitted steps."""

    def __init__(self, spec: RunSpec, mesh: Mesh, faults: Faults = Faults()):
        c = spec.config
        self.spec, self.config, self.mesh, self.rules, self.faults = spec, c, mesh, spec.rules, faults
        self.model_cfg, self.policy, self.loss_scaling = spec.model, spec.policy, spec.loss_scaling
        self.abstract_model = layout = AbstractModel(spec, mesh)
        trained = layout.trainable.part
        self.tx = optimizer(c, trained(layout.decay_mask), trained(layout.logical_axes))
        self.schedule = schedule(c)
        self.abstract_state = jax.eval_shape(lambda: self._init(0))
        replicated = NamedSharding(mesh, PartitionSpec())
        sharding.check_rules(self.rules, mesh)  # also the rules no parameter uses
        # The gradients' and optimizer state's placement: the parameters', or with ZeRO-1 spread
        # over the data replicas as well (the update then runs on each replica's share).
        self.grad_shardings = trained(layout.param_shardings)
        if c.sharding.optimizer_over_data:
            self.grad_shardings = jax.tree.map(
                lambda s, leaf: sharding.spread_sharding(s, leaf.shape), self.grad_shardings, trained(self.abstract_state.params)
            )
        opt_shardings = state_shardings(c, self.abstract_state.opt_state, trained(self.abstract_state.params), self.grad_shardings, replicated)
        loss_scale = self.abstract_state.loss_scale
        self.state_shardings = TrainState(
            step=replicated,
            params=layout.param_shardings,
            opt_state=opt_shardings,
            fp8=layout.fp8_shardings,
            loss_scale=None if loss_scale is None else jax.tree.map(lambda _: replicated, loss_scale),
        )
        batch_size, length = c.train.batch_size, c.train.seq_len + 1
        # Rows split over `batch`, each row whole (it is l = seq_len + 1 long, and a context shard
        # takes its part only after the load-balancing reorder).
        self.batch_sharding = sharding.named_sharding(mesh, ("batch", None), self.rules, shape=(batch_size, length), name="batch")
        self.replicated = replicated
        # Context parallelism: the order that balances causal attention over the sequence's shards.
        shards = sharding.axis_size(mesh, self.rules, "length")
        self.sequence_order = sharding.load_balanced_order(c.train.seq_len, shards) if shards > 1 else None
        # FSDP: the weights split along `embed`; the GEMMs' fusion as `train.gemm_fusion` says; a zero-bubble pipeline's slots.
        fused = targets.elementwise_gemm_fusion(c.train.gemm_fusion, self.policy.fp8 is not None, mesh.shape["tensor"] > 1)
        split_slots = mesh.shape["stage"] > 1 and c.pipeline.schedule in SPLIT_BACKWARD
        options = targets.compiler_options(mesh.devices.flat[0], sharding.axis_size(mesh, self.rules, "embed") > 1, fused, split_slots)
        jit = lambda fn, **kw: sharding.jit(fn, mesh, self.rules, compiler_options=options or None, **kw)  # noqa: E731
        self.init_state = jit(self._init, static_argnums=0, out_shardings=self.state_shardings)
        # A fresh state around given (e.g. imported) parameters, which it takes over.
        self.init_from = jit(self._init, static_argnums=0, out_shardings=self.state_shardings, donate_argnums=1)
        self.train_step = jit(self._train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                              out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        self.eval_step = jit(
            lambda state, batch: self._loss(state.params, loss_weights(batch), state.fp8, differentiated=False)[0],
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=replicated,
        )
        self.grads = jit(self._grads)  # loss, gradients and statistics alone (tests, inspection)

    # -- pure functions, traced under jit

    def _init(self, seed: int, params: dict | None = None) -> TrainState:
        model = self.abstract_model.build(seed)  # with `params` given, XLA drops the unused random init
        initial = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        params = initial if params is None else self.abstract_model.trainable.completed(params, initial)  # LoRA: new adapters
        params = self.abstract_model.trainable.frozen_in(params, self.policy.compute_dtype)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(self.abstract_model.trainable.part(params)),
            fp8=nnx.to_pure_dict(nnx.state(model, Fp8Meta)) if self.policy.fp8_state else None,
            loss_scale=self.loss_scaling.init(),
        )

    def model_inputs(self, batch, mtp: bool = False) -> tuple[dict, jax.Array, tuple | None]:
        """(the model's keyword inputs, the targets, multi-token prediction's (tokens, targets,
        validity) [D, b, t] when `mtp` and the model has it, else None) of a batch: tokens
        [b, l], or {'tokens', 'segments'} with document masking, where `l` is the sequence length
        + 1 (inputs are tokens[:, :-1], targets tokens[:, 1:]). Under context parallelism the
        sequence is put in `self.sequence_order` here, once, with its positions (and segment ids)."""
        tokens_bl, segments_bl = (batch["tokens"], batch.get("segments")) if isinstance(batch, dict) else (batch, None)
        inputs = {"tokens_bt": tokens_bl[:, :-1], "segments_bt": None if segments_bl is None else segments_bl[:, :-1]}
        if isinstance(batch, dict) and "dropout_keys" in batch:  # LoRA dropout: each input token's key, reordered with it
            inputs["dropout_keys_bt"] = lora.token_keys(batch["dropout_keys"], tokens_bl.shape[1] - 1)
        targets_bt = tokens_bl[:, 1:]
        if isinstance(batch, dict) and "weights" in batch:  # a loss mask: (targets, their weights)
            targets_bt = (targets_bt, batch["weights"][:, 1:])
        depth = self.model_cfg.mtp_trained  # (weight 0: the modules are kept, in checkpoints and exports, but not run)
        ahead = multi_token.shifted(tokens_bl, depth) if mtp and depth else None
        if self.sequence_order is not None:
            segments_bt = inputs["segments_bt"]
            in_order = jnp.broadcast_to(jnp.arange(tokens_bl.shape[1] - 1), inputs["tokens_bt"].shape)
            inputs["positions_bt"] = in_order if segments_bt is None else segment_positions(segments_bt)
            inputs = {k: None if a is None else sharding.reorder(a, self.sequence_order) for k, a in inputs.items()}
            targets_bt = jax.tree.map(lambda a: sharding.reorder(a, self.sequence_order), targets_bt)
            if ahead is not None:
                ahead = tuple(jnp.stack([sharding.reorder(a, self.sequence_order) for a in part]) for part in ahead)
        return inputs, jax.tree.map(lambda a: constrain(a, ("batch", "length"), "targets"), targets_bt), ahead

    def _loss(self, params, batch, fp8=None, probes=None, loss_scale=1.0, differentiated=True) -> tuple[jax.Array, dict]:
        """(the training objective, {'loss': mean cross entropy, 'mtp_loss': multi-token
        prediction's where the model has it}) of a batch (see `model_inputs`); the objective adds
        `mtp_loss` times `model.mtp_loss_weight` to the cross entropy. The means do not depend on
        the tokens' order, so nothing is undone after a reorder. `loss_scale`: what the loss will be
        multiplied by before differentiation (the pipelines run their backward with it);
        `differentiated=False` (evaluation): the pipelines run their forward alone."""
        inputs, targets_bt, ahead = self.model_inputs(batch, mtp=differentiated)
        keys_bt = inputs.pop("dropout_keys_bt", None)
        with lora.dropout(self.model_cfg.lora_dropout, keys_bt):
            return self._model_loss(params, inputs, targets_bt, ahead, fp8, probes, loss_scale, differentiated)

    def _model_loss(self, params, inputs, targets_bt, ahead, fp8, probes, loss_scale, differentiated):
        """`_loss` of the model's inputs and targets, as `model_inputs` gives them."""
        model = self.abstract_model.model(params, fp8, probes)
        if self._pipelined_loss:  # the head and loss per microbatch
            loss = model.pipelined_loss(cross_entropy, inputs["tokens_bt"], targets_bt, inputs.get("positions_bt"), loss_scale, differentiated, ahead)
            return (loss, {"loss": loss}) if ahead is None else (loss[0], {"loss": loss[1], "mtp_loss": loss[2]})
        with moe.loss_seed(loss_scale):
            if ahead is None:
                loss = model.train_loss(cross_entropy, targets_bt, loss_scale, **inputs)
                return loss, {"loss": loss}
            mtp_tokens_dbt, mtp_targets_dbt, valid_dbt = ahead
            logits, mtp_logits = model.train_logits(mtp_tokens_dbt=mtp_tokens_dbt, **inputs)
        loss, mtp = cross_entropy(logits, targets_bt), multi_token.mtp_loss(mtp_logits, mtp_targets_dbt, valid_dbt)
        return loss + self.model_cfg.mtp_loss_weight * mtp, {"loss": loss, "mtp_loss": mtp}

    def _grads(self, params, batch, fp8=None, loss_scale=1.0):
        """(mean losses {'loss', ..: `_loss`'s}, mean grads of `objective * loss_scale`, matmul statistics) over the batch. A
        step of several passes (accumulation, pipeline microbatches) on several data replicas
        sums each replica's gradients locally and combines the replicas once
        (`sharding.per_replica`), not at every pass."""
        # ZeRO-1 with plain accumulation keeps XLA's way: each pass's gradients reduce-scattered,
        # so the float32 accumulator is a replica's share, not the whole (llama_8b {data 4,
        # tensor 2}: 22.7 GiB of temporaries against 43.8).
        pipelined = self.spec.pipeline.stages > 1
        passes = pipelined or self.config.train.grad_accum > 1
        batch = loss_weights(batch)
        # (Experts split over `expert` inside a pipeline inside per-replica code: XLA's partitioner
        # fails a check on the third level of manual axes, jaxlib 0.10.2.)
        nested_experts = pipelined and self.mesh.shape["expert"] > 1
        if not passes or (self.config.sharding.optimizer_over_data and not pipelined) or nested_experts:
            return self._replica_grads(params, batch, fp8, loss_scale)
        # (`_replica_grads` itself where `data` is 1.)
        grads = sharding.per_replica(self._replica_grads, self.mesh, split=(False, True, False, False), combine=("mean", "sum", "max"))
        return grads(params, batch, fp8, loss_scale / self.mesh.shape["data"])

    @property
    def _pipelined_loss(self) -> bool:
        """Whether the model's loss runs as a pipeline (any stages, or a schedule other than
        GPipe even on one stage)."""
        return self.spec.pipeline.stages > 1 or self.spec.pipeline.schedule != "gpipe"

    def _fp8_weights_once(self) -> bool:
        """Whether the fp8 weights are quantised once a step, before the microbatches
        (`lm.model.fp8_weights`): with gradient accumulation, not under pipelines (their stages
        slice the weights themselves)."""
        return self.config.train.grad_accum > 1 and self.policy.fp8 is not None and not self._pipelined_loss

    def _weights_cast_once(self) -> bool:
        """As `_fp8_weights_once`, without fp8: the weights cast once a step (`lm.model.cast_weights`)."""
        return (self.config.train.grad_accum > 1 and self.policy.fp8 is None and not self._pipelined_loss
                and self.policy.compute_dtype != self.policy.param_dtype)

    def _replica_grads(self, params, batch, fp8=None, loss_scale=1.0):
        """`_grads` on the rows given, accumulated over `train.grad_accum` microbatches
        (statistics: amaxes, the maximum). Each microbatch's loss is differentiated divided by
        their number, so every gradient inside (and its fp8 scaling and statistics) is the one
        the whole batch would give."""
        accum = self.config.train.grad_accum
        seed = loss_scale / accum
        trainable = self.abstract_model.trainable
        trained, frozen = trainable.split(params)  # the gradients are the trained part's only
        # The weights' copies for the step, made before the microbatches (fp8, or the compute dtype).
        prepare = fp8_weights.quantised_once if self._fp8_weights_once() else cast_weights.cast_once if self._weights_cast_once() else None
        prepared = None if prepare is None else prepare(self.abstract_model.model(params, fp8), self.policy)

        def scaled_loss(trained, probes, tokens):
            merged = trainable.merge(trained, frozen)
            if prepared is not None:
                merged = cast_weights.attach_weights(merged, prepared)
            objective, losses = self._loss(merged, tokens, fp8, probes, seed)
            return objective * seed, jax.tree.map(lambda x: x / accum, losses)

        grad_fn = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)

        def one(tokens):
            (grads, stats), loss = grad_fn(trained, self.abstract_model.zero_probes(), tokens)
            return loss, grads, stats

        if accum == 1:
            return one(batch)
        micro = jax.tree.map(lambda a: split_microbatches(a, accum, ("batch", None)), batch)

        def add(carry, tokens):
            loss, grads, stats = one(tokens)
            summed = jax.tree.map(jnp.add, carry[:2], (loss, grads))
            return (*summed, jax.tree.map(jnp.maximum, carry[2], stats)), None

        losses = dict.fromkeys(("loss", "mtp_loss") if self.model_cfg.mtp_trained else ("loss",), jnp.zeros((), jnp.float32))
        zeros = (losses, jax.tree.map(jnp.zeros_like, trained), self.abstract_model.zero_probes())
        (loss, grads, stats), _ = jax.lax.scan(add, zeros, micro)
        return loss, grads, stats

    def _train_step(self, state: TrainState, batch):
        step = state.step + 1
        scale = self.loss_scaling.current(state.loss_scale)
        applied_scale = scale
        if self.faults.overflow_steps:  # fault injection (tests): gradients far too large
            applied_scale = scale * jnp.where(jnp.isin(step, jnp.asarray(self.faults.overflow_steps)), 1e30, 1.0)
        if self.model_cfg.lora_dropout:  # each row's key: its place in the global batch and the step
            tokens = batch["tokens"] if isinstance(batch, dict) else batch
            keys = constrain(lora.dropout_keys(self.config.train.seed, step, tokens.shape[0]), ("batch", None), "dropout keys")
            batch = {**(batch if isinstance(batch, dict) else {"tokens": batch}), "dropout_keys": keys}
        losses, grads, stats = self._grads(state.params, batch, state.fp8, applied_scale)
        if self.loss_scaling.kind != "none":
            grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        if self.config.sharding.optimizer_over_data:  # reduce-scattered over the replicas, not all-reduced
            grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
        if self.faults.nonfinite_steps:  # fault injection (tests): these steps' loss and gradients are NaN
            poison = jnp.where(jnp.isin(step, jnp.asarray(self.faults.nonfinite_steps)), jnp.nan, 1.0)
            losses, grads = jax.tree.map(lambda x: x * poison.astype(x.dtype), (losses, grads))
        # A non-finite update is not applied (optax.apply_if_finite); the step still counts.
        trainable = self.abstract_model.trainable
        trained, frozen = trainable.split(state.params)
        updates, opt_state = self.tx.update(grads, state.opt_state, trained)
        metrics = {
            **losses,  # the cross entropy, and multi-token prediction's loss (unweighted) beside it
            **({"trained_tokens": jnp.sum(trained_targets(batch))} if isinstance(batch, dict) and "mask" in batch else {}),
            "grad_norm": optax.tree.norm(grads),
            "lr": self.schedule(state.step),
            "nonfinite_in_a_row": opt_state.notfinite_count,
            "skipped_steps": opt_state.total_notfinite,
        }
        fp8 = state.fp8
        if fp8 is not None:  # delayed scaling learns from applied steps only
            updated = update_fp8(fp8, stats, self.policy.fp8)
            fp8 = jax.tree.map(lambda n, o: jnp.where(opt_state.last_finite, n, o), updated, fp8)
        if self.loss_scaling.kind != "none":
            metrics["loss_scale"] = scale
        stats, routing = moe.split_stats(stats)
        if routing is not None:
            metrics["moe"] = routing
        if self.policy.observe:
            metrics["matmul_stats"] = stats
        params = trainable.merge(optax.apply_updates(trained, updates), frozen)
        # No gradient moves it: the observed load does, on applied steps (LoRA: frozen with the base it belongs to).
        if self.model_cfg.expert_bias_rate > 0 and not self.model_cfg.lora:
            balanced = moe.updated_router_bias(params, routing, self.model_cfg.expert_bias_rate)
            params = jax.tree.map(lambda n, o: jnp.where(opt_state.last_finite, n, o), balanced, params)
        if self.config.sharding.optimizer_over_data:  # each replica's updated share, all-gathered
            params = jax.lax.with_sharding_constraint(params, self.abstract_model.param_shardings)
        new_state = TrainState(
            step=step,
            params=params,
            opt_state=opt_state,
            fp8=fp8,
            loss_scale=self.loss_scaling.update(state.loss_scale, opt_state.last_finite),
        )
        return new_state, metrics

    # -- host side

    def global_batch(self, local) -> jax.Array | dict:
        """This process's rows (an array, or a batch from `lm.data`) -> global arrays sharded over
        `batch`: the tokens, or {'tokens', 'segments'} when the batch carries segments."""
        make = lambda rows: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(rows))  # noqa: E731
        if not isinstance(local, dict):
            return make(local)
        if "segments" in local or "mask" in local:
            return {key: make(local[key]) for key in ("tokens", "segments", "mask") if key in local}
        return make(local["tokens"])

    def abstract_sharded_state(self) -> TrainState:
        """ShapeDtypeStructs of the state placed by its shardings: a restore or compile target."""
        return placed(self.abstract_state, self.state_shardings)


def setup(config, vocab_size: int, devices=None, faults: Faults = Faults(), observe: bool = False) -> Program:
    """Config -> typed spec (parsed once) -> mesh (checked against the batch) -> the Program.

    `observe`: every step also returns the block matmuls' statistics (`lm.numerics`)."""
    spec = RunSpec.parse(config, vocab_size, observe=observe)
    mesh = sharding.make_mesh(spec.mesh, devices)
    check_batch_split(spec, mesh)
    if spec.policy.fp8 and config.precision.fp8_sites == "auto" and (target := targets.target_of(mesh.devices.flat[0])):
        # Per device a site's GEMMs see the tokens split over the batch axes, its weight over tensor.
        tokens = mesh.shape["data"] * mesh.shape["expert"] * mesh.shape["fsdp"] * mesh.shape["context"]
        choice = steptime.Fp8SiteChoice(target, tokens, mesh.shape["tensor"])
        spec = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, fp8_choice=choice))
    if spec.policy.fp8 and all(mesh.shape[axis] == 1 for axis in ("fsdp", "tensor", "context")):
        spec = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, pin_weight_layouts=True))
    if spec.model.attention == "cudnn":  # before a run directory is written, not at the first trace
        with sharding.activate(mesh, ()):  # the mesh's GPU decides what cuDNN takes
            check_cudnn(mesh.devices.flat[0].platform, spec.policy.compute_dtype, spec.model.qk_head_dim, spec.model.value_head_dim)
    return Program(spec, mesh, faults)
