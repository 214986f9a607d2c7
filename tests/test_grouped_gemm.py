"""The dropless experts' Pallas kernels (lm.model.grouped_gemm, lm.model.swiglu_rows) run in Pallas'
GPU interpreter on the CPU: each equals XLA's `ragged_dot` (or the SwiGLU it replaces) in values
and gradients, on routings with empty groups, groups sharing a row tile and rows past the groups;
the tile table by hand. Their GPU programs: tests/test_gpu_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.model import experts, grouped_gemm, moe, swiglu_rows

BF16 = jnp.bfloat16


def _close(actual, expected, relative=2**-7):
    """Equal to bf16's rounding of the result: each element within `relative` of the largest."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = float(np.abs(expected).max())
    assert scale > 0
    np.testing.assert_allclose(actual, expected, atol=relative * scale, rtol=0)


def test_the_tile_table_by_hand():
    """Groups of 100, 0, 60 and 96 rows of 384 (128 past the groups), row tiles of 128: group 0
    in block 0; group 2 in blocks 0 (rows 100-127) and 1 (128-159); group 3 in block 1 (160-255).
    For the weight gradient (blocks of 64 rows): groups 0, 2, 3 span 2 blocks each, group 1 none."""
    table = grouped_gemm.tiles(jnp.asarray([100, 0, 60, 96]), 384)
    assert int(table.count[0]) == 4 and table.group_t.shape == (3 + 3,)  # 3 blocks + 3 group boundaries at most
    assert table.group_t[:4].tolist() == [0, 2, 2, 3]
    assert table.block_t[:4].tolist() == [0, 0, 1, 1]
    assert table.offset_t[:4].tolist() == [0, 100, 0, 32]
    assert table.rows_t.tolist() == [100, 28, 32, 96, 0, 0]
    assert table.first_block_g.tolist() == [0, 1, 1, 2] and table.blocks_g.tolist() == [2, 0, 2, 2]


ROUTINGS = {"uneven-with-empty": [100, 0, 60, 96], "two-groups": [128, 128, 0, 0], "one-late-group": [0, 0, 0, 300]}


@pytest.mark.parametrize("sizes", list(ROUTINGS.values()), ids=list(ROUTINGS))
def test_pallas_grouped_gemms_equal_ragged_dot_in_all_three_directions(sizes):
    m, k, n = 384, 128, 256
    keys = jax.random.split(jax.random.key(0), 3)
    x, dy = jax.random.normal(keys[0], (m, k)).astype(BF16), jax.random.normal(keys[1], (m, n)).astype(BF16)
    w = jax.random.normal(keys[2], (4, k, n)).astype(BF16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    table = grouped_gemm.tiles(group_sizes, m)
    y = grouped_gemm.grouped(x, w, group_sizes, table, implementation="pallas")
    assert y.dtype == BF16
    _close(y, grouped_gemm.grouped(x, w, group_sizes, implementation="xla"))
    assert not np.asarray(y[sum(sizes):], np.float32).any()  # rows past the groups: zeros, as ragged_dot's
    dx = grouped_gemm.grouped(dy, w, group_sizes, table, transpose_w=True, implementation="pallas")
    _close(dx, grouped_gemm.grouped(dy, w, group_sizes, transpose_w=True, implementation="xla"))
    dw = grouped_gemm.weight_grad(x, dy, group_sizes, table, implementation="pallas")
    _close(dw, grouped_gemm.weight_grad(x, dy, group_sizes, implementation="xla"))
    assert not np.asarray(dw)[[i for i, s in enumerate(sizes) if s == 0]].any()  # an empty group's gradient is zero


def test_swiglu_over_the_real_rows_equals_xla_with_gradients():
    m, f, real = 256, 256, 130
    g, u, dh = (jax.random.normal(key, (m, f)).astype(BF16) for key in jax.random.split(jax.random.key(1), 3))
    count = jnp.asarray([real], jnp.int32)
    _close(swiglu_rows.swiglu(g, u, count)[:real], swiglu_rows.reference(g, u)[:real])
    _, pullback = jax.vjp(lambda g, u: swiglu_rows.swiglu(g, u, count), g, u)
    _, ref_pullback = jax.vjp(swiglu_rows.reference, g, u)
    for got, want in zip(pullback(dh), ref_pullback(dh)):
        _close(got[:real], want[:real])


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 8], ids=["plain", "lora"])
def test_dropless_experts_with_the_pallas_kernels_equal_xla_in_values_and_gradients(rank):
    """A layer of 4 experts (width 128), 64 tokens x 2 choices, in bf16: the Pallas path (grouped
    GEMMs, the SwiGLU kernels, the tile table shared by the backward) against `ragged_dot`'s;
    with LoRA adapters on the experts (their rank-wide products by `ragged_dot` beside the kernels)."""
    b, t, d, e, f, k = 1, 64, 128, 4, 128, 2
    keys = jax.random.split(jax.random.key(2), 10)
    x = jax.random.normal(keys[0], (b, t, d))
    weights = [jax.random.normal(key, shape) * 0.1 for key, shape in zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)])]
    router = jax.random.normal(keys[4], (d, e))
    shapes = [(e, d, rank), (e, rank, f), (e, rank, f), (e, f, rank), (e, rank, d)]
    weights += [jax.random.normal(key, shape) * 0.1 for key, shape in zip(keys[5:], shapes)] if rank else []

    def layer(implementation, x, *w):
        routing = moe.route(jnp.einsum("btd,de->bte", x, router).reshape(b * t, -1), k, True)
        ids, gates = routing.ids_nk.reshape(b, t, k), routing.weights_nk.reshape(b, t, k)
        return experts.apply_experts(x, ids, gates, *w[:3], num_experts=e, capacity_factor=0.0, dtype=BF16, implementation=implementation,
                                     lora=tuple(w[3:]), lora_scale=2.0)[0]

    _close(layer("pallas", x, *weights), layer("xla", x, *weights), relative=2**-6)
    loss = lambda implementation: lambda *a: jnp.sum(layer(implementation, *a) ** 2)  # noqa: E731
    grads = jax.grad(loss("pallas"), argnums=tuple(range(1 + len(weights))))(x, *weights)
    reference = jax.grad(loss("xla"), argnums=tuple(range(1 + len(weights))))(x, *weights)
    for got, want in zip(grads, reference):
        _close(got, want, relative=2**-5)  # bf16 intermediates rounded at different points


def test_auto_picks_the_kernels_on_gpus_where_dtype_and_widths_allow():
    assert grouped_gemm.resolve("auto", "gpu", 4096, 14336, BF16) == "pallas"
    assert grouped_gemm.resolve("auto", "cpu", 4096, 14336, BF16) == "xla"
    assert grouped_gemm.resolve("auto", "gpu", 128, 192, BF16) == "xla"  # moe_tiny's width
    assert grouped_gemm.resolve("auto", "gpu", 4096, 14336, jnp.float32) == "xla"
    assert grouped_gemm.resolve("xla", "gpu", 4096, 14336, BF16) == "xla"


@pytest.mark.parametrize("transpose_w", [False, True], ids=["kn", "nk"])
def test_weights_with_the_group_axis_second_equal_the_group_first_layout(transpose_w):
    """An FSDP-gathered weight arrives [k, g, n] (gathered along its first axis): the kernels read
    each group's matrix from it, and write the weight gradient in it, as from [g, k, n]."""
    m, k, n = 256, 128, 256
    keys = jax.random.split(jax.random.key(3), 3)
    x, dy = jax.random.normal(keys[0], (m, n if transpose_w else k)).astype(BF16), jax.random.normal(keys[1], (m, k if transpose_w else n)).astype(BF16)
    w_gab = jax.random.normal(keys[2], (4, k, n)).astype(BF16)
    sizes = jnp.asarray([64, 100, 0, 60], jnp.int32)
    for implementation in ("pallas", "xla"):
        first = grouped_gemm.grouped(x, w_gab, sizes, transpose_w=transpose_w, implementation=implementation)
        second = grouped_gemm.grouped(x, w_gab.swapaxes(0, 1), sizes, transpose_w=transpose_w, group_axis=1, implementation=implementation)
        np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(second, np.float32))
        _close(second, grouped_gemm.grouped(x, w_gab, sizes, transpose_w=transpose_w, implementation="xla"))
    dw_first = grouped_gemm.weight_grad(x, dy, sizes, implementation="pallas")
    dw_second = grouped_gemm.weight_grad(x, dy, sizes, group_axis=1, implementation="pallas")
    assert dw_second.dtype == jnp.float32 and dw_second.shape == (x.shape[1], 4, dy.shape[1])
    np.testing.assert_array_equal(np.asarray(dw_first), np.asarray(dw_second.swapaxes(0, 1)))
    _close(dw_second, grouped_gemm.weight_grad(x, dy, sizes, group_axis=1, implementation="xla"))
