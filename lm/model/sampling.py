"""Sampling from a model with a KV cache: the prompt is run once, then each new token attends
to the cached keys and values instead of re-running the whole prefix. The whole loop is one
compiled scan. `python -m lm.generate` is its command; a run's weights come from
`lm.program.restore`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lm.errors import UserError
from lm.model.transformer import Transformer


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


def generate_ids(model, prompt_ids, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0, rows: int = 1) -> np.ndarray:
    """`max_new_tokens` ids sampled after `prompt_ids` (temperature 0: greedy, the argmax).
    `rows`: the prompt decoded as that many rows (a batch split over devices must divide), the
    first one returned."""
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
        model, jnp.tile(jnp.asarray(ids)[None], (rows, 1)), jax.random.key(seed), jnp.float32(temperature),
        max_new_tokens=max_new_tokens, top_k=min(top_k, vocab),
    )
    return np.asarray(out[0])


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, as text."""
    new = generate_ids(model, tokenizer.encode(prompt or "\n"), max_new_tokens, temperature, top_k, seed)
    return prompt + tokenizer.decode(new)
