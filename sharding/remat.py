"""Rematerialisation by name: what a layer (or a pipeline tick) keeps for its backward pass.

One vocabulary for the layer stack and the pipeline: `none` keeps every intermediate (no
`jax.checkpoint`), `full` keeps only the inputs (and fp8 scales) and recomputes the rest, `dots` keeps matmul
outputs and flash attention's (cuDNN's output and softmax statistics, which its backward
needs), `dots_and_inputs` keeps those and the matmuls' computed inputs whose recompute costs passes of its own (the norms' outputs, the rotated queries
and keys: tagged with `name_matmul_input`; not the MLP's product, which the backward remakes inside the pass that reads gate and up anyway), `dots_no_batch` keeps the outputs of matmuls without dot batch dimensions (the
projections, not attention's scores; attention is recomputed), `qkv_proj` keeps only the query / key / value projections
(tagged with `name_qkv`; MaxText's choice for its large GPU recipes). Matmuls are `dot_general`s, or outputs tagged with
`name_matmul`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

REMAT = ("none", "full", "dots", "dots_and_inputs", "dots_no_batch", "qkv_proj")
# Names for matmul outputs, so the `dots` policies find matmuls that JAX's own policies cannot see
# (a matmul behind a custom VJP is no `dot_general` to `checkpoint_dots`).
MATMUL, BATCHED_MATMUL = "matmul", "batched_matmul"  # without / with dot_general batch dims
QKV = "qkv_proj"
MATMUL_INPUT = "matmul_input"  # an input a matmul reads that a layer computed (a norm's output, rotated queries)
# An fp8 site's scales under current scaling (a few floats, each from a whole tensor's amax): every
# policy keeps them, so a recomputed forward quantises with them instead of reducing its tensors again.
FP8_SCALES = "fp8_scales"
# cuDNN flash attention (jax.nn.dot_product_attention) is a custom call behind a custom VJP, no
# `dot_general`: unless its forward's results are saved, `dots` runs every layer's attention
# forward again in the backward to get them (seen in the compiled H100 step: 2 forward calls a layer).
FLASH_ATTENTION_FORWARD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fp8_fwd_wrapper")


def _saves_flash_attention(prim, *_, **__) -> bool:
    return prim.name in FLASH_ATTENTION_FORWARD


_DOTS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots,
        jax.checkpoint_policies.save_only_these_names(MATMUL, BATCHED_MATMUL, FP8_SCALES),
    ),
    _saves_flash_attention,
)
_SAVEABLE = {
    "full": jax.checkpoint_policies.save_only_these_names(FP8_SCALES),  # nothing else
    "dots": _DOTS,
    "dots_and_inputs": jax.checkpoint_policies.save_from_both_policies(_DOTS, jax.checkpoint_policies.save_only_these_names(MATMUL_INPUT)),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, jax.checkpoint_policies.save_only_these_names(MATMUL, FP8_SCALES)
    ),
    "qkv_proj": jax.checkpoint_policies.save_only_these_names(QKV, FP8_SCALES),
}


def name_matmul(y: jax.Array, batched: bool) -> jax.Array:
    """`y`, tagged as a matmul's output (batched: its dot has batch dimensions, as attention's)."""
    return checkpoint_name(y, BATCHED_MATMUL if batched else MATMUL)


def name_matmul_input(y: jax.Array) -> jax.Array:
    """`y`, tagged as a computed input of a matmul (what remat `dots_and_inputs` keeps beside `dots`)."""
    return checkpoint_name(y, MATMUL_INPUT)


def name_fp8_scales(scales: jax.Array) -> jax.Array:
    """`scales`, tagged as an fp8 site's current-scaling scales (what every policy keeps)."""
    return checkpoint_name(scales, FP8_SCALES)


def name_qkv(y: jax.Array) -> jax.Array:
    """`y`, tagged as a query, key or value projection (what remat `qkv_proj` keeps)."""
    return checkpoint_name(y, QKV)


def remat(fn: Callable, kind: str, *, prevent_cse: bool = True) -> Callable:
    """`fn` rematerialised as `kind` says (one of REMAT); `none` returns `fn` itself."""
    if kind not in REMAT:
        raise ValueError(f"remat {kind!r} is not one of {', '.join(REMAT)}")
    if kind == "none":
        return fn
    return jax.checkpoint(fn, policy=_SAVEABLE[kind], prevent_cse=prevent_cse)
