"""Which parameters a run trains and decays: all of them, or under LoRA (`lm.model.lora`) the adapters
alone, the rest frozen. A run's state keeps its parameters as one tree; the gradients, optimizer
state and update cover the trained part only, so frozen weights have no gradients computed and no
optimizer state (`Trainable.split`), and a LoRA run's checkpoints hold that part
(`lm.program.lora_base` keeps the frozen base once)."""

from __future__ import annotations

import jax
from flax import nnx, traverse_util

from lm.model.layers import STACK_AXES, Embedding
from lm.model.lora import LoraParam


class Trainable:
    """The trained part of a parameter tree (pure dicts), told by the parameters' variable types."""

    def __init__(self, params: nnx.State, lora: bool):
        self.lora = lora
        flat = nnx.to_flat_state(params)
        self.paths = {tuple(path) for path, var in flat if not lora or isinstance(var, LoraParam)}

    def split(self, tree: dict) -> tuple[dict, dict]:
        """(the trained part, the frozen part) of a tree shaped as the parameters; the whole tree
        and {} when every parameter trains."""
        if not self.lora:
            return tree, {}
        flat = traverse_util.flatten_dict(tree)
        trained = {k: v for k, v in flat.items() if k in self.paths}
        frozen = {k: v for k, v in flat.items() if k not in self.paths}
        return traverse_util.unflatten_dict(trained), traverse_util.unflatten_dict(frozen)

    def part(self, tree: dict) -> dict:
        return self.split(tree)[0]

    def base(self, tree: dict) -> dict:
        """The base model's part of a tree: without LoRA the whole, with it the frozen part
        (what a Hugging Face checkpoint or a base run holds)."""
        return self.split(tree)[1] if self.lora else tree

    def completed(self, given: dict, initial: dict) -> dict:
        """`given` parameters (a base model's, or a whole LoRA run's) with whatever they lack
        (a new run's adapters) taken from `initial`."""
        return _overlaid(initial, given) if self.lora else given

    def merge(self, trained: dict, frozen: dict) -> dict:
        return _overlaid(frozen, trained) if self.lora else trained

    def frozen_in(self, params: dict, dtype) -> dict:
        """`params` with the frozen weights cast to `dtype` (the compute dtype: half a float32
        copy's memory in bf16); the trained ones as they are."""
        if not self.lora:
            return params
        trained, frozen = self.split(params)
        cast = lambda a: jax.ShapeDtypeStruct(a.shape, dtype) if isinstance(a, jax.ShapeDtypeStruct) else a.astype(dtype)  # noqa: E731
        return self.merge(trained, jax.tree.map(cast, frozen))


def _overlaid(under: dict, over: dict) -> dict:
    """One tree of two: `over`'s leaves, and `under`'s where `over` has none."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(under), **traverse_util.flatten_dict(over)})


def decay_mask(params: nnx.State) -> dict:
    """True for the parameters weight decay applies to: matmul weights, told by their logical
    axes (nanoGPT's rank >= 2 rule, where a weight's rank counts its logical axes other than the
    stacked `layers`, and one of them is the model width `embed`). Norm scales, biases (also the
    per-head ones of q/k/v) and lookup tables (`Embedding`) are not decayed."""
    flat = {}
    for path, var in nnx.to_flat_state(params):
        axes = [a for a in var.get_metadata().get("out_sharding") or () if a not in STACK_AXES]
        flat[path] = len(axes) >= 2 and "embed" in axes and not isinstance(var, Embedding)
    return nnx.to_pure_dict(nnx.from_flat_state(flat))
