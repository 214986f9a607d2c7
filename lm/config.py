"""The config schema: every key meshlm reads, its default, and
overrides (`--config.KEY=VALUE`) applied with their types checked. Recipe files are read by
`lm.recipe`; its checks are `lm.config_checks`; `lm.program.spec.RunSpec` is what a config is parsed into.

Recipe files in `configs/` start from `default_config()` and change what they need;
`apply_overrides` validates the result and locks it, so a misspelt key (in a file or on the
command line) is an error, not a new field, and a locked config is a validated one.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections
from ml_collections import config_dict

from lm.config_checks import validate
from lm.errors import UserError
from lm.model.config import config_defaults


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
        # Conversations (lm.data.chat): records with `messages` or `prompt` / `completion`,
        # rendered by the tokenizer's chat template (or chat_template: a file), the loss only on
        # loss_on's tokens (auto: assistant for chat), packed whole into rows (packing) with
        # document masking, each cut to a row (truncate=right) or dropped (drop) when longer.
        format="text",  # text | chat
        loss_on="auto",  # auto | assistant | completion | all
        chat_template=config_dict.placeholder(str),
        truncate="right",
        packing=True,
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
        # The step watchdog: no step completing for this long ends every process, each writing its
        # Python stacks to WORKDIR/hang-<process>.txt (resume with the same command). None: 10 x the
        # median step, at least 300 s, timed from the first completed step; 0: off.
        step_timeout_s=config_dict.placeholder(float),
        # GPU programs: what XLA fuses into its Triton GEMM kernels. operands: XLA's default (layout
        # changes and converts of a GEMM's operands); elementwise: XLA's GEMM fusion v2, also the
        # elementwise work before and after each GEMM (SwiGLU's product and its backward, residual
        # adds, the loss's cotangent), which then never makes a pass over memory of its own; auto:
        # elementwise without fp8 (whose GEMMs are cuBLAS calls it does not fuse) and without
        # tensor parallelism (where the kernel model finds it slower).
        # (jax 0.10.2's XLA fuses so; 0.12.0.1's takes the flag and fuses nothing more.)
        gemm_fusion="operands",
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
    # LoRA (lm.model.lora): rank > 0 adds adapters beside the targets' matmuls (q, k, v, o, gate,
    # up, down; latent attention's q_a, q_b, kv_a, kv_b; experts; or 'all' the model has), scaled by
    # alpha / rank, their inputs dropped at `dropout` in training; the base frozen in the compute dtype.
    c.lora = dict(rank=0, alpha=16.0, dropout=0.0, targets="q,k,v,o,gate,up,down")
    c.mesh = dict(data=-1, stage=1, context=1, expert=1, fsdp=1, tensor=1)
    c.pipeline = dict(
        microbatches=0,  # per step, with mesh.stage > 1; 0: as many as stages (dualpipev: twice that)
        repeats=1,  # layer chunks per stage: more is circular / interleaved 1F1B (smaller bubble)
        # What each tick keeps for the backward pass (sharding.remat, as model.remat). 1F1B: full
        # stashes each stage input and recomputes the tick; none stashes what the layers keep
        # (model.remat) for every microbatch in flight: no recompute, more memory (Megatron's way).
        remat="full",
        # gpipe (circular with repeats > 1) | 1f1b (interleaved with repeats > 1; at most 2S - 1
        # microbatches in flight) | 1f1b_per_stage (each stage its own half per slot: at most S;
        # repeats 1, no context parallelism) | zero_bubble (ZB-H1: the per-stage 1F1B with each
        # backward split in B and W, W deferred into the bubbles; as 1f1b_per_stage's limits) |
        # zbv (ZB-V: two chunks a stage in a V, the loss on stage 0; layers a multiple of 2 x stages) |
        # dualpipev (DeepSeek's DualPipeV: ZB-V's chunks, one chunk's forward beside the other's
        # backward in each slot of its middle; microbatches at least 2 x stages)
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


def shape_fields(c: ml_collections.ConfigDict) -> dict:
    """The fields that decide parameter shapes: a checkpoint only resumes when they match."""
    fields = {f"model.{k}": v for k, v in c.model.items() if k not in ("remat", "scan_layers", "attention", "loss_chunks")}
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


def _placeholder_type(dotted: str):
    """The type a key unset by default takes (a `placeholder`'s), or None."""
    node = default_config()
    *groups, key = dotted.split(".")
    for g in groups:
        node = node[g]
    return node.get_ref(key).get_type() if key in node else None


def _parse_value(text: str, current, unset_type=None):
    import ast

    if unset_type in (int, float) and current is None and text != "None":
        try:
            return unset_type(text)
        except ValueError:
            return text  # refused by the type check, naming the key
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
        value = _parse_value(text, node[key], _placeholder_type(dotted)) if isinstance(text, str) else text
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
