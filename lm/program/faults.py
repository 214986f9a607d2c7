"""Fault injection for tests and drills: how a training run should misbehave, and when (the
train step poisons its gradients, the loop kills, stalls or garbles; `lm.train --fault_*`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Faults:
    """Fault injection for tests: how a run should misbehave, and when."""

    kill_at_step: int | None = None  # SIGKILL once this step's checkpoint is durable
    kill_during_save_at_step: int | None = None  # SIGKILL as soon as this step's save has started
    nonfinite_steps: tuple[int, ...] = ()  # these steps' loss and gradients are NaN
    overflow_steps: tuple[int, ...] = ()  # these steps' gradients are 1e30 times too large
    garbled_batches: tuple[int, ...] = ()  # these batches (by number) hold random tokens
    stall_at_step: int | None = None  # this step's data read blocks for stall_s (alive, heartbeating)
    stall_s: float = float("inf")
