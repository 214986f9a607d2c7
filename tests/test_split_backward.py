"""The backward split in B (input gradient) and W (matmul weights' gradients) for zero-bubble
pipelines: on one block and through a scanned stack of layers, B's and W's gradients are the
unsplit backward's bit for bit; B computes no weight gradient of a matmul and W nothing else;
W reads B's stash."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lm.model.block import Block
from lm.model.config import ModelConfig
from lm.model.precision import Policy
from lm.model.split_backward import split_vjp, tap_shapes
from lm.model.transformer import Transformer
from sharding.dependence import depends_on_arguments
from sharding.pipeline_slots import halves_make

GPT2 = dict(norm="layernorm", position="learned", mlp="gelu", use_bias=True)


def block(compute_dtype, **kw):
    cfg = ModelConfig(vocab_size=256, max_len=32, num_layers=1, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=128, **kw)
    graphdef, params = nnx.split(Block(cfg, Policy(compute_dtype=jnp.dtype(compute_dtype)), nnx.Rngs(0)))
    return (lambda p, x: nnx.merge(graphdef, p)(x)[0]), params


@pytest.mark.parametrize("style", [{}, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_b_and_w_add_up_to_the_unsplit_backward_bit_for_bit(compute_dtype, style):
    fn, params = block(compute_dtype, **style)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (2, 16, 64), jnp.float32)

    @jax.jit
    def unsplit(params, x, dy):
        y, pullback = jax.vjp(fn, params, x)
        return (y, *pullback(dy))

    @jax.jit
    def input_part(params, x, dy):
        y, input_backward, _ = split_vjp(fn, params, x)
        dparams, dx, stash = input_backward(dy)
        return y, dx, dparams, stash

    @jax.jit
    def weight_part(params, x, stash):
        return split_vjp(fn, params, x)[2](stash)

    y, dparams, dx = unsplit(params, x, dy)
    y_split, dx_split, dparams_b, stash = input_part(params, x, dy)
    dparams_w = weight_part(params, x, stash)
    np.testing.assert_array_equal(y_split, y)
    np.testing.assert_array_equal(dx_split, dx)  # B: the input gradient, bit for bit

    # Each matmul's weight gradient comes from W alone (B's is zero), everything else from B alone.
    matmuls = len(tap_shapes(fn, params, x).seen)
    assert matmuls == (6 if style else 7)  # q, k, v, o, (gate,) up, down
    flat, flat_b, flat_w = (jax.tree_util.tree_leaves_with_path(t) for t in (dparams, dparams_b, dparams_w))
    from_w = 0
    for (path, full), (_, b), (_, w) in zip(flat, flat_b, flat_w, strict=True):
        name = jax.tree_util.keystr(path)
        if np.any(w != 0):
            from_w += 1
            assert not np.any(b != 0), name
        np.testing.assert_array_equal(np.asarray(b) + np.asarray(w), full, err_msg=name)
    assert from_w == matmuls


def test_w_needs_only_the_stash():
    """The negative control: W from another batch's stash gives other gradients (so W reads the
    stash, not the replayed input, which is zeros)."""
    fn, params = block("float32")
    x, other = (jax.random.normal(jax.random.key(k), (2, 16, 64), jnp.float32) for k in (1, 3))
    dy = jnp.ones((2, 16, 64), jnp.float32)
    _, input_backward, weight_backward = split_vjp(fn, params, x)
    _, _, stash = input_backward(dy)
    _, _, other_stash = split_vjp(fn, params, other)[1](dy)
    ours, theirs = (jax.tree.leaves(weight_backward(s)) for s in (stash, other_stash))
    assert any(np.any(a != b) for a, b in zip(ours, theirs))
    _, pullback = jax.vjp(fn, params, x)
    full = jax.tree.leaves(pullback(dy)[0])
    b_grads = jax.tree.leaves(input_backward(dy)[0])
    for f, b, w in zip(full, b_grads, ours):
        np.testing.assert_array_equal(np.asarray(b) + np.asarray(w), f)


def test_matmuls_reading_one_input_keep_it_once_in_the_stash():
    """q, k and v read the attention's normalised input, gate and up the MLP's: the stash keeps
    each once (k's, v's and gate's inputs are empty; W hands them the first's, and the gradients
    above stay bit for bit): 3 of the 7 inputs fewer. The control: o and down, whose
    inputs are their own, keep theirs."""
    fn, params = block("bfloat16")
    x, dy = jnp.ones((2, 16, 64)), jnp.ones((2, 16, 64))
    stash = split_vjp(fn, params, x)[1](dy)[2]
    assert [a.shape for a, _ in stash] == [(2, 16, 64), (0,), (0,), (2, 16, 4, 16), (2, 16, 64), (0,), (2, 16, 128)]
    inputs = sum(a.nbytes for a, _ in stash)
    assert inputs == 2 * 16 * (64 + 64 + 64 + 128) * 2  # q's, o's, up's and down's: bf16


@pytest.mark.parametrize("scan_layers, remat", [(True, "full"), (True, "dots"), (True, "none"), (False, "none")])
def test_a_stack_of_layers_splits_through_its_scan(scan_layers, remat):
    """Three layers (scanned: each layer's taps are its slice of the stack's) and the head: B + W
    is the unsplit backward bit for bit, under remat policies and unrolled."""
    cfg = ModelConfig(vocab_size=256, max_len=32, num_layers=3, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=128, scan_layers=scan_layers, remat=remat)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), policy=Policy(compute_dtype=jnp.dtype("bfloat16"))))

    def fn(p, x):
        model = nnx.merge(graphdef, p)
        return model._head(model.final_norm(model._layers(x, None, None, 0)[0]), model._head_weight())

    x = jax.random.normal(jax.random.key(1), (2, 16, 64), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (2, 16, 256), jnp.float32)
    seen = tap_shapes(fn, params, x).seen
    assert [(n, len(body.seen)) for n, body in seen[:-1]] == [(3, 7)] and seen[-1][1].shape == (2, 16, 256)  # the stack, the head

    @jax.jit
    def both(params, x, dy):
        _, pullback = jax.vjp(fn, params, x)
        _, input_backward, weight_backward = split_vjp(fn, params, x)
        dparams_b, dx, stash = input_backward(dy)
        return pullback(dy), (dparams_b, dx), weight_backward(stash)

    (dparams, dx), (dparams_b, dx_split), dparams_w = both(params, x, dy)
    np.testing.assert_array_equal(dx_split, dx)
    for full, b, w in zip(*(jax.tree.leaves(t) for t in (dparams, dparams_b, dparams_w)), strict=True):
        np.testing.assert_array_equal(np.asarray(b) + np.asarray(w), full)


def test_b_skips_the_weight_gradients_and_w_computes_nothing_else():
    """Dots in the compiled programs of one block (7 weight matmuls, 2 of attention): W is the 7
    weight-gradient dots alone (its replayed forward is dead code), B is the forward and the rest
    of the backward, so B + W is the unsplit backward's count (control: the unsplit one has 7 more
    than B)."""
    fn, params = block("float32")
    x, dy = jnp.ones((2, 16, 64)), jnp.ones((2, 16, 64))

    def dots(f, *args):
        return len(re.findall(r"= \S+ dot\(", jax.jit(f).lower(*args).compile().as_text()))

    _, input_backward, _ = split_vjp(fn, params, x)
    stash = input_backward(dy)[2]
    forward = dots(fn, params, x)
    unsplit = dots(lambda p, x, dy: jax.vjp(fn, p, x)[1](dy), params, x, dy)
    b = dots(lambda p, x, dy: split_vjp(fn, p, x)[1](dy), params, x, dy)
    w = dots(lambda p, x, stash: split_vjp(fn, p, x)[2](stash), params, x, stash)
    assert forward == 9 and w == 7
    assert b + w == unsplit and unsplit - b == 7


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_the_gradients_each_half_makes_are_found_from_the_jaxpr(scan_layers):
    """`halves_make` (what the zero-bubble programs add into their sums from B and from W) names
    as B's exactly the leaves whose B gradient is non-zero and as W's those whose W gradient is,
    through a scanned stack too (whose B stacks its zeros for the weights); each layer's leaf is
    one half's. Control: `depends_on_arguments` calls a result that reads its argument dependent
    even where the value is zero (x * 0), and a closed-over one not."""
    cfg = ModelConfig(vocab_size=256, max_len=32, num_layers=3, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=128, scan_layers=scan_layers, remat="dots")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), policy=Policy(compute_dtype=jnp.dtype("bfloat16"))))

    def fn(p, x):  # as a pipeline's stage takes them: (the layers, their probes: none here)
        return nnx.merge(graphdef, p[0])._layers(x, None, None, 0)[0]

    x = jax.random.normal(jax.random.key(1), (2, 16, 64), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (2, 16, 64), jnp.float32)
    _, input_backward, weight_backward = split_vjp(fn, (params, None), x)
    (dparams_b, _), _, stash = input_backward(dy)
    taps_ring = jax.tree.map(lambda a: a[None], stash)  # a ring one entry deep
    b_makes, w_makes = halves_make(lambda x: split_vjp(fn, (params, None), x), x, taps_ring)
    nonzero = lambda tree: jax.tree.map(lambda a: bool(np.any(np.asarray(a) != 0)), tree)  # noqa: E731
    assert b_makes == nonzero(dparams_b) and w_makes == nonzero(weight_backward(stash)[0])
    # Each layer's parameter is one half's (the embedding and the head, which `_layers` leaves alone, neither's).
    assert jax.tree.leaves(jax.tree.map(lambda b, w: b + w, b_makes["blocks"], w_makes["blocks"])) == [1] * 9
    assert sum(jax.tree.leaves(w_makes)) == 7 and sum(jax.tree.leaves(b_makes)) == 2  # q, k, v, o, gate, up, down; the norms

    y = jnp.ones(3)
    made = depends_on_arguments(lambda a: {"zeroed": a * 0, "closed": y * 2, "zeros": jnp.zeros(3)}, jnp.ones(3))
    assert made == {"zeroed": True, "closed": False, "zeros": False}
