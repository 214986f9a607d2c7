"""Weights & Biases for a run (`metrics.wandb=True`): what TensorBoard gets, and the run's config,
logged from process 0 under a run id kept in the workdir (`wandb_run_id`), so a resumed run goes
on as the same W&B run. Works offline (`WANDB_MODE=offline`: the run is written under
WORKDIR/wandb, for `wandb sync`). Never required: W&B missing, or failing at any point, is one
warning line and training goes on without it.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

RUN_ID_FILE = "wandb_run_id"


def _warn(what: str, error: BaseException | None = None) -> None:
    detail = f": {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}" if error else ""
    print(f"warning: W&B {what}{detail}; training goes on without it", file=sys.stderr, flush=True)


class WandbRun:
    """One W&B run for a workdir; every call after a failure does nothing."""

    def __init__(self, workdir: Path, project: str, config: dict):
        self.run = None
        try:
            import wandb
        except ImportError:
            _warn("is not installed (pip install wandb, or meshlm[wandb])")
            return
        id_file = workdir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        try:
            self.run = wandb.init(project=project, name=workdir.resolve().name, id=run_id, resume="allow",
                                  config=config, dir=str(workdir))
            id_file.write_text(run_id + "\n")
        except Exception as e:  # noqa: BLE001 - W&B's failures are never the run's
            _warn("could not start", e)
            self.run = None

    def log(self, row: dict) -> None:
        if self.run is None:
            return
        try:
            import wandb

            values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
            values |= {k: wandb.Histogram(v) for k, v in row.items() if isinstance(v, list)}  # per-expert loads
            self.run.log(values, step=int(row["step"]))
        except Exception as e:  # noqa: BLE001
            _warn("stopped logging", e)
            self.run = None

    def close(self) -> None:
        if self.run is None:
            return
        try:
            self.run.finish()
        except Exception as e:  # noqa: BLE001
            _warn("could not finish the run", e)
        self.run = None
