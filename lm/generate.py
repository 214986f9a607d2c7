"""Sampling from a trained run, `python -m lm.generate`.

    python -m lm.generate --workdir=runs/tiny --prompt="def " --max_new_tokens=200 \
        --temperature=0.8 --top_k=40
    python -m lm.generate --workdir=runs/imported --prompt_ids=5,17,42 --temperature=0 --print_ids

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
from lm import tokenizer as lm_tokenizer
from lm.checkpoint import Checkpointer
from lm.cli import Parser
from lm.config import UserError
from lm.model import Transformer
from lm.program import ModelLayout, placed
from lm.spec import RunSpec
from sharding.schedules import PipelinePlan


def load(workdir: str | Path, step: int | None = None):
    """(config, tokenizer, model) of the latest (or given) checkpoint in `workdir`, on one device."""
    config, tokenizer, layout, restored = restore(workdir, step)
    return config, tokenizer, layout.model(restored["params"], restored.get("fp8"))


def restore(workdir: str | Path, step: int | None = None, *, own_mesh: bool = False):
    """(config, tokenizer, layout, {'params', 'fp8'?}) of a run's latest (or given) checkpoint, on
    one device (or, `own_mesh`, split over every process's devices as the run's mesh config
    says). Only the parameters (and fp8 scales) are read, never the optimizer's moments:
    sampling or exporting needs a third of a training run's memory."""
    workdir = inputs.existing_run_dir(workdir)
    config = lm_config.load_run(workdir)
    tokenizer = lm_tokenizer.tokenizer_for(config.data, workdir)
    spec = RunSpec.parse(config, tokenizer.vocab_size)
    if own_mesh:
        mesh = sharding.make_mesh(spec.mesh)
    else:
        spec = dataclasses.replace(spec, pipeline=PipelinePlan())
        mesh = sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1])
    layout = ModelLayout(spec, mesh)
    part = {"params": placed(layout.abstract_params, layout.param_shardings)}
    if layout.fp8_shardings is not None:
        part["fp8"] = placed(layout.abstract_fp8, layout.fp8_shardings)
    ckpt = Checkpointer(workdir / "checkpoints")
    restored = ckpt.restore_part(part, step)
    ckpt.close()
    return config, tokenizer, layout, restored


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "top_k"))
def _sample(model: Transformer, prompt_bt, key, temperature, *, max_new_tokens: int, top_k: int):
    batch, prompt_len = prompt_bt.shape
    cache = model.init_cache(batch, prompt_len + max_new_tokens)
    logits, cache = model(prompt_bt, cache=cache, cache_index=0)

    def pick(logits_bv, key):  # the model gives padding ids the lowest logit: never picked
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


def generate_ids(model, prompt_ids, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> np.ndarray:
    """`max_new_tokens` ids sampled after `prompt_ids` (temperature 0: greedy, the argmax)."""
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens}: ask for at least one token")
    if not temperature >= 0:  # NaN too
        raise UserError(f"temperature={temperature}: use 0 (greedy) or a positive temperature")
    if top_k < 0:
        raise UserError(f"top_k={top_k}: use 0 (every token) or a positive k")
    ids = np.asarray(prompt_ids, np.int32)
    vocab = model.cfg.used_vocab
    if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab:
        raise UserError(f"prompt ids must be a non-empty list of ids in [0, {vocab}), got {ids.tolist()}")
    limit = model.cfg.max_len if model.cfg.position == "learned" else None
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise UserError(
            f"prompt ({len(ids)} tokens) + max_new_tokens={max_new_tokens} exceeds this model's "
            f"context of {limit} positions; ask for fewer tokens"
        )
    out = _sample(
        model, jnp.asarray(ids)[None], jax.random.key(seed), jnp.float32(temperature),
        max_new_tokens=max_new_tokens, top_k=min(top_k, vocab),
    )
    return np.asarray(out[0])


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, as text."""
    new = generate_ids(model, tokenizer.encode(prompt or "\n"), max_new_tokens, temperature, top_k, seed)
    return prompt + tokenizer.decode(new)


def _ids(text: str) -> list[int]:
    try:
        return [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise UserError(f"--prompt_ids={text!r}: write comma-separated token ids, e.g. 5,17,42") from None


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.generate", description="Sample text from a trained run.", with_config=False)
    parser.add_argument("--workdir", required=True, help="the run directory to sample from")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--prompt_ids", default=None, help="token ids to continue, e.g. 5,17,42 (instead of --prompt)")
    parser.add_argument("--print_ids", action="store_true", help="also print the generated ids, space-separated, on the last line")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=40, help="sample among the k likeliest tokens; 0 for all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse(argv)
    _, tokenizer, model = load(args.workdir, args.step)
    if args.prompt_ids is not None and args.prompt:
        raise UserError("give --prompt or --prompt_ids, not both")
    prompt_ids = _ids(args.prompt_ids) if args.prompt_ids is not None else tokenizer.encode(args.prompt or "\n")
    new = generate_ids(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    if not isinstance(tokenizer, lm_tokenizer.NoTokenizer):
        print((args.prompt if args.prompt_ids is None else tokenizer.decode(prompt_ids)) + tokenizer.decode(new))
    if args.print_ids or isinstance(tokenizer, lm_tokenizer.NoTokenizer):
        print(" ".join(map(str, new.tolist())))


if __name__ == "__main__":
    cli.run(main)
