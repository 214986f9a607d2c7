"""Hugging Face checkpoints in and out of meshlm runs: import straight into the run's shardings
(each process reads only its devices' slices) with a step-0 weights-only checkpoint
(`import_hf`), export one gathered tensor at a time (`export_hf`), and `init.from_hf`'s
architecture and weights (`with_init_model`, `initial_params`). `python -m lm.convert` is its
command.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

import sharding
from lm import config as lm_config
from lm import paths
from lm.config import UserError
from lm.data import tokenizer as lm_tokenizer
from lm.hf.adapters import write_adapter
from lm.model import lora
from lm.hf import export_config
from lm.hf import format as hf
from lm.hf import tensors
from lm.hf.safetensors_dir import Reader, Writer, parse_size
from lm.program.checkpoint import Checkpointer
from lm.program.restore import restore
from lm.program.spec import RunSpec
from lm.program.abstract_model import AbstractModel

HF_CONFIG = "hf_config.json"  # the imported checkpoint's config.json, kept in the run directory


def read_hf_config(hf_dir: str | Path, flag: str = "--hf") -> tuple[Path, dict]:
    path = Path(hf_dir).expanduser()
    if not path.is_dir():
        raise UserError(f"{flag}={hf_dir} is not a directory; pass a Hugging Face model directory (save_pretrained writes one)")
    file = path / "config.json"
    if not file.is_file():
        raise UserError(f"{flag}={hf_dir} has no config.json; pass a Hugging Face model directory (save_pretrained writes one)")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is not JSON ({type(e).__name__}); pass a Hugging Face model directory") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} is not a model config (not a JSON object)")
    return path, config


def _model_keys(hf_dir: Path, hf_config: dict) -> dict:
    """The checkpoint's architecture as `model.*` keys. Multi-token prediction layers its
    config.json names but its tensors lack (fine-tunes often drop them, as `transformers` does)
    are left out, with a warning."""
    keys = hf.model_keys(hf_config)
    depth, layers = keys.get("model.mtp_depth", 0), keys["model.num_layers"]
    if depth and f"model.layers.{layers}.eh_proj.weight" not in Reader(hf_dir):
        say(f"warning: {hf_dir}'s config.json names {depth} multi-token prediction layer(s) (num_nextn_predict_layers), but its "
            f"tensors have none (model.layers.{layers}.*); imported without them (model.mtp_depth=0)")
        keys["model.mtp_depth"] = 0
    return keys


def config_from_hf(base: ml_collections.ConfigDict, hf_dir: Path, hf_config: dict, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """`base` with the checkpoint's architecture and tokenizer (then `overrides`), validated."""
    tokenizer = hf_dir / "tokenizer.json"
    keys = {**_model_keys(hf_dir, hf_config), "data.tokenizer": str(tokenizer.absolute()) if tokenizer.is_file() else "none", "init.from_hf": None}
    return lm_config.apply_overrides(base, {**keys, **(overrides or {})})


def with_init_model(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A config whose `init.from_hf` names a Hugging Face checkpoint or a meshlm run, with that
    model's architecture and tokenizer (the recipe's `model` keys give way; how the layers run,
    remat / scan / attention kernel, stays the recipe's)."""
    source = Path(config.init.from_hf).expanduser()
    run = lm_config.load_run(source) if source.is_dir() and (source / "checkpoints").is_dir() else None
    if run is None:
        hf_dir, hf_config = read_hf_config(source, "--config.init.from_hf")
        keys = _model_keys(hf_dir, hf_config)
        tokenizer = hf_dir / "tokenizer.json"
        keys["data.tokenizer"] = str(tokenizer.absolute()) if tokenizer.is_file() else "none"
    else:
        keys = {f"model.{k}": v for k, v in run.model.items() if k not in ("remat", "scan_layers", "attention")}
        kept = source / "tokenizer.json"
        keys["data.tokenizer"] = str(kept.absolute()) if kept.is_file() else run.data.tokenizer
    return lm_config.apply_overrides(config, keys)


def initial_params(source: str, layout: AbstractModel) -> dict:
    """The weights `init.from_hf` names, placed as `layout` says."""
    path = Path(source).expanduser()
    if (path / "checkpoints").is_dir():
        ckpt = Checkpointer(path / "checkpoints")
        try:
            return ckpt.restore_part({"params": layout.base_target()})["params"]  # (a LoRA run: the base run's weights)
        finally:
            ckpt.close()
    return load_params(Reader(path), layout)


# ---------------------------------------------------------------------------- tensors


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value
    return out


def _nested(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        *groups, key = path.split("/")
        node = out
        for g in groups:
            node = node.setdefault(g, {})
        node[key] = value
    return out


def _resolve(reader: Reader, name: str) -> str:
    """`name`, or its form without GPT2LMHeadModel's `transformer.` prefix (GPT2Model's own)."""
    short = name.removeprefix("transformer.")
    return short if name not in reader and short in reader else name


def check_tensors(reader: Reader, cfg, our_shapes: dict) -> None:
    """Every tensor the config implies is in the checkpoint, with the implied shape."""
    for name, want, _ in tensor_plan(cfg, our_shapes, None):
        name = _resolve(reader, name)
        if name not in reader:
            raise UserError(f"{reader.directory}: tensor {name} is missing from the checkpoint; its config.json implies it")
        if reader.shape(name) != want:
            raise UserError(f"{reader.directory}: tensor {name} has shape {reader.shape(name)}, but config.json implies {want}")


def load_params(reader: Reader, layout: AbstractModel) -> dict:
    """The checkpoint's weights as meshlm parameters, each placed straight into its sharding:
    every device's slice is read (and converted) from the checkpoint tensors it covers."""
    cfg, dtype = layout.spec.model, layout.spec.policy.param_dtype
    shapes = {p: a.shape for p, a in _flat(layout.trainable.base(layout.abstract_params)).items()}  # (LoRA: the base)
    check_tensors(reader, cfg, shapes)
    owner = {path: (link, j) for link in tensors.links(cfg) if not link.copy for j, path in enumerate(link.ours)}

    @functools.lru_cache(maxsize=1)  # the devices of one parameter ask for the same tensors in turn
    def converted(link: tensors.Link, layer: int | None) -> tuple[np.ndarray, ...]:
        return link.to_ours(reader.read(_resolve(reader, tensors.tensor_name(link, layer))))

    def device_slice(path: str, index: tuple) -> np.ndarray:
        link, j = owner[path]
        if link.per_expert:  # [layers, experts, ...]: one tensor per layer and expert
            layers, experts = link.layer_ids[index[0]], range(shapes[path][1])[index[1]]
            return np.stack([np.stack([np.asarray(converted(link, (i, e))[j][index[2:]], dtype) for e in experts]) for i in layers])
        if link.stacked:  # the stack's entry k is the model's layer link.layer_ids[k]
            return np.stack([np.asarray(converted(link, i)[j][index[1:]], dtype) for i in link.layer_ids[index[0]]])
        return np.asarray(converted(link, None)[j][index], dtype)

    shardings = _flat(layout.param_shardings)
    return _nested({p: jax.make_array_from_callback(shape, shardings[p], functools.partial(device_slice, p)) for p, shape in shapes.items()})


def _fetch(x: jax.Array) -> np.ndarray:
    """One tensor whole on the host (gathered from every process when the mesh spans several)."""
    if isinstance(x, np.ndarray) or x.is_fully_addressable:  # (a LoRA run's merged weights are on the host already)
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _tensors(cfg):
    """(link, layer or (layer, expert)) of every checkpoint tensor of `cfg`'s family, in the order
    they are written."""
    def places(link):
        layers = link.layer_ids
        if link.per_expert:
            return [(i, e) for i in layers for e in range(cfg.num_experts)]
        return layers or [None]

    return [(link, place) for link in tensors.links(cfg) for place in places(link)]


def tensor_plan(cfg, our_shapes: dict, dtype) -> list[tuple[str, tuple, np.dtype]]:
    """(name, shape, dtype) of every checkpoint tensor, in writing order."""
    return [(tensors.tensor_name(link, layer), tensors.expected_shapes(link, our_shapes), dtype) for link, layer in _tensors(cfg)]


def save_params(params: dict, cfg, writer: Writer | None, dtype) -> None:
    """Every checkpoint tensor of `cfg`'s family, one at a time, into `writer` (None: this
    process only contributes its shards)."""
    flat = _flat(params)
    for link, layer in _tensors(cfg):
        where = None if not link.stacked else (link.layer_ids.index(layer[0]), layer[1]) if link.per_expert else link.layer_ids.index(layer)
        parts = [_fetch(flat[p] if where is None else flat[p][where]) for p in link.ours]  # the stack's layer (and expert)
        if writer is not None:
            writer.add(tensors.tensor_name(link, layer), link.to_theirs(*parts).astype(dtype))


# ---------------------------------------------------------------------------- commands


def import_hf(hf_dir: str | Path, workdir: str | Path, base: ml_collections.ConfigDict, overrides: dict | None = None, devices=None) -> Path:
    """A new meshlm run in `workdir` holding the Hugging Face checkpoint in `hf_dir`."""
    hf_dir, hf_config = read_hf_config(hf_dir)
    config = config_from_hf(base, hf_dir, hf_config, overrides)
    workdir = paths.new_output_dir(workdir, "--workdir")
    reader = Reader(hf_dir)
    tokenizer = lm_tokenizer.tokenizer_for(config.data, None)
    spec = RunSpec.parse(config, tokenizer.vocab_size)
    layout = AbstractModel(spec, sharding.make_mesh(spec.mesh, devices))
    if isinstance(tokenizer, lm_tokenizer.NoTokenizer):
        say(f"warning: {hf_dir} has no tokenizer.json; the run works on token ids (lm.generate --prompt_ids)")
    params = load_params(reader, layout)  # every check is done: now the run directory is written
    if jax.process_count() > 1:  # by process 0, once every process has found it new (else one finds process 0's files)
        multihost_utils.sync_global_devices("meshlm: import_hf checked")
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        if isinstance(tokenizer, lm_tokenizer.HFTokenizer):
            shutil.copyfile(tokenizer.path, workdir / "tokenizer.json")
        (workdir / HF_CONFIG).write_text(json.dumps(hf_config, indent=2))
        lm_config.save_run(config, workdir)
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    ckpt.save(0, {"params": params})
    ckpt.wait()
    ckpt.close()
    return workdir


def export_hf(workdir: str | Path, out: str | Path, dtype: str | None = None, max_shard_size: str = "5GB", step: int | None = None,
              adapter: bool = False) -> Path:
    """A Hugging Face model directory in `out` from a meshlm run's checkpoint. A LoRA run's
    adapters are merged into the weights, or with `adapter` written alone in PEFT's format."""
    max_bytes = parse_size(max_shard_size)
    config, tokenizer, layout, restored = _restore_for_export(workdir, step)
    cfg = layout.spec.model
    # Every process checks `out` is new before the first gather, which they make together: so
    # process 0, which writes, cannot have begun to when another checks.
    out = paths.new_output_dir(out, "--out")
    if adapter:
        return write_adapter(_flat(jax.tree.map(_fetch, restored["params"])), cfg, out, config.init.from_hf,
                             write=jax.process_index() == 0)
    if cfg.lora:
        restored = {**restored, "params": lora.merged(jax.tree.map(_fetch, restored["params"]), cfg)}
    dtype = dtype or config.precision.param_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype={dtype!r} is not one of float32, bfloat16, float16")
    kept = Path(workdir) / HF_CONFIG
    base = json.loads(kept.read_text()) if kept.is_file() else None
    hf_config = export_config.hf_config(cfg, dtype, base)  # a model without an HF equivalent fails here, before writing
    lead = jax.process_index() == 0
    if lead:
        out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    shapes = {p: a.shape for p, a in _flat(restored["params"]).items()}
    writer = Writer(out, tensor_plan(cfg, shapes, np_dtype), max_bytes) if lead else None
    save_params(restored["params"], cfg, writer, np_dtype)
    if not lead:
        return out
    writer.close()
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    generation = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if base and base.get(k) is not None}
    if not generation and tokenizer.eos_id is not None:
        generation["eos_token_id"] = tokenizer.eos_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if isinstance(tokenizer, lm_tokenizer.HFTokenizer):
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
    elif isinstance(tokenizer, lm_tokenizer.ByteTokenizer):
        tokenizer.save_hf(out / "tokenizer.json")
    else:
        say(f"warning: run {workdir} has no tokenizer; {out} holds no tokenizer.json")
    return out


def _restore_for_export(workdir, step):
    """The run's weights: on one device, or over every process's devices when there are several
    (each then holds its slices, and every tensor is gathered in turn)."""
    return restore(workdir, step, own_mesh=jax.process_count() > 1)


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)
