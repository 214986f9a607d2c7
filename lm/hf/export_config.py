"""The `config.json` an export writes (`hf_config`): a meshlm model in its `transformers` family's
fields (`lm.hf.format` reads them), RoPE settings spelled for the installed `transformers`."""

from __future__ import annotations

from lm.hf.format import ARCHITECTURES, family_of
from lm.model.config import ModelConfig


def _transformers_major() -> int:
    """The installed `transformers`' major version (5 when it is not installed): decides how RoPE
    settings are written."""
    from importlib import metadata

    try:
        return int(metadata.version("transformers").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return 5


def hf_config(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """A `config.json` for `cfg` (its family from `family_of`), over `base` (the imported model's
    own config.json, keeping its token ids and other settings) when it is of the same family."""
    kind = family_of(cfg)
    out = dict(base) if base and base.get("model_type") == kind else {}
    for stale in ("rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype", "quantization_config"):
        out.pop(stale, None)
    major = _transformers_major()
    out.update(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=cfg.used_vocab, tie_word_embeddings=cfg.tie_embeddings)
    out["dtype" if major >= 5 else "torch_dtype"] = dtype
    if kind == "gpt2":
        out.update(
            n_layer=cfg.num_layers, n_embd=cfg.embed_dim, n_head=cfg.num_heads, n_inner=cfg.mlp_dim,
            n_positions=cfg.max_len, layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
        )
        return out
    out.update(
        num_hidden_layers=cfg.num_layers, hidden_size=cfg.embed_dim, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim,
        rms_norm_eps=cfg.norm_eps, hidden_act="silu",
    )
    out.setdefault("max_position_embeddings", max(cfg.max_len, cfg.rope_original_max_len if cfg.rope_scaling == "llama3" else 0))
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if kind == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if kind in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * cfg.num_layers)
    if kind == "qwen3":
        out["attention_bias"] = False
    if kind == "mixtral":
        out.update(
            sliding_window=cfg.sliding_window or None, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
            intermediate_size=cfg.expert_width, router_aux_loss_coef=cfg.router_aux_loss_coef, router_jitter_noise=0.0,
        )
    if kind == "qwen3_moe":
        out.pop("num_local_experts", None)
        out.update(
            attention_bias=False, use_sliding_window=False, sliding_window=None, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.expert_width, norm_topk_prob=cfg.router_renormalize,
            decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layer_ids), router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    if kind == "deepseek_v3":
        out.pop("num_local_experts", None)
        out.update(
            attention_bias=False, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim, rope_interleave=cfg.rope_interleave,
            num_key_value_heads=cfg.num_heads, num_nextn_predict_layers=cfg.mtp_depth,
        )
        if cfg.moe:
            out.update(
                n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.expert_width,
                first_k_dense_replace=cfg.dense_layers, n_shared_experts=cfg.shared_experts, norm_topk_prob=cfg.router_renormalize,
                n_group=cfg.router_groups, topk_group=cfg.router_groups_chosen, routed_scaling_factor=cfg.router_scale,
            )
        else:
            out.update(first_k_dense_replace=cfg.num_layers, n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
                       moe_intermediate_size=cfg.mlp_dim, n_shared_experts=0)
    rope = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_len,
        )
    if cfg.rope_scaling == "yarn":
        rope.update(original_max_position_embeddings=cfg.rope_original_max_len, beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                    **{k: v for k, v in (("mscale", cfg.rope_mscale), ("mscale_all_dim", cfg.rope_mscale_all_dim)) if v})
    if major >= 5:
        out["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}
    else:
        out.update(rope_theta=cfg.rope_theta, rope_scaling=rope if cfg.rope_scaling != "none" else None)
    return out
