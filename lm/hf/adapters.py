"""LoRA adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`, the
form `peft.PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face base model.

PEFT keeps a Linear's adapter as `lora_A.weight` [rank, in] and `lora_B.weight` [out, rank]
under `base_model.model.<the Linear's module path>`; meshlm's A [*in, rank] and B [rank, *out]
flatten onto them in the order the weight's own link (`lm.hf.tensors`) flattens it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lm import paths
from lm.errors import UserError
from lm.hf import tensors
from lm.model.lora import WEIGHTS

_TARGET_OF = {weight: target for target, weight in WEIGHTS.items()}


def adapter_tensors(params_flat: dict, cfg) -> tuple[dict[str, np.ndarray], list[str]]:
    """(PEFT's tensors by name, its target module names) of a run's flat parameters."""
    out, modules = {}, set()
    for link in tensors.links(cfg):
        if len(link.ours) != 1 or link.per_expert or link.copy or not link.stacked:
            continue
        parent, _, weight = link.ours[0].rpartition("/")
        target = _TARGET_OF.get(weight)
        a = params_flat.get(f"{parent}/lora_{target}/a")
        if a is None:
            continue
        if not link.theirs.endswith(".weight") or tensors.family_of(cfg) == "gpt2":
            raise UserError("lm.convert to_hf --adapter: PEFT's format has no place for this family's fused projections; "
                            "export the merged model (to_hf without --adapter)")
        b = np.asarray(params_flat[f"{parent}/lora_{target}/b"], np.float32)
        a = np.asarray(a, np.float32)
        module = "base_model.model." + link.theirs.removesuffix(".weight")
        modules.add(module.rsplit(".", 1)[-1])
        for j, layer in enumerate(link.layer_ids):
            name = module.format(i=layer)
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, a.shape[-1]).T)
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[j].reshape(b.shape[1], -1).T)
    return out, sorted(modules)


def write_adapter(params_flat: dict, cfg, out: Path, base: str | None) -> Path:
    """`out` (a new directory) holding the run's adapters as PEFT writes them."""
    from safetensors.numpy import save_file

    if not cfg.lora:
        raise UserError("lm.convert to_hf --adapter: this run has no LoRA adapters (lora.rank=0); export it without --adapter")
    weights, modules = adapter_tensors(params_flat, cfg)
    out = paths.new_output_dir(out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0,
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "base_model_name_or_path": base,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
