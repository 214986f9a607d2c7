"""The checks a config passes before anything runs (`validate`): each key's choices, signs and
intervals, and the combinations meshlm refuses, every failure one UserError naming the key and
the fix. `lm.config.apply_overrides` runs them on every config it locks.
"""

from __future__ import annotations

import math

import ml_collections

from lm.errors import UserError
from lm.model.config import LORA_TARGETS, moe_problem, parse_targets
from lm.model.grouped_gemm import IMPLEMENTATIONS as GROUPED_GEMMS
from lm.model.grouped_gemm import pallas_fits
from sharding.remat import REMAT

_CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.position": ("rope", "learned"),
    "model.mlp": ("swiglu", "gelu"),
    "model.rope_scaling": ("none", "linear", "llama3", "yarn"),
    "model.router_score": ("softmax", "sigmoid"),
    "model.router_aux_loss_per": ("batch", "sequence"),
    "model.remat": REMAT,
    "model.attention": ("auto", "cudnn", "xla", "einsum"),
    "model.grouped_gemm": GROUPED_GEMMS,
    "train.on_nonfinite": ("skip", "stop"),
    "train.gemm_fusion": ("operands", "elementwise", "auto"),
    "optim.name": ("adamw", "muon"),
    "pipeline.remat": REMAT,
    "pipeline.schedule": ("gpipe", "1f1b", "1f1b_per_stage", "zero_bubble", "zbv", "dualpipev"),
    "precision.param_dtype": ("float32", "bfloat16"),
    "precision.compute_dtype": ("float32", "bfloat16", "float16"),
    "precision.mu_dtype": ("float32", "bfloat16"),
    "precision.fp8": ("off", "delayed", "current"),
    "precision.fp8_sites": ("auto", "all"),
    "data.format": ("text", "chat"),
    "data.loss_on": ("auto", "assistant", "completion", "all"),
    "data.truncate": ("right", "drop"),
}

_POSITIVE = (
    "model.num_layers", "model.embed_dim", "model.num_heads", "model.num_kv_heads", "model.mlp_dim",
    "model.vocab_multiple", "model.expert_dispatch_chunks", "model.loss_chunks", "train.steps", "train.batch_size", "train.seq_len", "train.grad_accum",
    "train.log_every", "train.eval_every", "train.eval_batches", "train.max_consecutive_nonfinite", "train.spike_window", "train.spike_steps",
    "train.spike_max_rollbacks", "optim.muon_ns_steps", "eval.every_steps", "eval.batch_size", "pipeline.repeats", "checkpoint.every_steps",
    "checkpoint.keep", "data.vocab_size",
    "precision.fp8_history", "precision.loss_scale_initial", "precision.loss_scale_growth_interval",
    "precision.loss_scale_min", "optim.lr", "optim.eps", "model.rope_theta", "model.norm_eps",
    "model.rope_factor", "model.rope_original_max_len", "model.router_groups", "model.router_groups_chosen", "model.router_scale",
    "model.qk_nope_head_dim", "model.qk_rope_head_dim", "model.v_head_dim",
)
_NOT_NEGATIVE = (
    "optim.weight_decay", "optim.clip_norm", "optim.warmup_steps", "optim.decay_steps", "model.head_dim",
    "model.vocab_size", "model.max_positions", "model.sliding_window", "model.num_experts", "model.expert_mlp_dim",
    "model.shared_experts", "model.expert_capacity_factor", "model.router_aux_loss_coef", "model.router_z_loss_coef",
    "model.expert_bias_rate", "model.kv_lora_rank", "model.q_lora_rank", "model.rope_mscale", "model.rope_mscale_all_dim",
    "pipeline.microbatches", "precision.fp8_margin", "data.prefetch", "train.seed", "data.workers", "eval.limit",
)
# [low, high) intervals
_INTERVALS = {"optim.muon_momentum": (0.0, 1.0), "optim.b1": (0.0, 1.0), "optim.b2": (0.0, 1.0), "optim.min_lr_ratio": (0.0, 1.0 + 1e-12)}


def _numbers(c, prefix: str = ""):
    """(dotted key, value) of every number in the config, booleans aside."""
    for key, value in c.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _numbers(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def _get(c, dotted: str):
    for part in dotted.split("."):
        c = c[part]
    return c


def validate(c: ml_collections.ConfigDict) -> None:
    """Checks that need no devices or data; raises UserError naming the key and the fix."""
    for key, choices in _CHOICES.items():
        if _get(c, key) not in choices:
            raise UserError(f"--config.{key}={_get(c, key)!r} is not one of {', '.join(choices)}")
    for key, value in _numbers(c):
        if not math.isfinite(value):
            raise UserError(f"--config.{key} must be a finite number, got {value}")
    for key in _POSITIVE:
        if _get(c, key) <= 0:
            raise UserError(f"--config.{key} must be positive, got {_get(c, key)}")
    for key in _NOT_NEGATIVE:
        if _get(c, key) < 0:
            raise UserError(f"--config.{key} must be zero or positive, got {_get(c, key)}")
    for key, (low, high) in _INTERVALS.items():
        if not low <= _get(c, key) < high:
            raise UserError(f"--config.{key} must be in [{low:g}, {min(high, 1.0):g}{')' if high <= 1.0 else ']'}, got {_get(c, key)}")
    if not c.train.spike_factor > 1.0:
        raise UserError(f"--config.train.spike_factor must be above 1 (a multiple of the recent mean loss), got {c.train.spike_factor}")
    timeout = c.train.step_timeout_s
    if timeout is not None and (isinstance(timeout, (str, bool)) or not timeout >= 0):
        raise UserError(f"--config.train.step_timeout_s must be zero (off) or positive seconds, or None (derived from the steps), "
                        f"got {c.train.step_timeout_s}")
    m = c.model
    if m.num_heads % m.num_kv_heads:
        raise UserError(
            f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}"
        )
    if not m.head_dim and m.embed_dim % m.num_heads:
        raise UserError(
            f"model.embed_dim={m.embed_dim} is not divisible by model.num_heads={m.num_heads}; "
            "set model.head_dim explicitly"
        )
    if m.kv_lora_rank and (m.position != "rope" or m.qk_rope_head_dim % 2):
        raise UserError(f"model.kv_lora_rank={m.kv_lora_rank} (latent attention) needs model.position=rope and an even "
                        f"model.qk_rope_head_dim, got {m.position} and {m.qk_rope_head_dim}")
    if m.position == "rope" and head_dim(c) % 2:
        raise UserError(f"RoPE needs an even head_dim, got {head_dim(c)}")
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise UserError(
            f"model.rope_scaling=llama3 needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, "
            f"got {m.rope_low_freq_factor} and {m.rope_high_freq_factor}"
        )
    if m.position == "learned" and m.max_positions and c.train.seq_len > m.max_positions:
        raise UserError(
            f"train.seq_len={c.train.seq_len} is longer than the model's {m.max_positions} learned positions "
            "(model.max_positions); lower train.seq_len"
        )
    if m.mtp_depth < 0 or m.mtp_loss_weight < 0:
        raise UserError(f"model.mtp_depth={m.mtp_depth} and model.mtp_loss_weight={m.mtp_loss_weight} must be >= 0")
    if c.train.seq_len % m.loss_chunks:
        raise UserError(f"model.loss_chunks={m.loss_chunks} does not divide train.seq_len={c.train.seq_len}")
    if m.loss_chunks > 1 and m.mtp_depth and m.mtp_loss_weight:
        raise UserError(f"model.loss_chunks={m.loss_chunks} with multi-token prediction (model.mtp_depth={m.mtp_depth}) is not "
                        "supported yet; use model.loss_chunks=1")
    if problem := moe_problem(m, c.mesh.expert, c.mesh.stage, c.pipeline.repeats, c.pipeline.schedule):
        raise UserError(problem)
    width = (m.expert_mlp_dim or m.mlp_dim) // max(1, c.mesh.tensor)
    if m.num_experts and m.grouped_gemm == "pallas" and m.expert_capacity_factor == 0 and (
            problem := pallas_fits(m.embed_dim, width, c.precision.compute_dtype)):
        raise UserError(f"model.grouped_gemm=pallas: {problem} (embed_dim and each device's expert width here); use model.grouped_gemm=auto")
    if c.train.batch_size % c.train.grad_accum:
        raise UserError(
            f"train.batch_size={c.train.batch_size} is not divisible by "
            f"train.grad_accum={c.train.grad_accum}"
        )
    if not 0.0 < c.data.val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in (0, 1), got {c.data.val_fraction}")
    _validate_precision(c)


def _validate_precision(c: ml_collections.ConfigDict) -> None:
    p = c.precision
    if str(p.loss_scale) not in ("auto", "none", "dynamic"):
        try:
            number = float(p.loss_scale)
        except ValueError:
            number = 0.0
        if not (number > 0 and math.isfinite(number)):
            raise UserError(f"--config.precision.loss_scale={p.loss_scale!r} is not one of auto, none, dynamic or a positive number")
    if not p.loss_scale_growth_factor > 1.0 or not 0.0 < p.loss_scale_backoff < 1.0:
        raise UserError(
            f"precision.loss_scale_growth_factor must be > 1 and precision.loss_scale_backoff in (0, 1), "
            f"got {p.loss_scale_growth_factor} and {p.loss_scale_backoff}"
        )
    skip = str(p.fp8_skip).replace(" ", "")
    layers = c.model.num_layers
    for index in filter(None, skip.split(",")):
        try:
            ok = -layers <= int(index) < layers
        except ValueError:
            ok = False
        if not ok:
            raise UserError(
                f"--config.precision.fp8_skip={p.fp8_skip!r}: {index!r} is not a layer index of the "
                f"{layers} layers; give comma-separated indices, negative from the end (e.g. 0,-1)"
            )
    _validate_chat(c)
    _validate_lora(c)
    if c.data.document_masking and c.mesh.stage > 1:
        raise UserError(
            "data.document_masking with pipeline stages (mesh.stage > 1) is not supported yet: the pipeline "
            "carries one set of positions for every microbatch; use mesh.stage=1"
        )


def _validate_lora(c: ml_collections.ConfigDict) -> None:
    lora = c.lora
    if lora.rank < 0:
        raise UserError(f"lora.rank={lora.rank} must be >= 1 (or 0: no adapters)")
    if not lora.rank:
        return
    try:
        targets = parse_targets(lora.targets)
    except ValueError as e:
        raise UserError(f"lora.targets={lora.targets!r}: no matmul named {e}") from None
    if not lora.alpha > 0:
        raise UserError(f"lora.alpha={lora.alpha} must be positive")
    if not 0.0 <= lora.dropout < 1.0:
        raise UserError(f"lora.dropout={lora.dropout} must be in [0, 1)")
    if lora.dropout and c.mesh.stage > 1:
        raise UserError(f"lora.dropout={lora.dropout}: pipeline stages (mesh.stage > 1) carry no per-token randomness yet; "
                        "use lora.dropout=0 or mesh.stage=1")
    m = c.model
    matched = set()
    if not m.kv_lora_rank:
        matched |= {"q", "k", "v", "o"}
    else:  # latent attention
        matched |= {"kv_a", "kv_b", "o"} | ({"q_a", "q_b"} if m.q_lora_rank else {"q"})
    if not m.num_experts or c.model.moe_layers != "all" or m.shared_experts:
        matched |= {"up", "down"} | ({"gate"} if m.mlp == "swiglu" else set())
    if m.num_experts:
        matched.add("experts")
    if lora.targets.strip() == "all":  # every matmul this model has
        targets = [t for t in targets if t in matched]
    missing = [t for t in targets if t not in matched]
    if missing or not targets:
        raise UserError(f"lora.targets={lora.targets!r}: {', '.join(missing) or 'it'} match(es) no matmul of this model "
                        f"(adapted here: {', '.join(t for t in LORA_TARGETS if t in matched) or 'none'})")
    if lora.dropout and "experts" in targets:
        raise UserError(f"lora.dropout={lora.dropout} with lora.targets naming experts: PEFT adapts the experts' fused weights, "
                        "where dropout on the input cannot be factored out (it refuses it too); use lora.dropout=0")


def _validate_chat(c: ml_collections.ConfigDict) -> None:
    d = c.data
    if d.format != "chat":
        if d.loss_on not in ("auto", "all"):
            raise UserError(f"data.loss_on={d.loss_on} needs conversations (data.format=chat); plain text trains on every token")
        return
    if d.packing and c.mesh.stage > 1:
        raise UserError("data.format=chat packs conversations with document masking, which pipeline stages (mesh.stage > 1) do not "
                        "carry yet; set --config.data.packing=False (one conversation a row) or mesh.stage=1")
    if c.model.mtp_depth and c.model.mtp_loss_weight:
        raise UserError("data.format=chat with multi-token prediction (model.mtp_depth) is not supported yet: its loss ignores the "
                        "loss mask; set model.mtp_loss_weight=0")


def head_dim(c: ml_collections.ConfigDict) -> int:
    return c.model.head_dim or c.model.embed_dim // c.model.num_heads
