"""A run's model without its optimizer: the graph, parameters (abstract, with logical axes and
shardings), fp8 state and statistics probes, and which parameters train (`lm.program.trainable`).
`lm.program.steps.Program` builds its steps on one; restores and `lm.generate` need only this."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import sharding
from lm.model.fp8 import Fp8Meta, Probe
from lm.model.transformer import Transformer
from lm.program.spec import RunSpec
from lm.program.trainable import Trainable, decay_mask


class AbstractModel:
    """The model's variables, abstract: its graph, parameters (with logical axes), fp8 state and
    statistics probes, and where each parameter lives on `mesh`."""

    def __init__(self, spec: RunSpec, mesh: Mesh):
        self.spec, self.mesh, self.rules = spec, mesh, spec.rules
        abstract = sharding.abstract_module(lambda: self.build(0))
        self.graphdef, params, fp8, probes = nnx.split(abstract, nnx.Param, Fp8Meta, Probe)
        self.abstract_params, self.abstract_fp8 = nnx.to_pure_dict(params), nnx.to_pure_dict(fp8)
        self.probes = nnx.to_pure_dict(probes)  # shapes: the probes are zeros each step
        self.logical_axes = sharding.logical_axes(params)
        self.param_shardings = sharding.state_shardings(params, mesh, spec.rules)
        self.fp8_shardings = sharding.state_shardings(fp8, mesh, spec.rules) if spec.policy.fp8_state else None
        self.decay_mask = decay_mask(params)
        self.trainable = Trainable(params, spec.model.lora)  # LoRA: the adapters alone
        # As a run keeps them (in its state and checkpoints): a LoRA run's frozen base in the compute dtype.
        self.run_params = self.trainable.frozen_in(self.abstract_params, spec.policy.compute_dtype)

    def base_target(self) -> dict:
        """The base model's parameters (LoRA: without the adapters), abstract and placed: what a
        Hugging Face import, a base run or an imported run's step-0 checkpoint restores onto."""
        base = self.trainable.base
        return placed(base(self.abstract_params), base(self.param_shardings))

    def build(self, seed: int) -> Transformer:
        """The model, initialised from `seed` (traced under jit or `eval_shape`)."""
        return Transformer(self.spec.model, rngs=nnx.Rngs(seed), policy=self.spec.policy, pipeline=self.spec.pipeline)

    def zero_probes(self) -> dict:
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.probes)

    def model(self, params, fp8=None, probes=None) -> Transformer:
        """The model on these parameters (and fp8 state; probes default to zeros)."""
        return nnx.merge(self.graphdef, params, fp8 or {}, self.zero_probes() if probes is None else probes)


def placed(tree, shardings):
    """ShapeDtypeStructs of `tree`'s arrays carrying `shardings`: a restore or compile target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
