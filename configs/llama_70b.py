"""A Llama-3-70B-shaped model: 80 layers, width 8192, 64 heads / 8 KV heads, SwiGLU 28672,
vocabulary 128256, context 8192, untied embeddings.

The layout of NVIDIA's MaxText Llama-3-70B H100 recipe: fully sharded over every GPU (data
parallel beyond 128), two sequences per GPU, remat keeping the q / k / v projections; 256
sequences per step as on 128 GPUs. `python -m lm.plan --config=configs/llama_70b.py --gpus=128
--target=h100` ranks the other ways to run it.
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=80,
        embed_dim=8192,
        num_heads=64,
        num_kv_heads=8,
        mlp_dim=28672,
        rope_theta=500_000.0,
        tie_embeddings=False,
        remat="qkv_proj",
    )
    c.data.update(tokenizer="bpe", vocab_size=128256)
    c.train.update(steps=100_000, batch_size=256, seq_len=8192, log_every=10, eval_every=1000, eval_batches=10)
    c.optim.update(lr=1.5e-4, min_lr_ratio=0.1, warmup_steps=2000, b2=0.95, weight_decay=0.1)
    c.checkpoint.every_steps = 500
    c.precision.compute_dtype = "bfloat16"
    c.mesh.update(data=1, fsdp=-1)
    return c
