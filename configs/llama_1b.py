"""A Llama-3.2-1B-shaped model: 16 layers, width 2048, 32 heads / 8 KV heads, SwiGLU 8192.

A recipe for accelerators; the BPE tokenizer (32768 ids) is trained on your corpus. 64 sequences
of 2048 per step, as 4 microbatches of 16 with remat `dots` (matmul results kept, the rest
recomputed) and the layers unrolled (a scan over them copies every kept result into its stacked
buffer, zero-filled and copied whole each microbatch: 157 ms of a 1.85 s H100 step); the weights
are cast to bf16 once a step (`lm.model.cast_weights`); on GPUs the elementwise work beside each
GEMM runs inside it (`train.gemm_fusion=auto`: XLA's GEMM fusion v2, not with fp8 or tensor). On one H100
the step-time model reads 86,034 tokens/s (57.8% MFU) from this program (`lm.layout
--config=configs/llama_1b.py --target=h100 --devices=1`; 78,079 with
`--config.train.gemm_fusion=operands`); PERFORMANCE.md compares it with the scanned, remat `full`
(which ran at 64,232 on an H100) and head-dim-128 forms."""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=16,
        embed_dim=2048,
        num_heads=32,
        num_kv_heads=8,
        mlp_dim=8192,
        rope_theta=500_000.0,
        tie_embeddings=True,
        remat="dots",
        scan_layers=False,
    )
    c.data.update(tokenizer="bpe", vocab_size=32768)
    c.train.update(steps=100_000, batch_size=64, grad_accum=4, seq_len=2048, log_every=20, eval_every=1000, eval_batches=10,
                   gemm_fusion="auto")
    c.optim.update(lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, b2=0.95, weight_decay=0.1)
    c.checkpoint.every_steps = 1000
    c.precision.compute_dtype = "bfloat16"
    return c
