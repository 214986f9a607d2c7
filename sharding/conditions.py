"""Conditions alike on every device whose share of true runs a pipeline's table fixes ahead of
time: its ends (the head after the last stage's forward, the embedding's gradient after stage
0's backward, stage 0's embedding) run under `lax.cond` in the loop over the table's ticks or
slots. Each is named with that share (`known_share`), so that a cost model reading the compiled
program (`lm.compiler.kernels`) charges each branch its share of the runs instead of the
costliest branch every run, which is what it must assume of a condition it knows nothing of.
"""

from __future__ import annotations

import re

import jax
import numpy as np

# In a compiled conditional's op_name: the scope, then the `cond` itself (not one nested deeper).
SHARE = re.compile(r"cond_true_(\d+)_of_(\d+)/cond\"")


def known_share(holds: np.ndarray):
    """A named scope for a condition that holds where `holds` (one bool per run: the scan's
    rows) does, to wrap its `lax.cond` in."""
    holds = np.asarray(holds, bool)
    return jax.named_scope(f"cond_true_{int(holds.sum())}_of_{holds.size}")


def share_of(op_name: str) -> float | None:
    """The share of runs a named condition's true branch takes, from its compiled instruction's
    text (its `op_name="..."`; None: not named)."""
    found = SHARE.search(op_name)
    return None if found is None else int(found.group(1)) / max(int(found.group(2)), 1)
