"""A run's weights read back: the parameters (and fp8 scales) of its latest or a given
checkpoint, never the optimizer's moments, on one device or over the run's own mesh. The one
reader of a run's weights (sampling, export, numerics, `init.from_hf` from a run)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

import sharding
from lm import config as lm_config
from lm import paths
from lm.data import tokenizer as lm_tokenizer
from lm.program.checkpoint import Checkpointer
from lm.program.lora_base import base_params
from lm.program.spec import RunSpec
from lm.program.abstract_model import AbstractModel, placed
from sharding.schedules import PipelinePlan


def load(workdir: str | Path, step: int | None = None):
    """(config, tokenizer, model) of the latest (or given) checkpoint in `workdir`, on one device."""
    config, tokenizer, layout, restored = restore(workdir, step)
    return config, tokenizer, layout.model(restored["params"], restored.get("fp8"))


def restore(workdir: str | Path, step: int | None = None, *, own_mesh: bool = False, unstaged: bool = False):
    """(config, tokenizer, layout, {'params', 'fp8'?}) of a run's latest (or given) checkpoint, on
    one device (or, `own_mesh`, split over every process's devices as the run's mesh config
    says; `unstaged` too: its pipeline stages and context shards folded into `data`, for the
    plain forward pass of evaluation). Only the parameters (and fp8 scales) are read, never
    the optimizer's moments: sampling or exporting needs a third of a training run's memory."""
    workdir = paths.existing_run_dir(workdir)
    config = lm_config.load_run(workdir)
    tokenizer = lm_tokenizer.tokenizer_for(config.data, workdir)
    spec = RunSpec.parse(config, tokenizer.vocab_size)
    if unstaged:
        sizes = dict(zip(sharding.MESH_AXES, spec.mesh.resolve(len(jax.devices()))))
        folded = sharding.MeshConfig(data=sizes["data"] * sizes["stage"] * sizes["context"], expert=sizes["expert"], fsdp=sizes["fsdp"], tensor=sizes["tensor"])
        spec = dataclasses.replace(spec, pipeline=PipelinePlan(), mesh=folded)
        mesh = sharding.make_mesh(folded)
    elif own_mesh:
        mesh = sharding.make_mesh(spec.mesh)
    else:
        spec = dataclasses.replace(spec, pipeline=PipelinePlan())
        mesh = sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1])
    layout = AbstractModel(spec, mesh)
    trainable = layout.trainable  # (a LoRA run's checkpoints hold its adapters; its base is kept once: lm.program.lora_base)
    part = {"params": placed(trainable.part(layout.run_params), trainable.part(layout.param_shardings))}
    if layout.fp8_shardings is not None:
        part["fp8"] = placed(layout.abstract_fp8, layout.fp8_shardings)
    ckpt = Checkpointer(workdir / "checkpoints")
    restored = ckpt.restore_part(part, step)
    ckpt.close()
    if trainable.lora:
        restored["params"] = trainable.merge(restored["params"], base_params(workdir, layout))
    return config, tokenizer, layout, restored
