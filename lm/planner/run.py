"""What the cost model (`lm.planner.cost`) reads of a config: a `Run`, its shapes and each state
array's mesh axes (from the sharding rules, on the abstract train state)."""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import jax
import numpy as np

from lm.config import apply_overrides
from lm.data.corpus import nominal_vocab_size
from lm.model.config import ModelConfig
from lm.model.flops import matmul_params
from lm.program.steps import setup
from sharding.mesh import MESH_AXES
from sharding.rules import path_name, spec_axes
from sharding.zero import spread_axes


@dataclasses.dataclass(frozen=True)
class StateLeaf:
    """One array of the train state: its name, shape, bytes per element and mesh axes per dimension."""

    path: str
    shape: tuple[int, ...]
    itemsize: int
    axes: tuple[tuple[str, ...], ...]
    kind: str  # params | opt_state | other
    trained: bool = True  # params: has a gradient (LoRA: the adapters alone)

    def device_bytes(self, mesh: dict, spread: bool = False) -> int:
        """Bytes on each device of `mesh` (sizes by axis); `spread`: also over `data`, as ZeRO-1 places it."""
        placed = spread_axes(self.shape, self.axes, mesh) if spread else self.axes
        return self.itemsize * math.prod(n // math.prod(mesh[a] for a in axes) for n, axes in zip(self.shape, placed))


@dataclasses.dataclass(frozen=True)
class Run:
    """What the cost model reads of a config: the model's shape, the batch, the dtypes, the
    state's arrays (`StateLeaf`s, from the sharding rules), whether fp8 is on and what XLA fuses
    into the GEMMs."""

    model: ModelConfig
    batch: int
    seq_len: int
    compute_bytes: int
    compute_dtype: str
    param_bytes: int
    fp8: bool
    state: tuple[StateLeaf, ...]
    gemm_fusion: str = "operands"  # train.gemm_fusion (lm.compiler.targets.elementwise_gemm_fusion)

    @cached_property
    def layer_params(self) -> int:
        """A layer's matmul weights a token goes through (of a mixture of experts: the active ones)."""
        return (matmul_params(self.model) - self.model.embed_dim * self.model.vocab_size) // self.model.num_layers

    @cached_property
    def layer_expert_params(self) -> int:
        """A layer's expert weights, all of them, averaged over the layers (0 in a dense model)."""
        m = self.model
        return 3 * m.embed_dim * m.expert_width * m.num_experts * m.sparse_layers // m.num_layers if m.moe else 0

    @cached_property
    def expert_active_params(self) -> int:
        """The routed experts' weights one token goes through in a layer (averaged over the layers)."""
        m = self.model
        return 3 * m.embed_dim * m.expert_width * m.experts_per_token * m.sparse_layers // m.num_layers if m.moe else 0

    def layer_weights(self, tensor: int, expert: int) -> float:
        """One layer's matmul weights on each device before FSDP's split: all but the experts
        split over `tensor`, the experts over `expert` too."""
        shared = self.layer_params - self.expert_active_params
        return (shared + self.layer_expert_params / expert) / tensor


def run_of(config) -> Run:
    """The cost model's view of a config: its state's arrays placed by its sharding rules (read
    from the abstract train state built on one CPU device; nothing is allocated)."""
    one = apply_overrides(config, {f"mesh.{a}": 1 for a in MESH_AXES})
    program = setup(one, nominal_vocab_size(config.data), jax.devices("cpu")[:1])
    state = program.abstract_state
    trained = {path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(program.abstract_model.trainable.part(state.params))[0]}
    leaves = []
    for kind, tree, shardings in (
        ("params", state.params, program.state_shardings.params),
        ("opt_state", state.opt_state, program.state_shardings.opt_state),
        ("other", (state.step, state.fp8, state.loss_scale), (program.state_shardings.step, program.state_shardings.fp8, program.state_shardings.loss_scale)),
    ):
        for (path, leaf), named in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(shardings)):
            axes = spec_axes(named.spec, len(leaf.shape))
            leaves.append(StateLeaf(f"{kind}/{path_name(path)}", tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, axes, kind,
                                    kind != "params" or path_name(path) in trained))
    policy = program.policy
    return Run(
        model=program.model_cfg,
        batch=config.train.batch_size,
        seq_len=config.train.seq_len,
        compute_bytes=np.dtype(policy.compute_dtype).itemsize,
        compute_dtype=np.dtype(policy.compute_dtype).name,
        param_bytes=np.dtype(policy.param_dtype).itemsize,
        fp8=bool(policy.fp8),
        state=tuple(leaves),
        gemm_fusion=config.train.gemm_fusion,
    )
