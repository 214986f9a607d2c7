"""A mixture-of-experts MLP: a float32 router picks `experts_per_token` of `num_experts` SwiGLU
experts per token, their outputs are summed with the router's weights, plus always-on shared
experts (DeepSeek / Qwen2-MoE).

Dropless by default: each device's token-expert assignments are sorted by expert and run through
one grouped matmul (`jax.lax.ragged_dot`), whatever the imbalance. With a capacity factor each
expert takes at most `factor x` its even share of a device's assignments (first choices before
second ones, earlier tokens first), in fixed-size buffers and dense batched matmuls; the rest
are dropped and counted.

Expert parallelism: the expert weights are split over the `experts` logical axis (mesh axis
`expert`), whose devices split the batch outside these layers. Inside, each device runs its own
shards (`sharding.per_shard`, every mesh axis manual): its weights gathered along `embed` (FSDP;
the gradient reduce-scattered by the transpose), its assignments sent to the devices holding
their experts and the results brought back (dropless: `ragged_exchange`, only the real rows
where XLA has `ragged_all_to_all`, received into room for every assignment of every device;
capacity mode: fixed-size `all_to_all`s of every expert's slots), the expert hidden width split
over `tensor` (partial outputs summed there).

Balancing: the Switch / Mixtral load-balancing loss (num_experts x sum over experts of the
fraction of assignments times the mean router probability) and ST-MoE's router z-loss, per
layer, averaged over the layers. They reach the training loss's gradient from inside the layer
(`_report`'s backward, at the cotangent the step gives the loss: `loss_seed`), as Megatron's
aux-loss scaler does, so that every pipeline schedule carries them without passing values
between stages; the step's reported `loss` is the cross entropy, the balancing losses are
logged beside it (`moe/...`). The layer's statistics leave the step through the gradient of a
zero probe, as the matmul statistics do (`lm.model.fp8`): per layer `STAT_FIELDS`.

Shape suffixes: n tokens (of this device), k experts per token, e experts, d embed, f expert
hidden width, c slots per expert (capacity), p devices along `expert`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sharding
from lm.model.config import ModelConfig
from lm.model.fp8 import Probe
from lm.model.layers import _param
from lm.model.matmul import backward, summed_as, varying
from lm.model.precision import Policy
from sharding.remat import name_matmul

F32 = jnp.float32
# After the per-expert loads [num_experts] (fractions of assignments, summing to 1) and mean
# router probabilities [num_experts]:
STAT_FIELDS = ("aux_loss", "z_loss", "dropped_fraction")
INPUT_AXES = ("batch", "length", "act_embed")  # the MLP's input: the sequence gathered over `tensor`
ROUTING_AXES = ("batch", "length", None)

_LOSS_SEED = contextvars.ContextVar("moe_loss_seed", default=1.0)


@contextlib.contextmanager
def loss_seed(seed):
    """Within: the balancing losses are differentiated at cotangent `seed`, the one the loss of
    the (micro)batch being traced is (its loss scale over the passes it is averaged over)."""
    token = _LOSS_SEED.set(seed)
    try:
        yield
    finally:
        _LOSS_SEED.reset(token)


class RouterBias(nnx.Param):
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the selection
    scores only (never to the combine weights). A parameter (it routes at inference too) that no
    gradient reaches; the step moves it toward an even load (`updated_router_bias`)."""


class RouterStats(Probe):
    """A zero input whose gradient is its layer's routing statistics: loads, mean router
    probabilities, then STAT_FIELDS."""


@dataclasses.dataclass(frozen=True)
class Routing:
    ids_nk: jax.Array  # chosen experts, best first
    weights_nk: jax.Array  # float32
    probs_ne: jax.Array  # float32 softmax over every expert


def route(logits_ne: jax.Array, k: int, renormalize: bool, bias_e: jax.Array | None = None) -> Routing:
    """Top-k of the softmax of float32 router logits (chosen by softmax + `bias_e` where given);
    `renormalize`: the chosen weights divided by their sum (Mixtral's softmax over the chosen
    logits; Qwen3-MoE's `norm_topk_prob`)."""
    probs = jax.nn.softmax(logits_ne.astype(F32), axis=-1)
    if bias_e is None:
        weights, ids = jax.lax.top_k(probs, k)
    else:
        _, ids = jax.lax.top_k(probs + jax.lax.stop_gradient(bias_e.astype(F32)), k)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(ids, weights, probs)


def balancing_losses(logits_ne: jax.Array, routing: Routing, num_experts: int):
    """(load per expert [e], mean router probability per expert [e], Switch load-balancing loss,
    router z-loss) of one layer's routing."""
    counts_e = jnp.zeros(num_experts, F32).at[routing.ids_nk.reshape(-1)].add(1.0)
    load_e = counts_e / routing.ids_nk.size
    tokens_e = counts_e / routing.ids_nk.shape[0]  # fraction of tokens sent to each (sums to k)
    prob_e = jnp.mean(routing.probs_ne, axis=0)
    aux = num_experts * jnp.sum(jax.lax.stop_gradient(tokens_e) * prob_e)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_ne.astype(F32), axis=-1)))
    return load_e, prob_e, aux, z


@jax.custom_vjp
def _report(y, losses, seed, probe, stats):
    """`y`; in the backward pass `losses` gets cotangent `seed` (they join the training loss's
    gradient) and `probe` gets `stats` (they leave the step)."""
    return y


def _report_fwd(y, losses, seed, probe, stats):
    return y, (losses, seed, stats)


def _report_bwd(residuals, dy):
    losses, seed, stats = residuals
    # An output no loss reads (a pipeline's bubble tick, run on filler) gets a zero cotangent:
    # it adds no balancing gradient and no statistics.
    used = jnp.any(dy != 0).astype(F32)
    return dy, jnp.full_like(losses, seed * used), jnp.zeros_like(seed), stats * used, jnp.zeros_like(stats)


_report.defvjp(_report_fwd, _report_bwd)


def split_stats(stats: dict) -> tuple[dict, jax.Array | None]:
    """(the matmul sites' statistics, the routing statistics [layers, 2 x experts + STAT_FIELDS]
    or None) of a step's probe gradients."""
    mlp = stats.get("blocks", {}).get("mlp", {})
    if "stats" not in mlp:
        return stats, None
    rest = {**stats, "blocks": {**stats["blocks"], "mlp": {k: v for k, v in mlp.items() if k != "stats"}}}
    return rest, mlp["stats"]


def updated_router_bias(params: dict, routing_lf: jax.Array, rate: float) -> dict:
    """`params` with every layer's router bias moved by `rate` toward an even load: up for the
    experts below the mean load, down for those above (DeepSeek-V3)."""
    mlp = params["blocks"]["mlp"]
    experts = mlp["router_bias"].shape[-1]
    load_le = routing_lf[:, :experts]
    bias = mlp["router_bias"] + rate * jnp.sign(1.0 / experts - load_le)
    return {**params, "blocks": {**params["blocks"], "mlp": {**mlp, "router_bias": bias}}}


def transformers_aux_loss(stats_lf, k: int) -> float:
    """The load-balancing loss as `transformers` computes it for Mixtral / Qwen3-MoE
    (`output_router_logits`): over every layer's tokens at once, num_experts x sum over experts of
    (fraction of tokens sent to it) x (mean probability), from the routing statistics. (Training
    uses each layer's own loss, averaged: `MoeMlp`.)"""
    stats_lf = np.asarray(stats_lf, np.float64)
    experts = (stats_lf.shape[1] - len(STAT_FIELDS)) // 2
    tokens_e, prob_e = stats_lf[:, :experts].mean(0) * k, stats_lf[:, experts : 2 * experts].mean(0)
    return float(experts * np.sum(tokens_e * prob_e))


def metric_rows(stats_lf, first_layer: int = 0) -> dict[str, float]:
    """Metrics rows of the routing statistics [layers, 2 x experts + STAT_FIELDS] of the model's
    layers `first_layer` ..: per layer each expert's load, max / mean load and STAT_FIELDS; and
    the layers' mean balancing losses."""
    stats_lf = np.asarray(stats_lf, np.float64)
    experts = (stats_lf.shape[1] - len(STAT_FIELDS)) // 2
    stats_lf = np.concatenate([stats_lf[:, :experts], stats_lf[:, 2 * experts :]], axis=1)
    row = {}
    for layer, stats in enumerate(stats_lf, start=first_layer):
        load = stats[:experts]
        row |= {f"moe/layer{layer}/load/expert{e}": float(v) for e, v in enumerate(load)}
        row[f"moe/layer{layer}/max_over_mean_load"] = float(load.max() * experts)
        row |= {f"moe/layer{layer}/{name}": float(v) for name, v in zip(STAT_FIELDS, stats[experts:])}
    for i, name in enumerate(STAT_FIELDS):
        row[f"moe/{name}"] = float(stats_lf[:, experts + i].mean())
    row["moe/max_over_mean_load"] = float((stats_lf[:, :experts].max(axis=1) * experts).mean())
    return row


# -- the experts' computation on one device's shards


# The experts' matmuls take compute-dtype activations and float32 weights (cast inside), and
# return float32; their backward GEMMs take compute-dtype operands too (autodiff would feed them
# the float32 cotangent, and XLA runs float32 x bf16 GEMMs in float32), the weight gradient left
# in float32 for its reduction over the devices (as `lm.model.matmul`).


@jax.custom_vjp
def grouped_matmul(x_md, w_edf, group_sizes_e):
    """`ragged_dot(x, w)`: row block g of the rows sorted by group through w[g]."""
    return jax.lax.ragged_dot(x_md, w_edf.astype(x_md.dtype), group_sizes_e, preferred_element_type=F32)


def _grouped_fwd(x_md, w_edf, group_sizes_e):
    return grouped_matmul(x_md, w_edf, group_sizes_e), (x_md, w_edf.astype(x_md.dtype), group_sizes_e)


def _grouped_bwd(residuals, dy_mf):
    x_md, w_edf, group_sizes_e = residuals
    dy = dy_mf.astype(x_md.dtype)
    dx = jax.lax.ragged_dot(dy, w_edf.swapaxes(1, 2), group_sizes_e, preferred_element_type=F32)
    # The weight gradient contracts the rows, group by group: [e, d, f].
    rows = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = jax.lax.ragged_dot_general(x_md, dy, group_sizes_e, rows, preferred_element_type=F32)
    return summed_as(dx.astype(x_md.dtype), x_md), summed_as(dw, w_edf), None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def batched_matmul(spec: str, x, w):
    """`einsum(spec, x, w)` over the experts' fixed-size buffers."""
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=F32)


def _batched_fwd(spec, x, w):
    return batched_matmul(spec, x, w), (x, w.astype(x.dtype))


def _batched_bwd(spec, residuals, dy):
    x, w = residuals
    dx, dw = backward(spec, x, w, dy.astype(x.dtype), dtypes=(x.dtype, F32))
    return summed_as(dx, x), summed_as(dw, w)


batched_matmul.defvjp(_batched_fwd, _batched_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gathered(w, axes: tuple[str, ...], axis: int, dtype):
    """FSDP inside `shard_map`: `w` whole along `axis` over the mesh `axes`, moved in the compute
    `dtype` and returned in w's; its gradient reduce-scattered in w's (float32), as the dense
    layers' are (XLA's placement there)."""
    return jax.lax.all_gather(w.astype(dtype), axes, axis=axis, tiled=True).astype(w.dtype)


def _gathered_fwd(w, axes, axis, dtype):
    return gathered(w, axes, axis, dtype), None


def _gathered_bwd(axes, axis, dtype, _, dw):
    return (jax.lax.psum_scatter(dw, axes, scatter_dimension=axis, tiled=True),)


gathered.defvjp(_gathered_fwd, _gathered_bwd)


def _ragged_swiglu(x_md, group_sizes_e, w_in, w_gate, w_out, dtype):
    """Rows sorted by group through the groups' SwiGLU experts (rows past the groups: zeros)."""
    # Tagged as matmul outputs: what remat's `dots` policies keep (a custom VJP hides the dot).
    dot = lambda a, w: name_matmul(grouped_matmul(a, w, group_sizes_e), batched=False)  # noqa: E731
    x = x_md.astype(dtype)
    h = (jax.nn.silu(dot(x, w_gate)) * dot(x, w_in)).astype(dtype)
    return dot(h, w_out)


def _grouped(x_md, group_m, w_in, w_gate, w_out, dtype):
    """Each row through expert `group_m` (values >= the experts here: no expert, zeros), by one
    grouped matmul over the rows sorted by expert."""
    experts = w_in.shape[0]
    order = jnp.argsort(group_m, stable=True)
    sizes = jnp.bincount(group_m, length=experts).astype(jnp.int32)  # out-of-range ids not counted
    y_sorted = _ragged_swiglu(x_md[order], sizes, w_in, w_gate, w_out, dtype)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


def _batched(x_ecd, w_in, w_gate, w_out, dtype):
    """Fixed-size per-expert buffers through their experts: dense batched matmuls."""
    dot = lambda spec, a, w: name_matmul(batched_matmul(spec, a, w), batched=True)  # noqa: E731
    x = x_ecd.astype(dtype)
    h = (jax.nn.silu(dot("ecd,edf->ecf", x, w_gate)) * dot("ecd,edf->ecf", x, w_in)).astype(dtype)
    return dot("ecf,efd->ecd", h, w_out)


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


def _exchange(x, expert_axes):
    """An all-to-all over the expert devices: chunk p of the leading axis goes to device p."""
    return jax.lax.all_to_all(x, expert_axes, 0, 0, tiled=True) if expert_axes else x


def _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """`jax.lax.ragged_all_to_all` over `axis`: rows `input_offsets[p]` .. `+ send_sizes[p]` of
    `operand` written into device p's `output` from its row `output_offsets[p]`; `recv_sizes[p]`
    rows arrive from p. Only the real rows move where XLA has the collective (GPUs); XLA:CPU has
    not, so there the same exchange runs as a fixed-size `all_to_all` (each device's chunk for
    each peer padded to the operand's length) and each received chunk is placed at its offset."""
    if sharding.platform() == "gpu":
        if devices := tuple(sorted(varying(operand) - varying(output))):  # the result varies as the rows sent do
            output = jax.lax.pcast(output, devices, to="varying")
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)
    ways, rows = input_offsets.shape[0], operand.shape[0]
    span = jnp.arange(rows)
    padded = jnp.concatenate([operand, jnp.zeros_like(operand)])
    chunks = jnp.stack([jax.lax.dynamic_slice_in_dim(padded, input_offsets[p], rows) for p in range(ways)])
    chunks = jnp.where((span[None] < send_sizes[:, None]).reshape(ways, rows, *(1,) * (operand.ndim - 1)), chunks, 0)
    arrived = _exchange(chunks.reshape(ways * rows, *operand.shape[1:]), axis).reshape(chunks.shape)
    at = _exchange(output_offsets, axis)  # where each source's rows go here
    where = jnp.where(span[None] < recv_sizes[:, None], at[:, None] + span[None], output.shape[0])  # past the end: dropped
    return output.at[where.reshape(-1)].set(arrived.reshape(ways * rows, *operand.shape[1:]), mode="drop")


def ragged_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows: int, fill, axis: tuple[str, ...]):
    """`_ragged` into a new buffer of `rows` rows filled with `fill`. On GPUs its backward sends
    the cotangent's rows back the way they came (`_gpu_exchange`); the CPU's emulation is
    differentiated as it is."""
    if sharding.platform() == "gpu":
        return _gpu_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, fill, axis)
    output = jnp.full((rows, *operand.shape[1:]), fill, operand.dtype)
    return _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gpu_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows: int, fill, axis: tuple[str, ...]):
    """`ragged_all_to_all` into a new buffer, with a hand-written backward: autodiff would also
    all-reduce the cotangent of the buffer (an invariant zero made varying) over every device,
    2 GiB a step in Mixtral's 64-GPU program."""
    output = jnp.full((rows, *operand.shape[1:]), fill, operand.dtype)
    return _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis)


def _exchange_fwd(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, fill, axis):
    shape = operand[:, :0]  # the operand's rows (and the devices it varies over), for the backward
    out = _gpu_exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, fill, axis)
    return out, (input_offsets, send_sizes, output_offsets, recv_sizes, shape)


def _exchange_bwd(rows, fill, axis, residuals, d_out):
    input_offsets, send_sizes, output_offsets, recv_sizes, shape = residuals
    # Back to each source p: the rows it put here (from here's row `at[p]`), into its operand's rows.
    at, their_offsets = _exchange(output_offsets, axis), _exchange(input_offsets, axis)
    back = _ragged(d_out, jnp.zeros((shape.shape[0], *d_out.shape[1:]), d_out.dtype), at, recv_sizes, their_offsets, send_sizes, axis)
    return summed_as(back, shape), None, None, None, None


_gpu_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def local_experts(x_btd, ids_btk, weights_btk, w_in, w_gate, w_out, *, num_experts, capacity_factor, dtype,
                  axes: dict[str, tuple[str, ...]]):
    """One device's part of the experts' output [b, t, d] and its dropped assignments (summed over
    the devices). `axes`: the mesh axes of 'experts', 'embed', 'mlp' and the token-splitting ones
    ('tokens'), all manual here (empty: one device)."""
    b, t, d = x_btd.shape
    k = ids_btk.shape[-1]
    if axes["embed"]:  # FSDP: this device's experts whole along embed (reduce-scattered in the backward pass)
        w_in, w_gate = (gathered(w, axes["embed"], 1, dtype) for w in (w_in, w_gate))
        w_out = gathered(w_out, axes["embed"], 2, dtype)
    here = w_in.shape[0]  # experts on this device
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
        recv = _exchange(buf, axes["experts"]).reshape(ways, here, slots, d).transpose(1, 0, 2, 3)
        y = _batched(recv.reshape(here, ways * slots, d), w_in, w_gate, w_out, dtype)
        y = _exchange(y.reshape(here, ways, slots, d).transpose(1, 0, 2, 3).reshape(-1, d), axes["experts"])
        y_nkd = jnp.concatenate([y, jnp.zeros((1, d), y.dtype)])[where].reshape(n, k, d)
        dropped = jnp.sum(~kept_nk).astype(F32)
    else:
        flat = ids_nk.reshape(-1)
        if ways == 1:
            y_nkd = _grouped(jnp.repeat(x_nd, k, axis=0), flat, w_in, w_gate, w_out, dtype).reshape(n, k, d)
        else:  # dropless: each device receives into room for every assignment from every device
            order = jnp.argsort(flat, stable=True)  # by destination device, then by its expert
            counts = jnp.bincount(flat[order] // here, length=ways).astype(jnp.int32)
            starts = jnp.cumsum(counts) - counts  # each destination's rows in the sorted order
            # Per source device: how many rows it sends here, and where its rows for here start.
            recv_counts, their_starts = _exchange(counts, axes["experts"]), _exchange(starts, axes["experts"])
            me = jax.lax.axis_index(axes["experts"])
            room = jnp.full((ways,), me * n * k, jnp.int32)  # here's rows land at chunk `me` of each receiver
            group = axes["experts"]
            recv = ragged_exchange(x_nd[order // k], starts, counts, room, recv_counts, ways * n * k, 0, group)
            recv_group = _ragged(flat[order] % here, jnp.full((ways * n * k,), here, flat.dtype), starts, counts, room, recv_counts, group)
            y = _grouped(recv, recv_group, w_in, w_gate, w_out, dtype)
            chunks = jnp.arange(ways, dtype=jnp.int32) * n * k
            back = ragged_exchange(y, chunks, recv_counts, their_starts, counts, n * k, 0, group)
            y_nkd = jnp.zeros_like(back).at[order].set(back).reshape(n, k, d)
        dropped = jnp.zeros((), F32)
    y_nd = jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(F32))
    if axes["mlp"]:  # the hidden width split over tensor: partial sums
        y_nd = jax.lax.psum(y_nd, axes["mlp"])
    if axes["tokens"]:
        dropped = jax.lax.psum(dropped, axes["tokens"])
    return y_nd.reshape(b, t, d), dropped


def experts(x_btd, routing_ids, routing_weights, w_in, w_gate, w_out, *, num_experts: int, capacity_factor: float, dtype):
    """The experts' weighted outputs [b, t, d] (float32) and the dropped assignments, each device
    running its shards (`local_experts`) under the mesh in force, or everything on one device."""
    axes = {name: sharding.active_axes(name) for name in ("experts", "embed", "mlp")}
    axes["tokens"] = tuple(dict.fromkeys(sharding.active_axes("batch") + sharding.active_axes("length")))

    def local(*args):
        return local_experts(*args, num_experts=num_experts, capacity_factor=capacity_factor, dtype=dtype, axes=axes)

    weight_in_axes, weight_out_axes = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")
    run = sharding.per_shard(
        local,
        (INPUT_AXES, ROUTING_AXES, ROUTING_AXES, weight_in_axes, weight_in_axes, weight_out_axes),
        [INPUT_AXES, ()],
    )
    return run(x_btd, routing_ids, routing_weights, w_in, w_gate, w_out)


def dense_reference(x_btd, routing: Routing, w_in, w_gate, w_out, dtype=F32):
    """Every token through every expert, the chosen ones weighted by one-hot sums: the grouped
    path's reference (tests)."""
    b, t, _ = x_btd.shape
    e = w_in.shape[0]
    gates_bte = jnp.einsum("nke,nk->ne", jax.nn.one_hot(routing.ids_nk, e, dtype=F32), routing.weights_nk).reshape(b, t, e)
    h = jax.nn.silu(jnp.einsum("btd,edf->btef", x_btd, w_gate)) * jnp.einsum("btd,edf->btef", x_btd, w_in)
    return jnp.einsum("btef,efd,bte->btd", h, w_out, gates_bte).astype(dtype)


class MoeMlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, policy: Policy, rngs: nnx.Rngs, shared_mlp=None):
        self.cfg, self.policy = cfg, policy
        d, e, f, dt = cfg.embed_dim, cfg.num_experts, cfg.expert_width, policy.param_dtype
        out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
        self.router = _param(rngs.params(), (d, e), ("embed", None), 0.02, dt)
        self.w_in = _param(rngs.params(), (e, d, f), ("experts", "embed", "mlp"), 0.02, dt)
        self.w_gate = _param(rngs.params(), (e, d, f), ("experts", "embed", "mlp"), 0.02, dt)
        self.w_out = _param(rngs.params(), (e, f, d), ("experts", "mlp", "embed"), out_std, dt)
        self.shared = shared_mlp  # the always-on experts, one MLP of their summed width, or None
        if cfg.expert_bias_rate > 0:
            self.router_bias = RouterBias(jnp.zeros(e, F32), out_sharding=(None,), eager_sharding=False)
        self.stats = RouterStats(jnp.zeros(2 * e + len(STAT_FIELDS), F32), out_sharding=(None,), eager_sharding=False)

    def router_logits(self, x_btd) -> jax.Array:
        """Float32 router logits [b, t, e]."""
        return jnp.einsum("btd,de->bte", x_btd.astype(F32), self.router[...].astype(F32))

    def __call__(self, x_btd):
        cfg = self.cfg
        b, t, _ = x_btd.shape
        logits_bte = sharding.constrain(self.router_logits(x_btd), ("batch", "length", None), "router logits")
        logits_ne = logits_bte.reshape(b * t, -1)
        bias = self.router_bias[...] if cfg.expert_bias_rate > 0 else None
        routing = route(logits_ne, cfg.experts_per_token, cfg.router_renormalize, bias)
        load_e, prob_e, aux, z = balancing_losses(logits_ne, routing, cfg.num_experts)
        k = cfg.experts_per_token
        y, dropped = experts(
            x_btd, routing.ids_nk.reshape(b, t, k), routing.weights_nk.reshape(b, t, k),
            self.w_in[...], self.w_gate[...], self.w_out[...],
            num_experts=cfg.num_experts, capacity_factor=cfg.expert_capacity_factor, dtype=self.policy.compute_dtype,
        )
        if self.shared is not None:
            y = y + self.shared(x_btd).astype(F32)
        losses = (cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z) / cfg.sparse_layers
        stats = jnp.concatenate([load_e, prob_e, jnp.stack([aux, z, dropped / routing.ids_nk.size])])
        y = _report(self.policy.cast(y), losses, jnp.asarray(_LOSS_SEED.get(), F32), self.stats[...], jax.lax.stop_gradient(stats))
        return sharding.constrain(y, INPUT_AXES, "moe output")
