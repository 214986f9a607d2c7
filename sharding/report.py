"""What a sharded state costs each device: one row per array, per-device totals, a text table.

Works on any pytree whose leaves carry shape, dtype and a sharding (`jax.ShapeDtypeStruct`s
from `jax.eval_shape` given shardings, or real `jax.Array`s), so a plan can be read before
anything is allocated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec

from sharding.rules import flat_logical_axes, path_name


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    logical_axes: tuple
    spec: PartitionSpec
    shape: tuple[int, ...]
    device_shape: tuple[int, ...]
    dtype: str
    device_bytes: int  # held by each device
    total_bytes: int  # the whole array, counted once


def rows(tree, logical_tree=None) -> list[Row]:
    """One Row per array leaf of `tree` (leaves need .shape, .dtype and .sharding)."""
    flat_logical = {} if logical_tree is None else flat_logical_axes(logical_tree)
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(leaf.shape)
        device_shape = tuple(leaf.sharding.shard_shape(shape))
        itemsize = np.dtype(leaf.dtype).itemsize
        out.append(
            Row(
                path=path_name(path),
                logical_axes=tuple(flat_logical.get(path) or ()),
                spec=getattr(leaf.sharding, "spec", PartitionSpec()),
                shape=shape,
                device_shape=device_shape,
                dtype=np.dtype(leaf.dtype).name,
                device_bytes=math.prod(device_shape) * itemsize,
                total_bytes=math.prod(shape) * itemsize,
            )
        )
    return out


def device_bytes(tree) -> int:
    """Bytes of `tree` that each device holds (shardings here split arrays evenly)."""
    return sum(r.device_bytes for r in rows(tree))


def total_bytes(tree) -> int:
    """Bytes of `tree` counted once, however it is sharded or replicated."""
    return sum(r.total_bytes for r in rows(tree))


def addressable_bytes(tree, device: jax.Device) -> int:
    """Bytes of real arrays in `tree` that live on `device`, measured from their shards."""
    return sum(
        shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards if shard.device == device
    )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _spec_text(spec: PartitionSpec) -> str:
    return "(" + ", ".join("None" if a is None else a if isinstance(a, str) else "+".join(a) for a in spec) + ")"


def table(report_rows: Sequence[Row]) -> str:
    """A fixed-width text table: path, logical axes, PartitionSpec, shapes, bytes per device."""
    header = ("array", "logical axes", "PartitionSpec", "global shape", "per-device shape", "dtype", "per device")
    body = [
        (
            r.path,
            "(" + ", ".join(str(a) for a in r.logical_axes) + ")" if r.logical_axes else "-",
            _spec_text(r.spec),
            str(r.shape),
            str(r.device_shape),
            r.dtype,
            format_bytes(r.device_bytes),
        )
        for r in report_rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in (header, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
