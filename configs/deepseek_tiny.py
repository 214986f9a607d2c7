"""The default model in DeepSeek-V3's shape: multi-head latent attention (rank-32 query and
key-value latents, 16 + 8 rotary query-key and 32 value features per head), the first layer dense,
then 8 routed experts in 4 groups (2 searched, 2 chosen per token) beside one shared expert, the
router's sigmoid scores balanced without a loss (`expert_bias_rate`), one multi-token prediction
module (weight 0.3, as DeepSeek-V3's first 10T tokens). Trains in minutes on a 2-core CPU:
    python -m lm.train --config=configs/deepseek_tiny.py --workdir=runs/deepseek_tiny
"""

from pathlib import Path

from lm.recipe import load_file


def get_config():
    c = load_file(str(Path(__file__).with_name("tiny.py")))
    c.model.update(
        num_kv_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32,
        num_experts=8, experts_per_token=2, expert_mlp_dim=96, shared_experts=1, moe_layers="from:1",
        router_score="sigmoid", router_groups=4, router_groups_chosen=2, router_scale=2.5, expert_bias_rate=0.001,
        router_aux_loss_coef=0.0001, router_aux_loss_per="sequence", mtp_depth=1, mtp_loss_weight=0.3,
    )
    return c
