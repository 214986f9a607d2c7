"""Conditions whose runs a pipeline's table fixes ahead of time, named so that a cost model
reading the compiled program (`lm.compiler.kernels`) charges each branch by its runs instead of
the costliest branch every run, which is what it must assume of a condition it knows nothing of.
The ends (the head after the last stage's forward, the embedding's gradient after stage 0's
backward, stage 0's embedding) run under `lax.cond`, alike on every device, in the loop over the
table's ticks or slots: each is named with its share of true runs (`known_share`). The per-stage
programs' slots run a `lax.switch` on each device's own column: it is named with the sets of
branches the devices take in a slot and how many slots take each (`known_branches`); a slot
lasts as long as its costliest branch on any device (the slot's sends wait for it).
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np

# In a compiled conditional's op_name: the scope, then the `cond` itself (not one nested deeper).
SHARE = re.compile(r"cond_true_(\d+)_of_(\d+)/cond\"")
BRANCHES = re.compile(r"branches_([\d.x_]+)/cond\"")


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


def known_branches(taken: np.ndarray):
    """A named scope for a `lax.switch` run once per row of `taken` ([runs, devices]: the branch
    each device takes), to wrap it in: each set of branches a run takes across the devices, with
    how many runs take it."""
    sets = Counter(tuple(sorted({int(b) for b in row})) for row in np.asarray(taken))
    return jax.named_scope("branches_" + "_".join(f"{'.'.join(map(str, s))}x{n}" for s, n in sorted(sets.items())))


def branch_sets(op_name: str) -> list[tuple[tuple[int, ...], int]] | None:
    """The sets of branches a named switch's runs take, each with its runs, from its compiled
    instruction's text (None: not named)."""
    found = BRANCHES.search(op_name)
    if found is None:
        return None
    return [(tuple(int(b) for b in part.split("x")[0].split(".")), int(part.split("x")[1])) for part in found.group(1).split("_")]
