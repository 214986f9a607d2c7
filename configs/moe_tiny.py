"""The default model as a mixture of experts: 4 layers of 8 SwiGLU experts (2 per token, width
192) instead of one 384-wide MLP, so its active parameters are the dense `tiny`'s (`lm.bench`
compares the two). Trains in minutes on a 2-core CPU:
    python -m lm.train --config=configs/moe_tiny.py --workdir=runs/moe_tiny
Split the experts over devices with --config.mesh.expert=N (N divides 8).
"""

from pathlib import Path

from lm.recipe import load_file


def get_config():
    c = load_file(str(Path(__file__).with_name("tiny.py")))
    c.model.update(num_experts=8, experts_per_token=2, expert_mlp_dim=192, router_aux_loss_coef=0.01)
    return c
