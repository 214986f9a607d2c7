"""The experts' matmuls with their backward written out (`jax.custom_vjp`), for
`lm.model.experts`: grouped GEMMs over rows sorted by expert (`lm.model.grouped_gemm`), alone or
as SwiGLU's gate / up pair sharing one input gradient; dense batched matmuls over fixed-size
per-expert buffers; FSDP's gather of a weight inside `shard_map`. Each takes compute-dtype
activations and float32 weights (cast inside) and feeds its backward GEMMs compute-dtype
operands (autodiff would give them the float32 cotangent, and XLA runs float32 x bf16 GEMMs in
float32), the weight gradient left in float32 for its reduction over the devices (as
`lm.model.matmul`).

Shape suffixes: m rows, d / f widths, e experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.model import grouped_gemm
from lm.model.matmul import F32, backward, summed_as


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def grouped_matmul(x_md, w, group_sizes_e, table, implementation: str, expected_rows: int, group_axis: int, transposed: bool):
    """Row block g of the rows sorted by group times group g's matrix of `w` ([g, k, n], or with
    `group_axis` 1 [k, g, n]; [n, k] matrices given `transposed`), by `lm.model.grouped_gemm`'s
    `implementation`; `table`: its tile table, made once per layer, or None. Under a name scope
    giving the rows it is expected to hold (the kernel model's)."""
    with jax.named_scope(grouped_gemm.rows_scope(expected_rows)):
        return grouped_gemm.grouped(x_md, w, group_sizes_e, table, transpose_w=transposed, group_axis=group_axis,
                                    implementation=implementation, zero_rest=False)


def _grouped_fwd(x_md, w, group_sizes_e, table, implementation, expected_rows, group_axis, transposed):
    y = grouped_matmul(x_md, w, group_sizes_e, table, implementation, expected_rows, group_axis, transposed)
    return y, (x_md, w.astype(x_md.dtype), group_sizes_e, table)


def _grouped_bwd(implementation, expected_rows, group_axis, transposed, residuals, dy_mf):
    x_md, w, group_sizes_e, table = residuals
    dy = dy_mf.astype(x_md.dtype)
    options = dict(group_axis=group_axis, implementation=implementation)
    with jax.named_scope(grouped_gemm.rows_scope(expected_rows)):
        dx = grouped_gemm.grouped(dy, w, group_sizes_e, table, transpose_w=not transposed, zero_rest=False, **options)
        # The weight gradient in w's layout: x^T dy per group, or (dy^T x) for [n, k] matrices.
        dw = grouped_gemm.weight_grad(*((dy, x_md) if transposed else (x_md, dy)), group_sizes_e, table, **options)
    return summed_as(dx.astype(x_md.dtype), x_md), summed_as(dw, w), None, None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def grouped_matmul_pair(x_md, w_a, w_b, group_sizes_e, table, implementation: str, expected_rows: int, group_axis: int):
    """(`grouped_matmul` of x by w_a, by w_b): SwiGLU's gate and up projections of the same rows.
    Their backward takes x's gradient from one grouped GEMM summing both products (the Pallas
    kernel accumulates them in each tile), not two GEMMs and a pass adding them over the buffer."""
    return tuple(grouped_matmul(x_md, w, group_sizes_e, table, implementation, expected_rows, group_axis, False) for w in (w_a, w_b))


def _pair_fwd(x_md, w_a, w_b, group_sizes_e, table, implementation, expected_rows, group_axis):
    ys = grouped_matmul_pair(x_md, w_a, w_b, group_sizes_e, table, implementation, expected_rows, group_axis)
    return ys, (x_md, w_a.astype(x_md.dtype), w_b.astype(x_md.dtype), group_sizes_e, table)


def _pair_bwd(implementation, expected_rows, group_axis, residuals, dys):
    x_md, w_a, w_b, group_sizes_e, table = residuals
    da, db = (dy.astype(x_md.dtype) for dy in dys)
    options = dict(group_axis=group_axis, implementation=implementation)
    with jax.named_scope(grouped_gemm.rows_scope(expected_rows)):
        dx = grouped_gemm.grouped_sum([(da, w_a), (db, w_b)], group_sizes_e, table, transpose_w=True, zero_rest=False, **options)
        dw_a, dw_b = (grouped_gemm.weight_grad(x_md, dy, group_sizes_e, table, **options) for dy in (da, db))
    return summed_as(dx.astype(x_md.dtype), x_md), summed_as(dw_a, w_a), summed_as(dw_b, w_b), None, None


grouped_matmul_pair.defvjp(_pair_fwd, _pair_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def batched_matmul(spec: str, x, w):
    """`einsum(spec, x, w)` over the experts' fixed-size buffers, accumulated in float32 and
    returned in x's dtype (as the grouped GEMMs: what remat's `dots` keeps of it is then half
    the bytes; float32 results put Mixtral's capacity mode 47% over the planner's memory)."""
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=F32).astype(x.dtype)


def _batched_fwd(spec, x, w):
    return batched_matmul(spec, x, w), (x, w.astype(x.dtype))


def _batched_bwd(spec, residuals, dy):
    x, w = residuals
    dx, dw = backward(spec, x, w, dy.astype(x.dtype), dtypes=(x.dtype, F32))
    return summed_as(dx, x), summed_as(dw, w)


batched_matmul.defvjp(_batched_fwd, _batched_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gathered(w, axes: tuple[str, ...], axis: int, dtype):
    """FSDP inside `shard_map`: `w` whole along `axis` over the mesh `axes`, moved in the compute
    `dtype` and returned in w's; its gradient reduce-scattered in w's (float32), as the dense
    layers' are (XLA's placement there)."""
    return jax.lax.all_gather(w.astype(dtype), axes, axis=axis, tiled=True).astype(w.dtype)


def _gathered_fwd(w, axes, axis, dtype):
    return gathered(w, axes, axis, dtype), None


def _gathered_bwd(axes, axis, dtype, _, dw):
    return (jax.lax.psum_scatter(dw, axes, scatter_dimension=axis, tiled=True),)


gathered.defvjp(_gathered_fwd, _gathered_bwd)
