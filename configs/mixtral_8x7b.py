"""A Mixtral-8x7B-shaped model: 32 layers, width 4096, 32 heads / 8 KV heads, 8 SwiGLU experts of
width 14336, 2 per token (softmax over the chosen), vocabulary 32000, untied embeddings. 46.7B
parameters, 12.9B active per token.

Sized for 64 GPUs (8 hosts of 8), as Megatron-Core trains it: 256 sequences of 4096, 1M tokens a
step (16,384 per GPU; the planner adds gradient accumulation where memory needs it). Under expert
parallelism each device dispatches its tokens in 2 chunks, so that one chunk's all-to-alls run
beside the other's expert GEMMs.

For planning and compiling: `python -m lm.plan --config=configs/mixtral_8x7b.py --gpus=64 --verify`,
`python -m lm.layout --config=configs/mixtral_8x7b.py --target=h100 --config.mesh.expert=8`.
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=32, embed_dim=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336, rope_theta=1_000_000.0,
        num_experts=8, experts_per_token=2, router_renormalize=True, router_aux_loss_coef=0.02, remat="full",
        expert_dispatch_chunks=2,
    )
    c.data.update(tokenizer="bpe", vocab_size=32000)
    c.train.update(steps=100_000, batch_size=256, seq_len=4096, log_every=10, eval_every=1000, eval_batches=10)
    c.optim.update(lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, b2=0.95, weight_decay=0.1)
    c.checkpoint.every_steps = 500
    c.precision.compute_dtype = "bfloat16"
    c.mesh.update(data=1, expert=8, fsdp=-1)
    return c
