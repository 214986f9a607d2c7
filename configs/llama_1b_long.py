"""`llama_1b.py` at 32k tokens per sequence, each sequence split over 8 devices (context parallelism).

One sequence of 32768 tokens per step on 8 GPUs: every GPU holds 4096 of its tokens everywhere,
attention included (queries stay split, keys and values are gathered), and an eighth of the
parameters and optimizer state. See what each GPU will hold before launching:

    python -m lm.layout --config=configs/llama_1b_long.py --target=h100 --devices=8

Raise `train.batch_size` with `mesh.data` (or `train.grad_accum`) for more tokens per step.
"""

from pathlib import Path

from lm.recipe import load_file


def get_config():
    c = load_file(str(Path(__file__).with_name("llama_1b.py")))
    c.train.update(steps=20_000, batch_size=1, grad_accum=1, seq_len=32768)
    c.model.remat = "full"  # at 4096 tokens a GPU, what a layer keeps under `dots` does not fit beside the rest
    c.optim.warmup_steps = 500
    c.mesh.update(data=1, context=8)
    return c
