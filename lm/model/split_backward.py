"""A function's backward in two parts, for zero-bubble pipelines (`sharding.schedules`): B, the
input gradient (on the critical path: its cotangent goes one stage back at once), and W, the
weights' gradients of its matmuls, which can wait.

Every weight goes through `lm.model.matmul.matmul`; under `split_vjp` each call of it is given a
tap (zeros shaped like its input and result) whose cotangent, in B, carries out the input and
output gradient that its weight's gradient needs (`input_gradient_matmul`), while B skips that
gradient. W replays the function with each matmul taking its pair back
(`weight_gradient_matmul`): its backward computes the weight's gradient exactly as the unsplit
backward does, and everything else of the replay is dead code. So B's and W's gradients add up
to the unsplit ones bit for bit, and B + W costs the unsplit backward.

Not yet: fp8 sites and the experts' grouped matmuls take the unsplit path (their weight
gradients come in B); a layer stack must be called layer by layer (taps are handed out in call
order, and a scan's body is traced once); the pipeline programs do not run B and W apart yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from lm.model.matmul import _matmul, _split, input_gradient_matmul, weight_gradient_matmul


@contextlib.contextmanager
def _matmuls_as(mode: Callable) -> Iterator[None]:
    previous, _split.mode = _split.mode, mode
    try:
        yield
    finally:
        _split.mode = previous


def tap_shapes(fn: Callable, *args) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
    """(input, result) shape and dtype of each matmul `fn(*args)` calls, in call order."""
    seen = []

    def record(spec, out_dtype, x, w):
        y = _matmul(spec, out_dtype, x, w)
        seen.append((jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype)))
        return y

    with _matmuls_as(record):
        jax.eval_shape(lambda *args: fn(*args), *args)  # a new function: a cached trace of fn would call no matmul
    return seen


def split_vjp(fn: Callable, params, x):
    """`fn(params, x)`'s result and its backward in two: `input_backward(dy)` gives (dx, the
    gradients of params that are not matmul weights, the stash W needs) and
    `weight_backward(stash)` the matmul weights' gradients (zeros elsewhere)."""
    taps = [(jnp.zeros(a.shape, a.dtype), jnp.zeros(b.shape, b.dtype)) for a, b in tap_shapes(fn, params, x)]

    def tapped(params, x, taps):
        handed = iter(taps)
        with _matmuls_as(lambda spec, out_dtype, x, w: input_gradient_matmul(spec, out_dtype, x, w, next(handed))):
            return fn(params, x)

    y, pullback = jax.vjp(tapped, params, x, taps)

    def input_backward(dy):
        dparams, dx, stash = pullback(dy)
        return dx, dparams, stash

    def weight_backward(stash):
        def replay(params):
            handed = iter(stash)
            with _matmuls_as(lambda spec, out_dtype, x, w: weight_gradient_matmul(spec, out_dtype, x, w, next(handed))):
                return fn(params, jnp.zeros(x.shape, x.dtype))  # the input is not needed: only the matmuls' pairs

        out, replay_pullback = jax.vjp(replay, params)
        return replay_pullback(jax.tree.map(jnp.zeros_like, out))[0]

    return y, input_backward, weight_backward
