"""What the cost model (`lm.cost`) reads: a layout, a target system's links, and a run (a
config's shapes and each state array's mesh axes, from the sharding rules)."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import cached_property
from pathlib import Path

import numpy as np

from lm.metrics import PEAK_FLOPS, matmul_params
from lm.model import ModelConfig
from sharding.schedules import PipelinePlan, balanced_slots
from sharding.zero import spread_axes

TARGETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "targets"
MESH_AXES = ("data", "stage", "context", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a config on a set of GPUs: the mesh, sequence parallelism, what the layers
    keep for backward, and how each replica's batch is cut (gradient accumulation, or pipeline
    microbatches under a schedule when `stage` > 1)."""

    data: int = 1
    stage: int = 1
    context: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    remat: str = "full"
    grad_accum: int = 1
    microbatches: int = 0  # pipeline microbatches, with stage > 1
    schedule: str = "none"  # none | gpipe | 1f1b | 1f1b_per_stage
    repeats: int = 1  # layer chunks per stage (gpipe with repeats > 1: circular; 1f1b: interleaved)
    pipeline_remat: str = "full"  # what a tick keeps: full recomputes it; 1f1b with none keeps what `remat` keeps
    optimizer_over_data: bool = False  # ZeRO-1: the optimizer state spread over `data` too (sharding.zero)

    @property
    def gpus(self) -> int:
        return self.data * self.stage * self.context * self.fsdp * self.tensor

    @property
    def plan(self) -> PipelinePlan:
        """The pipeline plan this layout runs (with `stage` > 1)."""
        return PipelinePlan(self.stage, self.microbatches, self.repeats, self.pipeline_remat, self.schedule)

    @property
    def mesh(self) -> dict:
        return {a: getattr(self, a) for a in MESH_AXES}

    def overrides(self) -> dict:
        """The config keys (`--config.KEY=VALUE`) that select this layout."""
        out = {f"mesh.{a}": n for a, n in self.mesh.items()}
        out |= {"sharding.sequence_parallel": self.sequence_parallel, "model.remat": self.remat, "train.grad_accum": self.grad_accum}
        if self.optimizer_over_data:
            out["sharding.optimizer_over_data"] = True
        if self.stage > 1:
            out |= {"pipeline.microbatches": self.microbatches, "pipeline.schedule": self.schedule, "pipeline.repeats": self.repeats,
                    "pipeline.remat": self.pipeline_remat}
        return out

    def name(self, layers: int = 0) -> str:
        """A short description; with the model's `layers`, a balanced per-stage 1F1B says so."""
        mesh = " ".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "one device"
        parts = [mesh, f"remat={self.remat}"]
        if self.sequence_parallel:
            parts.append("SP")
        if self.optimizer_over_data:
            parts.append("ZeRO-1")
        if self.grad_accum > 1:
            parts.append(f"accum={self.grad_accum}")
        if self.stage > 1:
            kind = self.schedule if self.repeats == 1 else {"gpipe": "circular", "1f1b": "interleaved 1f1b"}[self.schedule]
            kind = f"balanced {kind}" if balanced_slots(self.plan, layers) else kind
            parts.append(f"{kind} M={self.microbatches}" + (f" R={self.repeats}" if self.repeats > 1 else ""))
            if self.pipeline_remat != "full":
                parts.append(f"pipeline remat={self.pipeline_remat}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class System:
    """A target's figures the cost model reads (`configs/targets/systems.json`)."""

    name: str
    device_kind: str  # the key into lm.metrics.PEAK_FLOPS
    gpus_per_host: int
    nvlink_bytes_per_s: float
    nvlink_latency_s: float
    network_bytes_per_s: float
    network_latency_s: float
    hbm_bytes_per_s: float  # device memory bandwidth

    @classmethod
    def load(cls, name: str) -> System:
        table = json.loads((TARGETS_DIR / "systems.json").read_text())
        entry = {k: v for k, v in table[name].items() if not k.startswith("_")}
        return cls(name=name, **entry)

    def peak(self, dtype: str) -> float:
        return PEAK_FLOPS[(self.device_kind, dtype)]


@dataclasses.dataclass(frozen=True)
class StateLeaf:
    """One array of the train state: its name, shape, bytes per element and mesh axes per dimension."""

    path: str
    shape: tuple[int, ...]
    itemsize: int
    axes: tuple[tuple[str, ...], ...]
    kind: str  # params | opt_state | other

    def device_bytes(self, mesh: dict, spread: bool = False) -> int:
        """Bytes on each device of `mesh` (sizes by axis); `spread`: also over `data`, as ZeRO-1 places it."""
        placed = spread_axes(self.shape, self.axes, mesh) if spread else self.axes
        return self.itemsize * math.prod(n // math.prod(mesh[a] for a in axes) for n, axes in zip(self.shape, placed))


@dataclasses.dataclass(frozen=True)
class Run:
    """What the cost model reads of a config: the model's shape, the batch, the dtypes, the
    state's arrays (`StateLeaf`s, from the sharding rules) and whether fp8 is on."""

    model: ModelConfig
    batch: int
    seq_len: int
    compute_bytes: int
    compute_dtype: str
    param_bytes: int
    fp8: bool
    state: tuple[StateLeaf, ...]

    @cached_property
    def layer_params(self) -> int:
        return (matmul_params(self.model) - self.model.embed_dim * self.model.vocab_size) // self.model.num_layers


def run_of(config) -> Run:
    """The cost model's view of a config: its state's arrays placed by its sharding rules (read
    from the abstract train state built on one CPU device; nothing is allocated)."""
    import jax

    from lm import config as lm_config
    from lm import data as lm_data
    from lm.program import setup
    from sharding.rules import path_name, spec_axes

    one = lm_config.apply_overrides(config, {f"mesh.{a}": 1 for a in MESH_AXES})
    program = setup(one, lm_data.nominal_vocab_size(config.data), jax.devices("cpu")[:1])
    state = program.abstract_state
    leaves = []
    for kind, tree, shardings in (
        ("params", state.params, program.state_shardings.params),
        ("opt_state", state.opt_state, program.state_shardings.opt_state),
        ("other", (state.step, state.fp8, state.loss_scale), (program.state_shardings.step, program.state_shardings.fp8, program.state_shardings.loss_scale)),
    ):
        for (path, leaf), named in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(shardings)):
            axes = spec_axes(named.spec, len(leaf.shape))
            leaves.append(StateLeaf(f"{kind}/{path_name(path)}", tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, axes, kind))
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
    )
