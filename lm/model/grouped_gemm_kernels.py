"""meshlm's Pallas Mosaic GPU kernels of the grouped GEMM (`lm.model.grouped_gemm` picks them):
the tile table of rows sorted by group (`Tiles`, made once per layer), the rows kernel (each real
row tile times its group's matrix, over one or several summed pairs of operands) and the weight
gradient kernel (per group over its row blocks); and the plumbing Pallas GPU kernels share
(`sms`, Pallas' GPU interpreter off GPUs, `varying_like`).

Shape suffixes: m rows, k contracted, n columns, g groups, t row tiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import sharding
from lm.model.matmul import varying

# Hopper's SMs (H100 SXM and H200 alike); a real device's own count where it reports one.
HOPPER_SMS = 132
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
STAGES = 4  # TMA loads in flight per tile


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
        # jax 0.12 transposes the ref itself (`plgpu.transpose_ref` deprecated); 0.10 has only that.
        transposed = (lambda ref: ref.transpose((1, 0))) if jax.__version_info__ >= (0, 12) else (lambda ref: plgpu.transpose_ref(ref, (1, 0)))
        view = lambda ref, t: transposed(ref) if t else ref  # noqa: E731
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


def rows_kernel(pairs, table: Tiles, transpose_rhs: bool, group_axis: int):
    """[m, n] = the sum over `pairs` of (lhs_mk, rhs) of each real row of lhs_mk times its group's
    matrix of rhs ([k, n], or [n, k] given `transpose_rhs`; the group axis first or second),
    accumulated in one tile (two pairs: SwiGLU's input gradient through gate and up, with no pass
    adding two results); rows past the groups are left unwritten."""
    pl, plgpu = plgpu_modules()
    m, k = pairs[0][0].shape
    n = _matrix_shape(pairs[0][1], group_axis)[0 if transpose_rhs else 1]
    bm, bn, bk = BLOCK_M, BLOCK_N, BLOCK_K
    grid_n = n // bn

    # The kernels' function names are their names in a compiled program (`lm.compiler.kernels`).
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
        grouped_gemm_rows, kernel_name="grouped_gemm_rows", out_type=jax.ShapeDtypeStruct((m, n), pairs[0][0].dtype), grid=(sms(),), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), interpret=interpret_params(),
    )
    return kernel(table.count, table.group_t, table.block_t, table.offset_t, table.rows_t, *(a for pair in pairs for a in pair))


def weight_grad_kernel(x_mk, dy_mn, table: Tiles, groups: int, group_axis: int):
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
        grouped_gemm_weight_grad, kernel_name="grouped_gemm_weight_grad", out_type=jax.ShapeDtypeStruct((groups, k, n) if group_axis == 0 else (k, groups, n), jnp.float32),
        grid=(sms(),), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), interpret=interpret_params(),
    )
    return kernel(table.start_g, table.end_g, table.first_block_g, table.blocks_g, x_mk, dy_mn)


def varying_like(y, *inputs):
    """A Pallas call's result marked as varying over the manual mesh axes its inputs vary over
    (inside `shard_map`): the kernel call itself drops that type, which the expert-parallel
    backward's sums over devices (`summed_as`) read."""
    if axes := tuple(sorted(set().union(*map(varying, inputs)) - varying(y))):
        return jax.lax.pcast(y, axes, to="varying")
    return y
