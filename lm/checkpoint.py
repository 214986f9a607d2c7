"""Checkpoints with orbax: asynchronous saves of the train state plus the data iterator's position.

Layout: WORKDIR/checkpoints/<step>/{state, data}. Orbax writes each step into a temporary
directory and renames it when complete, so an unfinished save is never taken as the latest.
Restoring takes an abstract state carrying target shardings, so a checkpoint restores onto any
mesh the arrays fit.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from lm.config import UserError


class Checkpointer:
    def __init__(self, directory: Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        """Starts writing `state` for `step`; returns before the write is durable when async."""
        args = {"state": ocp.args.StandardSave(state)}
        if data_state is not None:
            args["data"] = ocp.args.JsonSave(data_state)
        self.manager.save(step, args=ocp.args.Composite(**args))

    def restore(self, abstract_state, step: int | None = None) -> tuple[object, dict | None]:
        """(state placed as `abstract_state`'s shardings, data iterator state) at `step` (default latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UserError(f"no checkpoint in {self.directory}; train first")
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        has_data = (self.directory / str(step) / "data").exists()
        if has_data:
            items["data"] = ocp.args.JsonRestore()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError, FileNotFoundError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"checkpoint {self.directory / str(step)} cannot be restored: {first}") from None
        return restored["state"], (restored["data"] if has_data else None)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of `tree` placed by `shardings`: a restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
