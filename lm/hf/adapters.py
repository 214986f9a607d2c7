"""LoRA adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`, the
form `peft.PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face base model.

PEFT keeps a Linear's adapter as `lora_A.weight` [rank, in] and `lora_B.weight` [out, rank]
under `base_model.model.<the Linear's module path>`; meshlm's A [*in, rank] and B [rank, *out]
flatten onto them in the order the weight's own link (`lm.hf.tensors`) flattens it.

Experts are adapted as PEFT adapts transformers' fused expert parameters (`target_parameters`:
`mlp.experts.gate_up_proj` [experts, 2 f, d] and `mlp.experts.down_proj` [experts, d, f], the
layout of transformers >= 5): per parameter one `lora_A` [rank x experts, in] (expert-major
rows) and `lora_B` [out, rank x experts] (expert-minor columns); the second parameter's wrapper
holds the first's, whose tensors are under `.base_layer`. For Qwen3-MoE and DeepSeek-V3 PEFT reads
`gate_proj` / `up_proj` / `down_proj` in `target_modules` as the experts' (it converts adapters
made for transformers 4's per-expert Linears), so adapters of those families' dense MLPs and
shared experts have no place in its format: refused (`write_adapter`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lm.errors import UserError
from lm.hf import tensors
from lm.model.lora import FUSED, WEIGHTS

_TARGET_OF = {(weight,): target for target, weight in WEIGHTS.items()} | {weights: target for target, weights in FUSED.items()}
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]  # PEFT's target_parameters, in its nesting order
EXPERTS_AS_MLP = ("qwen3_moe", "deepseek_v3")  # families whose `gate_proj` targets PEFT takes for the experts'


def _expert_tensors(params_flat: dict, parent: str, layer_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    """PEFT's tensors of the experts' adapters under `parent` (a stack's MoE layer), per layer."""
    a_in, b_gate, b_up, a_out, b_out = (np.asarray(params_flat[f"{parent}/lora_experts/{name}"], np.float32)
                                        for name in ("a_in", "b_gate", "b_up", "a_out", "b_out"))
    a_rows = lambda a: a.transpose(0, 2, 1).reshape(-1, a.shape[1])  # noqa: E731  [e, in, r] -> [e r, in]
    b_columns = lambda b: b.transpose(2, 1, 0).reshape(b.shape[2], -1)  # noqa: E731  [e, r, out] -> [out, r e]
    out = {}
    for j, layer in enumerate(layer_ids):
        module = f"base_model.model.model.layers.{layer}.mlp.experts"
        out[f"{module}.base_layer.lora_A.weight"] = a_rows(a_in[j])  # gate_up_proj: gate's rows, then up's
        out[f"{module}.base_layer.lora_B.weight"] = b_columns(np.concatenate([b_gate[j], b_up[j]], axis=2))
        out[f"{module}.lora_A.weight"] = a_rows(a_out[j])  # down_proj
        out[f"{module}.lora_B.weight"] = b_columns(b_out[j])
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def adapter_tensors(params_flat: dict, cfg) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """(PEFT's tensors by name, its target module names, its target parameters) of a run's flat
    parameters."""
    out, modules, parameters = {}, set(), []
    for link in tensors.links(cfg):
        parent, _, weight = link.ours[0].rpartition("/")
        if link.per_expert and weight == "w_gate" and f"{parent}/lora_experts/a_in" in params_flat:
            out |= _expert_tensors(params_flat, parent, link.layer_ids)
            parameters = EXPERT_PARAMETERS
        if link.per_expert or link.copy or not link.stacked:
            continue
        target = _TARGET_OF.get(tuple(path.rpartition("/")[2] for path in link.ours))
        a = params_flat.get(f"{parent}/lora_{target}/a")
        if a is None:
            continue
        names = ["b"] if target in WEIGHTS else [f"b_{path.rpartition('/')[2]}" for path in link.ours]
        bs = [np.asarray(params_flat[f"{parent}/lora_{target}/{name}"], np.float32) for name in names]
        a = np.asarray(a, np.float32)
        module = "base_model.model." + link.theirs.removesuffix(".weight")
        modules.add(module.rsplit(".", 1)[-1])
        for j, layer in enumerate(link.layer_ids):
            name = module.format(i=layer)
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, a.shape[-1]).T)
            shapes = [params_flat[path].shape[1:] for path in link.ours]
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(_lora_b(link, [b[j] for b in bs], shapes))
    return out, sorted(modules), parameters


def _lora_b(link, bs: list[np.ndarray], weight_shapes: list[tuple]) -> np.ndarray:
    """PEFT's lora_B [out, rank] of one layer's B(s) [rank, *out]: each laid into the first `rank`
    inputs of a zero weight of its weight's shape, through the link's own conversion (which
    arranges the outputs as the checkpoint does: fused, per head, rotary rows reordered), whose
    first `rank` columns it is."""
    rank, fakes = bs[0].shape[0], []
    for b, shape in zip(bs, weight_shapes):
        weight = np.zeros((int(np.prod(shape)) // int(np.prod(b.shape[1:])), *b.shape[1:]), np.float32)
        weight[:rank] = b
        fakes.append(weight.reshape(shape))
    return link.to_theirs(*fakes)[:, :rank]


def write_adapter(params_flat: dict, cfg, out: Path, base: str | None, write: bool = True) -> Path:
    """`out` (a new directory, checked by the caller) holding the run's adapters as PEFT writes
    them; `write` False: the same checks, nothing written (the other processes of a run over several)."""
    from safetensors.numpy import save_file

    if not cfg.lora:
        raise UserError("lm.convert to_hf --adapter: this run has no LoRA adapters (lora.rank=0); export it without --adapter")
    if tensors.family_of(cfg) == "gpt2":  # (its q, k, v adapters would share one fused Conv1D)
        raise UserError("lm.convert to_hf --adapter: PEFT's format has no place for GPT-2's fused projections; "
                        "export the merged model (to_hf without --adapter)")
    mlp_targets = [t for t in ("gate", "up", "down") if t in cfg.lora_targets]
    if cfg.moe and (cfg.dense_layers or cfg.shared_experts) and mlp_targets and tensors.family_of(cfg) in EXPERTS_AS_MLP:
        raise UserError(f"lm.convert to_hf --adapter: PEFT reads {'/'.join(mlp_targets)} adapters of a {tensors.family_of(cfg)} model as "
                        "the experts' fused ones, so this run's dense-MLP adapters have no place in its format; export the merged "
                        "model (to_hf without --adapter), or train with lora.targets naming no gate, up, down")
    weights, modules, parameters = adapter_tensors(params_flat, cfg)
    if not write:
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
        "target_modules": modules, "target_parameters": parameters or None, "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "base_model_name_or_path": base,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
