"""The grouped GEMM of dropless experts: rows sorted by group, row block g multiplied by w[g]; its
input and weight gradients. `model.grouped_gemm` picks the implementation:

- `xla`: `jax.lax.ragged_dot` (and `ragged_dot_general` for the weight gradient). On CPUs a
  loop over the groups; on GPUs jax 0.10.2 / 0.11.2's XLA rewrites it to one dense GEMM over
  every group for every row, masked (num_groups x the work).
- `pallas`: Pallas Mosaic GPU kernels for Hopper (`lm.model.grouped_gemm_kernels`): persistent over the SMs, one warpgroup
  MMA tile per (row tile, column tile), TMA loads pipelined over the contraction. Row tiles come
  from a tile table made once per layer from the group sizes (`Tiles`): a tile lies in one
  group, only the tiles that hold rows run, so the work is the real rows' (plus a partial tile
  per group boundary), however large the buffer holding them (expert parallelism receives into
  room for every assignment of every device). The weight gradient runs per group over the
  group's own row blocks, the rows outside it masked in the first and last block. Inputs and
  results in the compute dtype (bf16 / f16), float32 accumulation. Off GPUs the same kernels
  run in Pallas' GPU interpreter (slow; tests).
- `auto`: `pallas` on GPUs where the dtype and shapes allow it (`pallas_fits`), else `xla`.

Chosen over jax's own `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu` (which taught the
structure): the former computes a tile for every row block of the buffer whether or not it holds
rows (8x the work under 8-way expert parallelism), and the latter asks the process's first
device for its SM count, which fails when compiling for a GPU from a CPU host. cuDNN's grouped
GEMM (`--xla_gpu_experimental_use_ragged_dot_fusion`) still compiles to the dense rewrite on
jax 0.10.2; Transformer Engine's needs its CUDA library loaded to compile.

Shape suffixes: m rows, k contracted, n columns, g groups, t row tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.model.grouped_gemm_kernels import BLOCK_M, Tiles, rows_kernel, tiles, varying_like, weight_grad_kernel

IMPLEMENTATIONS = ("auto", "xla", "pallas")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


def pallas_fits(k: int, n: int, dtype) -> str:
    """Why the Pallas kernels cannot take a [*, k] x [k, n] grouped GEMM ('' where they can)."""
    if jnp.dtype(dtype) not in map(jnp.dtype, KERNEL_DTYPES):
        return f"the kernels take bfloat16 or float16, not {jnp.dtype(dtype).name}"
    if k % BLOCK_M or n % BLOCK_M:
        return f"the widths {k} and {n} must be multiples of {BLOCK_M}"
    return ""


def resolve(implementation: str, platform: str, k: int, n: int, dtype) -> str:
    """The implementation `implementation` means on `platform` for these widths and dtype."""
    if implementation == "auto":
        return "pallas" if platform == "gpu" and not pallas_fits(k, n, dtype) else "xla"
    return implementation


def _real_rows(y_mn, table: Tiles):
    """Rows past the groups as zeros (`ragged_dot`'s), where the kernels leave them unwritten."""
    row = jnp.arange(y_mn.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(row < table.end_g[-1], y_mn, 0)


def rows_scope(real_rows: int) -> str:
    """The name scope the kernels run under: the rows they are expected to hold (the static
    buffer may be larger), for the kernel model."""
    return f"expected_rows_{real_rows}"


def _padded_rows(a):
    """`a` with zero rows up to a multiple of BLOCK_M (a TMA tile read past the end is zeros on a
    GPU but an error in the interpreter); usually a no-op: rows are tokens x experts per token."""
    return jnp.pad(a, ((0, -a.shape[0] % BLOCK_M), (0, 0))) if a.shape[0] % BLOCK_M else a


def grouped(x_mk, w, sizes_g, table: Tiles | None = None, *, transpose_w: bool = False, group_axis: int = 0,
            implementation: str = "xla", zero_rest: bool = True):
    """Row block g of x_mk (sorted by group) times group g's matrix of `w` ([k, n], or [n, k]
    given `transpose_w`; `w` is [g, ., .], or [., g, .] given `group_axis` 1: an FSDP-gathered
    weight, whose gather along its first axis needs no transpose), accumulated in float32:
    float32 from `xla`, x's dtype from `pallas` (its tiles are stored so). `implementation`:
    `xla` or `pallas` (`resolve` maps `auto`). The kernels leave rows past the groups
    unwritten: `zero_rest` zeroes them (`ragged_dot`'s), a pass over the whole buffer that a
    caller reading only the real rows skips."""
    return grouped_sum([(x_mk, w)], sizes_g, table, transpose_w=transpose_w, group_axis=group_axis, implementation=implementation,
                       zero_rest=zero_rest)


def grouped_sum(pairs, sizes_g, table: Tiles | None = None, *, transpose_w: bool = False, group_axis: int = 0,
                implementation: str = "xla", zero_rest: bool = True):
    """`grouped` of each (x_mk, w) of `pairs` (same shapes), summed: with `pallas` in one kernel
    accumulating them all in each tile."""
    x_mk = pairs[0][0]
    if implementation == "pallas":
        table = table if table is not None else tiles(sizes_g, x_mk.shape[0])
        operands = [(_padded_rows(x.astype(x_mk.dtype)), w.astype(x_mk.dtype)) for x, w in pairs]
        y_mn = rows_kernel(operands, table, transpose_w, group_axis)[: x_mk.shape[0]]
        y_mn = varying_like(y_mn, *(a for pair in pairs for a in pair), sizes_g)
        return _real_rows(y_mn, table) if zero_rest else y_mn

    def one(x, w):
        w_gkn = jnp.moveaxis(w, group_axis, 0)
        w_gkn = w_gkn.swapaxes(1, 2) if transpose_w else w_gkn
        return jax.lax.ragged_dot(x, w_gkn.astype(x_mk.dtype), sizes_g, preferred_element_type=jnp.float32)

    return functools.reduce(jnp.add, (one(x, w) for x, w in pairs))


def weight_grad(x_mk, dy_mn, sizes_g, table: Tiles | None = None, *, group_axis: int = 0, implementation: str = "xla"):
    """Per group, x's rows transposed times dy's, float32: [g, k, n] (group_axis 0) or [k, g, n]."""
    if implementation == "pallas":
        table = table if table is not None else tiles(sizes_g, x_mk.shape[0])
        dw = weight_grad_kernel(_padded_rows(x_mk), _padded_rows(dy_mn.astype(x_mk.dtype)), table, sizes_g.shape[0], group_axis)
        return varying_like(dw, x_mk, dy_mn, sizes_g)
    rows = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw_gkn = jax.lax.ragged_dot_general(x_mk, dy_mn.astype(x_mk.dtype), sizes_g, rows, preferred_element_type=jnp.float32)
    return jnp.moveaxis(dw_gkn, 0, group_axis)


def flops(rows: int, k: int, n: int) -> float:
    """One grouped GEMM's FLOPs: its real rows', 2 x rows x k x n."""
    return 2.0 * rows * k * n if rows and k and n else 0.0

