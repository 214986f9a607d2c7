"""Rematerialisation by name: what a layer (or a pipeline tick) keeps for its backward pass.

One vocabulary for the layer stack and the pipeline: `none` keeps every intermediate (no
`jax.checkpoint`), `full` keeps only the inputs and recomputes the rest, `dots` keeps matmul
outputs, `dots_no_batch` keeps matmul outputs without batch dimensions (weights-shaped ones).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

REMAT = ("none", "full", "dots", "dots_no_batch")
_SAVEABLE = {
    "full": None,  # jax.checkpoint's default policy: save nothing
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat(fn: Callable, kind: str, *, prevent_cse: bool = True) -> Callable:
    """`fn` rematerialised as `kind` says (one of REMAT); `none` returns `fn` itself."""
    if kind not in REMAT:
        raise ValueError(f"remat {kind!r} is not one of {', '.join(REMAT)}")
    if kind == "none":
        return fn
    return jax.checkpoint(fn, policy=_SAVEABLE[kind], prevent_cse=prevent_cse)
