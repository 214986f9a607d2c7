"""Matmul weights cast to the compute dtype once a step, not once per microbatch.

With gradient accumulation the microbatches run in a loop, and a block matmul casting its
float32 weight inside reads it and writes its bf16 copy in every pass, twice under remat (the
forward's and the recomputed one's): on the `llama_1b` recipe, slices of the float32 stacks and
their casts were ~25 ms of a 1.7 s H100 step (PERFORMANCE.md). The program instead calls
`cast_once` before the loop: every block matmul's weight becomes a `CastWeight` (the weight and
its copy in the compute dtype), which the layer scans slice as they slice the weight and
`Policy.matmul` reads through `compute_copy`: in the forward the copy, in the backward the
gradient the cast's own transpose gives, so a step is bit for bit the per-microbatch one.
`lm.model.fp8_weights` does the same for fp8 copies; `attach_weights` puts either kind back in
each pass with the differentiated weight as its master.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx, traverse_util


class StepWeight:
    """A weight (`master`, differentiated) with copies of it made for the step, before the
    microbatch loop (`copies`, by subclass). Its arrays share the weight's leading layer axes, so
    layer scans slice it as they slice the weight; `variable[...]` gives it back whole. Each
    subclass is a pytree: the master, then its copies."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_node(cls, lambda w: ((w.master, *w.copies()), None), lambda _, leaves: cls(*leaves))

    def copies(self) -> tuple:
        raise NotImplementedError

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError(f"a {type(self).__name__} is read whole (variable[...])")
        return self

    def with_master(self, master) -> StepWeight:
        """The same copies around `master` (the differentiated weight of a pass)."""
        return type(self)(master, *self.copies())

    @property
    def shape(self):
        return self.master.shape

    @property
    def dtype(self):
        return self.master.dtype


class CastWeight(StepWeight):
    """A weight with its copy in the compute dtype for the step (`cast`)."""

    def __init__(self, master, cast):
        self.master, self.cast = master, cast

    def copies(self) -> tuple:
        return (self.cast,)


@jax.custom_vjp
def _copy_of(master, cast):
    return cast


def _copy_fwd(master, cast):
    return cast, jax.numpy.zeros((0,), master.dtype)  # the master's dtype, for the backward


def _copy_bwd(dtype_of, g):
    return g.astype(dtype_of.dtype), None  # the transpose of `master.astype(...)`: the same gradient


_copy_of.defvjp(_copy_fwd, _copy_bwd)


def compute_copy(w: CastWeight):
    """`w.master` in the compute dtype: the copy made before the loop, its gradient the master's."""
    return _copy_of(w.master, w.cast)


def matmul_weights(model) -> list[tuple]:
    """Paths of the weights `Policy.matmul` reads as weights in `model`: each `<name>` a module
    holds beside its `<name>_site` (the fp8 / statistics site, None when the policy keeps none)."""
    out = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for attr in vars(node):
            name = attr.removesuffix("_site")
            if attr.endswith("_site") and isinstance(getattr(node, name, None), nnx.Param):
                out.append((*path, name))
    return out


def cast_once(model, policy) -> dict:
    """{path of a block matmul's weight in the parameters: its `CastWeight`} under `policy`."""
    out = {}
    for path in matmul_weights(model):
        w = functools.reduce(lambda node, key: node[key] if isinstance(key, int) else getattr(node, key), path, model)[...]
        out[path] = CastWeight(w, policy.cast(w))
    return out


def attach_weights(params: dict, prepared: dict) -> dict:
    """`params` (a nested dict) with each weight of `prepared` (`cast_once`, or
    `lm.model.fp8_weights.quantised_once`) made again around the weight in `params`, its master
    (differentiated, in a pass)."""
    flat = traverse_util.flatten_dict(params)
    for path, w in prepared.items():
        flat[path] = w.with_master(flat[path])
    return traverse_util.unflatten_dict(flat)
