"""LoRA: low-rank adapters beside a model's matmuls (Hu et al., 2021), as PEFT makes them.

An adapted matmul computes `x W + (alpha / rank) (x A) B`: A `[in, rank]` starts as PEFT's
(Kaiming-uniform, a = sqrt(5): uniform within 1 / sqrt(in)), B `[rank, out]` at zero, so the
model at initialisation is the base model. A and B are `LoraParam`s: the only parameters a LoRA
run trains (`lm.program.trainable`), in float32 under the same logical axes as the weight
beside them (the rank axis `lora_rank` whole), while the base stays frozen in the compute dtype.
Their matmuls go through the policy as any matmul does, never as fp8 sites (fp8 applies to the
base matmuls).

Targets (`lm.model.config.LORA_TARGETS`) are named by the model's matmuls, as PEFT's
`target_modules` name Llama's:

    q k v o            attention's projections (q_proj ... o_proj)
    gate up down       the MLP's (gate_proj, up_proj, down_proj; GPT-2's c_fc, c_proj as up, down)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

RANK_LETTER = "z"  # the rank's letter in the adapters' einsums (no model spec uses it)


class LoraParam(nnx.Param):
    """An adapter's weight: what a LoRA run trains."""


def _letters(spec: str) -> tuple[str, str, str, str]:
    """(x's letters, the weight's, the output's, the contracted ones) of a matmul's einsum."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return x, w, out, "".join(c for c in w if c in x)


class Adapter(nnx.Module):
    """The adapter of one matmul `einsum(spec, x, w)` whose weight has `w_shape` and logical
    `w_axes`: A over the weight's contracted axes, B over its output axes."""

    def __init__(self, spec: str, w_shape: tuple[int, ...], w_axes: tuple[str, ...], rank: int, alpha: float, rngs: nnx.Rngs):
        x, w, out, contracted = _letters(spec)
        self.spec_a = f"{x},{contracted}{RANK_LETTER}->{''.join(c for c in x if c not in w)}{RANK_LETTER}"
        self.spec_b = f"{''.join(c for c in x if c not in w)}{RANK_LETTER},{RANK_LETTER}{''.join(c for c in w if c not in x)}->{out}"
        self.scale = alpha / rank
        in_shape = tuple(n for n, c in zip(w_shape, w) if c in contracted)
        in_axes = tuple(a for a, c in zip(w_axes, w) if c in contracted)
        out_shape = tuple(n for n, c in zip(w_shape, w) if c not in contracted)
        out_axes = tuple(a for a, c in zip(w_axes, w) if c not in contracted)
        bound = 1.0 / math.sqrt(math.prod(in_shape))  # kaiming_uniform(a=sqrt(5)) over fan_in
        a = jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32, -bound, bound)
        self.a = LoraParam(a, out_sharding=(*in_axes, "lora_rank"), eager_sharding=False)
        self.b = LoraParam(jnp.zeros((rank, *out_shape), jnp.float32), out_sharding=("lora_rank", *out_axes), eager_sharding=False)

    def __call__(self, policy, x):
        """(alpha / rank) (x A) B in the compute dtype."""
        xa = policy.matmul(self.spec_a, x, self.a[...])
        return policy.matmul(self.spec_b, xa, self.b[...]) * jnp.asarray(self.scale, policy.compute_dtype)


def adapters(cfg, matmuls: dict[str, tuple[str, nnx.Param]], rngs: nnx.Rngs) -> dict[str, Adapter]:
    """{target: its Adapter} for the `matmuls` ({target: (einsum spec, weight)}) that
    `cfg.lora_targets` names (none without LoRA)."""
    if not cfg.lora_rank:
        return {}
    out = {}
    for name, (spec, weight) in matmuls.items():
        if name in cfg.lora_targets:
            axes = tuple(weight.get_metadata().get("out_sharding") or (None,) * weight.ndim)
            out[name] = Adapter(spec, weight.shape, axes, cfg.lora_rank, cfg.lora_alpha, rngs)
    return out


def attach(module: nnx.Module, cfg, matmuls: dict[str, tuple[str, nnx.Param]], rngs: nnx.Rngs) -> None:
    """`adapters` set on `module` as attributes `lora_<target>` (nothing without LoRA)."""
    for name, adapter in adapters(cfg, matmuls, rngs).items():
        setattr(module, f"lora_{name}", adapter)


def adapted(module: nnx.Module, name: str, y: jax.Array, x: jax.Array) -> jax.Array:
    """The output `y` of `module`'s matmul `name` on input `x`, plus its adapter's update where
    it has one."""
    adapter = getattr(module, f"lora_{name}", None)
    return y if adapter is None else y + adapter(module.policy, x).astype(y.dtype)


# Each target's weight, beside its adapter `lora_<target>`: laid out (*in, *out), as A (*in, rank) and B (rank, *out).
WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_in", "down": "w_out"}


def delta(a, b, w_shape):
    """(A B) as an update of a weight of `w_shape` (leading stacked axes included), in float32."""
    import numpy as np

    lead = a.ndim + b.ndim - 2 - len(w_shape)  # stacked axes (layers) in front of all three
    a2 = np.asarray(a, np.float32).reshape(*a.shape[:lead], -1, a.shape[-1])
    b2 = np.asarray(b, np.float32).reshape(*b.shape[:lead], b.shape[lead], -1)
    return np.matmul(a2, b2).reshape(w_shape)


def merged(params: dict, cfg) -> dict:
    """Pure-dict parameters with every adapter folded into its weight (W + alpha / rank A B, in
    float32, rounded once where the export casts) and the adapters gone: the model a LoRA run
    has trained, as a plain one (on the host, numpy)."""
    import numpy as np

    def walk(tree: dict) -> dict:
        out = {k: walk(v) if isinstance(v, dict) else v for k, v in tree.items() if not k.startswith("lora_")}
        for target, weight in WEIGHTS.items():
            adapter = tree.get(f"lora_{target}")
            if adapter is not None:
                w = np.asarray(tree[weight])
                out[weight] = w.astype(np.float32) + cfg.lora_alpha / cfg.lora_rank * delta(adapter["a"], adapter["b"], w.shape)
        return out

    return walk(params)
