"""A Qwen3-30B-A3B-shaped model: 48 layers, width 2048, 32 query heads / 4 KV heads of dimension
128 with q / k RMSNorm, 128 SwiGLU experts of width 768, 8 per token (renormalised), vocabulary
151936, untied embeddings. 30.5B parameters, 3.3B active per token. Trained as `mixtral_8x7b.py`:
256 sequences of 4096 a step (1M tokens, for 64 GPUs).

For planning and compiling: `python -m lm.plan --config=configs/qwen3_30b_a3b.py --gpus=64 --verify`,
`python -m lm.layout --config=configs/qwen3_30b_a3b.py --target=h100 --config.mesh.expert=8`.
"""

from pathlib import Path

from lm.recipe import load_file


def get_config():
    c = load_file(str(Path(__file__).with_name("mixtral_8x7b.py")))
    c.model.update(
        num_layers=48, embed_dim=2048, num_heads=32, num_kv_heads=4, head_dim=128, mlp_dim=6144, qk_norm=True, norm_eps=1e-6,
        num_experts=128, experts_per_token=8, expert_mlp_dim=768, router_aux_loss_coef=0.001,
    )
    c.data.vocab_size = 151936
    return c
