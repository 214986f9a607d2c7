"""A Qwen3-30B-A3B-shaped model: 48 layers, width 2048, 32 query heads / 4 KV heads of dimension
128 with q / k RMSNorm, 128 SwiGLU experts of width 768, 8 per token (renormalised), vocabulary
151936, untied embeddings. 30.5B parameters, 3.3B active per token.

For planning and compiling: `python -m lm.plan --config=configs/qwen3_30b_a3b.py --gpus=8`,
`python -m lm.layout --config=configs/qwen3_30b_a3b.py --target=h100 --config.mesh.expert=8`.
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=48, embed_dim=2048, num_heads=32, num_kv_heads=4, head_dim=128, mlp_dim=6144, qk_norm=True,
        rope_theta=1_000_000.0, norm_eps=1e-6, num_experts=128, experts_per_token=8, expert_mlp_dim=768,
        router_renormalize=True, router_aux_loss_coef=0.001, remat="full",
    )
    c.data.update(tokenizer="bpe", vocab_size=151936)
    c.train.update(steps=100_000, batch_size=8, seq_len=4096, log_every=10, eval_every=1000, eval_batches=10)
    c.optim.update(lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, b2=0.95, weight_decay=0.1)
    c.checkpoint.every_steps = 500
    c.precision.compute_dtype = "bfloat16"
    c.mesh.update(data=1, expert=8, fsdp=-1)
    return c
