"""Four layers of `llama_70b.py` on one GPU: its GEMM shapes (width 8192, SwiGLU 28672, 64 heads /
8 KV heads) at sequences of 2048, to see on a single H100 what a number format does at 70B width.

A speed proxy, not a model to train: 3.6B parameters (tied embeddings over a 32768-id vocabulary),
about 58 GB of float32 weights and AdamW moments, so it fits one 80 GB GPU with remat `full`.

    python -m lm.bench --config=configs/llama_70b_layers.py [--config.precision.fp8=delayed]
"""

from pathlib import Path

from lm.recipe import load_file


def get_config():
    c = load_file(str(Path(__file__).with_name("llama_70b.py")))
    c.model.update(num_layers=4, tie_embeddings=True, remat="full")
    c.data.vocab_size = 32768
    c.train.update(batch_size=4, seq_len=2048)
    c.mesh.update(data=1, fsdp=1)
    return c
