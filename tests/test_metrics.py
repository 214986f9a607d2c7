from lm.metrics import flops_per_token, matmul_params
from lm.model import ModelConfig


def test_flops_per_token_matches_a_hand_count():
    # 2 layers, width 64, 4 heads of 16 (2 KV heads), SwiGLU 256, vocab 512, context 128.
    cfg = ModelConfig(vocab_size=512, max_len=128, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=256)
    q = 64 * 4 * 16  # 4096
    kv = 2 * 64 * 2 * 16  # 4096
    o = 4 * 16 * 64  # 4096
    mlp = 3 * 64 * 256  # 49152
    head = 64 * 512  # 32768
    assert matmul_params(cfg) == 2 * (q + kv + o + mlp) + head == 155648
    # Causal attention: QK^T and AV forward are 2 * 128 * 64 FLOPs each per token for full
    # attention; halved for causality = 16384 per layer, x3 for training, x2 layers.
    attention = 3 * 2 * (2 * 128 * 64 + 2 * 128 * 64) // 2
    assert attention == 98304
    assert flops_per_token(cfg, 128) == 6 * 155648 + attention
