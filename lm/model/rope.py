"""Rotary position embeddings: the frequencies, scaled as `model.rope_scaling` says (none, linear,
Llama 3.1's `llama3`, YaRN), and the rotation in the rotate-half form. Computed as Hugging Face
`transformers` computes them, so that imported models match it to the last bit."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lm.model.config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_dim(cfg: ModelConfig) -> int:
    """How many features of a head rotate: all of `head_dim`, or multi-head latent attention's
    decoupled rotary part (`qk_rope_head_dim`)."""
    return cfg.qk_rope_head_dim if cfg.kv_lora_rank else cfg.head_dim


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The rotary angular frequencies [rope_dim / 2] in float32, scaled as `cfg.rope_scaling` says."""
    dim = rope_dim(cfg)
    freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if cfg.rope_scaling == "linear":
        return (freq / cfg.rope_factor).astype(np.float32)
    if cfg.rope_scaling == "llama3":
        factor, low, high, old_len = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > old_len / low, freq / factor, freq)  # long wavelengths: slowed down
        smooth = (old_len / wavelen - low) / (high - low)
        ramp = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, ramp, scaled).astype(np.float32)
    if cfg.rope_scaling == "yarn":
        # Frequencies that turn more than beta_fast times over the original context are kept,
        # those turning fewer than beta_slow times are divided by the factor, a linear ramp between.
        def turning_dim(turns):
            return dim * math.log(cfg.rope_original_max_len / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low, high = max(math.floor(turning_dim(cfg.rope_beta_fast)), 0), min(math.ceil(turning_dim(cfg.rope_beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
        base = (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float32)
        kept = 1 - ramp.astype(np.float32)
        return ((1.0 / (cfg.rope_factor * base)) * (1 - kept) + (1.0 / base) * kept).astype(np.float32)
    return freq.astype(np.float32)


def rope_amplitude(cfg: ModelConfig) -> float:
    """What the rotated features are multiplied by: YaRN's attention factor (the ratio of its
    temperatures with `rope_mscale` and `rope_mscale_all_dim` where both are set), else 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def softmax_scale(cfg: ModelConfig, qk_dim: int) -> float:
    """Attention's logit scale: 1 / sqrt(query-key dim), times YaRN's squared temperature with
    `rope_mscale_all_dim` (DeepSeek's correction for the stretched context)."""
    scale = qk_dim**-0.5
    if cfg.rope_scaling != "none" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rope(x_bthk: jax.Array, positions_bt: jax.Array, freq_k: np.ndarray, amplitude: float = 1.0) -> jax.Array:
    """Rotary position embedding in the rotate-half form (the first half of each head's features
    pairs with the second half, as in `transformers`: no row permutation of imported q / k
    weights; checkpoints in the interleaved form are permuted on import), computed in float32."""
    angle = positions_bt[..., None, None].astype(jnp.float32) * freq_k  # b t 1 k/2
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    if amplitude != 1.0:
        sin, cos = sin * amplitude, cos * amplitude
    # The halves as an axis of 2, swapped by a reverse rather than split and concatenated: the same
    # products and sums, but a reverse fuses with what reads or writes the result (a
    # concatenation ends an XLA fusion: fp8's amax of the rotation's gradient took a pass of its own).
    x = x_bthk.astype(jnp.float32).reshape(*x_bthk.shape[:-1], 2, -1)
    sign = jnp.asarray([-1.0, 1.0], jnp.float32)[:, None]
    rotated = x * cos[..., None, :] + jnp.flip(x, axis=-2) * (sign * sin[..., None, :])
    return rotated.reshape(x_bthk.shape).astype(x_bthk.dtype)
