"""A Moonlight-16B-A3B-shaped model (moonshotai's, `model_type: deepseek_v3`, trained with Muon):
27 layers of width 2048, the first dense (SwiGLU 11264), the rest 64 routed SwiGLU experts of width
1408, 6 per token, plus two shared; multi-head latent attention with 16 heads, full-rank queries,
keys and values from one rank-512 latent (128 + 64 rotary query-key and 128 value features per
head); DeepSeek-V3's sigmoid router without groups (routed scaling 2.446, loss-free balancing);
vocabulary 163,840, untied. 16.0B parameters, 3B active per token: a mixture of experts for 8-64 GPUs.

    python -m lm.plan --config=configs/moonlight_16b.py --gpus=8
    python -m lm.layout --config=configs/moonlight_16b.py --target=h100 --devices=8 --no_compile
Fine-tune the released weights: `python -m lm.convert from_hf` then `lm.train --config.init.from_hf=...`.
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=27, embed_dim=2048, num_heads=16, num_kv_heads=16, head_dim=192, mlp_dim=11264, norm_eps=1e-5, rope_theta=50_000.0,
        kv_lora_rank=512, q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
        num_experts=64, experts_per_token=6, expert_mlp_dim=1408, shared_experts=2, moe_layers="from:1",
        router_score="sigmoid", router_scale=2.446, router_renormalize=True,
        expert_bias_rate=0.001, router_aux_loss_coef=0.0, remat="full",
    )
    c.data.update(tokenizer="bpe", vocab_size=163840)
    c.train.update(steps=50_000, batch_size=256, seq_len=8192, log_every=10, eval_every=1000, eval_batches=10)
    c.optim.update(name="muon", lr=4.2e-4, min_lr_ratio=0.1, warmup_steps=1000, b2=0.95, weight_decay=0.1)
    c.checkpoint.every_steps = 500
    c.precision.compute_dtype = "bfloat16"
    c.mesh.update(data=1, expert=8, fsdp=-1)
    return c
