"""A mixture-of-experts MLP: a float32 router picks `experts_per_token` of `num_experts` SwiGLU
experts per token, their outputs are summed with the router's weights, plus always-on shared
experts (DeepSeek / Qwen2-MoE).

Dropless by default, or with a capacity factor fixed per-expert buffers, the dropped assignments
counted; the experts split over the `expert` mesh axis, tokens exchanged between its devices:
`lm.model.experts` runs them.

Balancing: the Switch / Mixtral load-balancing loss (num_experts x sum over experts of the
fraction of assignments times the mean router probability) and ST-MoE's router z-loss, per
layer, averaged over the layers. They reach the training loss's gradient from inside the layer
(`_report`'s backward, at the cotangent the step gives the loss: `loss_seed`), as Megatron's
aux-loss scaler does, so that every pipeline schedule carries them without passing values
between stages; the step's reported `loss` is the cross entropy, the balancing losses are
logged beside it (`moe/...`). The layer's statistics leave the step through the gradient of a
zero probe, as the matmul statistics do (`lm.model.fp8`): per layer `STAT_FIELDS`.

Shape suffixes: n tokens, k experts per token, e experts, d embed, l layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sharding
from lm.model import lora
from lm.model.config import ModelConfig
from lm.model.experts import INPUT_AXES, apply_experts
from lm.model.fp8 import Probe
from lm.model.layers import _param
from lm.model.precision import Policy

F32 = jnp.float32
# After the per-expert loads [num_experts] (fractions of assignments, summing to 1) and mean
# router probabilities [num_experts]:
STAT_FIELDS = ("aux_loss", "z_loss", "dropped_fraction")

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


@contextlib.contextmanager
def loss_weighted(weight: float):
    """Within: the balancing losses count `weight` times as much (those of multi-token
    prediction's layers, whose whole loss is weighted)."""
    with loss_seed(_LOSS_SEED.get() * weight):
        yield


class RouterBias(nnx.Param):
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the selection
    scores only (never to the combine weights). A parameter (it routes at inference too) that no
    gradient reaches; the step moves it toward an even load (`updated_router_bias`)."""


def has_router_bias(cfg: ModelConfig) -> bool:
    """Whether the router has a selection bias: moved by the step (`expert_bias_rate` > 0), or a
    sigmoid router's (DeepSeek-V3's checkpoints carry one, `e_score_correction_bias`)."""
    return cfg.expert_bias_rate > 0 or cfg.router_score == "sigmoid"


class RouterStats(Probe):
    """A zero input whose gradient is its layer's routing statistics: loads, mean router
    probabilities, then STAT_FIELDS."""


@dataclasses.dataclass(frozen=True)
class Routing:
    ids_nk: jax.Array  # chosen experts, best first
    weights_nk: jax.Array  # float32
    probs_ne: jax.Array  # float32 router probabilities over every expert (sigmoid scores: normalised to sum to 1)


def route(logits_ne: jax.Array, k: int, renormalize: bool, bias_e: jax.Array | None = None, score: str = "softmax",
          groups: int = 1, groups_chosen: int = 1, scale: float = 1.0) -> Routing:
    """Top-k of the float32 router logits' scores, softmax or (DeepSeek-V3) `sigmoid`, chosen by
    score + `bias_e` where given (the weights are the scores themselves); with `groups` > 1, only
    among the experts of the `groups_chosen` groups whose best two choosing scores sum highest.
    `renormalize`: the chosen weights divided by their sum (Mixtral's softmax over the chosen
    logits; Qwen3-MoE's and DeepSeek's `norm_topk_prob`); then times `scale` (DeepSeek's
    `routed_scaling_factor`)."""
    logits_ne = logits_ne.astype(F32)
    scores = jax.nn.sigmoid(logits_ne) if score == "sigmoid" else jax.nn.softmax(logits_ne, axis=-1)
    choosing = scores if bias_e is None else scores + jax.lax.stop_gradient(bias_e.astype(F32))
    if groups > 1:
        n, e = choosing.shape
        grouped = choosing.reshape(n, groups, e // groups)
        best_two = jax.lax.top_k(grouped, 2)[0].sum(-1)  # n groups
        _, chosen = jax.lax.top_k(best_two, groups_chosen)
        in_chosen = jnp.zeros((n, groups), bool).at[jnp.arange(n)[:, None], chosen].set(True)
        choosing = jnp.where(jnp.repeat(in_chosen, e // groups, axis=1), choosing, -jnp.inf)
    _, ids = jax.lax.top_k(choosing, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if score == "sigmoid" else 0.0))
    if scale != 1.0:
        weights = weights * scale
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True) if score == "sigmoid" else scores
    return Routing(ids, weights, probs)


def balancing_losses(logits_ne: jax.Array, routing: Routing, num_experts: int, sequences: int = 0):
    """(load per expert [e], mean router probability per expert [e], load-balancing loss, router
    z-loss) of one layer's routing. The balancing loss is Switch's over all the tokens, or with
    `sequences` (the tokens being that many sequences in order) DeepSeek-V3's sequence-wise one:
    per sequence, sum over experts of (E / k) x (fraction of its tokens sent there) x (its mean
    normalised score), averaged over the sequences."""
    counts_e = jnp.zeros(num_experts, F32).at[routing.ids_nk.reshape(-1)].add(1.0)
    load_e = counts_e / routing.ids_nk.size
    tokens_e = counts_e / routing.ids_nk.shape[0]  # fraction of tokens sent to each (sums to k)
    prob_e = jnp.mean(routing.probs_ne, axis=0)
    if sequences:
        n, k = routing.ids_nk.shape
        ids_sm = routing.ids_nk.reshape(sequences, -1)
        counts_se = jnp.zeros((sequences, num_experts), F32).at[jnp.arange(sequences)[:, None], ids_sm].add(1.0)
        prob_se = jnp.mean(routing.probs_ne.reshape(sequences, n // sequences, num_experts), axis=1)
        share_se = jax.lax.stop_gradient(counts_se / (n // sequences))
        aux = num_experts / k * jnp.mean(jnp.sum(share_se * prob_se, axis=-1))
    else:
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


# Where a mixture of experts' layers keep their MLPs, in the order their statistics are reported:
# the stacked sparse layers, then multi-token prediction's blocks (`lm.model.multi_token`).
ROUTED_STACKS = (("blocks",), ("mtp", "block"))


def _mlp_at(tree: dict, stack: tuple[str, ...]) -> dict | None:
    for key in (*stack, "mlp"):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _with_mlp(tree: dict, stack: tuple[str, ...], mlp: dict) -> dict:
    head, *rest = (*stack, "mlp")
    return {**tree, head: mlp if not rest else _with_mlp(tree[head], tuple(rest[:-1]), mlp)}


def split_stats(stats: dict) -> tuple[dict, jax.Array | None]:
    """(the matmul sites' statistics, the routing statistics [layers, 2 x experts + STAT_FIELDS]
    or None: the sparse layers', then multi-token prediction's) of a step's probe gradients."""
    routing = []
    for stack in ROUTED_STACKS:
        mlp = _mlp_at(stats, stack)
        if mlp is not None and "stats" in mlp:
            routing.append(mlp["stats"])
            stats = _with_mlp(stats, stack, {k: v for k, v in mlp.items() if k != "stats"})
    return stats, jnp.concatenate(routing) if routing else None


def updated_router_bias(params: dict, routing_lf: jax.Array, rate: float) -> dict:
    """`params` with every routed layer's bias moved by `rate` toward an even load: up for the
    experts below the mean load, down for those above (DeepSeek-V3)."""
    first = 0
    for stack in ROUTED_STACKS:
        mlp = _mlp_at(params, stack)
        if mlp is None or "router_bias" not in mlp:
            continue
        layers, experts = mlp["router_bias"].shape
        load_le = routing_lf[first : first + layers, :experts]
        first += layers
        params = _with_mlp(params, stack, {**mlp, "router_bias": mlp["router_bias"] + rate * jnp.sign(1.0 / experts - load_le)})
    return params


def transformers_aux_loss(stats_lf, k: int) -> float:
    """The load-balancing loss as `transformers` computes it for Mixtral / Qwen3-MoE
    (`output_router_logits`): over every layer's tokens at once, num_experts x sum over experts of
    (fraction of tokens sent to it) x (mean probability), from the routing statistics. (Training
    uses each layer's own loss, averaged: `MoeMlp`.)"""
    stats_lf = np.asarray(stats_lf, np.float64)
    experts = (stats_lf.shape[1] - len(STAT_FIELDS)) // 2
    tokens_e, prob_e = stats_lf[:, :experts].mean(0) * k, stats_lf[:, experts : 2 * experts].mean(0)
    return float(experts * np.sum(tokens_e * prob_e))


def metric_rows(stats_lf, layer_ids: tuple[int, ...] = ()) -> dict[str, float | list[float]]:
    """Metrics rows of the routing statistics [layers, 2 x experts + STAT_FIELDS] of the model's
    layers `layer_ids` (none given: 0 ..): per layer its experts' loads as one list (Qwen3-30B-A3B would log
    48 x 128 scalars otherwise), max / mean load and STAT_FIELDS as scalars; and the layers' means."""
    stats_lf = np.asarray(stats_lf, np.float64)
    experts = (stats_lf.shape[1] - len(STAT_FIELDS)) // 2
    stats_lf = np.concatenate([stats_lf[:, :experts], stats_lf[:, 2 * experts :]], axis=1)
    row = {}
    for layer, stats in zip(layer_ids or range(len(stats_lf)), stats_lf):
        load = stats[:experts]
        row[f"moe/layer{layer}/load"] = [round(float(v), 6) for v in load]
        row[f"moe/layer{layer}/max_over_mean_load"] = float(load.max() * experts)
        row |= {f"moe/layer{layer}/{name}": float(v) for name, v in zip(STAT_FIELDS, stats[experts:])}
    for i, name in enumerate(STAT_FIELDS):
        row[f"moe/{name}"] = float(stats_lf[:, experts + i].mean())
    row["moe/max_over_mean_load"] = float((stats_lf[:, :experts].max(axis=1) * experts).mean())
    return row


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
        if has_router_bias(cfg):
            self.router_bias = RouterBias(jnp.zeros(e, F32), out_sharding=(None,), eager_sharding=False)
        self.stats = RouterStats(jnp.zeros(2 * e + len(STAT_FIELDS), F32), out_sharding=(None,), eager_sharding=False)
        if cfg.lora and "experts" in cfg.lora_targets:
            self.lora_experts = lora.ExpertAdapter(e, d, f, cfg.lora_rank, cfg.lora_alpha, rngs)

    def router_logits(self, x_btd) -> jax.Array:
        """Float32 router logits [b, t, e]."""
        return jnp.einsum("btd,de->bte", x_btd.astype(F32), self.router[...].astype(F32))

    def __call__(self, x_btd):
        cfg = self.cfg
        b, t, _ = x_btd.shape
        logits_bte = sharding.constrain(self.router_logits(x_btd), ("batch", "length", None), "router logits")
        logits_ne = logits_bte.reshape(b * t, -1)
        bias = self.router_bias[...] if has_router_bias(cfg) else None
        routing = route(logits_ne, cfg.experts_per_token, cfg.router_renormalize, bias, cfg.router_score, cfg.router_groups,
                        cfg.router_groups_chosen, cfg.router_scale)
        load_e, prob_e, aux, z = balancing_losses(logits_ne, routing, cfg.num_experts, b if cfg.router_aux_loss_per == "sequence" else 0)
        k = cfg.experts_per_token
        y, dropped = apply_experts(
            x_btd, routing.ids_nk.reshape(b, t, k), routing.weights_nk.reshape(b, t, k),
            self.w_in[...], self.w_gate[...], self.w_out[...],
            num_experts=cfg.num_experts, capacity_factor=cfg.expert_capacity_factor, dtype=self.policy.compute_dtype,
            implementation=cfg.grouped_gemm, dispatch_chunks=cfg.expert_dispatch_chunks,
            **({"lora": self.lora_experts.arrays(), "lora_scale": self.lora_experts.scale} if hasattr(self, "lora_experts") else {}),
        )
        if self.shared is not None:
            y = y + self.shared(x_btd).astype(F32)
        losses = (cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z) / cfg.sparse_layers
        stats = jnp.concatenate([load_e, prob_e, jnp.stack([aux, z, dropped / routing.ids_nk.size])])
        y = _report(self.policy.cast(y), losses, jnp.asarray(_LOSS_SEED.get(), F32), self.stats[...], jax.lax.stop_gradient(stats))
        return sharding.constrain(y, INPUT_AXES, "moe output")
