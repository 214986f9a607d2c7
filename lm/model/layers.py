"""The building blocks of the Transformer: norms, rotary positions, attention, MLPs, the block.

Every parameter carries logical axis names (`out_sharding` metadata) and large activations are
constrained by logical names, so the `sharding` rules alone decide how the model is split. Every
matmul goes through the dtype policy (`Policy.matmul`), so number formats never touch this code.
Shape suffixes: b batch, t query length, s key length, d embed, h heads, g kv heads, k head
dim, f mlp hidden, v vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import sharding
from lm.model import lora
from lm.model.attention import attention, causal_mask, training_mask
from lm.model.config import ModelConfig
from lm.model.precision import Policy
from lm.model.rope import rope, rope_frequencies
from lm.model.swiglu import swiglu
from sharding import constrain
from sharding.remat import name_matmul_input, name_qkv

# The residual stream's logical axes (the embedded tokens', each block's input and output).
STACK_AXES = ("layers", "unstaged_layers")  # the leading axis of stacked layers' weights: a batch axis of their matrices
RESIDUAL_AXES = ("batch", "norm_length", "act_embed")


class Embedding(nnx.Param):
    """A lookup table (token or position embeddings): a parameter, but not a matmul weight."""


def _param(key, shape, logical_axes, std: float | None, dtype, fill: float = 0.0, kind=nnx.Param) -> nnx.Param:
    """A parameter with logical axis names; normal(std) when std is given, else constant."""
    value = std * jax.random.normal(key, shape, dtype) if std else jnp.full(shape, fill, dtype)
    # Sharding is applied by `sharding` rules at state creation, not eagerly by flax.
    return kind(value, out_sharding=logical_axes, eager_sharding=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table_vd: jax.Array, ids_bt: jax.Array, dtype) -> jax.Array:
    """`table[ids]` in `dtype`, the table cast before it is gathered whole for the lookup (as
    every FSDP weight is before use: a lookup into a table split along `embed` makes XLA
    replicate its output instead), so the gather moves compute-dtype bytes. Its gradient is
    summed in float32, returned in the table's own dtype (not `dtype`: a bf16 table gradient
    would round the sum) and placed back as the parameter is (`vocab`, `embed`), so that FSDP
    reduce-scatters it rather than all-reducing the whole table's gradient and slicing it."""
    return jnp.take(constrain(table_vd.astype(dtype), ("vocab", None), "embedding table"), ids_bt, axis=0)


def _lookup_fwd(table_vd, ids_bt, dtype):
    return lookup(table_vd, ids_bt, dtype), (table_vd, ids_bt)


def _lookup_bwd(dtype, residuals, dy_btd):
    table_vd, ids_bt = residuals
    # The rows' gradients split along `embed` as the table is (an all-to-all from the batch
    # split), the batch over data-parallel replicas only: left to itself, with the batch split
    # over data x fsdp (or the sequence over context x tensor), XLA reaches the table's layout
    # only by replicating them.
    dy_btd = sharding.move(dy_btd, RESIDUAL_AXES, ("replica_batch", None, "embed"), "embedding gradient rows")
    ids_bt = constrain(ids_bt, ("replica_batch", None), "embedding gradient ids")  # placed as the rows
    grad = jnp.zeros(table_vd.shape, jnp.float32).at[ids_bt].add(dy_btd.astype(jnp.float32))
    return constrain(grad, ("vocab", "embed"), "embedding gradient").astype(table_vd.dtype), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Norm(nnx.Module):
    """RMSNorm or LayerNorm; statistics in float32."""

    def __init__(self, cfg: ModelConfig, policy: Policy):
        self.cfg, self.policy = cfg, policy
        dtype = policy.param_dtype
        self.scale = _param(None, (cfg.embed_dim,), ("embed",), None, dtype, fill=1.0)
        if cfg.norm == "layernorm":
            self.bias = _param(None, (cfg.embed_dim,), ("embed",), None, dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x = x_btd.astype(jnp.float32)
        if self.cfg.norm == "layernorm":
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        # Only the output named (remat `dots_and_inputs` keeps it): naming the statistic too split
        # the forward's one fused pass in two and made the backward slower (deviceless H100).
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.cfg.norm_eps)
        y = y * self.scale[...]
        if self.cfg.norm == "layernorm":
            y = y + self.bias[...]
        return name_matmul_input(self.policy.cast(y))


def head_norm(x_bthk: jax.Array, scale_k: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over each head's features, in float32, the result in x's dtype."""
    x = x_bthk.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * scale_k.astype(jnp.float32)
    return y.astype(x_bthk.dtype)


@jax.custom_vjp
def add_bias(x: jax.Array, bias: jax.Array) -> jax.Array:
    """`x + bias` over x's trailing axes, in x's dtype."""
    return x + bias.astype(x.dtype)


def _add_bias_fwd(x, bias):
    return add_bias(x, bias), bias


def _add_bias_bwd(bias, dy):
    # The bias gradient sums dy over every leading axis. Written as a ones-vector matmul: XLA:CPU
    # otherwise fuses this reduction into slow reduce-window loops (PERFORMANCE.md).
    dy_nf = dy.reshape(-1, bias.size).astype(jnp.float32)
    dbias = jnp.einsum("n,nf->f", jnp.ones(dy_nf.shape[0], jnp.float32), dy_nf)
    return dy, dbias.reshape(bias.shape).astype(bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, policy: Policy, rngs: nnx.Rngs):
        self.cfg, self.policy = cfg, policy
        d, h, g, k, dt = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, policy.param_dtype
        out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
        self.wq = _param(rngs.params(), (d, h, k), ("embed", "heads", "head_dim"), 0.02, dt)
        self.wk = _param(rngs.params(), (d, g, k), ("embed", "kv_heads", "head_dim"), 0.02, dt)
        self.wv = _param(rngs.params(), (d, g, k), ("embed", "kv_heads", "head_dim"), 0.02, dt)
        self.wo = _param(rngs.params(), (h, k, d), ("heads", "head_dim", "embed"), out_std, dt)
        # The state each dense matmul keeps under the policy (fp8 scales), or None.
        self.wq_site, self.wk_site, self.wv_site, self.wo_site = (policy.site() for _ in range(4))
        if cfg.use_bias or cfg.qkv_bias:
            self.bq = _param(None, (h, k), ("heads", "head_dim"), None, dt)
            self.bk = _param(None, (g, k), ("kv_heads", "head_dim"), None, dt)
            self.bv = _param(None, (g, k), ("kv_heads", "head_dim"), None, dt)
        if cfg.use_bias:
            self.bo = _param(None, (d,), ("embed",), None, dt)
        if cfg.qk_norm:
            self.q_norm = _param(None, (k,), ("head_dim",), None, dt, fill=1.0)
            self.k_norm = _param(None, (k,), ("head_dim",), None, dt, fill=1.0)
        lora.attach(self, cfg, {"q": ("btd,dhk->bthk", self.wq), "k": ("btd,dgk->btgk", self.wk), "v": ("btd,dgk->btgk", self.wv),
                                "o": ("bthk,hkd->btd", self.wo)}, rngs)

    def __call__(self, x_btd, positions_bt=None, cache=None, cache_index=None, segments_bt=None):
        """`positions_bt` None: the tokens are in order from position 0, and the mask is causal by
        index (what fused kernels take). Given, the mask comes from the positions (and
        `segments_bt`), whatever order the tokens are in."""
        cfg = self.cfg
        q = lora.adapted(self, "q", self.policy.matmul("btd,dhk->bthk", x_btd, self.wq[...], site=self.wq_site), x_btd)
        q_site = self.policy.quantising_site("btd,dhk->bthk", x_btd, self.wq[...], self.wq_site)  # k and v quantise x as q did
        k = lora.adapted(self, "k", self.policy.matmul("btd,dgk->btgk", x_btd, self.wk[...], site=self.wk_site, shares_input=q_site), x_btd)
        v = lora.adapted(self, "v", self.policy.matmul("btd,dgk->btgk", x_btd, self.wv[...], site=self.wv_site, shares_input=q_site), x_btd)
        if cfg.use_bias or cfg.qkv_bias:
            q, k, v = add_bias(q, self.bq[...]), add_bias(k, self.bk[...]), add_bias(v, self.bv[...])
        if cfg.qk_norm:  # each head's queries and keys RMS-normalised (Qwen3)
            q, k = head_norm(q, self.q_norm[...], cfg.norm_eps), head_norm(k, self.k_norm[...], cfg.norm_eps)
        q, k, v = name_qkv(q), name_qkv(k), name_qkv(v)
        # Each context shard projects its own part of the sequence; only then are keys and
        # values gathered (left free, XLA may gather the wider input instead and project it all).
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"), "local keys")
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"), "local values")
        if cfg.position == "rope":
            freq_k = rope_frequencies(cfg)
            rope_positions = jnp.arange(x_btd.shape[1])[None] if positions_bt is None else positions_bt
            q, k = name_matmul_input(rope(q, rope_positions, freq_k)), name_matmul_input(rope(k, rope_positions, freq_k))
        q = constrain(q, ("batch", "length", "heads", "head_dim"), "queries")
        if cache is None:
            # Queries stay split along the sequence (over `context`); keys and values are whole
            # on every shard: all-gathered, and their gradients reduce-scattered.
            k = constrain(k, ("batch", "kv_length", "kv_heads", "head_dim"), "keys")
            v = constrain(v, ("batch", "kv_length", "kv_heads", "head_dim"), "values")
            mask_bts = training_mask(positions_bt, segments_bt, cfg.sliding_window)
            out = attention(q, k, v, mask_bts, self.policy, cfg.attention, cfg.sliding_window)
        else:  # decoding: write this chunk into the cache, attend to every filled position
            start = (0, cache_index, 0, 0)
            cache = {
                "k": jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start),
                "v": jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start),
            }
            mask_bts = causal_mask(positions_bt, jnp.arange(cache["k"].shape[1])[None], cfg.sliding_window)
            k, v = self.policy.cast(cache["k"]), self.policy.cast(cache["v"])
            out = attention(q, k, v, mask_bts, self.policy, cfg.attention, decoding=True)
        # Its gradient arrives split as the queries are (not along the sequence over `tensor` too,
        # as sequence parallelism's would, which XLA can only reshard by replicating).
        out = constrain(out, ("batch", "length", "heads", "head_dim"), "attention output")
        y = lora.adapted(self, "o", self.policy.matmul("bthk,hkd->btd", out, self.wo[...], site=self.wo_site), out)
        if cfg.use_bias:
            y = add_bias(y, self.bo[...])
        return y, cache


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, policy: Policy, rngs: nnx.Rngs):
        self.cfg, self.policy = cfg, policy
        d, f, dt = cfg.embed_dim, cfg.mlp_dim, policy.param_dtype
        out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
        self.w_in = _param(rngs.params(), (d, f), ("embed", "mlp"), 0.02, dt)
        if cfg.mlp == "swiglu":
            self.w_gate = _param(rngs.params(), (d, f), ("embed", "mlp"), 0.02, dt)
        self.w_out = _param(rngs.params(), (f, d), ("mlp", "embed"), out_std, dt)
        self.w_in_site, self.w_out_site = policy.site(), policy.site()
        self.w_gate_site = policy.site() if cfg.mlp == "swiglu" else None
        if cfg.use_bias:
            self.b_in = _param(None, (f,), ("mlp",), None, dt)
            self.b_out = _param(None, (d,), ("embed",), None, dt)
        matmuls = {"up": ("btd,df->btf", self.w_in), "down": ("btf,fd->btd", self.w_out)}
        lora.attach(self, cfg, matmuls | ({"gate": ("btd,df->btf", self.w_gate)} if cfg.mlp == "swiglu" else {}), rngs)

    def __call__(self, x_btd):
        # On CPU the hidden activation is computed in float32 straight from the matmul accumulator
        # and cast once (bf16 elementwise maths is converted to f32 and back there); elsewhere it
        # stays in the compute dtype, which halves what the backward pass keeps of it.
        cfg = self.cfg
        hidden = jnp.float32 if sharding.platform() == "cpu" else None
        h = lora.adapted(self, "up", self.policy.matmul("btd,df->btf", x_btd, self.w_in[...], out_dtype=hidden, site=self.w_in_site), x_btd)
        if cfg.use_bias:
            h = add_bias(h, self.b_in[...])
        if cfg.mlp == "swiglu":
            up_site = self.policy.quantising_site("btd,df->btf", x_btd, self.w_in[...], self.w_in_site)  # gate quantises x as up did
            gate = lora.adapted(self, "gate", self.policy.matmul("btd,df->btf", x_btd, self.w_gate[...], out_dtype=hidden, site=self.w_gate_site,
                                                                  shares_input=up_site), x_btd)
            h = swiglu(gate, h)  # its backward by hand: XLA then quantises both gradients in one pass under fp8
        else:
            h = jax.nn.gelu(h)
        h = constrain(self.policy.cast(h), ("batch", "length", "mlp"), "mlp hidden")
        y = lora.adapted(self, "down", self.policy.matmul("btf,fd->btd", h, self.w_out[...], site=self.w_out_site), h)
        if cfg.use_bias:
            y = add_bias(y, self.b_out[...])
        return y


@jax.custom_vjp
def gathered_gradient(y_btd: jax.Array) -> jax.Array:
    """`y_btd` itself; its gradient is made whole along the sequence over `tensor`
    (`gather_length`) before it enters the row-parallel matmul's backward, as Megatron's sequence
    parallelism does. Left to itself, XLA may place the weight gradient's inputs by the weight's
    split of `embed` over `context`, which it can only reach by replicating the gradient."""
    return y_btd


gathered_gradient.defvjp(lambda y: (y, None), lambda _, dy: (gather_length(dy),))


def gather_length(x_btd: jax.Array) -> jax.Array:
    """The whole sequence on every tensor shard, entering a column-parallel matmul.

    Under sequence parallelism this is Megatron's all-gather from the sequence-split norm region;
    the row-parallel output's reduction then lands split again (reduce-scatter). Without it XLA
    may instead move the heads (all-to-all) or gather the weights. The input is pinned to its
    split first, so that the gather moves it in its own dtype (left alone, XLA gathered the final
    norm's float32 internals and cast after).
    """
    x_btd = constrain(x_btd, RESIDUAL_AXES, "norm output, split")
    return constrain(x_btd, ("batch", "length", "act_embed"), "norm output")
