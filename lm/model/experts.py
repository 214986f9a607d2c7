"""A mixture of experts' experts run on each device's shards (`apply_experts`): dropless, the
assignments sorted by expert through grouped GEMMs (`lm.model.grouped_gemm`); with a capacity
factor, fixed-size per-expert buffers through dense batched matmuls. Under expert parallelism
(`sharding.per_shard`, every mesh axis manual; the collectives' axes from `sharding.active_axes`)
each device's expert weights are gathered along `embed` (FSDP, in the compute dtype; gradients
reduce-scattered in float32), its assignments sent to the devices holding their experts and the
results brought back (`lm.model.expert_exchange`; dropless, only the real rows where XLA has
`ragged_all_to_all`, received into room for every assignment of every device; capacity mode:
fixed-size `all_to_all`s of every expert's slots), the expert hidden width split over `tensor`
(partial outputs summed there). The routing is `lm.model.moe`'s.

The matmuls (`lm.model.expert_matmuls`) take compute-dtype activations and float32 weights,
accumulate in float32 and return float32 (`ragged_dot`) or the compute dtype (the Pallas kernels,
the batched ones). LoRA adapters on the experts (`ExpertLora`) run beside them.

Shape suffixes: n tokens (of this device), k experts per token, e experts, d embed, f expert
hidden width, c slots per expert (capacity), m rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

import sharding
from lm.model import expert_exchange, grouped_gemm, swiglu_rows
from lm.model.expert_matmuls import batched_matmul, gathered, grouped_matmul, grouped_matmul_pair
from lm.model.matmul import F32
from sharding.remat import name_matmul

# Name scopes of the dropless routing's data movement (sort, permutation, exchange; the way
# back and the weighted sum), which `lm.compiler.passes` counts in a compiled step.
DISPATCH_SCOPE, COMBINE_SCOPE = "moe_dispatch", "moe_combine"
INPUT_AXES = ("batch", "length", "act_embed")  # the MLP's input: the sequence gathered over `tensor`
ROUTING_AXES = ("batch", "length", None)


class ExpertLora(NamedTuple):
    """LoRA on every expert (`lm.model.lora.ExpertAdapter`'s arrays, this device's shards: a_in
    [e, d, r] shared by gate and up, b_gate / b_up [e, r, f], a_out [e, f, r], b_out [e, r, d]),
    each product by `matmul(x, w)`: the experts' grouped or batched one."""

    arrays: tuple
    scale: float

    def gate_up(self, matmul, x, gate, up):
        """(gate + scale x A B_gate, up + scale x A B_up), in gate's and up's dtypes."""
        a_in, b_gate, b_up, _, _ = self.arrays
        xa = matmul(x, a_in).astype(x.dtype)
        return tuple(y + (self.scale * matmul(xa, b)).astype(y.dtype) for y, b in ((gate, b_gate), (up, b_up)))

    def down(self, matmul, h, y):
        """y + scale h A_out B_out, in y's dtype."""
        _, _, _, a_out, b_out = self.arrays
        return y + (self.scale * matmul(matmul(h, a_out).astype(h.dtype), b_out)).astype(y.dtype)


def _ragged_swiglu(x_md, group_sizes_e, w_in, w_gate, w_out, lora: ExpertLora | None, dtype, implementation: str, expected_rows: int,
                   gathered_layout: bool = False):
    """Rows sorted by group through the groups' SwiGLU experts (rows past the groups: zeros, or
    with the Pallas kernels unwritten), and their LoRA adapters where `lora` has them. The weights as stored ([e, d, f], [e, d, f], [e, f, d])
    or, `gathered_layout`, all [d, e, f] (FSDP gathers along embed, their first axis)."""
    f = w_in.shape[2]
    # The tile table, once for the layer's three grouped GEMMs and their gradients.
    table = grouped_gemm.tiles(group_sizes_e, x_md.shape[0]) if implementation == "pallas" else None
    group_axis = 1 if gathered_layout else 0
    # Each product tagged as a matmul output: what remat's `dots` policies keep (a custom VJP hides the dot).
    projected = grouped_matmul_pair(x_md.astype(dtype), w_gate, w_in, group_sizes_e, table, implementation, expected_rows, group_axis)
    gate, up = (name_matmul(y, batched=False) for y in projected)
    # The adapters' rank-wide GEMMs by ragged_dot: the Pallas kernels take widths in whole tiles.
    adapter = lambda x, w: grouped_matmul(x, w, group_sizes_e, None, "xla", expected_rows, 0, False)  # noqa: E731
    if lora is not None:
        gate, up = lora.gate_up(adapter, x_md.astype(dtype), gate, up)
    if implementation == "pallas" and swiglu_rows.fits(x_md.shape[0], f):  # over the rows holding tokens only
        with jax.named_scope(grouped_gemm.rows_scope(expected_rows)):
            h = swiglu_rows.swiglu(gate, up, table.end_g[-1:])
    else:
        h = (jax.nn.silu(gate.astype(F32)) * up).astype(dtype)
    y = grouped_matmul(h, w_out, group_sizes_e, table, implementation, expected_rows, group_axis, gathered_layout)
    if lora is not None:
        y = lora.down(adapter, h, y)
    return name_matmul(y, batched=False)


def _grouped(x_md, group_m, weights, dtype, implementation: str, expected_rows: int, gathered_layout: bool):
    """Each row through expert `group_m` (values >= the experts here: no expert, zeros), by one
    grouped matmul over the rows sorted by expert; `expected_rows` of them real on average."""
    experts = weights[0].shape[1 if gathered_layout else 0]
    with jax.named_scope(DISPATCH_SCOPE):
        order, inverse = expert_exchange.sorting(group_m)
        sizes = jnp.bincount(group_m, length=experts).astype(jnp.int32)  # out-of-range ids not counted
        x_sorted = expert_exchange.permuted(x_md, order, inverse)
    y_sorted = _ragged_swiglu(x_sorted, sizes, *weights, dtype, implementation, expected_rows, gathered_layout)
    with jax.named_scope(COMBINE_SCOPE):
        return expert_exchange.permuted(y_sorted, inverse, order)


def _batched(x_ecd, w_in, w_gate, w_out, lora: ExpertLora | None, dtype):
    """Fixed-size per-expert buffers through their experts (and their adapters): dense batched matmuls."""
    dot = lambda spec, a, w: name_matmul(batched_matmul(spec, a, w), batched=True)  # noqa: E731
    adapter = lambda a, w: batched_matmul("eci,eio->eco", a, w)  # noqa: E731
    x = x_ecd.astype(dtype)
    gate, up = dot("ecd,edf->ecf", x, w_gate), dot("ecd,edf->ecf", x, w_in)
    if lora is not None:
        gate, up = lora.gate_up(adapter, x, gate, up)
    h = (jax.nn.silu(gate) * up).astype(dtype)
    y = dot("ecf,efd->ecd", h, w_out)
    return y if lora is None else lora.down(adapter, h, y)


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Slots per expert on a device with `tokens` tokens: factor x its even share of assignments."""
    return max(1, math.ceil(factor * tokens * k / experts))


def slot_ranks(ids_nk: jax.Array, experts: int) -> jax.Array:
    """Per assignment [n, k], its place in its expert's queue: first choices before second ones,
    earlier tokens first."""
    flat = ids_nk.T.reshape(-1)  # choice-major
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=experts)
    starts = jnp.cumsum(counts) - counts
    ranks = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.size) - starts[flat[order]])
    return ranks.reshape(ids_nk.shape[::-1]).T


def _dropless_exchanged(x_nd, flat_m, weights, dtype, implementation: str, group: tuple[str, ...], ways: int, gathered_layout: bool):
    """Dropless expert parallelism: each assignment's row [n k, d] through its expert on the
    device holding it, and back. Every device learns every device's rows per expert (an
    all-gather of [experts] counts), so the exchange writes each received row straight to its
    place in the receiver's buffer sorted by its local expert, then by source: the grouped GEMMs
    run on the buffer as it arrives, with no sort of it and no pass over its unused room (the
    buffer holds every assignment of every device: dropless whatever the routing). One slice
    per (device, expert) each way."""
    here = weights[0].shape[1 if gathered_layout else 0]  # experts on each device
    experts, rows, k = ways * here, flat_m.shape[0], flat_m.shape[0] // x_nd.shape[0]
    with jax.named_scope(DISPATCH_SCOPE):
        order, inverse = expert_exchange.sorting(flat_m)  # by expert: destination device, then its expert
        counts_g = jnp.bincount(flat_m, length=experts).astype(jnp.int32)  # rows this device sends each expert
        starts_g = jnp.cumsum(counts_g) - counts_g
        counts_pg = jax.lax.all_gather(counts_g, group)  # [source device, expert]
        me = jax.lax.axis_index(group)
        totals_qe = counts_pg.sum(0).reshape(ways, here)  # rows each expert receives, by its device
        region_g = (jnp.cumsum(totals_qe, axis=1) - totals_qe).reshape(-1)  # where its rows start there
        landing_pg = region_g[None] + jnp.cumsum(counts_pg, axis=0) - counts_pg  # source p's rows for g, at g's device
        mine = me * here + jnp.arange(here)  # this device's experts
        recv_sizes = counts_pg[:, mine].reshape(-1)  # slice (source p, local expert e)
        # Each token's row once per choice, sorted (the repeat's backward sums the k choices).
        sent = expert_exchange.permuted(jnp.repeat(x_nd, k, axis=0), order, inverse)
        recv = expert_exchange.ragged_exchange(sent, starts_g, counts_g, landing_pg[me], recv_sizes, ways * rows, 0, group)
    y = _ragged_swiglu(recv, totals_qe[me], *weights, dtype, implementation, rows, gathered_layout)  # an even share: n k of ways n k rows
    with jax.named_scope(COMBINE_SCOPE):
        their_starts_pg = jnp.cumsum(counts_pg, axis=1) - counts_pg  # where source p took its rows for each expert from
        back = expert_exchange.ragged_exchange(y, landing_pg[:, mine].reshape(-1), recv_sizes, their_starts_pg[:, mine].reshape(-1), counts_g, rows, 0, group)
        return expert_exchange.permuted(back, inverse, order)


def gathers_along_first_axis(implementation: str) -> bool:
    """Whether FSDP gathers the dropless experts' weights as [d, e, f] (the Pallas kernels read
    them so; XLA's `ragged_dot` takes them as stored)."""
    return implementation == "pallas"


def local_experts(x_btd, ids_btk, weights_btk, w_in, w_gate, w_out, *lora_arrays, num_experts, capacity_factor, dtype,
                  axes: dict[str, tuple[str, ...]], implementation: str = "auto", dispatch_chunks: int = 1, lora_scale: float = 1.0):
    """One device's part of the experts' output [b, t, d] and its dropped assignments (summed over
    the devices). `axes`: the mesh axes of 'experts', 'embed', 'mlp' and the token-splitting ones
    ('tokens'), all manual here (empty: one device). Dropless under expert parallelism, the tokens
    go in `dispatch_chunks` independent exchanges (the greatest divisor of the device's tokens
    at most that), which XLA's scheduler may overlap with each other's expert GEMMs. `lora_arrays`:
    the experts' LoRA adapters (`ExpertLora.arrays`), or none."""
    b, t, d = x_btd.shape
    k = ids_btk.shape[-1]
    here = w_in.shape[0]  # experts on this device
    dropless = capacity_factor == 0
    if dropless:
        implementation = grouped_gemm.resolve(implementation, sharding.platform(), d, w_in.shape[2], dtype)
    # FSDP: this device's experts whole along embed (reduce-scattered in the backward pass). For the
    # Pallas kernels all three [d, e, f], gathered along their first axis: gathering (and scattering
    # the gradients) along a later one makes XLA transpose every gathered weight and gradient.
    gathered_layout = bool(axes["embed"]) and dropless and gathers_along_first_axis(implementation)
    if gathered_layout:
        w_in, w_gate = (gathered(jnp.transpose(w, (1, 0, 2)), axes["embed"], 0, dtype) for w in (w_in, w_gate))
        w_out = gathered(jnp.transpose(w_out, (2, 0, 1)), axes["embed"], 0, dtype)
    elif axes["embed"]:
        w_in, w_gate = (gathered(w, axes["embed"], 1, dtype) for w in (w_in, w_gate))
        w_out = gathered(w_out, axes["embed"], 2, dtype)
    lora = None
    if lora_arrays:
        a_in, b_gate, b_up, a_out, b_out = lora_arrays
        if axes["embed"]:
            a_in, b_out = gathered(a_in, axes["embed"], 1, dtype), gathered(b_out, axes["embed"], 2, dtype)
        lora = ExpertLora((a_in, b_gate, b_up, a_out, b_out), lora_scale)
    weights = (w_in, w_gate, w_out, lora)
    ways = num_experts // here
    x_nd, ids_nk, weights_nk = x_btd.reshape(b * t, d), ids_btk.reshape(b * t, k), weights_btk.reshape(b * t, k)
    n = b * t
    if capacity_factor > 0:
        slots = capacity(n, k, num_experts, capacity_factor)
        ranks_nk = slot_ranks(ids_nk, num_experts)
        kept_nk = ranks_nk < slots
        # Buffers [e * c, d] expert-major: device p's chunk holds its experts' slots.
        where = jnp.where(kept_nk, ids_nk * slots + ranks_nk, num_experts * slots).reshape(-1)
        buf = jnp.zeros((num_experts * slots + 1, d), x_nd.dtype).at[where].set(jnp.repeat(x_nd, k, axis=0))[:-1]
        recv = expert_exchange.exchange(buf, axes["experts"]).reshape(ways, here, slots, d).transpose(1, 0, 2, 3)
        y = _batched(recv.reshape(here, ways * slots, d), *weights, dtype)
        y = expert_exchange.exchange(y.reshape(here, ways, slots, d).transpose(1, 0, 2, 3).reshape(-1, d), axes["experts"])
        y_nkd = jnp.concatenate([y, jnp.zeros((1, d), y.dtype)])[where].reshape(n, k, d)
        dropped = jnp.sum(~kept_nk).astype(F32)
    else:
        flat = ids_nk.reshape(-1)
        if ways == 1:
            y_nkd = _grouped(jnp.repeat(x_nd, k, axis=0), flat, weights, dtype, implementation, n * k, gathered_layout).reshape(n, k, d)
        else:
            chunks = math.gcd(n, dispatch_chunks)
            y_nkd = jnp.concatenate([
                _dropless_exchanged(x_cd, flat_c, weights, dtype, implementation, axes["experts"], ways, gathered_layout)
                for x_cd, flat_c in zip(jnp.split(x_nd, chunks), jnp.split(flat, chunks))
            ]).reshape(n, k, d)
        dropped = jnp.zeros((), F32)
    with jax.named_scope(COMBINE_SCOPE):
        y_nd = jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(F32))
    if axes["mlp"]:  # the hidden width split over tensor: partial sums
        y_nd = jax.lax.psum(y_nd, axes["mlp"])
    if axes["tokens"]:
        dropped = jax.lax.psum(dropped, axes["tokens"])
    return y_nd.reshape(b, t, d), dropped


def apply_experts(x_btd, routing_ids, routing_weights, w_in, w_gate, w_out, *, num_experts: int, capacity_factor: float, dtype,
                  implementation: str = "auto", dispatch_chunks: int = 1, lora: tuple = (), lora_scale: float = 1.0):
    """The experts' weighted outputs [b, t, d] (float32) and the dropped assignments, each device
    running its shards (`local_experts`) under the mesh in force, or everything on one device.
    `lora`: the experts' LoRA arrays (`ExpertLora`), or none."""
    axes = {name: sharding.active_axes(name) for name in ("experts", "embed", "mlp")}
    axes["tokens"] = tuple(dict.fromkeys(sharding.active_axes("batch") + sharding.active_axes("length")))

    def local(*args):
        return local_experts(*args, num_experts=num_experts, capacity_factor=capacity_factor, dtype=dtype, axes=axes,
                             implementation=implementation, dispatch_chunks=dispatch_chunks, lora_scale=lora_scale)

    weight_in_axes, weight_out_axes = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")
    lora_axes = (("experts", "embed", "lora_rank"), *[("experts", "lora_rank", "mlp")] * 2, ("experts", "mlp", "lora_rank"),
                 ("experts", "lora_rank", "embed"))
    run = sharding.per_shard(
        local,
        (INPUT_AXES, ROUTING_AXES, ROUTING_AXES, weight_in_axes, weight_in_axes, weight_out_axes, *lora_axes[: len(lora)]),
        [INPUT_AXES, ()],
    )
    return run(x_btd, routing_ids, routing_weights, w_in, w_gate, w_out, *lora)


def dense_reference(x_btd, ids_nk, weights_nk, w_in, w_gate, w_out, dtype=F32):
    """Every token through every expert, the chosen ones weighted by one-hot sums: the grouped
    path's reference (tests)."""
    b, t, _ = x_btd.shape
    e = w_in.shape[0]
    gates_bte = jnp.einsum("nke,nk->ne", jax.nn.one_hot(ids_nk, e, dtype=F32), weights_nk).reshape(b, t, e)
    h = jax.nn.silu(jnp.einsum("btd,edf->btef", x_btd, w_gate)) * jnp.einsum("btd,edf->btef", x_btd, w_in)
    return jnp.einsum("btef,efd,bte->btd", h, w_out, gates_bte).astype(dtype)
