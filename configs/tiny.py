"""The default: a ~1M-parameter Llama-style model on the built-in code corpus, byte tokens.

Loss falls visibly within two minutes on a 2-core CPU.
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(num_layers=4, embed_dim=128, num_heads=4, num_kv_heads=2, mlp_dim=384, scan_layers=False)
    c.train.update(steps=500, batch_size=16, seq_len=128, log_every=10, eval_every=100, eval_batches=4)
    c.optim.update(lr=2e-3, warmup_steps=50)
    c.checkpoint.every_steps = 250
    # float32 master weights; bf16 matmuls: faster on CPUs with AMX or AVX-512 BF16 (`lm.bench`
    # says: cpu_bf16_units), slower elsewhere: there --config.precision.compute_dtype=float32.
    c.precision.compute_dtype = "bfloat16"
    return c
