"""A DeepSeek-V3-shaped model (also R1's; Kimi-K2 is the same architecture, wider in experts): 61
layers of width 7168, the first 3 dense (SwiGLU 18432), the rest 256 routed SwiGLU experts of width
2048, 8 per token, plus one shared; multi-head latent attention with 128 heads (queries through a
rank-1536 latent, keys and values from one rank-512 latent, 128 + 64 rotary query-key and 128 value
features per head), YaRN for 4096 -> 163,840 positions; the router DeepSeek's (sigmoid scores, 8
groups of which 4 are searched, routed scaling 2.5, loss-free balancing with a small sequence-wise
loss); vocabulary 129,280, untied; one multi-token prediction module (weight 0.3, as DeepSeek-V3's
first 10T tokens). 671B parameters in the model, 37B active per token, and 11.6B in the module.

For planning and compiling: `python -m lm.plan --config=configs/deepseek_v3.py --gpus=256`,
`python -m lm.layout --config=configs/deepseek_v3.py --target=h100 --devices=64 --no_compile`.
Import the released weights with `python -m lm.convert from_hf` (their float8 blocks dequantised).
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=61, embed_dim=7168, num_heads=128, num_kv_heads=128, head_dim=192, mlp_dim=18432, norm_eps=1e-6,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
        rope_scaling="yarn", rope_factor=40.0, rope_original_max_len=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        num_experts=256, experts_per_token=8, expert_mlp_dim=2048, shared_experts=1, moe_layers="from:3",
        router_score="sigmoid", router_groups=8, router_groups_chosen=4, router_scale=2.5, router_renormalize=True,
        expert_bias_rate=0.001, router_aux_loss_coef=0.0001, router_aux_loss_per="sequence", remat="full", expert_dispatch_chunks=2,
        mtp_depth=1, mtp_loss_weight=0.3,
    )
    c.data.update(tokenizer="bpe", vocab_size=129280)
    c.train.update(steps=100_000, batch_size=1024, seq_len=4096, log_every=10, eval_every=1000, eval_batches=10)
    c.optim.update(lr=2.2e-4, min_lr_ratio=0.1, warmup_steps=2000, b2=0.95, weight_decay=0.1)
    c.checkpoint.every_steps = 500
    c.precision.compute_dtype = "bfloat16"
    c.mesh.update(data=1, expert=8, fsdp=-1)
    return c
