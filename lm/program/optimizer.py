"""The optax chain from config: global-norm clipping, then AdamW (or Muon) with warm-up + cosine
decay, wrapped in `optax.apply_if_finite` so that an update from non-finite gradients is never
applied.

Weight decay applies where `decay_mask` says (a tree of booleans shaped like the parameters;
`lm.program.trainable.decay_mask` derives it from the model's logical axes: matmul weights only).
`optim.name=muon`: optax's Muon for the block matmul weights (decayed, and not the vocabulary
head), each orthogonalised as the matrix (its input axes x its output axes) per layer; AdamW with
the same rule for the rest (embedding, head, norms, biases). Muon's updates are scaled to
AdamW's RMS (Moonlight's 0.2 x sqrt(max(fan_in, fan_out))), so `optim.lr` and
`optim.weight_decay` mean the same for both. Under FSDP its momentum is kept with the stacked
`layers` axis split over `fsdp` (`layers_over_fsdp`): each device orthogonalises whole matrices.
Where the state lives is `state_shardings`'.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

import sharding.constraints
from lm.model.layers import STACK_AXES


def schedule(c) -> optax.Schedule:
    """Linear warm-up to `optim.lr`, then cosine decay to `lr * min_lr_ratio` at `decay_steps`."""
    o = c.optim
    decay_steps = o.decay_steps or c.train.steps
    warmup = min(o.warmup_steps, max(decay_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=o.lr / (warmup + 1),
        peak_value=o.lr,
        warmup_steps=warmup,
        decay_steps=max(decay_steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def optimizer(c, decay_mask, logical_axes=None) -> optax.GradientTransformation:
    o = c.optim
    adamw = optax.adamw(
        schedule(c), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask,
        mu_dtype=c.precision.mu_dtype,  # optax keeps the second moment in the parameters' dtype
    )
    if o.name == "muon":
        adamw = _with_muon(c, adamw, decay_mask, logical_axes)
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw) if o.clip_norm else adamw
    tx = in_gradient_dtype(tx)
    # Skipped steps are counted in the state (`notfinite_count` in a row, `total_notfinite`); the
    # train loop, not optax, decides when too many in a row end the run, so never let one through.
    return optax.apply_if_finite(tx, max_consecutive_errors=NEVER)


NEVER = 2**31 - 1

# Moonlight's update RMS match: Muon's orthogonalised update scaled to AdamW's typical RMS.
MUON_RMS = 0.2


def muon_dimensions(decay_mask, logical_axes) -> dict:
    """Per parameter: Muon's (input axes, output axes) for the decayed matmul weights other than
    the vocabulary head, None for the rest (AdamW). The stacked `layers` axis is a batch axis:
    each layer's matrix is orthogonalised on its own. A weight's input axes are `embed` when it
    comes first (q/k/v, MLP in), else all but the trailing `embed` (attention out, MLP out)."""

    def dims(decayed, axes):
        axes = tuple(axes)
        if not decayed or "vocab" in axes:
            return None
        inner = [i for i, a in enumerate(axes) if a not in STACK_AXES]
        if axes[inner[0]] == "embed":
            return optax.contrib.MuonDimensionNumbers(reduction_axis=(inner[0],), output_axis=tuple(inner[1:]))
        return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(inner[:-1]), output_axis=(inner[-1],))

    return jax.tree.map(dims, decay_mask, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def layers_over_fsdp(mesh, x) -> NamedSharding | None:
    """Each layer's matrix whole on one device: a stacked weight's `layers` axis split over the
    axes that split the matrices (`fsdp`, and `tensor` too where the layers divide over both: the
    same bytes per device as the parameters' own split). None without such a split, where a
    pipeline owns `layers`, or where the layers do not divide. Muon's momentum is kept so and its
    input constrained so (`_whole_layers`): its Newton-Schulz matmuls then need no gather (an
    all-to-all in and out instead of a gather per iteration)."""
    if mesh is None or mesh.shape.get("stage", 1) > 1 or getattr(x, "ndim", 0) < 3:
        return None
    for axes in (("fsdp", "tensor"), ("fsdp",)):
        n = 1
        for a in axes:
            n *= mesh.shape.get(a, 1)
        if n > 1 and x.shape[0] % n == 0:
            return NamedSharding(mesh, PartitionSpec(axes))
    return None


def state_shardings(c, opt_state, params, param_shardings, other):
    """The optimizer state's shardings: a leaf whose path ends with a parameter's path and has
    its shape (a moment, a momentum) is placed like that parameter; anything else (counts) as
    `other`. Path-based, so nested `optax.partition`s (Muon beside AdamW, whose states hold
    masked-out entries) place their states as plain AdamW's. Muon's momentum (outside ZeRO-1,
    which spreads it over the replicas as it does the rest) is kept as `layers_over_fsdp` says."""
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    by_path = {path: (leaf.shape, s) for (path, leaf), s in zip(flat_params, jax.tree.leaves(param_shardings))}
    whole_layers = c.optim.name == "muon" and not c.sharding.optimizer_over_data

    def place(path, leaf):
        if whole_layers and "muon" in [getattr(k, "key", getattr(k, "name", None)) for k in path]:
            if (split := layers_over_fsdp(other.mesh, leaf)) is not None:
                return split
        for start in range(len(path)):
            shape, placed_as = by_path.get(tuple(path[start:]), (None, None))
            if shape is not None and shape == getattr(leaf, "shape", None):
                return placed_as
        return other

    return jax.tree_util.tree_map_with_path(place, opt_state)


def _whole_layers() -> optax.GradientTransformation:
    """Muon's input placed as its momentum (`layers_over_fsdp`), inside the traced step."""

    def update(updates, state, params=None):
        mesh = sharding.constraints.active_mesh()
        place = lambda u: jax.lax.with_sharding_constraint(u, s) if (s := layers_over_fsdp(mesh, u)) else u  # noqa: E731
        return jax.tree.map(place, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _with_muon(c, adamw, decay_mask, logical_axes) -> optax.GradientTransformation:
    o = c.optim
    by_path = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_flatten_with_path(
        muon_dimensions(decay_mask, logical_axes), is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))[0]}

    def dimension_numbers(params):  # the Muon partition's own view: other parameters are masked out
        return jax.tree_util.tree_map_with_path(lambda p, x: by_path[jax.tree_util.keystr(p)], params)

    muon = optax.contrib.muon(
        schedule(c), beta=o.muon_momentum, ns_steps=o.muon_ns_steps, weight_decay=o.weight_decay,
        consistent_rms=MUON_RMS, mu_dtype=c.precision.mu_dtype, muon_weight_dimension_numbers=dimension_numbers,
    )
    labels = {k: "muon" if d is not None else "adamw" for k, d in by_path.items()}
    return optax.partition(
        # Under ZeRO-1 the momentum stays spread over the replicas as the parameters' state is.
        {"muon": muon if c.sharding.optimizer_over_data else optax.chain(_whole_layers(), muon), "adamw": adamw},
        lambda params: jax.tree_util.tree_map_with_path(lambda p, x: labels[jax.tree_util.keystr(p)], params),
    )


def in_gradient_dtype(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with its updates cast back to the gradients' dtype: the float32 learning rate promotes
    bfloat16 ones, and `apply_if_finite`'s skipped branch (zeros like the gradients) must have the
    same type. The state is `tx`'s own, so checkpoints keep their structure."""

    def update(grads, state, params=None):
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads), state

    return optax.GradientTransformation(tx.init, update)
