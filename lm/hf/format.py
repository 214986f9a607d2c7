"""The Hugging Face `transformers` format: which of its models meshlm represents exactly, how a
`config.json` maps onto meshlm's `model` keys (and back), and how each checkpoint tensor maps
onto meshlm's parameters (`lm.hf.tensors`). No I/O and no torch here: `lm.convert` moves the tensors.

Families: Llama (2, 3, 3.1's `llama3` RoPE scaling), Mistral (sliding-window attention), Qwen2
(biases on q / k / v), Qwen3 (q / k RMSNorm), the mixtures of experts Mixtral and Qwen3-MoE (one
checkpoint tensor per layer and expert) and GPT-2 (LayerNorm, learned positions, GELU, biases,
fused `c_attn` in Conv1D's `(in, out)` layout). A `config.json` meshlm cannot represent exactly is a UserError
naming the field; an import is never approximate.

RoPE: meshlm's rotary embedding is the rotate-half form `transformers` uses, so q / k weights are
copied as they are (Meta's original Llama weights, in the interleaved form, would need the row
permutation that `transformers`' own conversion script applies; we read HF checkpoints only).
Grouped-query heads: query head j uses kv head j // (num_heads / num_kv_heads) in both.
"""

from __future__ import annotations

from lm.config import UserError
from lm.model.config import ModelConfig

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
FAMILIES = (*LLAMA_LIKE, "gpt2")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "gpt2": "GPT2LMHeadModel",
}
# Families meshlm knows but cannot represent: the field that says why.
UNSUPPORTED = {"deepseek_v2": "topk_method"}
# DeepSeek-V3's loss-free balancing on import: how fast the routers' selection bias moves toward an
# even load while training (the paper's bias update speed); 0 freezes it.
DEEPSEEK_BIAS_RATE = 0.001


def _unsupported(field: str, value, why: str) -> UserError:
    return UserError(f"config.json: {field}={value!r} cannot be represented exactly by meshlm ({why})")


def _require(hf: dict, field: str, allowed, default, why: str):
    value = hf.get(field, default)
    if value not in allowed:
        raise _unsupported(field, value, why)
    return value


def family(hf: dict) -> str:
    kind = hf.get("model_type")
    if kind in UNSUPPORTED:
        field = UNSUPPORTED[kind]
        raise _unsupported(field, hf.get(field), "DeepSeek-V2's softmax routing over device groups is not modelled; DeepSeek-V3's is")
    if kind not in FAMILIES:
        raise UserError(f"config.json: model_type={kind!r} is not supported; meshlm imports {', '.join(FAMILIES)}")
    return kind


def _rope_keys(hf: dict) -> dict:
    """`model.rope_*` keys from transformers 5's `rope_parameters` or 4.x's `rope_theta` and
    `rope_scaling` (either spelling is read)."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(field) or {}
    if hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _unsupported("partial_rotary_factor", hf.get("partial_rotary_factor", params.get("partial_rotary_factor")), "RoPE on every head feature only")
    kind = params.get("rope_type", params.get("type", "default"))
    keys = {"model.rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))}
    if kind == "default":
        return {**keys, "model.rope_scaling": "none"}
    if kind == "linear":
        return {**keys, "model.rope_scaling": "linear", "model.rope_factor": float(params["factor"])}
    if kind == "llama3":
        return {
            **keys,
            "model.rope_scaling": "llama3",
            "model.rope_factor": float(params["factor"]),
            "model.rope_low_freq_factor": float(params["low_freq_factor"]),
            "model.rope_high_freq_factor": float(params["high_freq_factor"]),
            "model.rope_original_max_len": int(params["original_max_position_embeddings"]),
        }
    if kind == "yarn":
        for unset in ("attention_factor",):
            if params.get(unset) is not None:
                raise _unsupported(f"{field}.{unset}", params[unset], "YaRN's attention factor is derived from its mscales")
        if params.get("truncate", True) is not True:
            raise _unsupported(f"{field}.truncate", params["truncate"], "YaRN's ramp bounds are rounded outwards")
        original = int(params["original_max_position_embeddings"])
        return {
            **keys,
            "model.rope_scaling": "yarn",
            "model.rope_factor": float(params.get("factor") or hf["max_position_embeddings"] / original),
            "model.rope_original_max_len": original,
            "model.rope_beta_fast": float(params.get("beta_fast") or 32),
            "model.rope_beta_slow": float(params.get("beta_slow") or 1),
            "model.rope_mscale": float(params.get("mscale") or 0),
            "model.rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0),
        }
    raise _unsupported(f"{field}.rope_type", kind, "meshlm scales RoPE as default, linear, llama3 or yarn")


def model_keys(hf: dict) -> dict:
    """The meshlm `model.*` config keys (dotted, as overrides) that represent `hf` exactly."""
    kind = family(hf)
    try:
        return _model_keys(hf, kind)
    except KeyError as e:
        raise UserError(f"config.json: a {kind} config needs {e.args[0]!r}, which this one lacks; pass the config.json "
                        "that transformers' save_pretrained wrote") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise UserError(f"config.json: a {kind} field has a value of the wrong kind ({e}); pass the config.json "
                        "that transformers' save_pretrained wrote") from None


def _model_keys(hf: dict, kind: str) -> dict:
    if kind == "gpt2":
        d = hf.get("n_embd", 768)
        _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new", "meshlm's GELU is the tanh approximation")
        _require(hf, "scale_attn_weights", (True,), True, "attention scores are scaled by 1/sqrt(head_dim)")
        _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False, "no per-layer attention scaling")
        heads = hf.get("n_head", 12)
        return {
            "model.num_layers": hf.get("n_layer", 12),
            "model.embed_dim": d,
            "model.num_heads": heads,
            "model.num_kv_heads": heads,
            "model.head_dim": d // heads,
            "model.mlp_dim": hf.get("n_inner") or 4 * d,
            "model.norm": "layernorm",
            "model.norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "model.position": "learned",
            "model.max_positions": hf.get("n_positions", 1024),
            "model.mlp": "gelu",
            "model.use_bias": True,
            "model.qkv_bias": False,
            "model.tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "model.vocab_size": hf["vocab_size"],
            "model.sliding_window": 0,
            "model.rope_scaling": "none",
        }
    _require(hf, "hidden_act", ("silu",), "silu", "meshlm's SwiGLU gates with SiLU")
    if kind == "llama":
        _require(hf, "attention_bias", (False,), False, "no attention biases in a Llama block")
        _require(hf, "mlp_bias", (False,), False, "no MLP biases in a Llama block")
    window = 0
    if kind in ("mistral", "mixtral"):
        window = hf.get("sliding_window") or 0
    if kind in ("qwen3", "qwen3_moe"):
        _require(hf, "attention_bias", (False,), False, "no attention biases in a Qwen3 block")
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        _require(hf, "use_sliding_window", (False, None), False, "Qwen2's per-layer sliding windows are not modelled")
        layer_types = set(hf.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise _unsupported("layer_types", sorted(layer_types), "every layer must use full attention")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if kind == "deepseek_v3":
        _require(hf, "attention_bias", (False,), False, "no attention biases in a DeepSeek-V3 block")
        quantized = hf.get("quantization_config") or {}
        if quantized and (quantized.get("quant_method"), quantized.get("fmt", "e4m3"), len(quantized.get("weight_block_size") or [])) != ("fp8", "e4m3", 2):
            raise _unsupported("quantization_config", quantized.get("quant_method"), "float8 e4m3 weights with 2-D block scales are "
                               "dequantised on import; other quantisations are not read")
    return {
        "model.num_layers": hf["num_hidden_layers"],
        "model.embed_dim": d,
        "model.num_heads": heads,
        "model.num_kv_heads": hf.get("num_key_value_heads") or heads,
        "model.head_dim": hf.get("head_dim") or d // heads,
        "model.mlp_dim": hf["intermediate_size"],
        "model.norm": "rmsnorm",
        "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "model.position": "rope",
        "model.max_positions": 0,
        "model.mlp": "swiglu",
        "model.use_bias": False,
        "model.qkv_bias": kind == "qwen2",
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.vocab_size": hf["vocab_size"],
        "model.sliding_window": window,
        "model.qk_norm": kind in ("qwen3", "qwen3_moe"),
        **_rope_keys(hf),
        **_expert_keys(hf, kind),
        **_latent_keys(hf, kind),
        "model.mtp_depth": int(hf.get("num_nextn_predict_layers") or 0) if kind == "deepseek_v3" else 0,
    }


def _latent_keys(hf: dict, kind: str) -> dict:
    """Multi-head latent attention's `model.*` keys of a DeepSeek-V3 config ({} otherwise)."""
    if kind != "deepseek_v3":
        return {"model.kv_lora_rank": 0}
    return {
        "model.kv_lora_rank": hf["kv_lora_rank"],
        "model.q_lora_rank": hf.get("q_lora_rank") or 0,
        "model.qk_nope_head_dim": hf["qk_nope_head_dim"],
        "model.qk_rope_head_dim": hf["qk_rope_head_dim"],
        "model.v_head_dim": hf["v_head_dim"],
        "model.head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        "model.num_kv_heads": hf["num_attention_heads"],
        "model.rope_interleave": bool(hf.get("rope_interleave", True)),
    }


def _expert_keys(hf: dict, kind: str) -> dict:
    """The mixture-of-experts `model.*` keys of a Mixtral or Qwen3-MoE config ({} otherwise)."""
    if kind == "mixtral":
        _require(hf, "router_jitter_noise", (0, 0.0, None), 0.0, "no noise on the router's logits")
        width, renormalize, moe_layers = hf["intermediate_size"], True, "all"
    elif kind == "qwen3_moe":
        n, step, only = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
        dense = [i for i in range(n) if i in only or (i + 1) % step]  # transformers' rule for a sparse layer, negated
        if len(dense) >= n:
            raise _unsupported("mlp_only_layers", sorted(only), "at least one layer must be a mixture of experts")
        width, renormalize = hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", False))
        moe_layers = moe_layers_spec(dense, n)
    elif kind == "deepseek_v3":
        _require(hf, "scoring_func", ("sigmoid",), "sigmoid", "DeepSeek-V3's router scores are sigmoids")
        _require(hf, "topk_method", ("noaux_tc",), "noaux_tc", "DeepSeek-V3's router chooses by group, with the selection bias")
        dense = hf.get("first_k_dense_replace") or 0
        if dense >= hf["num_hidden_layers"] or hf.get("moe_layer_freq", 1) != 1:
            raise _unsupported("first_k_dense_replace", dense, "the first layers dense, every later one a mixture of experts")
        return {
            "model.num_experts": hf["n_routed_experts"],
            "model.experts_per_token": hf["num_experts_per_tok"],
            "model.expert_mlp_dim": hf["moe_intermediate_size"],
            "model.moe_layers": f"from:{dense}" if dense else "all",
            "model.shared_experts": hf.get("n_shared_experts") or 0,
            "model.expert_bias_rate": DEEPSEEK_BIAS_RATE,
            "model.router_renormalize": bool(hf.get("norm_topk_prob", True)),
            "model.router_aux_loss_coef": 0.0,  # balanced by the selection bias instead (loss-free)
            "model.router_aux_loss_per": "sequence",  # DeepSeek-V3's complementary loss, where a coefficient is set
            "model.router_score": "sigmoid",
            "model.router_groups": hf.get("n_group") or 1,
            "model.router_groups_chosen": hf.get("topk_group") or 1,
            "model.router_scale": float(hf.get("routed_scaling_factor", 1.0)),
        }
    else:
        return {"model.num_experts": 0, "model.expert_bias_rate": 0.0}
    return {
        "model.num_experts": hf.get("num_local_experts") or hf["num_experts"],
        "model.experts_per_token": hf["num_experts_per_tok"],
        "model.expert_mlp_dim": width,
        "model.moe_layers": moe_layers,
        "model.shared_experts": 0,
        "model.expert_bias_rate": 0.0,
        "model.router_renormalize": renormalize,
        "model.router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        "model.router_aux_loss_per": "batch",
        "model.router_score": "softmax",
        "model.router_groups": 1,
        "model.router_groups_chosen": 1,
        "model.router_scale": 1.0,
    }


def moe_layers_spec(dense: list[int], num_layers: int) -> str:
    """The `model.moe_layers` value whose dense layers are `dense` (model indices), in its
    shortest form."""
    if not dense:
        return "all"
    if dense == list(range(len(dense))):
        return f"from:{len(dense)}"
    for step in range(2, num_layers + 1):
        if dense == [i for i in range(num_layers) if (i + 1) % step]:
            return f"every:{step}"
    return "dense:" + ",".join(map(str, dense))


def family_of(cfg: ModelConfig) -> str:
    """The `transformers` family that represents a meshlm model exactly, or a UserError."""
    if cfg.position == "learned":
        if cfg.norm == "layernorm" and cfg.mlp == "gelu" and cfg.use_bias and cfg.num_kv_heads == cfg.num_heads and cfg.num_heads * cfg.head_dim == cfg.embed_dim:
            return "gpt2"
    elif cfg.latent_attention:
        if (not cfg.mtp_depth or cfg.mtp_sparse) and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and not cfg.use_bias and not cfg.qkv_bias and not cfg.qk_norm and not cfg.sliding_window \
                and cfg.position == "rope" and (not cfg.moe or cfg.router_score == "sigmoid" and cfg.dense_layer_ids == tuple(range(cfg.dense_layers))):
            return "deepseek_v3"
    elif cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and not cfg.use_bias and not cfg.shared_experts and not cfg.expert_bias_rate and not cfg.mtp_depth \
            and cfg.router_score == "softmax" and cfg.router_groups == 1 and cfg.router_scale == 1.0:
        if cfg.moe and not cfg.qkv_bias:
            if cfg.qk_norm and not cfg.sliding_window:
                return "qwen3_moe"
            if not cfg.qk_norm and cfg.router_renormalize and not cfg.dense_layers:  # Mixtral: every layer sparse
                return "mixtral"
        elif cfg.qk_norm:
            if not cfg.qkv_bias and not cfg.sliding_window:
                return "qwen3"
        elif cfg.qkv_bias:
            if not cfg.sliding_window:
                return "qwen2"
        else:
            return "mistral" if cfg.sliding_window else "llama"
    raise UserError(
        f"this model (norm={cfg.norm}, position={cfg.position}, mlp={cfg.mlp}, use_bias={cfg.use_bias}, qkv_bias={cfg.qkv_bias}, "
        f"qk_norm={cfg.qk_norm}, sliding_window={cfg.sliding_window}, num_experts={cfg.num_experts}, shared_experts={cfg.shared_experts}, "
        f"router_renormalize={cfg.router_renormalize}, expert_bias_rate={cfg.expert_bias_rate}, mtp_depth={cfg.mtp_depth}) has no exact Hugging Face equivalent; export supports Llama-, Mistral-, "
        "Qwen2-, Qwen3-, Mixtral-, Qwen3-MoE-, DeepSeek-V3- and GPT-2-shaped models"
    )
