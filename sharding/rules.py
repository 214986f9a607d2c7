"""Logical-axis rules: logical names of array dimensions -> mesh axes -> shardings.

A rule table is plain data: `((logical_name, mesh_axes), ...)` where `mesh_axes` is a mesh axis
name, a tuple of them, or None (replicated). A logical name without a rule is an error rather
than a silent replication, and so is a dimension that its mesh axes do not divide.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import ShardingError

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),
    # The batch split over data-parallel replicas alone: where an activation moves its FSDP split
    # from the batch to `embed` (the embedding gradient's rows, before they meet the table).
    ("replica_batch", "data"),
    ("length", "context"),  # the sequence inside attention / MLP, where heads and mlp use `tensor`
    ("norm_length", "context"),  # the sequence in the residual stream and norms
    ("kv_length", None),  # keys and values inside attention: whole, gathered over `context`
    # Parameters are split over `context` too: its devices would otherwise each hold a replica of
    # the weights and optimizer state (FSDP over context x fsdp, as MaxText does).
    ("embed", ("context", "fsdp")),
    ("act_embed", None),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    # The embedding, the head and the logits: split over `stage` as well, so that under pipeline
    # parallelism the head and loss (outside the pipeline) are shared by the stages rather than
    # repeated whole on each (no stage holds a full-vocabulary logits buffer).
    ("vocab", ("stage", "tensor")),
    ("head_dim", None),
    ("layers", "stage"),  # stacked layer weights: split into pipeline stages (no-op when stage=1)
    ("stages", "stage"),  # the stage axis of pipeline buffers
)


# Megatron-LM's sequence parallelism: the residual stream and norms, replicated over `tensor`
# under plain tensor parallelism, are split along the sequence instead.
SEQUENCE_PARALLEL_RULES: tuple[tuple[str, MeshAxes], ...] = (("norm_length", ("context", "tensor")),)


def merge_rules(base: Rules, *overrides: Rules) -> tuple[tuple[str, MeshAxes], ...]:
    """`base` with each override's entries replacing same-named ones (new names appended)."""
    table = dict(check_rules(base))
    for rules in overrides:
        table.update(check_rules(rules))
    return tuple(table.items())


def check_rules(rules: Rules, mesh: Mesh | None = None) -> tuple[tuple[str, MeshAxes], ...]:
    """The rule table as a tuple of pairs; ShardingError for a malformed entry or, given `mesh`,
    a rule naming a mesh axis the mesh does not have."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ShardingError(f"sharding rules must be a sequence of (logical_name, mesh_axes) pairs, got {rules!r}")
    checked = []
    for entry in rules:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ShardingError(
                f"rule {entry!r} is not (logical_name, mesh_axes); write e.g. ('embed', 'fsdp'), "
                "('batch', ('data', 'fsdp')) or ('length', None)"
            )
        logical, mesh_axes = entry[0], entry[1]
        if isinstance(mesh_axes, list):
            mesh_axes = tuple(mesh_axes)
        if not (mesh_axes is None or isinstance(mesh_axes, str) or all(isinstance(a, str) for a in mesh_axes)):
            raise ShardingError(f"rule {entry!r}: mesh axes must be a name, a tuple of names or None")
        if mesh is not None:
            missing = [a for a in _as_tuple(mesh_axes) if a not in mesh.axis_names]
            if missing:
                raise ShardingError(
                    f"rule ({logical!r}, {mesh_axes!r}) names mesh axis {missing[0]!r}, which does "
                    f"not exist (mesh axes: {', '.join(mesh.axis_names)})"
                )
        checked.append((logical, mesh_axes))
    return tuple(checked)


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def spec_axes(spec: PartitionSpec, rank: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each of an array's `rank` dimensions under `spec` (() where replicated)."""
    return tuple(_as_tuple(a) for a in (*spec, *(None,) * (rank - len(spec))))


def axes_spec(axes: Sequence[Sequence[str]]) -> PartitionSpec:
    """The PartitionSpec of per-dimension mesh axes (`spec_axes`' inverse)."""
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes))


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    *,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
    name: str = "array",
) -> PartitionSpec:
    """The PartitionSpec for one array; with `mesh` and `shape`, also checks it fits that mesh."""
    table = dict(rules)
    described = f"{name} (shape {tuple(shape) if shape is not None else '?'}, logical axes {tuple(logical_axes)}"
    if mesh is not None:
        described += ", mesh " + " ".join(f"{a}={n}" for a, n in mesh.shape.items())
    described += ")"
    if shape is not None and len(shape) != len(logical_axes):
        raise ShardingError(f"{described}: {len(logical_axes)} logical names for {len(shape)} dimensions")
    spec, used = [], {}
    for dim, logical in enumerate(logical_axes):
        if logical is None:
            spec.append(None)
            continue
        if logical not in table:
            raise ShardingError(
                f"{described}: logical axis {logical!r} has no rule; add ({logical!r}, mesh_axes) "
                f"to the rules (known: {', '.join(sorted(table))})"
            )
        mesh_axes = _as_tuple(table[logical])
        for axis in mesh_axes:
            if mesh is not None and axis not in mesh.axis_names:
                raise ShardingError(
                    f"{described}: rule {logical!r} -> {axis!r} names a mesh axis that does not "
                    f"exist (mesh axes: {', '.join(mesh.axis_names)})"
                )
            if axis in used:
                raise ShardingError(
                    f"{described}: mesh axis {axis!r} is used by both {used[axis]!r} and "
                    f"{logical!r}; a mesh axis may shard only one dimension of an array"
                )
            used[axis] = logical
        if mesh is not None and shape is not None:
            ways = math.prod(mesh.shape[a] for a in mesh_axes)
            if shape[dim] % ways:
                raise ShardingError(
                    f"{described}: dimension {dim} ({logical!r}, size {shape[dim]}) is not "
                    f"divisible by mesh axes {mesh_axes} of total size {ways}; change the mesh "
                    f"or the model size"
                )
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def named_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    *,
    shape: Sequence[int] | None = None,
    name: str = "array",
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh=mesh, shape=shape, name=name))


def path_name(path) -> str:
    """`a/b/0` for a pytree key path: how errors and reports name an array."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """NamedShardings for every array of `abstract_tree` from a same-shaped tree of logical specs.

    `logical_tree` holds a PartitionSpec (or tuple) of logical names per array, as
    `flax.nnx.get_partition_spec` gives for annotated variables (an empty one, for an array
    without annotations, means replicated); errors name the array's path.
    """
    flat_logical = flat_logical_axes(logical_tree)

    def one(path, leaf):
        logical = tuple(flat_logical.get(path) or ()) or (None,) * len(leaf.shape)  # unannotated: replicated
        return named_sharding(mesh, logical, rules, shape=leaf.shape, name=path_name(path))

    return jax.tree_util.tree_map_with_path(one, abstract_tree)


def flat_logical_axes(logical_tree) -> dict:
    """{key path: logical axes} of a tree whose leaves are PartitionSpecs or tuples of names."""
    return dict(jax.tree_util.tree_flatten_with_path(logical_tree, is_leaf=_is_spec)[0])


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec) or (isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x))


class _Active(threading.local):
    stack: list[tuple[Mesh, Rules]] = []


_ACTIVE = _Active()


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Within this context, `constrain` places activations on `mesh` by `rules` (traced code too)."""
    _ACTIVE.stack = [*_ACTIVE.stack, (mesh, tuple(rules))]
    try:
        yield
    finally:
        _ACTIVE.stack = _ACTIVE.stack[:-1]


def bind(fn: Callable, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Callable:
    """`fn` run (and so traced) with `mesh` and `rules` active, whatever context its caller is in."""

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        with activate(mesh, rules):
            return fn(*args, **kwargs)

    return bound


def jit(fn: Callable, mesh: Mesh, rules: Rules = DEFAULT_RULES, **jit_kwargs) -> Callable:
    """`jax.jit(fn, **jit_kwargs)` with the mesh and rules bound into the traced function, so
    every `constrain` inside it applies wherever it is first traced, lowered or called."""
    return jax.jit(bind(fn, mesh, rules), **jit_kwargs)


def rule_axes(rules: Rules, logical: str) -> tuple[str, ...]:
    """The mesh axes the rules map the logical axis `logical` onto (none: replicated)."""
    return _as_tuple(dict(rules).get(logical))


def axis_size(mesh: Mesh, rules: Rules, logical: str) -> int:
    """How many ways the rules split the logical axis `logical` on `mesh` (1: not split)."""
    return math.prod(mesh.shape[a] for a in rule_axes(rules, logical))


def active_mesh() -> Mesh | None:
    """The mesh of the innermost `activate` (None outside one)."""
    return _ACTIVE.stack[-1][0] if _ACTIVE.stack else None


def platform() -> str:
    """The platform ('cpu', 'gpu', 'tpu') of the mesh in force, else JAX's default backend: what a
    traced program is compiled for, also when that is a GPU this machine does not have."""
    if _ACTIVE.stack:
        return _ACTIVE.stack[-1][0].devices.flat[0].platform
    return jax.default_backend()


def manual_axes() -> set[str]:
    """The mesh axes a surrounding `jax.shard_map` has made manual (none outside one)."""
    return set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def _in_force() -> tuple[Mesh, Rules]:
    """The mesh and rules of the innermost `activate`; inside a `shard_map` that made some mesh
    axes manual (a pipeline running each stage's own code), the rules without those axes: an
    array there is already one shard along them, and the partitioner places only the others."""
    mesh, rules = _ACTIVE.stack[-1]
    if manual := manual_axes():
        rules = tuple((logical, tuple(a for a in _as_tuple(axes) if a not in manual) or None) for logical, axes in rules)
    return mesh, rules


def _placement(mesh: Mesh, spec: PartitionSpec) -> NamedSharding | PartitionSpec:
    """`spec` on `mesh`; inside a partly manual `shard_map`, the bare spec, which applies to the
    mesh in context there (a NamedSharding on the concrete mesh, whose axes are all automatic, is
    refused)."""
    return spec if manual_axes() else NamedSharding(mesh, spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], name: str = "activation") -> jax.Array:
    """Constrain an activation's sharding by logical names; a no-op outside `activate`."""
    if not _ACTIVE.stack:
        return x
    mesh, rules = _in_force()
    return jax.lax.with_sharding_constraint(x, _placement(mesh, logical_to_spec(logical_axes, rules, mesh=mesh, shape=x.shape, name=name)))


def constrain_leading(x: jax.Array, logical_axis: str, name: str = "activation") -> jax.Array:
    """Constrain only `x`'s first dimension (to one logical axis), leaving XLA to place the rest:
    for buffers stacked from arrays whose own placement the program already decides (the
    pipeline's stash of backward residuals). A no-op outside `activate`."""
    if not _ACTIVE.stack:
        return x
    mesh, rules = _in_force()
    leading = logical_to_spec((logical_axis,), rules, mesh=mesh, shape=x.shape[:1], name=name)
    spec = PartitionSpec(leading[0] if len(leading) else None, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, _placement(mesh, spec))


def resharding_steps(source: PartitionSpec, target: PartitionSpec) -> list[PartitionSpec]:
    """The specs an array passes through from `source` to `target`, one mesh axis changing at a
    time: the axes the target does not use gathered first, then each axis that changes dimension
    moved on its own (an all-to-all over that axis), then the target (its new splits sliced)."""
    target_axes = [_as_tuple(a) for a in target]
    wanted = {a: dim for dim, axes in enumerate(target_axes) for a in axes}
    steps = [[[a for a in _as_tuple(axes) if a in wanted] for axes in source]]
    for axis, dim in wanted.items():
        where = next((d for d, axes in enumerate(steps[-1]) if axis in axes), dim)
        if where != dim:
            step = [[a for a in axes if a != axis] for axes in steps[-1]]
            step[dim] = [a for a in target_axes[dim] if a in step[dim] or a == axis]
            steps.append(step)
    specs = [*(PartitionSpec(*(tuple(axes) if axes else None for axes in step)) for step in steps), target]
    return [spec for i, spec in enumerate(specs) if i == 0 or spec != specs[i - 1]]


def move(x: jax.Array, from_axes: Sequence[str | None], to_axes: Sequence[str | None], name: str = "activation") -> jax.Array:
    """Reshard `x` from logical axes `from_axes` to `to_axes` through `resharding_steps`: XLA's
    partitioner finds each single-axis move, while asked for several at once (a sequence split
    over context x tensor to `embed` over context, say) it may only replicate the array whole.
    A no-op outside `activate`."""
    if not _ACTIVE.stack:
        return x
    mesh, rules = _in_force()
    source, target = (logical_to_spec(axes, rules, mesh=mesh, shape=x.shape, name=name) for axes in (from_axes, to_axes))
    for spec in resharding_steps(source, target):
        x = jax.lax.with_sharding_constraint(x, _placement(mesh, spec))
    return x


def split_ways(logical: str) -> int:
    """How many ways the mesh and rules in force split the logical axis `logical` (1 outside
    `activate`)."""
    return axis_size(*_in_force(), logical) if _ACTIVE.stack else 1


def per_shard(fn: Callable, in_axes: Sequence[Sequence[str | None]], out_axes: Sequence[str | None]) -> Callable:
    """`fn` run on each device's shards of its arguments (`jax.shard_map`), the arguments and the
    result placed by logical names under the mesh and rules in force; outside `activate`, `fn`
    itself. For a kernel that cannot be partitioned as its arguments are split (cuDNN attention
    takes queries, keys and values split alike; context parallelism splits only the queries), or
    at all (inside a partly manual `shard_map`: there, over the axes still automatic)."""

    def run(*args):
        if not _ACTIVE.stack:
            return fn(*args)
        mesh, rules = _in_force()
        specs = tuple(logical_to_spec(axes, rules, mesh=mesh, shape=a.shape) for axes, a in zip(in_axes, args))
        out_spec = logical_to_spec(out_axes, rules, mesh=mesh)
        if manual := manual_axes():
            automatic = set(mesh.axis_names) - manual
            return jax.shard_map(fn, in_specs=specs, out_specs=out_spec, axis_names=automatic, check_vma=False)(*args)
        return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec)(*args)

    return run
