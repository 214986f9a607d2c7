"""Two layers of `mixtral_8x7b.py` on one GPU: its expert GEMM shapes (8 SwiGLU experts of
4096 x 14336, 2 per token) at sequences of 2048, to measure the dropless grouped GEMM, the capacity
mode and a dense model of the same active width (`--config.model.num_experts=0
--config.model.mlp_dim=28672`) on a single H100 (`benchmarks/gpu.py`'s MoE cases).

A speed proxy, not a model to train: 3.0B parameters (tied embeddings over a 32768-id vocabulary),
about 48 GB of float32 weights and AdamW moments, so it fits one 80 GB GPU with remat `full`.

    python -m lm.bench --config=configs/mixtral_layers.py --config.precision.compute_dtype=bfloat16
"""

from pathlib import Path

from lm.recipe import load_file


def get_config():
    c = load_file(str(Path(__file__).with_name("mixtral_8x7b.py")))
    c.model.update(num_layers=2, tie_embeddings=True, remat="full")
    c.data.vocab_size = 32768
    c.train.update(batch_size=4, seq_len=2048, grad_accum=1)
    c.mesh.update(data=1, fsdp=1, expert=1)
    return c
