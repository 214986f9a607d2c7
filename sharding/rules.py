"""Logical-axis rules: logical names of array dimensions -> mesh axes -> shardings.

A rule table is plain data: `((logical_name, mesh_axes), ...)` where `mesh_axes` is a mesh axis
name, a tuple of them, or None (replicated). A logical name without a rule is an error rather
than a silent replication, and so is a dimension that its mesh axes do not divide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import ShardingError

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # The batch over `expert` too: outside its experts' layers an expert shard does data-parallel work.
    ("batch", ("data", "expert", "fsdp")),
    # The batch split over data-parallel replicas alone (and `expert`, which no such array uses): where an activation moves its FSDP split
    # from the batch to `embed` (the embedding gradient's rows, before they meet the table).
    ("replica_batch", ("data", "expert")),
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
    ("q_lora", None),  # multi-head latent attention's low-rank query and key-value latents: narrow, kept whole
    ("kv_lora", None),
    ("lora_rank", None),  # LoRA adapters' rank: narrow, kept whole
    ("experts", "expert"),  # a mixture of experts' expert weights, each shard holding its own experts
    ("layers", "stage"),  # stacked layer weights: split into pipeline stages (no-op when stage=1)
    ("unstaged_layers", None),  # stacked layers a pipeline runs outside its stages (with the embedding or the head): whole on each
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
            missing = [a for a in as_axes(mesh_axes) if a not in mesh.axis_names]
            if missing:
                raise ShardingError(
                    f"rule ({logical!r}, {mesh_axes!r}) names mesh axis {missing[0]!r}, which does "
                    f"not exist (mesh axes: {', '.join(mesh.axis_names)})"
                )
        checked.append((logical, mesh_axes))
    return tuple(checked)


def as_axes(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def spec_axes(spec: PartitionSpec, rank: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each of an array's `rank` dimensions under `spec` (() where replicated)."""
    return tuple(as_axes(a) for a in (*spec, *(None,) * (rank - len(spec))))


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
        mesh_axes = as_axes(table[logical])
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


def rule_axes(rules: Rules, logical: str) -> tuple[str, ...]:
    """The mesh axes the rules map the logical axis `logical` onto (none: replicated)."""
    return as_axes(dict(rules).get(logical))


def axis_size(mesh: Mesh, rules: Rules, logical: str) -> int:
    """How many ways the rules split the logical axis `logical` on `mesh` (1: not split)."""
    return math.prod(mesh.shape[a] for a in rule_axes(rules, logical))
