"""A function's backward in two parts, for zero-bubble pipelines (`sharding.zero_bubble`): B, the
input gradient (on the critical path: its cotangent goes one stage back at once), and W, the
weights' gradients of its matmuls, which can wait.

Every weight goes through `lm.model.matmul.matmul`; under `split_vjp` each call of it is handed
a tap (zeros shaped like its input and result) whose cotangent, in B, carries out the input and
output gradient that its weight's gradient needs (`input_gradient_matmul`), while B skips that
gradient. W replays the function with each matmul handed its pair back
(`weight_gradient_matmul`): its backward computes the weight's gradient exactly as the unsplit
backward does, and everything else of the replay is dead code. So B's and W's gradients add up
to the unsplit ones bit for bit, and B + W costs the unsplit backward.

A matmul reading the very input the one before it read (q / k / v, gate / up) keeps no copy of
it: its tap's input is empty, and W hands it the input kept with the first of them.

Taps are handed out in call order. A stack of layers run by a scan (whose body is traced once)
takes its layers' taps stacked, as part of the scan's input (`stack_taps`), and hands each
layer its own inside the body (`layer_taps`): `StackRunner.run_stack` (lm.model.layer_stack) does.

Not yet: fp8 sites and the experts' grouped matmuls take the unsplit path (their weight
gradients come in B); the pipeline programs do not run B and W apart yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from lm.model.matmul import _matmul, _split, input_gradient_matmul, weight_gradient_matmul


class _Recording:
    """Notes the input and result shapes of each weight matmul, and of each stack's layer (the
    body's first trace), in call order; an input the matmul before read too as empty."""

    def __init__(self):
        self.seen, self.stacks, self.traced, self.last_x = [], [], False, None

    def matmul(self, spec, out_dtype, x, w):
        y = _matmul(spec, out_dtype, x, w)
        if not self.traced:
            shared = x is self.last_x
            self.seen.append((jax.ShapeDtypeStruct((0,) if shared else x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype)))
        self.last_x = x
        return y

    def stack(self, layers: int):
        self.stacks.append(_Recording())
        self.seen.append((layers, self.stacks[-1]))
        return None

    def layer(self, _):
        body = self.stacks[-1]
        if body.seen:  # traced before (a remat's second trace): noted already
            body.traced = True
        return body

    def zeros(self) -> list:
        """Taps for what was seen: zeros shaped like each matmul's input and result, a stack's
        stacked over its layers."""
        taps = []
        for first, second in self.seen:
            if isinstance(first, int):
                taps.append(jax.tree.map(lambda a: jnp.zeros((first, *a.shape), a.dtype), second.zeros()))
            else:
                taps.append((jnp.zeros(first.shape, first.dtype), jnp.zeros(second.shape, second.dtype)))
        return taps


class _Handing:
    """Hands each weight matmul its tap (B) or its stash (W) in call order; a stack its layers'
    stacked, and each layer inside the scan its own. In W (`stashed`) a stash whose input is
    empty (shared with the matmul before) is handed that matmul's input."""

    def __init__(self, matmul: Callable, items, stashed: bool = False):
        self.split_matmul, self.items, self.stashed, self.last_x = matmul, iter(items), stashed, None

    def matmul(self, spec, out_dtype, x, w):
        item = next(self.items)
        if self.stashed and item[0].shape == (0,) and x.shape != (0,):
            item = (self.last_x, *item[1:])
        self.last_x = item[0]
        return self.split_matmul(spec, out_dtype, x, w, item)

    def stack(self, layers: int):
        return next(self.items)

    def layer(self, items):
        return _Handing(self.split_matmul, items, self.stashed)


@contextlib.contextmanager
def _matmuls_as(mode) -> Iterator[None]:
    previous, _split.mode = _split.mode, mode
    try:
        yield
    finally:
        _split.mode = previous


def stack_taps(layers: int):
    """For a stack of `layers` layers that a scan runs: what to pass in the scan's input beside
    the layers' parameters (None outside `split_vjp`)."""
    return None if _split.mode is None else _split.mode.stack(layers)


@contextlib.contextmanager
def layer_taps(taps) -> Iterator[None]:
    """Inside a stack's scan body: its layer's share of `stack_taps` handed to the matmuls."""
    if _split.mode is None:
        yield
        return
    with _matmuls_as(_split.mode.layer(taps)):
        yield


def tap_shapes(fn: Callable, *args) -> _Recording:
    """What `fn(*args)`'s weight matmuls take and give, in call order (`_Recording`)."""
    recording = _Recording()
    with _matmuls_as(recording):
        jax.eval_shape(lambda *args: fn(*args), *args)  # a new function: a cached trace of fn would call no matmul
    return recording


def split_vjp(fn: Callable, params, x):
    """`fn(params, x)`'s result and its backward in two: `input_backward(dy)` gives (the
    gradients of params that are not matmul weights, dx, the stash W needs) and
    `weight_backward(stash)` the matmul weights' gradients (zeros elsewhere). `input_backward`
    is `jax.vjp`'s own pullback (a pytree of its residuals, which a pipeline can stash)."""
    taps = tap_shapes(fn, params, x).zeros()

    def tapped(params, x, taps):
        with _matmuls_as(_Handing(input_gradient_matmul, taps)):
            return fn(params, x)

    y, input_backward = jax.vjp(tapped, params, x, taps)

    def weight_backward(stash):
        def replay(params):
            with _matmuls_as(_Handing(weight_gradient_matmul, stash, stashed=True)):
                return fn(params, jnp.zeros(x.shape, x.dtype))  # the input is not needed: only the matmuls' pairs

        out, replay_pullback = jax.vjp(replay, params)
        return replay_pullback(jax.tree.map(jnp.zeros_like, out))[0]

    return y, input_backward, weight_backward
