import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lm.model.config import ModelConfig
from lm.model.transformer import Transformer

LLAMA = dict(num_kv_heads=2)
GPT2 = dict(norm="layernorm", position="learned", mlp="gelu", use_bias=True, tie_embeddings=True)


def build(**kw):
    cfg = ModelConfig(**{"vocab_size": 256, "max_len": 32, "num_layers": 2, **kw})
    return Transformer(cfg, rngs=nnx.Rngs(0))


def tokens(b=2, t=16, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, 256)


@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_output_shape_and_dtype(style):
    logits, cache = build(**style)(tokens())
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32 and cache is None


@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_causal(style):
    model = build(**style)
    x = tokens()
    changed = x.at[:, 10].set((x[:, 10] + 1) % 256)
    a, _ = model(x)
    b, _ = model(changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-4


@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_kv_cache_decoding_equals_full_forward(style):
    model = build(**style)
    x = tokens(t=20)
    full, _ = model(x)
    cache = model.init_cache(2, 32)
    prefix, cache = model(x[:, :7], cache=cache, cache_index=0)
    steps = [prefix]
    for i in range(7, 20):
        logits, cache = model(x[:, i : i + 1], cache=cache, cache_index=i)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5, rtol=1e-5)


def test_unrolled_and_rematerialised_layers_equal_scan():
    x = tokens()
    ref, _ = build(**LLAMA)(x)
    for kw in (dict(scan_layers=False), dict(remat="full"), dict(remat="dots", scan_layers=False), dict(remat="qkv_proj"),
               dict(remat="dots_and_inputs")):
        out, _ = build(**LLAMA, **kw)(x)
        np.testing.assert_allclose(out, ref, atol=1e-5)


def test_remat_policies_keep_what_they_say():
    # A training step's temporaries: none keeps every intermediate, dots the matmul outputs
    # (named, since every matmul is a custom VJP that JAX's dot policies cannot see), full only
    # the layer inputs, qkv_proj the layer inputs and the query / key / value projections.
    def temp_bytes(remat):
        graphdef, params = nnx.split(build(**LLAMA, remat=remat, num_layers=4))
        loss = lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x)[0])  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params, tokens(b=8, t=32)).compile().memory_analysis().temp_size_in_bytes

    none, inputs, dots, qkv, full = (temp_bytes(r) for r in ("none", "dots_and_inputs", "dots", "qkv_proj", "full"))
    assert none > inputs > dots > qkv > full  # dots_and_inputs: the norms' outputs, rotated q / k, not the MLP's product


def test_remat_dots_and_inputs_gives_the_gradients_dots_gives():
    """Keeping the matmuls' computed inputs instead of recomputing them changes no gradient
    (float32, one step of a 4-layer model, scanned and unrolled)."""
    def grads(remat, scan):
        graphdef, params = nnx.split(build(**LLAMA, remat=remat, num_layers=4, scan_layers=scan))
        loss = lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x)[0] ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss))(params, tokens(b=4, t=32))

    for scan in (True, False):
        for a, b in zip(jax.tree.leaves(grads("dots_and_inputs", scan)), jax.tree.leaves(grads("dots", scan)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_parameters_carry_logical_axes():
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(build(**LLAMA))))
    assert tuple(specs["blocks"]["attn"]["wq"]) == ("layers", "embed", "heads", "head_dim")
    assert tuple(specs["blocks"]["attn"]["wk"]) == ("layers", "embed", "kv_heads", "head_dim")
    assert tuple(specs["blocks"]["mlp"]["w_out"]) == ("layers", "mlp", "embed")
    assert tuple(specs["embedding"]) == ("vocab", "embed")
    assert tuple(specs["head"]) == ("embed", "vocab")
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(build(**LLAMA))))
    assert shapes["blocks"]["attn"]["wk"] == (2, 128, 2, 32)  # stacked layers, grouped-query heads


def test_gpt2_style_has_biases_and_tied_head():
    state = nnx.to_pure_dict(nnx.state(build(**GPT2)))
    assert "head" not in state and "pos_embedding" in state
    assert "bias" in state["blocks"]["attn_norm"] and "b_in" in state["blocks"]["mlp"]


@pytest.mark.parametrize("attention", ["einsum", "xla"])
@pytest.mark.parametrize("style", [LLAMA, GPT2, dict(num_kv_heads=2, sliding_window=6)], ids=["llama", "gpt2", "window"])
def test_packed_documents_equal_each_document_run_alone(style, attention):
    """Document masking: a packed window's logits are each document's own (float32, 1e-5), and
    changing one document's token leaves the other documents' logits as they were."""
    model = build(**style, attention=attention)
    lengths = [5, 11, 16]
    x = tokens(1, sum(lengths), seed=3)
    segments = jnp.asarray(np.repeat(np.arange(3), lengths))[None]
    packed, _ = model(x, segments_bt=segments)
    start = 0
    for n in lengths:
        alone, _ = model(x[:, start : start + n])
        np.testing.assert_allclose(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
        start += n
    changed = x.at[:, 7].set((x[:, 7] + 1) % 256)  # inside document 1
    again, _ = model(changed, segments_bt=segments)
    np.testing.assert_array_equal(again[:, :5], packed[:, :5])
    np.testing.assert_array_equal(again[:, 16:], packed[:, 16:])
    assert np.abs(again[:, 7:16] - packed[:, 7:16]).max() > 1e-4


def test_the_embedding_lookup_gathers_the_cast_table_and_sums_its_gradient_in_float32():
    """The table is cast to the compute dtype before the lookup (its gather moves 16-bit bytes);
    its gradient stays float32: two rows' cotangents 1 and 2^-10 on one id sum to 1 + 2^-10,
    which bfloat16 (8 significant bits) would round to 1."""
    from lm.model.layers import lookup

    table = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 7
    ids = jnp.array([[1, 1, 3]])
    rows, pullback = jax.vjp(lambda t: lookup(t, ids, jnp.bfloat16), table)
    assert rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(table.astype(jnp.bfloat16)[ids], np.float32))
    dy = jnp.array([[[1.0] * 3, [2.0**-10] * 3, [0.5] * 3]], jnp.bfloat16)
    (grad,) = pullback(dy)
    assert grad.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(grad), [[0.0] * 3, [1 + 2.0**-10] * 3, [0.0] * 3, [0.5] * 3])


@pytest.mark.parametrize("mask_axis", [0, None], ids=["mask-mapped", "mask-shared"])
def test_attention_batched_as_one_is_jaxs_batching_forward_and_backward(mask_axis):
    """Context parallelism's masked attention under the pipelines' vmap over stages, with the
    mapped axis merged into the batch (`attention.batched_as_one`, where jax's cuDNN batching
    rule fails): the same outputs and gradients as jax's own batching, through XLA's attention
    (the same maths as cuDNN's). Negative control: masks paired with the wrong rows are seen."""
    from lm.model import attention

    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (2, 3, 8, 4, 16))  # [stages, batch, length, heads, head_dim]
    k, v = (jax.random.normal(key, (2, 3, 16, 2, 16)) for key in keys[1:3])
    mask = (jax.random.uniform(keys[3], (2, 3, 8, 16)) < 0.6) | jnp.eye(8, 16, dtype=bool)
    mask = mask if mask_axis == 0 else mask[0]
    weights = jax.random.normal(keys[4], q.shape)

    def kernel(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")

    def loss(fn, q, k, v):
        return (jax.vmap(fn, in_axes=(0, 0, 0, mask_axis))(q, k, v, mask) * weights).sum()

    ref, ref_grads = jax.value_and_grad(functools.partial(loss, kernel), argnums=(0, 1, 2))(q, k, v)
    out, grads = jax.value_and_grad(functools.partial(loss, attention.batched_as_one(kernel)), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-5)
    swapped = loss(attention.batched_as_one(lambda q, k, v, mask: kernel(q, k, v, mask[::-1])), q, k, v)
    assert not np.isclose(swapped, ref, rtol=1e-3)


def test_the_cross_entropys_backward_equals_autodiffs_of_optax():
    """`lm.model.cross_entropy`'s hand-written backward, (softmax - one-hot) x g, against
    autodiff of optax's form: the per-token losses and the logits' gradient (weighted by an
    arbitrary cotangent) to 1e-6 in float32, padding ids at float32's lowest as the head writes
    them. Negative control: the same gradient against other targets is far off."""
    import optax

    from lm.model.cross_entropy import cross_entropy, token_cross_entropy

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    logits = 4 * jax.random.normal(k1, (2, 8, 48), jnp.float32)
    logits = logits.at[..., 40:].set(jnp.finfo(jnp.float32).min)  # padding ids past the used vocabulary
    targets = jax.random.randint(k2, (2, 8), 0, 40)
    weights = jax.random.uniform(k3, (2, 8))

    def reference(l, t):
        return optax.softmax_cross_entropy_with_integer_labels(l, t)

    np.testing.assert_allclose(token_cross_entropy(logits, targets), reference(logits, targets), rtol=1e-6, atol=1e-6)
    ours = jax.grad(lambda l: jnp.sum(token_cross_entropy(l, targets) * weights))(logits)
    theirs = jax.grad(lambda l: jnp.sum(reference(l, targets) * weights))(logits)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    assert float(cross_entropy(logits, targets)) == pytest.approx(float(jnp.mean(reference(logits, targets))), rel=1e-6)
    others = jax.grad(lambda l: jnp.sum(token_cross_entropy(l, (targets + 1) % 40) * weights))(logits)
    assert float(jnp.max(jnp.abs(others - theirs))) > 0.1


def test_swiglus_hand_written_backward_equals_autodiffs():
    """`lm.model.swiglu.swiglu`: silu(g) x u as `jax.nn.silu(g) * u` bit for bit, its gradients
    as autodiff's to 1e-6 in float32, over values where silu bends (|g| up to 8); in bfloat16 the
    results come back in bfloat16. Negative control: gate and up swapped, far off."""
    from lm.model.swiglu import swiglu

    kg, ku, kd = jax.random.split(jax.random.key(2), 3)
    g, u, dh = (4 * jax.random.normal(k, (4, 8, 96), jnp.float32) for k in (kg, ku, kd))
    autodiff = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    np.testing.assert_array_equal(swiglu(g, u), autodiff(g, u))
    ours, theirs = (jax.vjp(f, g, u)[1](dh) for f in (swiglu, autodiff))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))
    assert float(jnp.max(jnp.abs(ours[0] - theirs[1]))) > 1.0
    low = jax.vjp(swiglu, g.astype(jnp.bfloat16), u.astype(jnp.bfloat16))[1](dh.astype(jnp.bfloat16))
    assert all(d.dtype == jnp.bfloat16 for d in low)


@pytest.mark.parametrize("chunks", [2, 4, 16])
def test_the_chunked_loss_equals_the_plain_one_in_value_and_gradient(chunks):
    """`chunked_cross_entropy` (`model.loss_chunks`): the head and loss a piece of the positions
    at a time, each piece's gradients made in the forward, against the plain head and
    `cross_entropy`, in float32 to 1e-6: the mean loss, the input's and the head weight's
    gradients, with loss weights and padding ids past the used vocabulary; the backward scales
    by the cotangent over the seed it was told (twice the seed: twice the gradients)."""
    from lm.model.cross_entropy import chunked_cross_entropy, cross_entropy

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    x, w = jax.random.normal(k1, (2, 16, 8), jnp.float32), jax.random.normal(k2, (8, 48), jnp.float32)
    targets, weights = jax.random.randint(k3, (2, 16), 0, 40), jax.random.uniform(k4, (2, 16))

    def head(x, w):
        logits = jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)
        return jnp.where(jnp.arange(48) < 40, logits, jnp.finfo(jnp.float32).min)

    seed = 0.25
    for given in (targets, (targets, weights)):
        plain, plain_grads = jax.value_and_grad(lambda x, w: cross_entropy(head(x, w), given) * seed, (0, 1))(x, w)  # noqa: B023
        loss_fn = jax.jit(lambda x, w, g: chunked_cross_entropy(head, x, w, given, chunks, seed) * g)  # noqa: B023
        for g in (seed, 2 * seed):
            value, grads = jax.value_and_grad(loss_fn, (0, 1))(x, w, g)
            assert float(value) == pytest.approx(float(plain) * g / seed, rel=1e-6)
            for ours, theirs in zip(grads, plain_grads, strict=True):
                np.testing.assert_allclose(ours, theirs * g / seed, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(theirs))))
    assert float(chunked_cross_entropy(head, x, w, targets, chunks)) != pytest.approx(float(cross_entropy(head(x, w), (targets, weights))), rel=1e-3)
