"""The grouped GEMM of dropless experts: rows sorted by group, row block g multiplied by w[g]; its
input and weight gradients. `model.grouped_gemm` picks the implementation:

- `xla`: `jax.lax.ragged_dot` (and `ragged_dot_general` for the weight gradient). On CPUs a
  loop over the groups; on GPUs jax 0.10.2 / 0.11.2's XLA rewrites it to one dense GEMM over
  every group for every row, masked (num_groups x the work).
- `pallas`: Pallas Mosaic GPU kernels for Hopper, here: persistent over the SMs, one warpgroup
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
from typing import NamedTuple

import jax
import jax.numpy as jnp

import sharding
from lm.model.matmul import varying

IMPLEMENTATIONS = ("auto", "xla", "pallas")
# Hopper's SMs (H100 SXM and H200 alike); a real device's own count where it reports one.
HOPPER_SMS = 132
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
STAGES = 4  # TMA loads in flight per tile
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
# The kernels' names, as they appear in a compiled program's metadata (`lm.compiler.kernels`).
ROWS_KERNEL, WEIGHT_GRAD_KERNEL = "grouped_gemm_rows", "grouped_gemm_weight_grad"


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


class Tiles(NamedTuple):
    """The row tiles of rows sorted by group: per tile its group, its row block, where in the
    block the group's rows start and how many there are; and per group its rows' start and
    end and its first row block (for the weight gradient). Made once per layer (`tiles`), used
    by the forward and both gradients."""

    count: jax.Array  # [1] tiles that hold rows
    group_t: jax.Array
    block_t: jax.Array
    offset_t: jax.Array
    rows_t: jax.Array
    start_g: jax.Array
    end_g: jax.Array
    first_block_g: jax.Array
    blocks_g: jax.Array  # row blocks of BLOCK_K rows each group spans (the weight gradient's)


def tiles(sizes_g: jax.Array, rows: int, block_m: int = BLOCK_M, block_k: int = BLOCK_K) -> Tiles:
    """The tile table of `rows` rows whose first sum(sizes_g) are sorted into groups of
    `sizes_g`: a group of r rows starting at s spans the row blocks s // block_m .. (s + r - 1)
    // block_m; a block two groups share is a tile of each."""
    sizes = sizes_g.astype(jnp.int32)
    end = jnp.cumsum(sizes)
    start = end - sizes
    first = start // block_m
    spans = jnp.where(sizes > 0, (end - 1) // block_m - first + 1, 0)
    tile_end = jnp.cumsum(spans)
    most = -(-rows // block_m) + sizes.shape[0] - 1  # every block, plus one per group boundary
    t = jnp.arange(most, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
    block = first[group] + t - (tile_end - spans)[group]
    lo = jnp.maximum(start[group], block * block_m)
    hi = jnp.minimum(end[group], (block + 1) * block_m)
    real = t < tile_end[-1]
    k_first = start // block_k
    k_blocks = jnp.where(sizes > 0, -(-end // block_k) - k_first, 0)
    return Tiles(tile_end[-1:], jnp.where(real, group, 0), jnp.where(real, block, 0), jnp.where(real, lo - block * block_m, 0),
                 jnp.where(real, hi - lo, 0), start, end, k_first.astype(jnp.int32), k_blocks.astype(jnp.int32))


def sms() -> int:
    """The SMs of the GPU the program is for (a compile-only device may not say: Hopper's)."""
    return getattr(sharding.device(), "core_count", 0) or HOPPER_SMS


def interpret_params():
    """Where the program is not for a GPU: Pallas' GPU interpreter's parameters (else None)."""
    if sharding.platform() == "gpu":
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def plgpu_modules():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return pl, plgpu


def _mma(pl, plgpu, acc_ref, a_smem, b_smem, transpose_a: bool = False, transpose_b: bool = False):
    """acc += a @ b on SMEM tiles, either given transposed (a view: the MMA reads it so).
    Pallas' GPU interpreter (jax 0.10.2) ignores transposed views, so there the tiles are copied
    transposed into SMEM first."""
    if interpret_params() is None:
        view = lambda ref, t: plgpu.transpose_ref(ref, (1, 0)) if t else ref  # noqa: E731
        plgpu.wgmma(acc_ref, view(a_smem, transpose_a), view(b_smem, transpose_b))
        return
    flipped = lambda ref, t: ref.shape[::-1] if t else ref.shape  # noqa: E731

    def copied(a_copy, b_copy):
        for ref, copy, t in ((a_smem, a_copy, transpose_a), (b_smem, b_copy, transpose_b)):
            copy[...] = ref[...].T if t else ref[...]
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, a_copy, b_copy)

    pl.run_scoped(copied, plgpu.SMEM(flipped(a_smem, transpose_a), a_smem.dtype), plgpu.SMEM(flipped(b_smem, transpose_b), b_smem.dtype))


def _store_rows(pl, plgpu, o_smem, o_gmem, first_row, offset, rows, column, block_m: int, block_n: int):
    """Rows `offset` .. `offset + rows` of the tile in SMEM to the result from row `first_row +
    offset`. TMA copies have static shapes, so `rows` goes as its binary digits: one copy of
    2^i rows for each bit set."""
    at = offset
    size = block_m
    while size >= 1:
        @pl.when(rows & size != 0)
        def _(at=at, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(at, size)], o_gmem.at[pl.ds(first_row + at, size), pl.ds(column, block_n)])

        at = at + (rows & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _group(ref, group, group_axis: int):
    """The [a, b] matrix of group `group` in a [g, a, b] (group_axis 0) or [a, g, b] (1) array."""
    return ref.at[group] if group_axis == 0 else ref.at[:, group]


def _matrix_shape(w, group_axis: int) -> tuple[int, int]:
    return tuple(d for i, d in enumerate(w.shape) if i != group_axis)


def _rows_kernel(pairs, table: Tiles, transpose_rhs: bool, group_axis: int):
    """[m, n] = the sum over `pairs` of (lhs_mk, rhs) of each real row of lhs_mk times its group's
    matrix of rhs ([k, n], or [n, k] given `transpose_rhs`; the group axis first or second),
    accumulated in one tile (two pairs: SwiGLU's input gradient through gate and up, with no pass
    adding two results); rows past the groups are left unwritten."""
    pl, plgpu = plgpu_modules()
    m, k = pairs[0][0].shape
    n = _matrix_shape(pairs[0][1], group_axis)[0 if transpose_rhs else 1]
    bm, bn, bk = BLOCK_M, BLOCK_N, BLOCK_K
    grid_n = n // bn

    def grouped_gemm_rows(count, group_t, block_t, offset_t, rows_t, *refs):
        operands, o_gmem = refs[:-1], refs[-1]
        real = count[0]

        @plgpu.nd_loop((real * grid_n,), collective_axes="sm")
        def _tile(info):
            t, ni = plgpu.planar_snake(info.index[0], (real, grid_n), 1, 1)
            block, group = block_t[t], group_t[t]

            def accumulate(acc_ref):
                for lhs_gmem, rhs_gmem in zip(operands[::2], operands[1::2]):
                    plgpu.emit_pipeline(
                        lambda _, a_smem, b_smem: _mma(pl, plgpu, acc_ref, a_smem, b_smem, transpose_b=transpose_rhs),
                        grid=(k // bk,),
                        in_specs=[
                            plgpu.BlockSpec((bm, bk), lambda kk: (block, kk), delay_release=1),
                            plgpu.BlockSpec((bn, bk) if transpose_rhs else (bk, bn), (lambda kk: (ni, kk)) if transpose_rhs else (lambda kk: (kk, ni)),
                                            delay_release=1),
                        ],
                        max_concurrent_steps=STAGES,
                    )(lhs_gmem, _group(rhs_gmem, group, group_axis))
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), o_gmem.dtype))
            def _store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                _store_rows(pl, plgpu, o_smem, o_gmem, block * bm, offset_t[t], rows_t[t], ni * bn, min(bm, m), bn)

    kernel = plgpu.kernel(
        grouped_gemm_rows, out_type=jax.ShapeDtypeStruct((m, n), pairs[0][0].dtype), grid=(sms(),), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), interpret=interpret_params(),
    )
    return kernel(table.count, table.group_t, table.block_t, table.offset_t, table.rows_t, *(a for pair in pairs for a in pair))


def _weight_grad_kernel(x_mk, dy_mn, table: Tiles, groups: int, group_axis: int):
    """[g, k, n] (or [k, g, n], group_axis 1), float32: per group, its rows of x_mk (transposed)
    times its rows of dy_mn, over the group's own row blocks (the rows of its neighbours in a
    shared block masked to zero)."""
    pl, plgpu = plgpu_modules()
    m, k = x_mk.shape
    n = dy_mn.shape[1]
    bm, bn, bk = BLOCK_M, BLOCK_N, BLOCK_K  # here: bm along k (x's columns), bk along the rows
    swizzle = plgpu.find_swizzle(bk * jnp.dtype(x_mk.dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(x_mk.dtype).itemsize
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(bn * 4 * 8)  # the float32 result tile
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 4)), plgpu.SwizzleTransform(out_swizzle))
    grid_k, grid_n = k // bm, n // bn

    def grouped_gemm_weight_grad(start_g, end_g, first_g, blocks_g, x_gmem, dy_gmem, o_gmem):
        @plgpu.nd_loop((groups, grid_k * grid_n), collective_axes="sm")
        def _tile(info):
            g = info.index[0]
            ki, ni = jax.lax.div(info.index[1], grid_n), jax.lax.rem(info.index[1], grid_n)  # (planar_snake crashes XLA:CPU's folding on a 1 x 1 grid)
            first = pl.multiple_of(first_g[g] * bk, bk)
            # Rows first .. first + m: past the array's end for a late group, but the pipeline reads
            # only the group's blocks.
            rows = pl.ds(first, m)

            def accumulate(acc_ref):
                def step(index, x_smem, dy_smem):
                    r = index[0]

                    def keep(lo, hi):
                        # x_smem is [bk rows, bm]: zero its rows outside [lo, hi) of this block.
                        row = jax.lax.broadcasted_iota(jnp.int32, (bk, bm), 0)
                        row = row if interpret_params() else plgpu.layout_cast(row, plgpu.Layout.WGMMA)  # the interpreter has no layouts
                        x_smem[...] = x_smem[...] * ((row >= lo) & (row < hi)).astype(x_smem.dtype)
                        plgpu.commit_smem()

                    @pl.when((r == 0) | (r == blocks_g[g] - 1))
                    def _():
                        base = first + r * bk
                        keep(jnp.maximum(start_g[g] - base, 0), jnp.minimum(end_g[g] - base, bk))

                    _mma(pl, plgpu, acc_ref, x_smem, dy_smem, transpose_a=True)

                @pl.when(blocks_g[g] > 0)
                def _():
                    plgpu.emit_pipeline(
                        step,
                        grid=(blocks_g[g],),
                        in_specs=[
                            plgpu.BlockSpec((bk, bm), lambda r: (r, ki), delay_release=1, transforms=transforms),
                            plgpu.BlockSpec((bk, bn), lambda r: (r, ni), delay_release=1, transforms=transforms),
                        ],
                        max_concurrent_steps=2,
                    )(x_gmem.at[rows, :], dy_gmem.at[rows, :])

                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), o_gmem.dtype, transforms=out_transforms))
            def _store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, _group(o_gmem, g, group_axis).at[pl.ds(ki * bm, bm), pl.ds(ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        grouped_gemm_weight_grad, out_type=jax.ShapeDtypeStruct((groups, k, n) if group_axis == 0 else (k, groups, n), jnp.float32),
        grid=(sms(),), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), interpret=interpret_params(),
    )
    return kernel(table.start_g, table.end_g, table.first_block_g, table.blocks_g, x_mk, dy_mn)


def _real_rows(y_mn, table: Tiles):
    """Rows past the groups as zeros (`ragged_dot`'s), where the kernels leave them unwritten."""
    row = jnp.arange(y_mn.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(row < table.end_g[-1], y_mn, 0)


def rows_scope(real_rows: int) -> str:
    """The name scope the kernels run under: the rows they are expected to hold (the static
    buffer may be larger), for the kernel model."""
    return f"expected_rows_{real_rows}"


def varying_like(y, *inputs):
    """A Pallas call's result marked as varying over the manual mesh axes its inputs vary over
    (inside `shard_map`): the kernel call itself drops that type, which the expert-parallel
    backward's sums over devices (`summed_as`) read."""
    if axes := tuple(sorted(set().union(*map(varying, inputs)) - varying(y))):
        return jax.lax.pcast(y, axes, to="varying")
    return y


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
        y_mn = _rows_kernel(operands, table, transpose_w, group_axis)[: x_mk.shape[0]]
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
        dw = _weight_grad_kernel(_padded_rows(x_mk), _padded_rows(dy_mn.astype(x_mk.dtype)), table, sizes_g.shape[0], group_axis)
        return varying_like(dw, x_mk, dy_mn, sizes_g)
    rows = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw_gkn = jax.lax.ragged_dot_general(x_mk, dy_mn.astype(x_mk.dtype), sizes_g, rows, preferred_element_type=jnp.float32)
    return jnp.moveaxis(dw_gkn, 0, group_axis)


def flops(rows: int, k: int, n: int) -> float:
    """One grouped GEMM's FLOPs: its real rows', 2 x rows x k x n."""
    return 2.0 * rows * k * n if rows and k and n else 0.0

