"""The mesh and rules in force while a program is traced, and the activation constraints that read them.

`activate` (or `bind` / `jit`, which carry the mesh and rules into a jitted function) puts a
mesh and a rule table in force; inside, `constrain`, `constrain_leading`, `move`, `split_ways`
and `per_shard` place activations by logical names. Outside one they are no-ops (or run the
function as it is), so a model runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import DEFAULT_RULES, Rules, as_axes, axis_size, logical_to_spec


class _Active(threading.local):
    stack: list[tuple[Mesh, Rules]] = []
    mapped: int = 0  # the `vmap_over`s being traced around this point


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


def active_mesh() -> Mesh | None:
    """The mesh of the innermost `activate` (None outside one)."""
    return _ACTIVE.stack[-1][0] if _ACTIVE.stack else None


def device() -> jax.Device:
    """A device of the mesh in force, else JAX's first: what a traced program is compiled for
    (its platform, kind and, on CUDA, compute capability), also a GPU this machine does not have."""
    mesh = active_mesh()
    return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def platform() -> str:
    """The platform ('cpu', 'gpu', 'tpu') of the mesh in force, else JAX's default backend."""
    return device().platform if active_mesh() is not None else jax.default_backend()


def manual_axes() -> set[str]:
    """The mesh axes a surrounding `jax.shard_map` has made manual (none outside one)."""
    return set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def _in_force() -> tuple[Mesh, Rules]:
    """The mesh and rules of the innermost `activate`; inside a `shard_map` that made some mesh
    axes manual (a pipeline running each stage's own code), the rules without those axes: an
    array there is already one shard along them, and the partitioner places only the others."""
    mesh, rules = _ACTIVE.stack[-1]
    if manual := manual_axes():
        rules = tuple((logical, tuple(a for a in as_axes(axes) if a not in manual) or None) for logical, axes in rules)
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
    target_axes = [as_axes(a) for a in target]
    wanted = {a: dim for dim, axes in enumerate(target_axes) for a in axes}
    steps = [[[a for a in as_axes(axes) if a in wanted] for axes in source]]
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


def active_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes the mesh and rules in force split the logical axis `logical` over, less any a
    surrounding `shard_map` made manual (() outside `activate`): the axis names a collective
    inside `per_shard` runs over."""
    return as_axes(dict(_in_force()[1]).get(logical)) if _ACTIVE.stack else ()


def split_ways(logical: str) -> int:
    """How many ways the mesh and rules in force split the logical axis `logical` (1 outside
    `activate`)."""
    return axis_size(*_in_force(), logical) if _ACTIVE.stack else 1


def vmap_over(fn: Callable, logical_axis: str, **kwargs) -> Callable:
    """`jax.vmap(fn)` whose mapped dimension lies on the mesh axes `logical_axis` maps to (vmap's
    `spmd_axis_name`): the constraints inside split it there, and so does a `per_shard` kernel
    inside, which a plain vmap hands the whole mapped dimension (gathering it: a pipeline's
    attention, per stage, inside a partly manual `shard_map`). Outside `activate`, a plain vmap."""

    def run(*args):
        axes = None
        if _ACTIVE.stack:
            mesh, rules = _in_force()
            spec = logical_to_spec((logical_axis,), rules, mesh=mesh)
            axes = spec[0] if len(spec) else None
        _ACTIVE.mapped += 1
        try:
            return jax.vmap(fn, spmd_axis_name=axes, **kwargs)(*args)
        finally:
            _ACTIVE.mapped -= 1

    return run


def per_shard(fn: Callable, in_axes: Sequence[Sequence[str | None]], out_axes: Sequence[str | None] | list) -> Callable:
    """`fn` run on each device's shards of its arguments (`jax.shard_map`), the arguments and the
    result placed by logical names under the mesh and rules in force; outside `activate`, `fn`
    itself. For a kernel that cannot be partitioned as its arguments are split (cuDNN attention
    takes queries, keys and values split alike; context parallelism splits only the queries), or
    at all (inside a partly manual `shard_map`: there, over the axes still automatic), or code
    that runs its own collectives (`active_axes` names their axes). `out_axes` a list: several
    results, each placed by its entry."""

    def run(*args):
        if not _ACTIVE.stack:
            return fn(*args)
        mesh, rules = _in_force()
        specs = tuple(logical_to_spec(axes, rules, mesh=mesh, shape=a.shape) for axes, a in zip(in_axes, args))
        if isinstance(out_axes, list):
            out_spec = tuple(logical_to_spec(axes, rules, mesh=mesh) for axes in out_axes)
        else:
            out_spec = logical_to_spec(out_axes, rules, mesh=mesh)
        if manual := manual_axes():
            automatic = set(mesh.axis_names) - manual
            return jax.shard_map(fn, in_specs=specs, out_specs=out_spec, axis_names=automatic, check_vma=False)(*args)
        # Under `vmap_over` the mapped axis joins the manual ones when jax batches the shard_map,
        # and its batching of the body's mesh-axis types is unsound there (jax 0.10 to 0.12: a
        # second pvary over `stage`, a gather whose operands' types then differ): untyped, as
        # inside a partly manual shard_map; the transpose sums the gradients of unsplit inputs.
        return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=not _ACTIVE.mapped)(*args)

    return run
