"""`Parallelism`: one way to run a config on a set of GPUs, the unit the planner enumerates,
costs and ranks (the mesh, sequence parallelism, what the layers keep for backward, how each
replica's batch is cut), and the config keys that select it."""

from __future__ import annotations

import dataclasses

from sharding.mesh import MESH_AXES
from sharding.schedules import PipelinePlan, balanced_slots, balanced_zero_bubble


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """One way to run a config on a set of GPUs: the mesh, sequence parallelism, what the layers
    keep for backward, and how each replica's batch is cut (gradient accumulation, or pipeline
    microbatches under a schedule when `stage` > 1)."""

    data: int = 1
    stage: int = 1
    context: int = 1
    expert: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    remat: str = "full"
    grad_accum: int = 1
    microbatches: int = 0  # pipeline microbatches, with stage > 1
    schedule: str = "none"  # none | gpipe | 1f1b | 1f1b_per_stage | zero_bubble | zbv | dualpipev
    repeats: int = 1  # layer chunks per stage (gpipe with repeats > 1: circular; 1f1b: interleaved)
    pipeline_remat: str = "full"  # what a tick keeps: full recomputes it; 1f1b with none keeps what `remat` keeps
    optimizer_over_data: bool = False  # ZeRO-1: the optimizer state spread over `data` too (sharding.zero)

    @property
    def gpus(self) -> int:
        return self.data * self.stage * self.context * self.expert * self.fsdp * self.tensor

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
        """A short description; with the model's `layers`, a balanced per-stage 1F1B or ZB-H1 says so."""
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
            kind = f"balanced {kind}" if balanced_slots(self.plan, layers) or balanced_zero_bubble(self.plan, layers) else kind
            parts.append(f"{kind} M={self.microbatches}" + (f" R={self.repeats}" if self.repeats > 1 else ""))
            if self.pipeline_remat != "full":
                parts.append(f"pipeline remat={self.pipeline_remat}")
        return ", ".join(parts)
