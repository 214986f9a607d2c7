"""GPT-2 small (124M): 12 layers, 12 heads, width 768, context 1024, BPE vocabulary 50257.

A recipe for accelerators; the BPE tokenizer is trained on your corpus (--config.data.path).
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=12,
        embed_dim=768,
        num_heads=12,
        num_kv_heads=12,
        mlp_dim=3072,
        norm="layernorm",
        position="learned",
        mlp="gelu",
        use_bias=True,
        tie_embeddings=True,
        remat="dots_no_batch",
    )
    c.data.update(tokenizer="bpe", vocab_size=50257)
    c.train.update(steps=100_000, batch_size=64, seq_len=1024, log_every=20, eval_every=1000, eval_batches=20)
    c.optim.update(lr=6e-4, min_lr_ratio=0.1, warmup_steps=2000, b2=0.95, weight_decay=0.1)
    c.checkpoint.every_steps = 2000
    c.precision.compute_dtype = "bfloat16"
    return c
