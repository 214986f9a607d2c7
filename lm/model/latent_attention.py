"""Multi-head latent attention (MLA, DeepSeek-V2 / V3): keys and values come from one compressed
latent per token (`kv_lora_rank` wide, RMS-normalised) through per-head up-projections, beside a
rotary key (`qk_rope_head_dim`) shared by every head; queries go through their own low-rank path
(`q_lora_rank`; 0: one full-rank projection). Each head's query and key are a non-rotary part
(`qk_nope_head_dim`) and a rotary part; values are `v_head_dim` wide.

Training runs the expanded form: keys and values per head, then the same attention kernels as
grouped-query attention (`lm.model.attention`). Decoding runs the absorbed form: the cache holds
only the latent and the rotary key per token (kv_lora_rank + qk_rope_head_dim values, 576 in
DeepSeek-V3, against 2 x heads x head_dim for grouped-query attention), and the key and value
up-projections are multiplied into the query and the output instead (DeepSeek-V2, section 2.1.2).

Shape suffixes as in `lm.model.layers`, and r a latent's width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lm.model import lora
from lm.model.attention import attention, causal_mask, training_mask, softmax
from lm.model.config import ModelConfig
from lm.model.layers import _param, head_norm
from lm.model.precision import Policy
from lm.model.rope import rope, rope_amplitude, rope_frequencies, softmax_scale
from sharding import constrain
from sharding.remat import name_qkv

LATENT_EPS = 1e-6  # the latents' RMSNorms (the checkpoints' own, whatever the model's norm_eps)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, policy: Policy, rngs: nnx.Rngs):
        self.cfg, self.policy = cfg, policy
        d, h, dt = cfg.embed_dim, cfg.num_heads, policy.param_dtype
        nope, rot, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
        if cfg.q_lora_rank:
            self.wq_a = _param(rngs.params(), (d, cfg.q_lora_rank), ("embed", "q_lora"), 0.02, dt)
            self.q_norm = _param(None, (cfg.q_lora_rank,), ("q_lora",), None, dt, fill=1.0)
            self.wq_b = _param(rngs.params(), (cfg.q_lora_rank, h, nope + rot), ("q_lora", "heads", "head_dim"), 0.02, dt)
        else:
            self.wq = _param(rngs.params(), (d, h, nope + rot), ("embed", "heads", "head_dim"), 0.02, dt)
        self.wkv_a = _param(rngs.params(), (d, r), ("embed", "kv_lora"), 0.02, dt)
        self.wk_rope = _param(rngs.params(), (d, rot), ("embed", "head_dim"), 0.02, dt)
        self.kv_norm = _param(None, (r,), ("kv_lora",), None, dt, fill=1.0)
        self.wk_b = _param(rngs.params(), (r, h, nope), ("kv_lora", "heads", "head_dim"), 0.02, dt)
        self.wv_b = _param(rngs.params(), (r, h, v), ("kv_lora", "heads", "head_dim"), 0.02, dt)
        self.wo = _param(rngs.params(), (h, v, d), ("heads", "head_dim", "embed"), out_std, dt)
        # The state each matmul keeps under the policy (fp8 scales), or None: `<weight>_site`.
        for name in (("wq_a", "wq_b") if cfg.q_lora_rank else ("wq",)) + ("wkv_a", "wk_rope", "wk_b", "wv_b", "wo"):
            setattr(self, f"{name}_site", policy.site())
        query = {"q_a": ("btd,dr->btr", self.wq_a), "q_b": ("btr,rhk->bthk", self.wq_b)} if cfg.q_lora_rank else {"q": ("btd,dhk->bthk", self.wq)}
        lora.attach(self, cfg, {**query, "kv_a": {"wkv_a": ("btd,dr->btr", self.wkv_a), "wk_rope": ("btd,dk->btk", self.wk_rope)},
                                "kv_b": {"wk_b": ("btr,rhk->bthk", self.wk_b), "wv_b": ("btr,rhk->bthk", self.wv_b)},
                                "o": ("bthk,hkd->btd", self.wo)}, rngs)

    def _matmul(self, spec, x, name):
        return self.policy.matmul(spec, x, getattr(self, name)[...], site=getattr(self, f"{name}_site"))

    def __call__(self, x_btd, positions_bt=None, cache=None, cache_index=None, segments_bt=None):
        """As `lm.model.layers.Attention` (same arguments and cache protocol: here the cache is
        {'latent', 'k_rope'})."""
        cfg = self.cfg
        nope = cfg.qk_nope_head_dim
        adapted = functools.partial(lora.adapted, self)
        if cfg.q_lora_rank:
            q_latent = head_norm(adapted("q_a", self._matmul("btd,dr->btr", x_btd, "wq_a"), x_btd), self.q_norm[...], LATENT_EPS)
            q = adapted("q_b", self._matmul("btr,rhk->bthk", q_latent, "wq_b"), q_latent)
        else:
            q = adapted("q", self._matmul("btd,dhk->bthk", x_btd, "wq"), x_btd)
        latent, k_rope = adapted("kv_a", (self._matmul("btd,dr->btr", x_btd, "wkv_a"), self._matmul("btd,dk->btk", x_btd, "wk_rope")), x_btd)
        latent = constrain(head_norm(latent, self.kv_norm[...], LATENT_EPS), ("batch", "length", "kv_lora"), "kv latent")
        k_rope = k_rope[:, :, None]  # b t 1 k: one rotary key for every head
        positions = jnp.arange(x_btd.shape[1])[None] if positions_bt is None else positions_bt
        freq_k, amplitude = rope_frequencies(cfg), rope_amplitude(cfg)
        q = jnp.concatenate([q[..., :nope], rope(q[..., nope:], positions, freq_k, amplitude)], axis=-1)
        k_rope = rope(k_rope, positions, freq_k, amplitude)
        q = constrain(name_qkv(q), ("batch", "length", "heads", "head_dim"), "queries")
        scale = softmax_scale(cfg, cfg.qk_head_dim)
        if cache is None:
            # Under context parallelism the latent and rotary key are gathered (576 values a token
            # in DeepSeek-V3), then expanded per head on each shard (40,960 gathered otherwise).
            latent = constrain(latent, ("batch", "kv_length", "kv_lora"), "kv latent, whole")
            k_rope = constrain(k_rope, ("batch", "kv_length", None, "head_dim"), "rotary key, whole")
            k_nope, v = adapted("kv_b", (self._matmul("btr,rhk->bthk", latent, "wk_b"), self._matmul("btr,rhk->bthk", latent, "wv_b")), latent)
            v = name_qkv(v)
            k = name_qkv(jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1))
            k = constrain(k, ("batch", "kv_length", "kv_heads", "head_dim"), "keys")
            v = constrain(v, ("batch", "kv_length", "kv_heads", "head_dim"), "values")
            mask_bts = training_mask(positions_bt, segments_bt, cfg.sliding_window)
            out = attention(q, k, v, mask_bts, self.policy, cfg.attention, cfg.sliding_window, scale=scale)
        else:
            cache = {
                "latent": jax.lax.dynamic_update_slice(cache["latent"], latent.astype(cache["latent"].dtype), (0, cache_index, 0)),
                "k_rope": jax.lax.dynamic_update_slice(cache["k_rope"], k_rope[:, :, 0].astype(cache["k_rope"].dtype), (0, cache_index, 0)),
            }
            mask_bts = causal_mask(positions_bt, jnp.arange(cache["latent"].shape[1])[None], cfg.sliding_window)
            out = self._absorbed(q, cache, mask_bts, scale)
        out = constrain(out, ("batch", "length", "heads", "head_dim"), "attention output")
        return adapted("o", self._matmul("bthk,hkd->btd", out, "wo"), out), cache

    def _absorbed(self, q_bthk, cache, mask_bts, scale: float) -> jax.Array:
        """Attention over the cached latents without expanding them: each head's non-rotary query
        taken into latent space through its key up-projection, the weighted latents out through
        its value up-projection (with kv_b's LoRA adapter: its A and B taken in turn, never merged)."""
        nope, matmul = self.cfg.qk_nope_head_dim, self.policy.matmul
        latent_bsr, k_rope_bsk = self.policy.cast(cache["latent"]), self.policy.cast(cache["k_rope"])
        adapter = getattr(self, "lora_kv_b", None)
        q_latent = matmul("bthk,rhk->bthr", q_bthk[..., :nope], self.wk_b[...], weight=False)
        if adapter is not None:  # + s (q B_k) A^T
            q_a = matmul("bthk,zhk->bthz", q_bthk[..., :nope], adapter.b_wk_b[...], weight=False)
            q_latent += (adapter.scale * matmul("bthz,rz->bthr", q_a, adapter.a[...], weight=False)).astype(q_latent.dtype)
        logits = matmul("bthr,bsr->bhts", q_latent, latent_bsr, out_dtype=jnp.float32, weight=False)
        logits += matmul("bthk,bsk->bhts", q_bthk[..., nope:], k_rope_bsk, out_dtype=jnp.float32, weight=False)
        logits = jnp.where(mask_bts[:, None], logits * scale, jnp.finfo(jnp.float32).min)
        out_latent = matmul("bhts,bsr->bthr", softmax(logits), latent_bsr, weight=False)
        out = matmul("bthr,rhk->bthk", out_latent, self.wv_b[...], weight=False)
        if adapter is not None:  # + s (o A) B_v
            o_a = matmul("bthr,rz->bthz", out_latent, adapter.a[...], weight=False)
            out += (adapter.scale * matmul("bthz,zhk->bthk", o_a, adapter.b_wv_b[...], weight=False)).astype(out.dtype)
        return out


def init_latent_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> dict[str, jax.Array]:
    """An empty cache for `length` positions: {'latent' [n, b, s, r], 'k_rope' [n, b, s, k]}."""
    return {"latent": jnp.zeros((cfg.num_layers, batch, length, cfg.kv_lora_rank), dtype),
            "k_rope": jnp.zeros((cfg.num_layers, batch, length, cfg.qk_rope_head_dim), dtype)}


def cache_values_per_layer(cfg: ModelConfig) -> tuple[int, int]:
    """(values a decoding cache keeps per token and layer, what keys and values per head would):
    latent attention's latent and rotary key against its expanded heads; grouped-query attention's
    keys and values of its kv heads (both figures alike)."""
    if cfg.latent_attention:
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return 2 * cfg.num_kv_heads * cfg.head_dim, 2 * cfg.num_kv_heads * cfg.head_dim
