"""A decoder-only Transformer in Flax NNX, Llama-style or GPT-2-style by config.

Every parameter carries logical axis names (`out_sharding` metadata) and large activations are
constrained by logical names, so the `sharding` rules alone decide how the model is split. The
layers are stacked along a leading `layers` axis and run by `lax.scan`: one compiled block
whatever the depth. Shape suffixes: b batch, t query length, s key length, d embed, h heads,
g kv heads, k head dim, f mlp hidden, v vocab, l layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lm.precision import Policy, fp8_suspended
from sharding import constrain
from sharding.pipeline import pipeline

# Parameters exempt from weight decay: norms, biases and embeddings.
NO_DECAY = frozenset({"embedding", "pos_embedding", "scale", "bias", "bq", "bk", "bv", "bo", "b_in", "b_out"})

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """How the layer stack is split over the `stage` mesh axis (stages=1: not at all)."""

    stages: int = 1
    microbatches: int = 1
    repeats: int = 1
    remat: str = "full"

    @classmethod
    def from_config(cls, c) -> PipelinePlan:
        stages = c.mesh.stage
        if stages == 1:
            return cls()
        return cls(stages, c.pipeline.microbatches or stages, c.pipeline.repeats, c.pipeline.remat)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # padded
    max_len: int  # rows of the learned position table
    num_layers: int = 2
    embed_dim: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 512
    norm: str = "rmsnorm"
    position: str = "rope"
    mlp: str = "swiglu"
    use_bias: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    remat: str = "none"
    scan_layers: bool = True
    policy: Policy = Policy()
    pipeline: PipelinePlan = PipelinePlan()

    @classmethod
    def from_config(cls, c, vocab_size: int) -> ModelConfig:
        """From the `model` group of a meshlm config and the tokenizer's vocabulary size."""
        m = c.model
        multiple = m.vocab_multiple
        fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size", "max_len", "policy", "head_dim", "pipeline"}
        return cls(
            vocab_size=-(-vocab_size // multiple) * multiple,
            max_len=c.train.seq_len,
            head_dim=m.head_dim or m.embed_dim // m.num_heads,
            policy=Policy.from_config(c.precision),
            pipeline=PipelinePlan.from_config(c),
            **{k: m[k] for k in fields},
        )


def _param(key, shape, logical_axes, std: float | None, dtype, fill: float = 0.0) -> nnx.Param:
    """A parameter with logical axis names; normal(std) when std is given, else constant."""
    value = std * jax.random.normal(key, shape, dtype) if std else jnp.full(shape, fill, dtype)
    # Sharding is applied by `sharding` rules at state creation, not eagerly by flax.
    return nnx.Param(value, out_sharding=logical_axes, eager_sharding=False)


class Norm(nnx.Module):
    """RMSNorm or LayerNorm; statistics in float32."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        dtype = cfg.policy.param_dtype
        self.scale = _param(None, (cfg.embed_dim,), ("embed",), None, dtype, fill=1.0)
        if cfg.norm == "layernorm":
            self.bias = _param(None, (cfg.embed_dim,), ("embed",), None, dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x = x_btd.astype(jnp.float32)
        if self.cfg.norm == "layernorm":
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.cfg.norm_eps)
        y = y * self.scale[...]
        if self.cfg.norm == "layernorm":
            y = y + self.bias[...]
        return self.cfg.policy.cast(y)


@jax.custom_vjp
def add_bias(x: jax.Array, bias: jax.Array) -> jax.Array:
    """`x + bias` over x's trailing axes, in x's dtype."""
    return x + bias.astype(x.dtype)


def _add_bias_fwd(x, bias):
    return add_bias(x, bias), bias


def _add_bias_bwd(bias, dy):
    # The bias gradient sums dy over every leading axis. Written as a ones-vector matmul: XLA:CPU
    # otherwise fuses this reduction into slow reduce-window loops (2 ms per bias here).
    dy_nf = dy.reshape(-1, bias.size).astype(jnp.float32)
    dbias = jnp.einsum("n,nf->f", jnp.ones(dy_nf.shape[0], jnp.float32), dy_nf)
    return dy, dbias.reshape(bias.shape).astype(bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def rope(x_bthk: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form), computed in float32."""
    half = x_bthk.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions_bt[..., None, None].astype(jnp.float32) * freq  # b t 1 k/2
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(x_bthk.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthk.dtype)


def attention(q_bthk, k_bsgk, v_bsgk, mask_bts, policy: Policy) -> jax.Array:
    """Softmax attention with grouped-query heads; `mask_bts` None means causal.

    On GPU/TPU this is `jax.nn.dot_product_attention` (cuDNN flash attention where it applies).
    On CPU the same maths is written out: XLA:CPU fuses the library version's softmax backward
    into a slow reduction, and the einsums here run on the policy's matmul (bf16 units).
    """
    if jax.default_backend() != "cpu":
        mask = None if mask_bts is None else mask_bts[:, None]
        return jax.nn.dot_product_attention(q_bthk, k_bsgk, v_bsgk, mask=mask, is_causal=mask_bts is None)
    b, t, h, k = q_bthk.shape
    g = k_bsgk.shape[2]
    q = (q_bthk * jnp.asarray(k**-0.5, q_bthk.dtype)).reshape(b, t, g, h // g, k)
    logits = policy.matmul("btgrk,bsgk->bgrts", q, k_bsgk, out_dtype=jnp.float32)
    if mask_bts is None:
        s = k_bsgk.shape[1]
        mask_bts = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None]
    logits = jnp.where(mask_bts[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = policy.matmul("bgrts,bsgk->btgrk", probs, v_bsgk)
    return out.reshape(b, t, h, k)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, g, k, dt = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.policy.param_dtype
        out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
        self.wq = _param(rngs.params(), (d, h, k), ("embed", "heads", "head_dim"), 0.02, dt)
        self.wk = _param(rngs.params(), (d, g, k), ("embed", "kv_heads", "head_dim"), 0.02, dt)
        self.wv = _param(rngs.params(), (d, g, k), ("embed", "kv_heads", "head_dim"), 0.02, dt)
        self.wo = _param(rngs.params(), (h, k, d), ("heads", "head_dim", "embed"), out_std, dt)
        # The state each dense matmul keeps under the policy (fp8 scales), or None.
        self.wq_dot, self.wk_dot, self.wv_dot, self.wo_dot = (cfg.policy.site() for _ in range(4))
        if cfg.use_bias:
            self.bq = _param(None, (h, k), ("heads", "head_dim"), None, dt)
            self.bk = _param(None, (g, k), ("kv_heads", "head_dim"), None, dt)
            self.bv = _param(None, (g, k), ("kv_heads", "head_dim"), None, dt)
            self.bo = _param(None, (d,), ("embed",), None, dt)

    def __call__(self, x_btd, positions_bt, cache=None, cache_index=None):
        cfg = self.cfg
        q = cfg.policy.matmul("btd,dhk->bthk", x_btd, self.wq[...], site=self.wq_dot)
        k = cfg.policy.matmul("btd,dgk->btgk", x_btd, self.wk[...], site=self.wk_dot)
        v = cfg.policy.matmul("btd,dgk->btgk", x_btd, self.wv[...], site=self.wv_dot)
        if cfg.use_bias:
            q, k, v = add_bias(q, self.bq[...]), add_bias(k, self.bk[...]), add_bias(v, self.bv[...])
        if cfg.position == "rope":
            q, k = rope(q, positions_bt, cfg.rope_theta), rope(k, positions_bt, cfg.rope_theta)
        q = constrain(q, ("batch", "length", "heads", "head_dim"), "queries")
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"), "keys")
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"), "values")
        if cache is None:
            out = attention(q, k, v, None, cfg.policy)
        else:  # decoding: write this chunk into the cache, attend to every filled position
            start = (0, cache_index, 0, 0)
            cache = {
                "k": jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start),
                "v": jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start),
            }
            key_positions = jnp.arange(cache["k"].shape[1])
            mask_bts = key_positions[None, None, :] <= positions_bt[:, :, None]
            out = attention(q, cfg.policy.cast(cache["k"]), cfg.policy.cast(cache["v"]), mask_bts, cfg.policy)
        y = cfg.policy.matmul("bthk,hkd->btd", out, self.wo[...], site=self.wo_dot)
        if cfg.use_bias:
            y = add_bias(y, self.bo[...])
        return y, cache


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f, dt = cfg.embed_dim, cfg.mlp_dim, cfg.policy.param_dtype
        out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
        self.w_in = _param(rngs.params(), (d, f), ("embed", "mlp"), 0.02, dt)
        if cfg.mlp == "swiglu":
            self.w_gate = _param(rngs.params(), (d, f), ("embed", "mlp"), 0.02, dt)
        self.w_out = _param(rngs.params(), (f, d), ("mlp", "embed"), out_std, dt)
        self.w_in_dot, self.w_out_dot = cfg.policy.site(), cfg.policy.site()
        self.w_gate_dot = cfg.policy.site() if cfg.mlp == "swiglu" else None
        if cfg.use_bias:
            self.b_in = _param(None, (f,), ("mlp",), None, dt)
            self.b_out = _param(None, (d,), ("embed",), None, dt)

    def __call__(self, x_btd):
        # The hidden activation is computed in float32 straight from the matmul accumulator and
        # cast once: cheaper on CPU than bf16 elementwise maths (converted to f32 and back).
        cfg, f32 = self.cfg, jnp.float32
        h = cfg.policy.matmul("btd,df->btf", x_btd, self.w_in[...], out_dtype=f32, site=self.w_in_dot)
        if cfg.use_bias:
            h = add_bias(h, self.b_in[...])
        if cfg.mlp == "swiglu":
            gate = cfg.policy.matmul("btd,df->btf", x_btd, self.w_gate[...], out_dtype=f32, site=self.w_gate_dot)
            h = jax.nn.silu(gate) * h
        else:
            h = jax.nn.gelu(h)
        h = constrain(cfg.policy.cast(h), ("batch", "length", "mlp"), "mlp hidden")
        y = cfg.policy.matmul("btf,fd->btd", h, self.w_out[...], site=self.w_out_dot)
        if cfg.use_bias:
            y = add_bias(y, self.b_out[...])
        return y


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = Norm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = Norm(cfg)
        self.mlp = Mlp(cfg, rngs)

    def __call__(self, x_btd, positions_bt, cache=None, cache_index=None):
        y, cache = self.attn(_gather_length(self.attn_norm(x_btd)), positions_bt, cache, cache_index)
        x_btd = constrain(x_btd + y, ("batch", "norm_length", "act_embed"), "residual")
        x_btd = x_btd + self.mlp(_gather_length(self.mlp_norm(x_btd)))
        return constrain(x_btd, ("batch", "norm_length", "act_embed"), "residual"), cache


def _gather_length(x_btd: jax.Array) -> jax.Array:
    """The whole sequence on every tensor shard, entering a column-parallel matmul.

    Under sequence parallelism this is Megatron's all-gather from the sequence-split norm region;
    the row-parallel output's reduction then lands split again (reduce-scatter). Without it XLA
    may instead move the heads (all-to-all) or gather the weights.
    """
    return constrain(x_btd, ("batch", "length", "act_embed"), "norm output")


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = cfg.policy.param_dtype
        self.embedding = _param(rngs.params(), (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), 0.02, dt)
        if cfg.position == "learned":
            self.pos_embedding = _param(rngs.params(), (cfg.max_len, cfg.embed_dim), (None, "embed"), 0.01, dt)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(layer_rngs):
            return Block(cfg, layer_rngs)

        self.blocks = stacked_blocks(rngs.split(cfg.num_layers))
        self.final_norm = Norm(cfg)
        if not cfg.tie_embeddings:
            self.head = _param(rngs.params(), (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), 0.02, dt)

    def init_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
        """An empty KV cache for `length` positions: {'k', 'v'} of shape [l, b, s, g, k]."""
        c = self.cfg
        shape = (c.num_layers, batch, length, c.num_kv_heads, c.head_dim)
        return {"k": jnp.zeros(shape, c.policy.compute_dtype), "v": jnp.zeros(shape, c.policy.compute_dtype)}

    def __call__(self, tokens_bt: jax.Array, cache=None, cache_index=0):
        """Float32 logits [b, t, v] and the updated cache (None when not decoding).

        With a cache, `tokens_bt` continues the sequence at position `cache_index`.
        """
        cfg = self.cfg
        positions_bt = cache_index + jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        # The table is gathered over `fsdp` before the lookup (as every FSDP weight is before use);
        # a lookup into a table split along `embed` makes XLA replicate its output instead.
        table_vd = constrain(self.embedding[...], ("vocab", None), "embedding table")
        x = cfg.policy.cast(jnp.take(table_vd, tokens_bt, axis=0))
        if cfg.position == "learned":
            table_td = constrain(self.pos_embedding[...], (None, None), "position table")
            x = x + cfg.policy.cast(jnp.take(table_td, positions_bt, axis=0))
        x = constrain(x, ("batch", "norm_length", "act_embed"), "embeddings")
        x, cache = self._layers(x, positions_bt, cache, cache_index)
        x = _gather_length(self.final_norm(x))
        if cfg.tie_embeddings:
            logits = cfg.policy.matmul("btd,vd->btv", x, self.embedding[...], out_dtype=jnp.float32)
        else:
            logits = cfg.policy.matmul("btd,dv->btv", x, self.head[...], out_dtype=jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"), "logits"), cache

    def _layers(self, x, positions_bt, cache, cache_index):
        graphdef, stacked = nnx.split(self.blocks)
        if self.cfg.pipeline.stages > 1 and cache is None:
            plan = self.cfg.pipeline

            def stage(chunk, x_btd):  # a chunk of consecutive layers on one microbatch
                return self._run_stack(graphdef, chunk, x_btd, positions_bt[: x_btd.shape[0]], None, None)[0]

            x = pipeline(
                stage,
                stacked,
                nnx.get_partition_spec(stacked),
                x,
                ("batch", "norm_length", "act_embed"),
                stages=plan.stages,
                microbatches=plan.microbatches,
                repeats=plan.repeats,
                remat_policy=_REMAT_POLICIES.get(plan.remat, "none"),
            )
            return x, None
        return self._run_stack(graphdef, stacked, x, positions_bt, cache, cache_index)

    def _run_stack(self, graphdef, stacked, x, positions_bt, cache, cache_index):
        """The stacked layers (all of them, or one pipeline chunk) applied in order; layers that
        `precision.fp8_skip` keeps out of fp8 run as separate segments."""

        def layer(x, params_and_cache):
            params, layer_cache = params_and_cache
            return nnx.merge(graphdef, params)(x, positions_bt, layer_cache, cache_index)

        if self.cfg.remat != "none":  # also inside a pipeline tick: one layer's internals at a time
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[self.cfg.remat], prevent_cse=not self.cfg.scan_layers)
        num_layers = jax.tree.leaves(stacked)[0].shape[0]
        fp8 = self.cfg.policy.fp8_layers(num_layers)
        runs, new_caches = _runs(fp8), []
        for start, stop in runs:
            segment = (stacked, cache) if len(runs) == 1 else jax.tree.map(lambda a: a[start:stop], (stacked, cache))
            with fp8_suspended(self.cfg.policy.fp8 is not None and not fp8[start]):
                if self.cfg.scan_layers:
                    x, segment_cache = jax.lax.scan(layer, x, segment)
                    new_caches.append(segment_cache)
                    continue
                for i in range(stop - start):
                    x, layer_cache = layer(x, jax.tree.map(lambda a: a[i], segment))
                    new_caches.append(jax.tree.map(lambda a: a[None], layer_cache))
        if cache is None:
            return x, None
        return x, jax.tree.map(lambda *a: jnp.concatenate(a), *new_caches)


def _runs(flags: list) -> list[tuple[int, int]]:
    """[start, stop) ranges of equal consecutive flags: [T, T, F, T] -> [(0, 2), (2, 3), (3, 4)]."""
    bounds = [0] + [i for i in range(1, len(flags)) if flags[i] != flags[i - 1]] + [len(flags)]
    return list(zip(bounds[:-1], bounds[1:]))
