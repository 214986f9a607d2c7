"""Fine-tuning a Hugging Face Llama (also Mistral, Qwen2, GPT-2) checkpoint on your text:

    python -m lm.train --config=configs/finetune_llama.py --config.init.from_hf=path/to/model \
        --config.data.path=my_corpus/ --workdir=runs/finetune

The architecture and tokenizer come from the checkpoint (`init.from_hf`: a Hugging Face model
directory, or a run made by `python -m lm.convert from_hf`); the recipe's `model` keys give way.
The optimizer starts fresh, as every fine-tuning recipe's does: a learning rate two orders of
magnitude below pretraining's, a short warm-up (Adam's moments are zero at step 0; a long
warm-up would spend the run re-learning what the checkpoint knows), no weight decay pulling the
pretrained weights towards zero, cosine decay to a tenth. Resuming (the same command) continues
the schedule where it stopped.
"""

from lm.config import default_config


def get_config():
    c = default_config()
    c.model.update(remat="full")  # how the layers run; the shape comes from the checkpoint
    c.train.update(steps=1000, batch_size=16, seq_len=1024, log_every=10, eval_every=200, eval_batches=8)
    c.optim.update(lr=2e-5, min_lr_ratio=0.1, warmup_steps=20, weight_decay=0.0, clip_norm=1.0)
    c.checkpoint.every_steps = 200
    c.precision.compute_dtype = "bfloat16"
    return c
