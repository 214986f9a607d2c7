"""Context parallelism's load balance for causal attention.

Split a sequence over C devices in order and causal attention's work is lopsided: the last
device's queries see every key, the first's see a few. Cut the sequence into 2C chunks and give
device i chunks i and 2C-1-i (an early chunk and its mirror): every device then holds the same
number of (query, key) pairs under the causal mask. The sequence is reordered once, before the
model, with its positions (and segment ids, and targets); attention builds its mask from the
positions, so nothing downstream has to undo the order (a mean loss does not see it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharding.mesh import ShardingError


def load_balanced_order(length: int, shards: int) -> np.ndarray:
    """Indices into a sequence of `length`: `x[..., order]` is the reordered sequence, whose
    `shards` contiguous slices each hold chunk i and chunk 2*shards-1-i. One shard: in order."""
    if shards == 1:
        return np.arange(length)
    if length % (2 * shards):
        raise ShardingError(
            f"a sequence of {length} tokens cannot be load-balanced over {shards} context shards: "
            f"it is cut into 2 x {shards} equal chunks; use a length divisible by {2 * shards}"
        )
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def inverse_order(order: np.ndarray) -> np.ndarray:
    """The order that undoes `order`: `x[order][inverse_order(order)] == x`."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse


def reorder(x_bt: jax.Array, order: np.ndarray) -> jax.Array:
    """`x_bt` with its sequence (axis 1) in `order`: a local gather when the sequence is whole on
    each device, as a batch arriving from the host is."""
    return x_bt if np.array_equal(order, np.arange(len(order))) else jnp.take(x_bt, order, axis=1)


def causal_pairs_per_shard(order: np.ndarray, shards: int) -> np.ndarray:
    """How many (query, key) pairs the causal mask keeps on each shard of the sequence in `order`
    (a query at position p sees p + 1 keys): equal across shards means balanced."""
    return np.array([int(np.sum(part + 1)) for part in np.split(np.asarray(order), shards)])
