"""How long a collective takes on a target's links: the device group a mesh axis set spans
(devices numbered row-major over the mesh, consecutive ones on one host) and ring formulas over
NVLink inside a host or the network across hosts, one NIC per GPU, as many at once as the group
has GPUs on each host (NCCL builds a ring channel per NIC, each passing through the host's
members over NVLink). Used by `lm.planner.cost`'s step time."""

from __future__ import annotations

import functools
import math

import numpy as np

from lm.hardware.systems import System
from sharding.mesh import MESH_AXES


@functools.cache
def device_group(sizes: tuple[int, ...], axes: tuple[str, ...], gpus_per_host: int) -> tuple[int, int]:
    """(size, hosts spanned) of the device group of a mesh of `sizes` that varies along `axes`."""
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    group = ids[tuple(slice(None) if a in axes else 0 for a in MESH_AXES)]
    return group.size, len(np.unique(group // gpus_per_host))


def ring_seconds(system: System, sizes: tuple[int, ...], axes: tuple[str, ...], gathered_bytes: float, kind: str = "gather") -> float:
    """Seconds for an all-gather / reduce-scatter (`gather`) or all-reduce (`reduce`) over the
    group of `axes` whose whole result is `gathered_bytes` per device: a group with g GPUs on
    each host moves its data across hosts at g NICs' bandwidth, up to NVLink's."""
    n, hosts = device_group(sizes, axes, system.gpus_per_host)
    if n == 1:
        return 0.0
    if hosts > 1:
        bandwidth, latency = min(n // hosts * system.network_bytes_per_s, system.nvlink_bytes_per_s), system.network_latency_s
    else:
        bandwidth, latency = system.nvlink_bytes_per_s, system.nvlink_latency_s
    steps = (n - 1) * (2 if kind == "reduce" else 1)
    return steps * (gathered_bytes / n / bandwidth + latency)


def send_bandwidth(system: System, sizes: tuple[int, ...], axes: tuple[str, ...]) -> float:
    """Bytes per second of a point-to-point send between neighbours along `axes`: NVLink inside a
    host, one NIC across hosts."""
    _, hosts = device_group(sizes, axes, system.gpus_per_host)
    return system.network_bytes_per_s if hosts > 1 else system.nvlink_bytes_per_s
