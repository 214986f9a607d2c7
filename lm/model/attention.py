"""The attention computation inside `layers.Attention`: the causal (sliding-window) mask from
positions, and which kernel runs it for the compile target: cuDNN flash attention, XLA's fused
attention, or the einsums written out for CPU. Shape suffixes as in `lm.model.layers`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

import sharding
from lm.errors import UserError
from lm.model.precision import Policy


def causal_mask(q_positions_bt: jax.Array, k_positions_bs: jax.Array, window: int = 0) -> jax.Array:
    """[b, t, s] True where a query may attend to a key: not later than itself and, with a sliding
    `window`, among its latest `window` positions (itself included). From positions, not array
    indices: it holds for a sequence in any order (context parallelism reorders it)."""
    q, k = q_positions_bt[:, :, None], k_positions_bs[:, None, :]
    mask = k <= q
    return mask & (k > q - window) if window else mask


def training_mask(positions_bt: jax.Array | None, segments_bt: jax.Array | None, window: int = 0) -> jax.Array | None:
    """[b, t, s] mask of a training forward whose keys are the whole sequence (gathered over
    `context`): causal by position and, for packed documents, within each document only. None
    when the tokens are in order from position 0 (the kernels' own causal mask is then enough)."""
    if positions_bt is None:
        return None
    mask_bts = causal_mask(positions_bt, sharding.constrain(positions_bt, ("batch", "kv_length"), "key positions"), window)
    if segments_bt is not None:
        mask_bts &= segments_bt[:, :, None] == sharding.constrain(segments_bt, ("batch", "kv_length"), "key segments")[:, None, :]
    return mask_bts


@functools.cache
def cudnn_available() -> bool:
    """Whether cuDNN's library can be loaded here (to run, or to compile for a GPU target)."""
    from jax._src.cudnn import fused_attention_stablehlo

    try:
        fused_attention_stablehlo.check_cudnn_version()
    except (RuntimeError, ImportError, AttributeError):
        return False
    return True


def _hopper_or_later() -> bool:
    """Whether the device in force (a compile-only one included) is an NVIDIA GPU of compute
    capability 9.0 or later."""
    capability = getattr(sharding.device(), "compute_capability", None)
    return bool(capability) and tuple(int(x) for x in str(capability).split(".")[:2]) >= (9, 0)


def _cudnn_version() -> int:
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo.check_cudnn_version()


def cudnn_missing(platform: str, dtype, head_dim: int, value_dim: int | None = None) -> str | None:
    """What cuDNN's fused attention needs that a program for `platform` with `dtype` queries of
    `head_dim` (values of `value_dim`, None: the same) lacks (the first such need, as a phrase),
    or None when it can run there. Hopper and later take head dims up to 256 and narrower values
    (multi-head latent attention, cuDNN 9.10 on)."""
    hopper = platform == "gpu" and _hopper_or_later()
    widest = 256 if hopper else 128
    needs = {
        f"a GPU target (this program is for {platform})": platform == "gpu",
        "cuDNN installed": platform != "gpu" or cudnn_available(),
        f"bfloat16 or float16 inputs (precision.compute_dtype gives {jnp.dtype(dtype)})": dtype in (jnp.bfloat16, jnp.float16),
        f"a head dim that is a multiple of 8 up to {widest} on this GPU (the model's is {head_dim})": head_dim % 8 == 0 and head_dim <= widest,
        f"a Hopper GPU and cuDNN 9.10 for values ({value_dim}) narrower than queries and keys ({head_dim})":
            value_dim in (None, head_dim) or (hopper and cudnn_available() and _cudnn_version() >= 91000),
    }
    return next((need for need, met in needs.items() if not met), None)


def check_cudnn(platform: str, dtype, head_dim: int, value_dim: int | None = None) -> None:
    """The UserError for `model.attention=cudnn` where cuDNN cannot run."""
    missing = cudnn_missing(platform, dtype, head_dim, value_dim)
    if missing:
        raise UserError(f"model.attention=cudnn needs {missing}; use model.attention=auto (cuDNN where it can run) or xla")


def attention_kernel(requested: str, q_bthk: jax.Array, decoding: bool = False, value_dim: int | None = None) -> str:
    """Which attention runs: `einsum` (written out, the CPU default), `xla` (XLA's own fused
    attention) or `cudnn` (cuDNN flash attention). `auto` takes cuDNN when compiling for a GPU
    and it can take the call (`cudnn_missing`: cuDNN loadable here, bf16 / float16 inputs, a
    head dim that is a multiple of 8 up to 128) and not decoding (the cache's mask goes to XLA);
    a training mask (packed documents, a reordered sequence) reaches cuDNN as a bias. Otherwise
    XLA on accelerators and einsum on CPU. `cudnn` asked for where it cannot run is a
    `UserError` (`check_cudnn`, also run by `lm.program.steps.setup` before anything is written);
    decoding takes `auto`'s choice."""
    backend = sharding.platform()  # the compile target's, not necessarily this machine's
    if requested == "cudnn" and not decoding:
        check_cudnn(backend, q_bthk.dtype, q_bthk.shape[-1], value_dim)
        return requested
    if requested not in ("auto", "cudnn"):
        return requested
    if backend == "cpu":
        return "einsum"
    return "xla" if decoding or cudnn_missing(backend, q_bthk.dtype, q_bthk.shape[-1], value_dim) else "cudnn"


@jax.custom_jvp
def softmax(logits: jax.Array) -> jax.Array:
    """`jax.nn.softmax` over the last axis, differentiated as y * (dx - sum(y * dx)): with no
    division in the backward, XLA compiles it alike in every program (its simplifier turns a
    division by a broadcast sum into a multiplication in some and not in others, an ulp apart),
    which makes pipelined gradients bitwise the one-device run's. (JAX's own softmax does this
    under `jax_softmax_custom_jvp`, off by default.)"""
    unnormalized = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    return unnormalized / unnormalized.sum(-1, keepdims=True)


@softmax.defjvp
def _softmax_jvp(primals, tangents):
    (logits,), (dlogits,) = primals, tangents
    y = softmax(logits)
    return y, y * (dlogits - (y * dlogits).sum(-1, keepdims=True))


# jax >= 0.11's batching rule for cuDNN attention reshapes a mask broadcast over the heads to one
# per head and fails ("cannot reshape array of shape (1, 2, 1, 64, 128) ... into shape (2, 4, 64,
# 128)"): context parallelism's masked attention under the pipelines' vmap over stages. Under
# every jax (0.10.2 to 0.12) it also reshapes the values to the keys' width, failing for narrower
# ones (latent attention's 128 beside 192: "cannot reshape array of shape (2, 4, 4096, 128, 128)
# ... into shape (8, 4096, 128, 192)").
CUDNN_BATCHING_RESHAPES_THE_MASK = jax.__version_info__ >= (0, 11)
_MAPPED = contextvars.ContextVar("attention_mapped", default=False)


@contextlib.contextmanager
def mapped():
    """Attention traced inside runs under a vmap (a pipeline stage's layers, mapped over the
    stages): there jax's own batching rule for cuDNN's masked attention is bypassed where it
    fails (`batched_as_one`)."""
    token = _MAPPED.set(True)
    try:
        yield
    finally:
        _MAPPED.reset(token)


def _merged_into_batch(fn):
    """`fn`, whose arguments and results are batch-first, under `vmap` run once with the mapped
    axis merged into the batch axis, never through the batching rules of what it calls."""
    merged = jax.custom_batching.custom_vmap(fn)

    @merged.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if batched or a is None else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(args, in_batched, strict=True)]
        out = merged(*[None if a is None else a.reshape(-1, *a.shape[2:]) for a in args])
        return jax.tree.map(lambda o: o.reshape(axis_size, -1, *o.shape[1:]), out), jax.tree.map(lambda _: True, out)

    return merged


def batched_as_one(kernel):
    """`kernel(q, k, v, mask)` (mask None or not) differentiable, with its forward and backward each run under `vmap`
    as one call over the mapped axis merged into the batch (`_merged_into_batch`). The backward
    runs the forward again for its pullback: one more attention forward, only where jax's own
    batching rule fails (`CUDNN_BATCHING_RESHAPES_THE_MASK`, inside `mapped`)."""
    forward = _merged_into_batch(kernel)
    backward = _merged_into_batch(lambda q, k, v, mask, dy: jax.vjp(lambda q, k, v: kernel(q, k, v, mask), q, k, v)[1](dy))

    @jax.custom_vjp
    def attend(q, k, v, mask):
        return forward(q, k, v, mask)

    def attend_fwd(q, k, v, mask):
        return forward(q, k, v, mask), (q, k, v, mask)

    def attend_bwd(residuals, dy):
        return (*backward(*residuals, dy), None)

    attend.defvjp(attend_fwd, attend_bwd)
    return lambda q, k, v, mask=None: attend(q, k, v, mask)


def cudnn_narrow_values(q_bthk, k_bsgk, v_bsgk, mask, scale, local) -> jax.Array:
    """cuDNN flash attention with values narrower than queries and keys (multi-head latent
    attention: 192 and 128). jax.nn.dot_product_attention checks the widths equal, though the
    cuDNN call beneath it takes them unequal on Hopper (cuDNN 9.10 on), so that call is made
    here directly (`jax._src.cudnn`: checked by `cudnn_missing`)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    return cudnn_attention(q_bthk, k_bsgk, v_bsgk, mask=mask, scale=q_bthk.shape[-1] ** -0.5 if scale is None else scale,
                           mask_type=MaskType.CAUSAL if mask is None else MaskType.NO_MASK,
                           sliding_window_length=None if local is None else local[0] + 1)


def attention(q_bthk, k_bsgk, v_bsgk, mask_bts, policy: Policy, kernel: str = "auto", window: int = 0, decoding: bool = False,
              scale: float | None = None) -> jax.Array:
    """Softmax attention with grouped-query heads; `mask_bts` None means causal (within a sliding
    `window` of keys when it is > 0); `decoding`: the queries continue a KV cache. Logits are
    scaled by `scale` (None: 1 / sqrt(head dim)); values may be narrower than queries and keys.

    On GPU this is `jax.nn.dot_product_attention` (cuDNN flash attention where it applies, see
    `attention_kernel`). On CPU the same maths is written out: XLA:CPU fuses the library
    version's softmax backward into a slow reduction, and the einsums here run on the policy's
    matmul (bf16 units).
    """
    kernel = attention_kernel(kernel, q_bthk, decoding, v_bsgk.shape[-1])
    narrow_values = v_bsgk.shape[-1] != q_bthk.shape[-1]
    if kernel == "xla" and narrow_values:  # jax.nn's attention takes values as wide as keys only
        kernel = "einsum"
    if kernel != "einsum":
        local = (window - 1, 0) if window and mask_bts is None else None

        def fused(q_bthk, k_bsgk, v_bsgk, mask_bts=None):
            mask = None if mask_bts is None else mask_bts[:, None]
            if narrow_values:
                return cudnn_narrow_values(q_bthk, k_bsgk, v_bsgk, mask, scale, local)
            return jax.nn.dot_product_attention(
                q_bthk, k_bsgk, v_bsgk, mask=mask, scale=scale, is_causal=mask is None, local_window_size=local, implementation=kernel
            )

        if _MAPPED.get() and (narrow_values or (CUDNN_BATCHING_RESHAPES_THE_MASK and mask_bts is not None)):
            fused = batched_as_one(fused)  # where jax's batching rule fails (above)
        args = (q_bthk, k_bsgk, v_bsgk, mask_bts)
        if (mask_bts is None or sharding.split_ways("length") == 1) and not sharding.manual_axes():
            return fused(*args)
        # Context parallelism: queries split along the sequence, keys and values whole. cuDNN's
        # partitioner takes the three split alike only, and inside a partly manual shard_map (the
        # per-stage pipeline) cannot partition at all: each device runs its own part.
        queries, keys = ("batch", "length", "heads", "head_dim"), ("batch", "kv_length", "kv_heads", "head_dim")
        masks = () if mask_bts is None else (("batch", "length", "kv_length"),)
        return sharding.per_shard(fused, (queries, keys, keys, *masks), queries)(*args[: 3 + len(masks)])
    b, t, h, k = q_bthk.shape
    g = k_bsgk.shape[2]
    q = (q_bthk * jnp.asarray(k**-0.5 if scale is None else scale, q_bthk.dtype)).reshape(b, t, g, h // g, k)
    logits = policy.matmul("btgrk,bsgk->bgrts", q, k_bsgk, out_dtype=jnp.float32, weight=False)
    if mask_bts is None:
        mask_bts = causal_mask(jnp.arange(t)[None], jnp.arange(k_bsgk.shape[1])[None], window)
    logits = jnp.where(mask_bts[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = softmax(logits)
    out = policy.matmul("bgrts,bsgk->btgrk", probs, v_bsgk, weight=False)
    return out.reshape(b, t, h, v_bsgk.shape[-1])
