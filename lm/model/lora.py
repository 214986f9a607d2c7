"""LoRA: low-rank adapters beside a model's matmuls (Hu et al., 2021), as PEFT makes them.

An adapted matmul computes `x W + (alpha / rank) (x A) B`: A `[in, rank]` starts as PEFT's
(Kaiming-uniform, a = sqrt(5): uniform within 1 / sqrt(in)), B `[rank, out]` at zero, so the
model at initialisation is the base model. A and B are `LoraParam`s: the only parameters a LoRA
run trains (`lm.program.trainable`), in float32 under the same logical axes as the weight
beside them (the rank axis `lora_rank` whole), while the base stays frozen in the compute dtype.
Their matmuls go through the policy as any matmul does, never as fp8 sites (fp8 applies to the
base matmuls).

With `lora.dropout` p > 0 a training step drops each adapter's input as PEFT does (`lora_B(lora_A(
dropout(x)))`, kept values scaled by 1 / (1 - p)); each token's mask comes from its own key, made
from the run's seed, the step and the token's place in the global batch (`dropout_keys`), folded
with the layer and the target, so a step drops the same values on any mesh, microbatching or
restart.

Targets (`lm.model.config.LORA_TARGETS`) are named by the model's matmuls, as PEFT's
`target_modules` name Llama's:

    q k v o            attention's projections (q_proj ... o_proj)
    q_a q_b kv_a kv_b  latent attention's (DeepSeek's q_a_proj, q_b_proj, kv_a_proj_with_mqa,
                       kv_b_proj; q and o as above): kv_a and kv_b fused matmuls, one A each
    gate up down       the MLP's (gate_proj, up_proj, down_proj; GPT-2's c_fc, c_proj as up, down)
    experts            every routed expert's three (`ExpertAdapter`: PEFT's adapters on the fused
                       `experts.gate_up_proj` / `experts.down_proj` parameters)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

RANK_LETTER = "z"  # the rank's letter in the adapters' einsums (no model spec uses it)
_DROPOUT = contextvars.ContextVar("lora_dropout", default=None)  # (rate, each token's key [b, t, 2]) in a training step
_LAYER = contextvars.ContextVar("lora_layer", default=0)  # the model's layer being traced (a scan's index: traced)


def dropout_keys(seed: int, step, rows: int) -> jax.Array:
    """[rows, 2] uint32: each row's dropout key of a step's global batch."""
    base = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(rows))


def token_keys(row_keys_b2: jax.Array, length: int) -> jax.Array:
    """[b, length, 2]: each token's key, from its row's and its place in the row."""
    return jax.vmap(lambda key: jax.vmap(lambda t: jax.random.fold_in(key, t))(jnp.arange(length)))(row_keys_b2)


@contextlib.contextmanager
def dropout(rate: float, keys_bt2: jax.Array | None):
    """Within (a training step's forward): the adapters' inputs dropped at `rate`, each token's
    mask from its key in `keys_bt2` (none given: no dropout)."""
    token = _DROPOUT.set((rate, keys_bt2) if rate and keys_bt2 is not None else None)
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def dropping() -> bool:
    return _DROPOUT.get() is not None


@contextlib.contextmanager
def in_layer(layer):
    """Within: the adapters traced belong to the model's layer `layer` (an int, or a scan's traced index)."""
    token = _LAYER.set(layer)
    try:
        yield
    finally:
        _LAYER.reset(token)


def _dropped(x, target: str):
    """`x` [b, t, ...] with LoRA dropout applied where a step asks for it (inverted dropout: kept
    values scaled by 1 / (1 - rate)); `x` itself otherwise."""
    state = _DROPOUT.get()
    if state is None:
        return x
    rate, keys_bt2 = state  # (the keys: the tokens' order and placement, as x's)
    salt, layer = zlib.crc32(target.encode()) & 0x7FFFFFFF, _LAYER.get()
    features = math.prod(x.shape[2:])

    def draws(key):  # one token's 16-bit draws over its features: two from each 32-bit word (half the generator's work)
        words = jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, layer), salt), (-(-features // 2),), jnp.uint32)
        return jnp.concatenate([words & 0xFFFF, words >> 16])[:features].reshape(x.shape[2:])

    keep = jax.vmap(jax.vmap(draws))(keys_bt2) >= jnp.uint32(round(rate * 2**16))
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


class LoraParam(nnx.Param):
    """An adapter's weight: what a LoRA run trains."""


def _letters(spec: str) -> tuple[str, str, str, str]:
    """(x's letters, the weight's, the output's, the contracted ones) of a matmul's einsum."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return x, w, out, "".join(c for c in w if c in x)


def _kaiming_a(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """A's PEFT initialisation: kaiming_uniform(a = sqrt(5)), uniform within 1 / sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)


def _axes(weight: nnx.Param) -> tuple:
    return tuple(weight.get_metadata().get("out_sharding") or (None,) * weight.ndim)


class Adapter(nnx.Module):
    """The adapter of one matmul `einsum(spec, x, w)` (`parts` = (spec, w)): A [*in, rank] over the
    weight's contracted axes, B `b` [rank, *out] over its output axes, each under the weight's
    logical axes. Or of several matmuls of one input that a checkpoint fuses into one
    (`parts` = {weight name: (spec, w)}: DeepSeek's `kv_a_proj_with_mqa`, `kv_b_proj`), one A
    and a B `b_<weight name>` for each, as PEFT adapts the fused matrix."""

    def __init__(self, target: str, parts, rank: int, alpha: float, rngs: nnx.Rngs):
        self.target, self.scale, self.fused = target, alpha / rank, isinstance(parts, dict)
        parts = parts if self.fused else {"": parts}
        spec, weight = next(iter(parts.values()))
        x, w, _, contracted = _letters(spec)
        rest = "".join(c for c in x if c not in w)  # x's axes the matmuls keep (batch, length)
        self.spec_a = f"{x},{contracted}{RANK_LETTER}->{rest}{RANK_LETTER}"
        in_shape = tuple(n for n, c in zip(weight.shape, w) if c in contracted)
        in_axes = tuple(a for a, c in zip(_axes(weight), w) if c in contracted)
        self.a = LoraParam(_kaiming_a(rngs, (*in_shape, rank), math.prod(in_shape)), out_sharding=(*in_axes, "lora_rank"), eager_sharding=False)
        self.b_names, specs_b = tuple(f"b_{name}" if self.fused else "b" for name in parts), []
        for b_name, (spec, weight) in zip(self.b_names, parts.values()):
            _, w, out, _ = _letters(spec)
            own = [(n, a) for n, a, c in zip(weight.shape, _axes(weight), w) if c not in contracted]
            specs_b.append(f"{rest}{RANK_LETTER},{RANK_LETTER}{''.join(c for c in w if c not in x)}->{out}")
            b = jnp.zeros((rank, *(n for n, _ in own)), jnp.float32)
            setattr(self, b_name, LoraParam(b, out_sharding=("lora_rank", *(a for _, a in own)), eager_sharding=False))
        self.specs_b = tuple(specs_b)

    def __call__(self, policy, x):
        """(alpha / rank) (dropout(x) A) B in the compute dtype (a tuple of them, fused)."""
        xa = policy.matmul(self.spec_a, _dropped(x, self.target), self.a[...])
        scale = jnp.asarray(self.scale, policy.compute_dtype)
        out = tuple(policy.matmul(spec, xa, getattr(self, b)[...]) * scale for spec, b in zip(self.specs_b, self.b_names))
        return out if self.fused else out[0]


class ExpertAdapter(nnx.Module):
    """The adapters of every routed expert's matmuls, laid out as PEFT adapts Hugging Face's fused
    expert parameters (`target_parameters`): per expert one A for gate and up together (PEFT
    adapts `gate_up_proj` as one matrix: their shared input, one x A for both) and a B for each
    half, and A, B for down. Rank `rank` per expert; `lm.model.experts` runs them beside the
    experts' grouped (or batched) GEMMs."""

    FIELDS = ("a_in", "b_gate", "b_up", "a_out", "b_out")

    def __init__(self, experts: int, d: int, f: int, rank: int, alpha: float, rngs: nnx.Rngs):
        self.scale = alpha / rank
        self.a_in = LoraParam(_kaiming_a(rngs, (experts, d, rank), d), out_sharding=("experts", "embed", "lora_rank"), eager_sharding=False)
        zeros_b = lambda n, axis: LoraParam(jnp.zeros((experts, rank, n), jnp.float32), out_sharding=("experts", "lora_rank", axis), eager_sharding=False)  # noqa: E731
        self.b_gate, self.b_up = zeros_b(f, "mlp"), zeros_b(f, "mlp")
        self.a_out = LoraParam(_kaiming_a(rngs, (experts, f, rank), f), out_sharding=("experts", "mlp", "lora_rank"), eager_sharding=False)
        self.b_out = zeros_b(d, "embed")

    def arrays(self) -> tuple[jax.Array, ...]:
        """(a_in [e, d, r], b_gate [e, r, f], b_up [e, r, f], a_out [e, f, r], b_out [e, r, d])."""
        return tuple(getattr(self, name)[...] for name in self.FIELDS)


def adapters(cfg, matmuls: dict, rngs: nnx.Rngs) -> dict[str, Adapter]:
    """{target: its Adapter} for the `matmuls` ({target: (einsum spec, weight)}, or fused
    {target: {weight name: (spec, weight)}}) that `cfg.lora_targets` names (none without LoRA)."""
    if not cfg.lora_rank:
        return {}
    return {name: Adapter(name, parts, cfg.lora_rank, cfg.lora_alpha, rngs) for name, parts in matmuls.items() if name in cfg.lora_targets}


def attach(module: nnx.Module, cfg, matmuls: dict, rngs: nnx.Rngs) -> None:
    """`adapters` set on `module` as attributes `lora_<target>` (nothing without LoRA)."""
    for name, adapter in adapters(cfg, matmuls, rngs).items():
        setattr(module, f"lora_{name}", adapter)


def adapted(module: nnx.Module, name: str, y, x: jax.Array):
    """The output `y` of `module`'s matmul `name` on input `x` (fused: the tuple of its
    matmuls' outputs), plus its adapter's update where it has one."""
    adapter = getattr(module, f"lora_{name}", None)
    if adapter is None:
        return y
    update = adapter(module.policy, x)
    return tuple(a + u.astype(a.dtype) for a, u in zip(y, update)) if adapter.fused else y + update.astype(y.dtype)


# Each target's weight, beside its adapter `lora_<target>`: laid out (*in, *out), as A (*in, rank) and B (rank, *out).
WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_in", "down": "w_out", "q_a": "wq_a", "q_b": "wq_b"}
# Fused targets' weights (latent attention's), each with its B `b_<weight>` beside the shared A.
FUSED = {"kv_a": ("wkv_a", "wk_rope"), "kv_b": ("wk_b", "wv_b")}
# The experts' weights, each with its (A, B) in `lora_experts` (`ExpertAdapter`).
EXPERT_WEIGHTS = {"w_gate": ("a_in", "b_gate"), "w_in": ("a_in", "b_up"), "w_out": ("a_out", "b_out")}


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
        pairs = [(weight, tree.get(f"lora_{target}"), ("a", "b")) for target, weight in WEIGHTS.items()]
        pairs += [(weight, tree.get(f"lora_{target}"), ("a", f"b_{weight}")) for target, weights in FUSED.items() for weight in weights]
        pairs += [(weight, tree.get("lora_experts"), ab) for weight, ab in EXPERT_WEIGHTS.items()]
        for weight, adapter, (a, b) in pairs:
            if adapter is not None:
                w = np.asarray(tree[weight])
                out[weight] = w.astype(np.float32) + cfg.lora_alpha / cfg.lora_rank * delta(adapter[a], adapter[b], w.shape)
        return out

    return walk(params)
