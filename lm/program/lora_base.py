"""A LoRA run's frozen base, kept once in its run directory (`WORKDIR/lora_base`: an orbax
checkpoint of the base weights in the compute dtype, written when the run starts), so that each
step's checkpoint holds only what trains: the adapters and their optimizer state. The run's
config names where the base came from (`init.from_hf`, or the imported run it started in)."""

from __future__ import annotations

from pathlib import Path

from lm.program.checkpoint import Checkpointer
from lm.program.abstract_model import placed

BASE_DIR = "lora_base"


def checkpointed(program, state):
    """The part of a train state (or its abstract form) a step's checkpoint holds: under LoRA,
    the state with the adapters as its parameters; otherwise the state."""
    trainable = program.abstract_model.trainable
    return state.replace(params=trainable.part(state.params)) if trainable.lora else state


def restore_target(program):
    """The abstract state a step's checkpoint restores onto (`checkpointed`)."""
    return checkpointed(program, program.abstract_sharded_state())


def keep_base(workdir: Path, program, state) -> None:
    """Writes the base of a LoRA run's starting state into the run, once."""
    trainable = program.abstract_model.trainable
    directory = Path(workdir) / BASE_DIR
    if not trainable.lora or directory.is_dir():
        return
    ckpt = Checkpointer(directory, async_save=False)
    try:
        ckpt.save(0, {"params": trainable.split(state.params)[1]})
        ckpt.wait()
    finally:
        ckpt.close()


def base_params(workdir: Path, layout) -> dict:
    """A LoRA run's base weights, placed as `layout` says ({} without LoRA)."""
    trainable = layout.trainable
    if not trainable.lora:
        return {}
    ckpt = Checkpointer(Path(workdir) / BASE_DIR)
    try:
        frozen = trainable.split(layout.run_params)[1]
        return ckpt.restore_part({"params": placed(frozen, trainable.split(layout.param_shardings)[1])})["params"]
    finally:
        ckpt.close()


def with_base(program, state, workdir: Path):
    """A restored state (`checkpointed`) with the run's base merged back into its parameters."""
    trainable = program.abstract_model.trainable
    if not trainable.lora:
        return state
    return state.replace(params=trainable.merge(state.params, base_params(workdir, program.abstract_model)))
