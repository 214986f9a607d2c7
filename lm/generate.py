"""Sampling from a trained run, `python -m lm.generate`.

    python -m lm.generate --workdir=runs/tiny --prompt="def " --max_new_tokens=200 \
        --temperature=0.8 --top_k=40

Decoding keeps a KV cache: the prompt is run once, then each new token attends to the cached
keys and values instead of re-running the whole prefix. The whole loop is one compiled scan.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from lm import cli, inputs
from lm import config as lm_config
from lm import data as lm_data
from lm.checkpoint import Checkpointer
from lm.cli import Parser
from lm.config import UserError
from lm.model import Transformer
from lm.program import ModelLayout, placed
from lm.spec import RunSpec
from sharding.pipeline import PipelinePlan


def load(workdir: str | Path, step: int | None = None):
    """(config, tokenizer, model) of the latest (or given) checkpoint in `workdir`, on one device.

    Only the parameters (and fp8 scales) are read from the checkpoint, never the optimizer's
    moments: sampling needs a third of a training run's memory."""
    workdir = inputs.existing_run_dir(workdir)
    config = lm_config.load_run(workdir)
    tokenizer = lm_data.tokenizer_for(config.data, workdir)
    spec = dataclasses.replace(RunSpec.parse(config, tokenizer.vocab_size), pipeline=PipelinePlan())  # one device
    layout = ModelLayout(spec, sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1]))
    part = {"params": placed(layout.abstract_params, layout.param_shardings)}
    if layout.fp8_shardings is not None:
        part["fp8"] = placed(layout.abstract_fp8, layout.fp8_shardings)
    ckpt = Checkpointer(workdir / "checkpoints")
    restored = ckpt.restore_part(part, step)
    ckpt.close()
    return config, tokenizer, layout.model(restored["params"], restored.get("fp8"))


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "top_k", "vocab_size"))
def _sample(model: Transformer, prompt_bt, key, temperature, *, max_new_tokens: int, top_k: int, vocab_size: int):
    batch, prompt_len = prompt_bt.shape
    cache = model.init_cache(batch, prompt_len + max_new_tokens)
    logits, cache = model(prompt_bt, cache=cache, cache_index=0)

    def pick(logits_bv, key):
        logits_bv = jnp.where(jnp.arange(logits_bv.shape[-1]) < vocab_size, logits_bv, -jnp.inf)  # padding ids
        if top_k:
            kth = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
            logits_bv = jnp.where(logits_bv < kth, -jnp.inf, logits_bv)
        sampled = jax.random.categorical(key, logits_bv / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, sampled, jnp.argmax(logits_bv, axis=-1))

    def step(carry, key):
        last_bv, cache, index = carry
        token_b = pick(last_bv, key)
        logits, cache = model(token_b[:, None], cache=cache, cache_index=index)
        return (logits[:, -1], cache, index + 1), token_b

    keys = jax.random.split(key, max_new_tokens)
    _, tokens = jax.lax.scan(step, (logits[:, -1], cache, prompt_len), keys)
    return tokens.T


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, as text."""
    ids = tokenizer.encode(prompt or "\n")
    limit = model.cfg.max_len if model.cfg.position == "learned" else None
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise UserError(
            f"prompt ({len(ids)} tokens) + max_new_tokens={max_new_tokens} exceeds this model's "
            f"context of {limit} positions; ask for fewer tokens"
        )
    out = _sample(
        model,
        jnp.asarray(ids, jnp.int32)[None],
        jax.random.key(seed),
        jnp.float32(temperature),
        max_new_tokens=max_new_tokens,
        top_k=min(top_k, tokenizer.vocab_size),
        vocab_size=tokenizer.vocab_size,
    )
    return prompt + tokenizer.decode(np.asarray(out[0]))


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.generate", description="Sample text from a trained run.", with_config=False)
    parser.add_argument("--workdir", required=True, help="the run directory to sample from")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=40, help="sample among the k likeliest tokens; 0 for all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse(argv)
    _, tokenizer, model = load(args.workdir, args.step)
    print(generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))


if __name__ == "__main__":
    cli.run(main)
