"""How many FLOPs a model costs per trained token, the convention MFU is measured in.

FLOPs per trained token, the convention used for MFU (`flops_per_token`):
  * every matmul weight (Q, K, V, O, the MLP matrices, the output head) costs 2 FLOPs per
    weight per token forward and 4 backward: 6 * matmul_params; in a mixture of experts only
    the *active* ones count: the chosen experts, the shared experts and the router;
  * attention scores (Q K^T) and the weighted sum (A V) each cost 2 * T * heads * head_dim
    FLOPs per token forward for a full T x T attention; causal attention halves that (each
    query sees T/2 keys on average), so forward is 2 * T * heads * head_dim per layer and
    training, at 3x forward, is 6 * layers * T * heads * head_dim (latent attention: the query-key
    and value widths differ, each counted for its product);
  * multi-token prediction's modules (DeepSeek-V3) count as layers, with their projection and
    the head again, as Megatron-Core counts them;
  * LoRA (`lm.model.lora`): the frozen weights cost 2 forward and 2 for the input gradient (no
    weight gradient), 4 * matmul_params; the adapters 6 per weight (`lora_params`);
  * embedding lookups, norms, activations, softmax and the optimizer are not counted.
"""

from __future__ import annotations

import jax
import numpy as np

from lm.model.config import ModelConfig


def qkv_params(cfg: ModelConfig) -> int:
    """A layer's weights from its input to the queries, keys and values: q / k / v, or latent
    attention's query path, latent, rotary key and up-projections."""
    d, h = cfg.embed_dim, cfg.num_heads
    if cfg.latent_attention:
        query = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim if cfg.q_lora_rank else d * h * cfg.qk_head_dim
        return query + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return d * (h + 2 * cfg.num_kv_heads) * cfg.head_dim


def matmul_params(cfg: ModelConfig) -> int:
    """The matmul weights a token goes through (a mixture of experts: its active ones), with
    the multi-token prediction modules training runs (each its projection, block and the head)."""
    d, f = cfg.embed_dim, cfg.mlp_dim
    attention = qkv_params(cfg) + cfg.num_heads * cfg.value_head_dim * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * f
    sparse = 3 * d * cfg.expert_width * (cfg.experts_per_token + cfg.shared_experts) + d * cfg.num_experts if cfg.moe else 0
    head = d * cfg.vocab_size
    mtp = cfg.mtp_trained * (2 * d * d + attention + (sparse if cfg.mtp_sparse else mlp) + head)
    return cfg.num_layers * attention + cfg.dense_layers * mlp + cfg.sparse_layers * sparse + head + mtp


def lora_params(cfg: ModelConfig) -> int:
    """The LoRA adapters' weights a token goes through (0 without LoRA): rank x (inputs +
    outputs) of each adapted matmul, in attention, the dense and shared-expert MLPs and the
    token's routed experts."""
    if not cfg.lora:
        return 0
    d, q, kv = cfg.embed_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    widths = {"q": d + q, "k": d + kv, "v": d + kv, "o": q + d}
    if cfg.latent_attention:  # (fused kv_a, kv_b: one A, a B per part)
        h, r, qk = cfg.num_heads, cfg.kv_lora_rank, cfg.num_heads * cfg.qk_head_dim
        widths = {"q": d + qk, "q_a": d + cfg.q_lora_rank, "q_b": cfg.q_lora_rank + qk, "kv_a": d + r + cfg.qk_rope_head_dim,
                  "kv_b": r + h * (cfg.qk_nope_head_dim + cfg.v_head_dim), "o": h * cfg.v_head_dim + d}
        widths = {t: n for t, n in widths.items() if t not in ("q_a", "q_b")} if not cfg.q_lora_rank else {t: n for t, n in widths.items() if t != "q"}
    attention = sum(widths[t] for t in cfg.lora_targets if t in widths)

    def mlp(f: int, swiglu: bool) -> int:
        return sum(d + f for t in cfg.lora_targets if t in ("up", "down") or (t == "gate" and swiglu))

    shared = mlp(cfg.shared_experts * cfg.expert_width, True) if cfg.moe and cfg.shared_experts else 0
    # A token's routed experts: one A for gate and up (d x r), a B for each and for down (f x r), down's A, B.
    if cfg.moe and "experts" in cfg.lora_targets:
        shared += cfg.experts_per_token * (2 * d + 3 * cfg.expert_width)
    dense = mlp(cfg.mlp_dim, cfg.mlp == "swiglu")
    per_layer = cfg.num_layers * attention + cfg.dense_layers * dense + cfg.sparse_layers * shared
    mtp = cfg.mtp_trained * (attention + (shared if cfg.mtp_sparse else dense))
    return cfg.lora_rank * (per_layer + mtp)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token; see the module docstring."""
    frozen = 4.0 if cfg.lora else 6.0  # LoRA: the base has no weight gradients
    return frozen * matmul_params(cfg) + 6.0 * lora_params(cfg) + 3 * attention_flops(cfg, seq_len)


def attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Causal attention's forward FLOPs per token: the scores over queries and keys and the
    weighted sum over values, each 2 * T * heads * width, halved for causality."""
    return 1.0 * (cfg.num_layers + cfg.mtp_trained) * seq_len * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def split_backward_flops(cfg: ModelConfig, seq_len: int, remat: str = "none") -> dict[str, float]:
    """FLOPs per token of the layers' forward (F), input gradient (B) and matmul weights'
    gradients (W), the split a zero-bubble pipeline schedules (`sharding.zero_bubble`): the
    matmuls cost 2 per weight in each, attention's 2 * T * heads * head_dim (causal) forward and
    twice that in B (its backward has no weights); under the layers' `remat` full, B also runs
    each layer's forward again. The head is not in the pipeline's stages."""
    layer_matmuls = matmul_params(cfg) - cfg.embed_dim * cfg.vocab_size
    attention = attention_flops(cfg, seq_len)
    forward = 2.0 * layer_matmuls + attention
    return {"F": forward, "B": 2.0 * layer_matmuls + 2 * attention + forward * (remat == "full"), "W": 2.0 * layer_matmuls}
