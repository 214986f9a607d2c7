"""The config schema: every key meshlm reads, its default, the checks run before training, and
overrides (`--config.KEY=VALUE`) applied with their types checked. Recipe files are read by
`lm.recipe`; `lm.program.spec.RunSpec` is what a config is parsed into.

Recipe files in `configs/` start from `default_config()` and change what they need;
`apply_overrides` validates the result and locks it, so a misspelt key (in a file or on the
command line) is an error, not a new field, and a locked config is a validated one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_collections
from ml_collections import config_dict

from lm.errors import UserError
from lm.model.config import config_defaults, moe_problem
from sharding.remat import REMAT


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = config_defaults()  # ModelConfig's fields and defaults, plus head_dim=0 and vocab_multiple
    c.data = dict(
        # A token store (python -m lm.prepare), or raw text: a file, directory or glob of text,
        # JSONL (.gz / .zst), Parquet or a `datasets` save_to_disk directory, prepared into
        # cache_dir on first use. None: this interpreter's standard-library sources.
        path=config_dict.placeholder(str),
        sources=config_dict.placeholder(tuple),  # ((path, weight), ...): a mixture instead of `path`
        tokenizer="byte",  # byte | bpe | path/to/tokenizer.json | none (token ids only)
        vocab_size=4096,  # for tokenizer=bpe
        text_field="text",  # JSONL / Parquet / datasets column holding the text
        skip_bad_records=False,  # malformed JSONL lines: an error naming the line, or skipped and counted
        document_masking=False,  # attention within documents only, positions restart at each (Llama 3)
        val_fraction=0.1,  # of the tokens, held out as whole documents
        workers=0,  # tokenising processes when raw text is prepared; 0: every core
        cache_dir=config_dict.placeholder(str),  # None: $XDG_CACHE_HOME/meshlm
        prefetch=2,
    )
    c.train = dict(
        steps=1000,
        batch_size=16,  # global, in sequences
        seq_len=128,
        seed=0,
        grad_accum=1,
        log_every=10,
        eval_every=200,
        eval_batches=8,
        on_nonfinite="skip",  # skip: drop the update, go on | stop: checkpoint the last good state, exit
        max_consecutive_nonfinite=10,  # skipped steps in a row that end the run
        # Loss spikes: spike_steps steps in a row above spike_factor x the mean loss of the last
        # spike_window steps (or non-finite) restore the last checkpoint before them and skip their
        # batches (WORKDIR/skipped_batches.json); at most spike_max_rollbacks times.
        spike_rollback=False,
        spike_factor=2.0,
        spike_window=100,
        spike_steps=3,
        spike_max_rollbacks=3,
    )
    c.optim = dict(
        name="adamw",  # adamw | muon: Muon for the block matmul weights, AdamW for the rest
        lr=1e-3,
        min_lr_ratio=0.1,
        warmup_steps=100,
        decay_steps=0,  # 0: train.steps
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        clip_norm=1.0,  # 0: no clipping
        muon_momentum=0.95,
        muon_ns_steps=5,  # Newton-Schulz iterations per update
    )
    c.checkpoint = dict(every_steps=500, keep=3, async_save=True)
    # Weights & Biases beside metrics.jsonl and TensorBoard (lm.training.tracking); never required.
    c.metrics = dict(wandb=False, wandb_project="meshlm")
    # lm-eval tasks run inside lm.train every `every_steps` (comma-separated names; '' for none),
    # `limit` examples each (0: all), local YAML tasks from `include_path`: lm.evaluation.harness.
    c.eval = dict(tasks="", every_steps=1000, limit=0, batch_size=16, include_path=config_dict.placeholder(str))
    # Start a new run from trained weights: a Hugging Face checkpoint directory (config.json and
    # safetensors; its architecture and tokenizer replace the recipe's) or a meshlm run directory.
    c.init = dict(from_hf=config_dict.placeholder(str))
    c.mesh = dict(data=-1, stage=1, context=1, expert=1, fsdp=1, tensor=1)
    c.pipeline = dict(
        microbatches=0,  # per step, with mesh.stage > 1; 0: as many as stages
        repeats=1,  # layer chunks per stage: more is circular / interleaved 1F1B (smaller bubble)
        # What each tick keeps for the backward pass (sharding.remat, as model.remat). 1F1B: full
        # stashes each stage input and recomputes the tick; none stashes what the layers keep
        # (model.remat) for every microbatch in flight: no recompute, more memory (Megatron's way).
        remat="full",
        # gpipe (circular with repeats > 1) | 1f1b (interleaved with repeats > 1; at most 2S - 1
        # microbatches in flight) | 1f1b_per_stage (each stage its own half per slot: at most S;
        # repeats 1, no context parallelism)
        schedule="gpipe",
    )
    # optimizer_over_data: ZeRO-1, the optimizer state spread over the `data` replicas too
    # (sharding.zero): its memory / data, gradients reduce-scattered, parameters all-gathered.
    c.sharding = dict(rules=config_dict.placeholder(tuple), sequence_parallel=False, optimizer_over_data=False)
    c.precision = dict(
        param_dtype="float32",  # master weights
        compute_dtype="float32",  # float32 | bfloat16 | float16 (matmul inputs and activations)
        mu_dtype="float32",  # Adam's first moment; bfloat16 halves its memory
        loss_scale="auto",  # auto (dynamic for float16, else none) | none | dynamic | a number
        loss_scale_initial=2.0**16,
        loss_scale_growth_interval=2000,  # good steps in a row before the scale grows
        loss_scale_growth_factor=2.0,
        loss_scale_backoff=0.5,  # the scale is multiplied by this on overflow
        loss_scale_min=1.0,
        fp8="off",  # off | delayed | current: the blocks' dense matmuls in fp8 (e4m3 fwd, e5m2 grads), scaled from amax histories or each tensor's own amax
        fp8_history=1024,  # amax history length
        fp8_margin=0,  # scales keep 2**margin headroom
        fp8_skip="",  # layers kept in compute_dtype, e.g. "0,-1" (first and last)
        fp8_sites="auto",  # auto: on a GPU target, fp8 only at matmuls the step-time model says it speeds up | all
    )
    return c


_CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.position": ("rope", "learned"),
    "model.mlp": ("swiglu", "gelu"),
    "model.rope_scaling": ("none", "linear", "llama3"),
    "model.remat": REMAT,
    "model.attention": ("auto", "cudnn", "xla", "einsum"),
    "train.on_nonfinite": ("skip", "stop"),
    "optim.name": ("adamw", "muon"),
    "pipeline.remat": REMAT,
    "pipeline.schedule": ("gpipe", "1f1b", "1f1b_per_stage"),
    "precision.param_dtype": ("float32", "bfloat16"),
    "precision.compute_dtype": ("float32", "bfloat16", "float16"),
    "precision.mu_dtype": ("float32", "bfloat16"),
    "precision.fp8": ("off", "delayed", "current"),
    "precision.fp8_sites": ("auto", "all"),
}

_POSITIVE = (
    "model.num_layers", "model.embed_dim", "model.num_heads", "model.num_kv_heads", "model.mlp_dim",
    "model.vocab_multiple", "train.steps", "train.batch_size", "train.seq_len", "train.grad_accum",
    "train.log_every", "train.eval_every", "train.eval_batches", "train.max_consecutive_nonfinite", "train.spike_window", "train.spike_steps",
    "train.spike_max_rollbacks", "optim.muon_ns_steps", "eval.every_steps", "eval.batch_size", "pipeline.repeats", "checkpoint.every_steps",
    "checkpoint.keep", "data.vocab_size",
    "precision.fp8_history", "precision.loss_scale_initial", "precision.loss_scale_growth_interval",
    "precision.loss_scale_min", "optim.lr", "optim.eps", "model.rope_theta", "model.norm_eps",
    "model.rope_factor", "model.rope_original_max_len",
)
_NOT_NEGATIVE = (
    "optim.weight_decay", "optim.clip_norm", "optim.warmup_steps", "optim.decay_steps", "model.head_dim",
    "model.vocab_size", "model.max_positions", "model.sliding_window", "model.num_experts", "model.expert_mlp_dim",
    "model.shared_experts", "model.expert_capacity_factor", "model.router_aux_loss_coef", "model.router_z_loss_coef",
    "model.expert_bias_rate",
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
    if problem := moe_problem(m, c.mesh.expert, c.mesh.stage):
        raise UserError(problem)
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
    if c.data.document_masking and c.mesh.stage > 1:
        raise UserError(
            "data.document_masking with pipeline stages (mesh.stage > 1) is not supported yet: the pipeline "
            "carries one set of positions for every microbatch; use mesh.stage=1"
        )


def head_dim(c: ml_collections.ConfigDict) -> int:
    return c.model.head_dim or c.model.embed_dim // c.model.num_heads


def shape_fields(c: ml_collections.ConfigDict) -> dict:
    """The fields that decide parameter shapes: a checkpoint only resumes when they match."""
    fields = {f"model.{k}": v for k, v in c.model.items() if k not in ("remat", "scan_layers", "attention")}
    fields["data.tokenizer"] = c.data.tokenizer
    if c.data.tokenizer == "bpe":
        fields["data.vocab_size"] = c.data.vocab_size
    if c.model.position == "learned" and not c.model.max_positions:
        fields["train.seq_len"] = c.train.seq_len
    return fields


def to_json(c: ml_collections.ConfigDict) -> str:
    return json.dumps(c.to_dict(), indent=2, sort_keys=True, default=str)


def from_json(text: str) -> ml_collections.ConfigDict:
    """A saved config, merged over the current defaults (keys added since then keep defaults)."""
    saved = json.loads(text)
    c = default_config()
    for group, values in saved.items():
        if group in c:
            for key, value in values.items():
                if key in c[group]:
                    c[group][key] = tuple(map(tuple, value)) if key in ("rules", "sources") and value else value
    return c


def assign(node: ml_collections.ConfigDict, key: str, value, shown: str) -> None:
    """`node[key] = value`, type-checked: a value of the wrong type, or None for a key that has
    no "unset" meaning, is a UserError starting with `shown` (how the user wrote it)."""
    kind = type(node[key]).__name__ if node[key] is not None else "value"
    if value is None and node[key] is not None:
        raise UserError(f"{shown} is not a valid {kind}: this key cannot be unset")
    try:
        node[key] = value
    except TypeError:
        raise UserError(f"{shown} is not a valid {kind}") from None


def _parse_value(text: str, current):
    import ast

    if isinstance(current, str) or (current is None and text[:1] not in "([{" and text not in ("None", "True", "False")):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """`{'train.steps': '100'}` applied to a copy of `c`, then locked; unknown keys are errors.

    String values are parsed as the command line's are; other values are assigned as they are.
    """
    import difflib

    c = ml_collections.ConfigDict(c.to_dict(), type_safe=True)
    for dotted, text in overrides.items():
        *groups, key = dotted.split(".")
        dotted = dotted if dotted.isprintable() else repr(dotted)  # echoed in one-line errors
        node = c
        for g in groups:
            if not isinstance(node, ml_collections.ConfigDict) or g not in node:
                raise UserError(f"unknown config key --config.{dotted}; groups are {', '.join(sorted(c))}")
            node = node[g]
        if not isinstance(node, ml_collections.ConfigDict) or key not in node:
            known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean --config.{'.'.join(groups + close)}?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise UserError(f"unknown config key --config.{dotted}{hint}")
        value = _parse_value(text, node[key]) if isinstance(text, str) else text
        assign(node, key, value, f"--config.{dotted}={text!r}")
    validate(c)
    c.lock()
    return c


def checked(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` validated and locked: as it is when it came through `apply_overrides` (every config
    from a file or the command line does), else validated once now."""
    return c if c.is_locked else apply_overrides(c, {})


def load_run(workdir: str | Path) -> ml_collections.ConfigDict | None:
    """The config a run in `workdir` was trained with (its config.json), or None if there is none."""
    path = Path(workdir) / "config.json"
    if not path.exists():
        return None
    try:
        return from_json(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, TypeError, AttributeError) as e:  # not JSON, or not a config's shape / types
        raise UserError(f"{path} is not a meshlm run config ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "it was not written by lm.train: use another --workdir") from None


def save_run(c: ml_collections.ConfigDict, workdir: str | Path) -> None:
    (Path(workdir) / "config.json").write_text(to_json(c))
