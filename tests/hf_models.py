"""Tiny random `transformers` models, made offline, and meshlm's view of them (for test_hf.py and
notebooks/hf_finetune.ipynb)."""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import numpy as np

import sharding
from lm import config as lm_config
from lm.data.tokenizer import ByteTokenizer
from lm.hf import checkpoint as hf_checkpoint
from lm.hf.safetensors_dir import Reader
from lm.program.spec import RunSpec
from lm.program.abstract_model import AbstractModel

VOCAB = 301  # not a multiple of 128: the import pads it

FAMILIES = {
    "llama": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=5),
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mixtral": dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
    # Multi-head latent attention with a low-rank query, 8 experts in 4 groups (2 chosen), a shared
    # expert, the first layer dense.
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5),
}


def make_hf_model(directory: Path, family: str, std: float = 0.5, seed: int = 0, dtype: str = "float32", tokenizer: bool = True, max_shard_size: str | None = None, **overrides):
    """A `transformers` model of `family` with weights ~ N(0, std) (norm scales ~ 1 + N(0, 0.1),
    so logits are far from uniform), saved with `save_pretrained` into `directory`; returns it."""
    import torch
    import transformers

    kind = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mixtral": "MixtralConfig",
            "qwen3_moe": "Qwen3MoeConfig", "gpt2": "GPT2Config", "deepseek_v3": "DeepseekV3Config"}[family]
    # A copy: transformers writes into the rope settings it is given.
    config = getattr(transformers, kind)(vocab_size=VOCAB, **copy.deepcopy({**FAMILIES[family], **overrides}))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name or ".ln_" in name or name.startswith("ln_") or "transformer.ln_f" in name
            if norm and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's selection bias: made to matter
                buffer.normal_(0.0, 0.3)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        ByteTokenizer().save_hf(directory / "tokenizer.json")
    return model


def hf_logits(model, tokens_bt: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens_bt, dtype=torch.long)).logits.float().numpy()


def imported(hf_dir: Path, mesh: dict | None = None, devices=None, **overrides):
    """(layout, params) of a checkpoint imported in memory (no run directory)."""
    hf_dir, hf_config = hf_checkpoint.read_hf_config(hf_dir)
    keys = {"model.attention": "einsum", **{f"mesh.{k}": v for k, v in (mesh or {"data": 1}).items()}, **overrides}
    config = hf_checkpoint.config_from_hf(lm_config.default_config(), hf_dir, hf_config, keys)
    spec = RunSpec.parse(config, 0)
    devices = devices or jax.devices()[: max(1, int(np.prod(list((mesh or {"data": 1}).values()))))]
    layout = AbstractModel(spec, sharding.make_mesh(spec.mesh, devices))
    return layout, hf_checkpoint.load_params(Reader(hf_dir), layout)


def meshlm_logits(layout, params, tokens_bt: np.ndarray) -> np.ndarray:
    """Logits over the real vocabulary (the padding columns dropped)."""
    model = layout.model(params)
    with sharding.activate(layout.mesh, layout.rules):
        logits = jax.jit(lambda m, t: m(t)[0])(model, tokens_bt)
    return np.asarray(logits)[..., : layout.spec.model.used_vocab]


def add_mtp_layers(directory: Path, depth: int = 1, std: float = 0.5, seed: int = 1) -> dict:
    """DeepSeek-V3's multi-token prediction layers added to the checkpoint `make_hf_model` wrote
    (`transformers` has no module for them and drops them): layers L .. L + depth - 1, each a
    block like the last layer's (from a deeper random model), its norms and projection, and copies
    of the embedding and head, in a second shard with an index. Returns the new tensors."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((directory / "config.json").read_text())
    layers, d = config["num_hidden_layers"], config["hidden_size"]
    make_hf_model(directory / "deeper", "deepseek_v3", std=std, seed=seed, tokenizer=False,
                  num_hidden_layers=layers + depth, first_k_dense_replace=config["first_k_dense_replace"])
    main = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    # (as saved, not the live model's fused experts)
    added = {name: tensor for name, tensor in load_file(directory / "deeper" / "model.safetensors").items()
             if any(name.startswith(f"model.layers.{i}.") for i in range(layers, layers + depth))}
    for i in range(layers, layers + depth):
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            added[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(d, generator=generator)
        added[f"model.layers.{i}.eh_proj.weight"] = std * torch.randn(d, 2 * d, generator=generator)
        added[f"model.layers.{i}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        added[f"model.layers.{i}.shared_head.head.weight"] = main["lm_head.weight"].clone()
    import shutil

    shutil.rmtree(directory / "deeper")
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    save_file(added, directory / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(main, "model-00001-of-00002.safetensors"), **dict.fromkeys(added, "model-00002-of-00002.safetensors")}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": depth}))
    return {k: v.numpy() for k, v in added.items()}
