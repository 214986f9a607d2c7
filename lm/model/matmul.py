"""The one matmul every model weight goes through: `einsum(spec, x, w)` on compute-dtype
inputs with float32 accumulation, forward and backward (a hand-written VJP).

Autodiff of a dot with `preferred_element_type=float32` would give float32 x bf16 backward dots
(slow on CPU, and not what fp8 / bf16 hardware runs); here the output gradient is cast to the
inputs' dtype so both backward matmuls run on the same units as the forward one.

On accelerators a 16-bit result is the dot's own output (accumulated in float32 by the named dot
algorithm, rounded once), not a float32 result cast afterwards: where the contraction is split
over devices (tensor parallelism's row-parallel matmuls and input gradients) the partial sums are
reduced in the dot's output type, so a float32 dot put float32 collectives on the wire, twice
Megatron's bytes, and XLA turned those under sequence parallelism into whole all-reduces instead
of reduce-scatters (PERFORMANCE.md, "Partial sums in the compute dtype"). XLA:CPU runs
16-bit-result dots about 2x slower, so there the result is float32, cast.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp

import sharding

F32 = jnp.float32
# Dot algorithms that accumulate 16-bit or fp8 operands in float32 whatever the result's type.
_F32_ACCUMULATION = {jnp.dtype(jnp.bfloat16): "BF16_BF16_F32", jnp.dtype(jnp.float16): "F16_F16_F32"}
_FP8_F32_ACCUMULATION = "ANY_F8_ANY_F8_F32"


def _algorithm(a, b):
    if a.dtype == b.dtype and a.dtype in _F32_ACCUMULATION:
        return _F32_ACCUMULATION[a.dtype]
    if jnp.dtype(a.dtype).itemsize == 1 and jnp.dtype(b.dtype).itemsize == 1 and has_fp8_gemms():  # e4m3 / e5m2
        return _FP8_F32_ACCUMULATION if fp8_algorithm_compiles(sharding.device()) else None
    return None


@functools.cache
def fp8_algorithm_compiles(device) -> bool:
    """Whether a dot naming the fp8 algorithm compiles for `device`. jax 0.12.0.1's CUDA plugin
    takes StableHLO 1.16.3, which cannot carry a dot algorithm on fp8 operands ("failed to
    legalize operation 'vhlo.dot_general_v2'"); there fp8 GEMMs write float32, scaled and cast
    after (one more pass per GEMM), rather than fail."""
    f8 = jax.ShapeDtypeStruct((16, 16), jnp.float8_e4m3fn, sharding=jax.sharding.SingleDeviceSharding(device))
    dot = functools.partial(jnp.dot, precision=_FP8_F32_ACCUMULATION, preferred_element_type=jnp.bfloat16)
    try:
        jax.jit(dot).lower(f8, f8).compile()
    except jax.errors.JaxRuntimeError:
        return False
    return True


def has_fp8_gemms() -> bool:
    """Whether the target runs fp8 GEMMs: CUDA compute capability 8.9 (Ada) or later. XLA checks a
    dot's named algorithm against the device, so an fp8 one on an A100 would not compile; there
    (and on CPUs) fp8 sites leave float32 results, which XLA computes in wider types."""
    device = sharding.device()
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return False
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return (major, minor) >= (8, 9)


def einsum(spec: str, a, b, out_dtype, scale=None):
    """`jnp.einsum(spec, a, b)` accumulated in float32, times `scale` (an fp8 site's two scales),
    its result in `out_dtype`.

    On GPUs with fp8 GEMMs (`has_fp8_gemms`) an fp8 GEMM's result leaves it in `out_dtype` too,
    multiplied by the scale in that dtype: the form XLA's GEMM rewriter folds into one cuBLAS
    fp8 GEMM that applies the float32 scale itself and writes 16 bits. A float32 result (the
    form before) was written whole by cuBLAS and converted by a separate pass (the first H100
    run: 11 such `f32[16384, 2048]` results in `llama_1b`'s step); a 16-bit result scaled in
    float32 kept a separate scaling pass (deviceless H100 compiles, jaxlib 0.10.2)."""
    algorithm = _algorithm(a, b) if jnp.dtype(out_dtype) != F32 else None
    if algorithm is None or sharding.platform() == "cpu":
        y = jnp.einsum(spec, a, b, preferred_element_type=F32)
        return (y if scale is None else y * scale).astype(out_dtype)
    y = jnp.einsum(spec, a, b, precision=algorithm, preferred_element_type=out_dtype)
    return y if scale is None else y * scale.astype(out_dtype)


def transposed_specs(spec: str) -> tuple[str, str, str]:
    """For `x,w->y`: the einsums giving dx from (dy, w), and dw from (x, dy) or from (dy, x)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    for index in set(x + w + out):
        if (index in x) + (index in w) + (index in out) < 2:
            raise ValueError(f"matmul spec {spec!r}: index {index!r} must appear in two or three terms")
    return f"{out},{w}->{x}", f"{x},{out}->{w}", f"{out},{x}->{w}"


def has_batch_dims(spec: str) -> bool:
    """Whether `x,w->y` has indices in all three terms (dot_general batch dimensions)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return bool(set(x) & set(w) & set(out))


def backward(spec: str, x, w, dy, *, dtypes=None, scales=(None, None)):
    """(dx, dw) of `einsum(spec, x, w)`, float32 accumulation, in x's and w's dtypes (or
    `dtypes`). At fp8 sites (`scales` given) each result is multiplied by its scale. dw leaves
    its dot in float32 either way: it is summed over the data and fsdp devices there, in float32
    (torchtitan's reduce dtype)."""
    dx_spec, dw_spec, dw_spec_swapped = transposed_specs(spec)
    dx_dtype, dw_dtype = dtypes or (x.dtype, w.dtype)
    dx = einsum(dx_spec, dy, w, dx_dtype, scales[0])
    # XLA:CPU transposes a weight-gradient matmul's first operand (and refuses to materialise
    # what produced it, recomputing it inside the transpose); so the smaller operand goes first.
    if x.size > dy.size:
        dw = jnp.einsum(dw_spec_swapped, dy, x, preferred_element_type=F32)
    else:
        dw = jnp.einsum(dw_spec, x, dy, preferred_element_type=F32)
    if scales[1] is not None:
        dw = dw * scales[1]
    return dx, dw.astype(dw_dtype)


def matmul(spec: str, out_dtype, x, w, weight: bool = True):
    """`einsum(spec, x, w)` accumulated in float32, the result in `out_dtype`. Where `w` is a
    weight, under `split_backward.split_vjp` its backward's input-gradient (B) or weight-gradient
    (W) half."""
    if _split.mode is None or not weight:
        return _matmul(spec, out_dtype, x, w)
    return _split.mode.matmul(spec, out_dtype, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(spec: str, out_dtype, x, w):
    return einsum(spec, x, w, out_dtype)


def _matmul_fwd(spec, out_dtype, x, w):
    return _matmul(spec, out_dtype, x, w), (x, w)


def _matmul_bwd(spec, out_dtype, residuals, dy):
    x, w = residuals
    dx, dw = backward(spec, x, w, dy.astype(x.dtype))
    return summed_as(dx, x), summed_as(dw, w)


def varying(a) -> set[str]:
    """The manual mesh axes `a` varies over inside a `shard_map` (none outside one)."""
    kind = getattr(jax.typeof(a), "manual_axis_type", None)
    return set(kind.varying) if kind is not None else set(getattr(jax.typeof(a), "vma", None) or ())


def summed_as(cotangent, primal):
    """A hand-written backward's `cotangent` summed over the manual axes (inside `shard_map`) it
    varies over and `primal` does not: what autodiff does itself where an invariant value (a
    weight, the same on every data shard) meets varying ones (each shard's tokens)."""
    extra = varying(cotangent) - varying(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


class _Split(threading.local):
    mode = None  # set by `lm.model.split_backward`: its `matmul` runs instead of `_matmul`


_split = _Split()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def input_gradient_matmul(spec: str, out_dtype, x, w, tap):
    """`matmul` whose backward gives x's gradient alone (B) and, as the cotangent of `tap` (zeros
    shaped like x and the result), the x and output gradient the weight's gradient needs later
    (W: `weight_gradient_matmul`); w's cotangent is zero."""
    return einsum(spec, x, w, out_dtype)


def _input_fwd(spec, out_dtype, x, w, tap):
    return einsum(spec, x, w, out_dtype), (x, w, tap[0])


def _input_bwd(spec, out_dtype, residuals, dy):
    x, w, tap_x = residuals
    dx_spec = transposed_specs(spec)[0]
    dx = einsum(dx_spec, dy.astype(x.dtype), w, x.dtype)
    # An empty tap input: the matmul before read this x and keeps it for both (`split_backward`).
    return summed_as(dx, x), jnp.zeros_like(w), (x if tap_x.shape == x.shape else tap_x, dy)


input_gradient_matmul.defvjp(_input_fwd, _input_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def weight_gradient_matmul(spec: str, out_dtype, x, w, stash):
    """`matmul` replayed for W: its result is zeros (nothing downstream of it is needed) and its
    backward ignores the incoming cotangent, giving w's gradient from `stash` (the x and output
    gradient `input_gradient_matmul` handed out), exactly as `_matmul`'s backward computes it."""
    return jnp.zeros(stash[1].shape, out_dtype)


def _weight_fwd(spec, out_dtype, x, w, stash):
    return jnp.zeros(stash[1].shape, out_dtype), (w, stash)


def _weight_bwd(spec, out_dtype, residuals, _):
    w, (x, dy) = residuals
    _, dw = backward(spec, x, w, dy.astype(x.dtype))
    return jnp.zeros(x.shape, x.dtype), summed_as(dw, w), (jnp.zeros_like(x), jnp.zeros_like(dy))


weight_gradient_matmul.defvjp(_weight_fwd, _weight_bwd)
