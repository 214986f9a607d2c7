"""How a mixture of experts' rows move (`lm.model.experts`): sorted by expert and back by one
permutation whose backward is a gather too (`permuted`, `sorting`), and exchanged with the
devices holding their experts: `ragged_exchange` (only the real rows, by
`jax.lax.ragged_all_to_all` on GPUs with a hand-written backward; emulated by a fixed-size
`all_to_all` on CPUs, which lack it) and `exchange`, a fixed-size all-to-all (capacity mode).

Shape suffixes: m rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import sharding
from lm.model.grouped_gemm_kernels import varying_like
from lm.model.matmul import summed_as, varying


@jax.custom_vjp
def permuted(x_md, to_m, from_m):
    """x's rows in the order `to_m` (x[to_m]), `from_m` its inverse permutation. The backward is
    a gather by `from_m` (autodiff's would be a scatter-add: XLA cannot know `to_m` permutes),
    which fuses with what reads it, as the forward's gather does."""
    return _rows(x_md, to_m)


def _rows(x_md, index_m):
    # Indices in range by construction: no wrapping of negative ones (a comparison with a
    # constant, which under the pipeline's scan lacks the indices' varying mesh axes).
    return x_md.at[index_m].get(mode="promise_in_bounds", wrap_negative_indices=False)


def _permuted_fwd(x_md, to_m, from_m):
    return _rows(x_md, to_m), (to_m, from_m)


def _permuted_bwd(residuals, dy_md):
    to_m, from_m = residuals
    return _rows(dy_md, from_m), None, None


permuted.defvjp(_permuted_fwd, _permuted_bwd)


def sorting(group_m):
    """The stable order sorting rows by group and its inverse: the layer's routing metadata,
    made once and used by the forward and backward passes."""
    order_m = jnp.argsort(group_m, stable=True)
    positions_m = varying_like(jnp.arange(order_m.shape[0], dtype=order_m.dtype), order_m)
    return order_m, jnp.zeros_like(order_m).at[order_m].set(positions_m)


def exchange(x, expert_axes):
    """An all-to-all over the expert devices: chunk p of the leading axis goes to device p."""
    return jax.lax.all_to_all(x, expert_axes, 0, 0, tiled=True) if expert_axes else x


def _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """`jax.lax.ragged_all_to_all` over `axis`: rows `input_offsets[p]` .. `+ send_sizes[p]` of
    `operand` written into device p's `output` from its row `output_offsets[p]`; `recv_sizes[p]`
    rows arrive from p. Only the real rows move where XLA has the collective (GPUs); XLA:CPU has
    not, so there the same exchange runs as a fixed-size `all_to_all` (each device's chunk for
    each peer padded to the operand's length) and each received chunk is placed at its offset."""
    if sharding.platform() == "gpu":
        if devices := tuple(sorted(varying(operand) - varying(output))):  # the result varies as the rows sent do
            output = jax.lax.pcast(output, devices, to="varying")
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)
    return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s exchange by a fixed-size `all_to_all` (XLA:CPU has no
    ragged one)."""
    axis = axis_name
    slices, rows = input_offsets.shape[0], operand.shape[0]  # slices: a multiple of the devices, in device order
    span = jnp.arange(rows)
    padded = jnp.concatenate([operand, jnp.zeros_like(operand)])
    chunks = jnp.stack([jax.lax.dynamic_slice_in_dim(padded, input_offsets[i], rows) for i in range(slices)])
    chunks = jnp.where((span[None] < send_sizes[:, None]).reshape(slices, rows, *(1,) * (operand.ndim - 1)), chunks, 0)
    arrived = exchange(chunks.reshape(slices * rows, *operand.shape[1:]), axis).reshape(chunks.shape)
    at = exchange(output_offsets, axis)  # where each source's slices go here
    where = jnp.where(span[None] < recv_sizes[:, None], at[:, None] + span[None], output.shape[0])  # past the end: dropped
    return output.at[where.reshape(-1)].set(arrived.reshape(slices * rows, *operand.shape[1:]), mode="drop")


def ragged_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows: int, fill, axis: tuple[str, ...]):
    """`_ragged` into a new buffer of `rows` rows filled with `fill`. On GPUs its backward sends
    the cotangent's rows back the way they came (`_gpu_exchange`); the CPU's emulation is
    differentiated as it is."""
    if sharding.platform() == "gpu":
        return _gpu_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, fill, axis)
    output = jnp.full((rows, *operand.shape[1:]), fill, operand.dtype)
    return _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gpu_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows: int, fill, axis: tuple[str, ...]):
    """`ragged_all_to_all` into a new buffer, with a hand-written backward: autodiff would also
    all-reduce the cotangent of the buffer (an invariant zero made varying) over every device,
    2 GiB a step in Mixtral's 64-GPU program."""
    output = jnp.full((rows, *operand.shape[1:]), fill, operand.dtype)
    return _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis)


def _exchange_fwd(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, fill, axis):
    shape = operand[:, :0]  # the operand's rows (and the devices it varies over), for the backward
    out = _gpu_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, fill, axis)
    return out, (input_offsets, send_sizes, output_offsets, recv_sizes, shape)


def _exchange_bwd(rows, fill, axis, residuals, d_out):
    input_offsets, send_sizes, output_offsets, recv_sizes, shape = residuals
    # Back to each source p: the rows it put here (from here's row `at[p]`), into its operand's rows.
    at, their_offsets = exchange(output_offsets, axis), exchange(input_offsets, axis)
    back = _ragged(d_out, jnp.zeros((shape.shape[0], *d_out.shape[1:]), d_out.dtype), at, recv_sizes, their_offsets, send_sizes, axis)
    return summed_as(back, shape), None, None, None, None


_gpu_exchange.defvjp(_exchange_fwd, _exchange_bwd)
