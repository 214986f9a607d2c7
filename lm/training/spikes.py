"""Loss spikes (`train.spike_rollback`): detected from the logged losses, recorded in the run
directory as the batches to skip (PaLM's remedy: restart from a checkpoint before the spike and
leave out the data that fed it).

    WORKDIR/skipped_batches.json   [{"batches": [n, ...], "steps": [...], "losses": [...],
                                     "rolled_back_to": step}, ...]; every batch listed is drawn
                                     and dropped by this run, also after a restart
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

SKIPPED = "skipped_batches.json"


class SpikeWatch:
    """`steps` losses in a row above `factor` x the mean of the last `window` ordinary losses (or
    non-finite) make a spike. Losses of a spike never enter the mean; no spike is called before
    the window is full."""

    def __init__(self, factor: float, window: int, steps: int):
        self.factor, self.steps = factor, steps
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.run: list[tuple[int, int, float]] = []  # (step, batch number, loss) above the line, in a row

    def mean(self) -> float:
        return sum(self.recent) / len(self.recent)

    def observe(self, step: int, batch: int, loss: float) -> list[tuple[int, int, float]] | None:
        """The spike's (step, batch, loss) rows when this step completes one, else None."""
        full = len(self.recent) == self.recent.maxlen
        if full and (not math.isfinite(loss) or loss > self.factor * self.mean()):
            self.run.append((step, batch, loss))
            if len(self.run) >= self.steps:
                spike, self.run = self.run, []
                return spike
            return None
        if math.isfinite(loss):
            self.recent.append(loss)
        self.run = []
        return None


def skipped(workdir: Path) -> list[dict]:
    path = workdir / SKIPPED
    return json.loads(path.read_text()) if path.is_file() else []


def record(workdir: Path, spike: list[tuple[int, int, float]], rolled_back_to: int) -> None:
    """Appends one rollback to the run's record (written whole, then renamed: never half)."""
    rows = [*skipped(workdir), {
        "steps": [s for s, _, _ in spike],
        "batches": [b for _, b, _ in spike],
        "losses": [loss if math.isfinite(loss) else str(loss) for _, _, loss in spike],
        "rolled_back_to": rolled_back_to,
    }]
    tmp = workdir / f".{SKIPPED}.tmp"
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(workdir / SKIPPED)
