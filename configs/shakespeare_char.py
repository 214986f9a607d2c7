"""The classic CPU "baby GPT": GPT-2-style, 4 layers, 4 heads, width 128, context 64, batch 12.

Byte tokens (Shakespeare is ASCII, so bytes are characters). The data path is yours to give:
    python -m lm.train --config=configs/shakespeare_char.py --workdir=runs/shakespeare \
        --config.data.path=path/to/tinyshakespeare.txt
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=4,
        embed_dim=128,
        num_heads=4,
        num_kv_heads=4,
        mlp_dim=512,
        norm="layernorm",
        position="learned",
        mlp="gelu",
        use_bias=True,
        tie_embeddings=True,
        scan_layers=False,  # 4 layers: unrolled runs faster on CPU (see PERFORMANCE.md)
    )
    c.train.update(steps=2000, batch_size=12, seq_len=64, log_every=50, eval_every=250, eval_batches=20)
    c.optim.update(lr=1e-3, min_lr_ratio=0.1, warmup_steps=100, b2=0.99, weight_decay=0.1, clip_norm=1.0)
    c.checkpoint.every_steps = 1000
    # float32 master weights; bf16 matmuls: faster on CPUs with AMX or AVX-512 BF16 (`lm.bench`
    # says: cpu_bf16_units), slower elsewhere: there --config.precision.compute_dtype=float32.
    c.precision.compute_dtype = "bfloat16"
    return c
