"""SwiGLU between dropless experts' grouped GEMMs, over the rows that hold tokens only.

Under expert parallelism a device receives its tokens into room for every assignment of every
device (ways x its even share, static shapes), and the grouped GEMMs (`lm.model.grouped_gemm`,
Pallas) touch only the rows that hold tokens. XLA's elementwise kernels between them would read
and write the whole buffer (Mixtral on 8-way expert parallelism: 8x its rows, each [rows, 14336]
wide: more time than the GEMMs). These Pallas Mosaic GPU kernels run silu(gate) x up and its
gradients over the row blocks below the real rows' count, pipelined over the columns; rows past
it are left unwritten (nothing reads them: the exchange sends back only real rows). Off GPUs
they run in Pallas' GPU interpreter (tests).

Shape suffixes: m rows, f expert hidden width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lm.model import grouped_gemm_kernels as mosaic
from lm.model import swiglu as swiglu_maths

BLOCK_ROWS, BLOCK_COLUMNS = 64, 128


def _forward(g, u):
    return (swiglu_maths.forward(g, u),)


def _map_rows(fn, inputs, outputs: int, real_rows):
    """`fn` over [BLOCK_ROWS, BLOCK_COLUMNS] tiles of the `inputs` ([m, f] each), in the row
    blocks below `real_rows[0]`: `outputs` arrays [m, f] in the inputs' dtype."""
    pl, plgpu = mosaic.plgpu_modules()
    m, f = inputs[0].shape
    bm, bf = BLOCK_ROWS, BLOCK_COLUMNS
    n_in = len(inputs)

    def swiglu_rows(real_ref, *refs):
        blocks = (real_ref[0] + bm - 1) // bm

        @plgpu.nd_loop((blocks,), collective_axes="sm")
        def _block(info):
            r = info.index[0]

            def step(index, *tiles):
                results = fn(*(t[...] for t in tiles))

                # Stored by hand (the pipeline's own output stores are predicated, which Pallas'
                # GPU interpreter lacks); the copies overlap the next step's loads.
                def store(*o_smem):
                    for o, value in zip(o_smem, results):
                        o[...] = value.astype(o.dtype)
                    plgpu.commit_smem()
                    for o, o_gmem in zip(o_smem, refs[n_in:]):
                        plgpu.copy_smem_to_gmem(o, o_gmem.at[pl.ds(r * bm, bm), pl.ds(index[0] * bf, bf)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                pl.run_scoped(store, *[plgpu.SMEM((bm, bf), refs[n_in].dtype)] * outputs)

            spec = plgpu.BlockSpec((bm, bf), lambda j: (r, j))
            plgpu.emit_pipeline(step, grid=(f // bf,), in_specs=[spec] * n_in, max_concurrent_steps=2)(*refs[:n_in])

    kernel = plgpu.kernel(
        swiglu_rows, kernel_name="swiglu_rows", out_type=[jax.ShapeDtypeStruct((m, f), inputs[0].dtype)] * outputs, grid=(mosaic.sms(),), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), interpret=mosaic.interpret_params(),
    )
    return kernel(real_rows, *inputs)


def fits(rows: int, f: int) -> bool:
    return rows % BLOCK_ROWS == 0 and f % BLOCK_COLUMNS == 0


@jax.custom_vjp
def swiglu(g_mf, u_mf, real_rows):
    """silu(g) x u in g's dtype over the rows below `real_rows[0]` ([1] int32)."""
    (h,) = _map_rows(_forward, (g_mf, u_mf), 1, real_rows)
    return mosaic.varying_like(h, g_mf, u_mf)


def _swiglu_fwd(g_mf, u_mf, real_rows):
    return swiglu(g_mf, u_mf, real_rows), (g_mf, u_mf, real_rows)


def _swiglu_bwd(residuals, dh_mf):
    g_mf, u_mf, real_rows = residuals
    dg, du = _map_rows(swiglu_maths.gradients, (dh_mf.astype(g_mf.dtype), g_mf, u_mf), 2, real_rows)
    return mosaic.varying_like(dg, dh_mf, g_mf), mosaic.varying_like(du, dh_mf, u_mf), None


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def reference(g_mf, u_mf):
    """What `swiglu` computes, by XLA (tests)."""
    return _forward(g_mf, u_mf)[0].astype(g_mf.dtype)

