"""Per-layer ranges of every block matmul's x / w / g over a few training steps, and which
layers a number format would overflow or flush to zero (`report`, `advice`, `heat_map`).
`python -m lm.numerics` is its command, and its docstring says what is measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lm import config as lm_config
from lm.config import UserError
from lm.data import corpus as lm_data
from lm.model.fp8 import FP8_FORMATS, REPORT_FORMATS, ROLES, named_stats
from lm.program.checkpoint import Checkpointer
from lm.program.lora_base import restore_target, with_base
from lm.program.loss_scale import LossScaling
from lm.program.steps import Program, TrainState, setup

FP8_ROLE_FORMAT = dict(zip(ROLES, FP8_FORMATS))


def collect(config, workdir: Path, steps: int, devices=None) -> dict:
    """{'step': restored step, 'rows': [{layer, tensor, absmax, <format>: {overflow, underflow}}]}."""
    if config.mesh.stage > 1:
        raise UserError("lm.numerics runs without pipeline stages: add --config.mesh.stage=1")
    corpus = lm_data.open_corpus(config, workdir)
    trainer = setup(config, corpus.tokenizer.vocab_size, devices, observe=True)
    t = config.train
    batches = corpus.train_batches(t.batch_size, t.seed, jax.process_index(), jax.process_count(), 1)
    step = 0
    state, fp8_restored = trainer.init_state(t.seed), False
    if (workdir / "checkpoints").is_dir():
        ckpt = Checkpointer(workdir / "checkpoints")
        if ckpt.latest_step() is not None:
            step = ckpt.latest_step()
            state, data_state, fp8_restored = _restore(ckpt, step, workdir, trainer, state, devices)
            if data_state is not None:
                batches.set_state(data_state)
        ckpt.close()
    if trainer.policy.fp8_state and not fp8_restored:  # fresh delayed scales are 1 until one step has run
        state, _ = trainer.train_step(state, trainer.global_batch(next(batches)))
    worst = None
    for _ in range(steps):
        state, metrics = trainer.train_step(state, trainer.global_batch(next(batches)))
        stats = jax.device_get(metrics["matmul_stats"])
        worst = stats if worst is None else jax.tree.map(np.fmax, worst, stats)
    m = trainer.model_cfg
    return {"step": step, "steps": steps, "rows": rows(worst, {"dense_blocks": m.dense_layer_ids, "blocks": m.sparse_layer_ids or tuple(range(m.num_layers)),
                                                  "mtp": m.mtp_layer_ids})}


def _restore(ckpt: Checkpointer, step: int, workdir: Path, trainer: Program, fresh: TrainState, devices):
    """(state, data state, were fp8 scales restored): the checkpoint's parameters and optimizer
    state in `fresh` (the report's state). A run trained in another precision is restored in its
    own layout first (the report's config with the run's precision): its fp8 scales and loss
    scale are left behind, its arrays cast to the report's dtypes."""
    saved_config = lm_config.load_run(workdir)
    if saved_config is None:
        restored, data_state = ckpt.restore(restore_target(trainer), step)
        return with_base(trainer, restored, workdir), data_state, True
    saved_precision = saved_config.precision
    run_config = lm_config.apply_overrides(trainer.config, {f"precision.{k}": v for k, v in saved_precision.items()})
    run = setup(run_config, trainer.model_cfg.vocab_size, devices)
    restored, data_state = ckpt.restore(restore_target(run), step)
    restored = with_base(run, restored, workdir)
    if jax.tree.structure(run.abstract_state) == jax.tree.structure(trainer.abstract_state):
        return restored, data_state, True
    cast = lambda part: jax.tree.map(lambda a, ref: a.astype(ref.dtype), getattr(restored, part), getattr(fresh, part))  # noqa: E731
    state = fresh.replace(step=restored.step, params=cast("params"), opt_state=cast("opt_state"))
    return state, data_state, False


def rows(stats: dict, layer_ids: dict[str, tuple[int, ...]]) -> list[dict]:
    """One row per (layer, matmul, role) from the probes' statistics [layers, roles, stats], each
    stack's layers numbered as the model's (`layer_ids` per stack: a mixture of experts' dense
    layers and sparse ones apart)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        # blocks/attn/wq_site/probe -> attn.wq
        name = ".".join(k.removesuffix("_site") for k in keys[1:-1])
        for index in range(leaf.shape[0]):
            layer = layer_ids[keys[0]][index]
            for r, role in enumerate(ROLES):
                stat = named_stats(leaf[index, r])
                row = {"layer": layer, "tensor": f"{name}.{role}", "absmax": stat["absmax"], "nonfinite": stat["nonfinite"]}
                for fmt in REPORT_FORMATS:
                    row[fmt] = {"overflow": stat[f"{fmt}_overflow"], "underflow": stat[f"{fmt}_underflow"]}
                out.append(row)
    return sorted(out, key=lambda r: (r["layer"], r["tensor"]))


def advice(report_rows: list[dict], underflow_limit: float, overflow_limit: float = 1e-4) -> dict[str, list[int]]:
    """Layers to keep out of fp8: their x or w in e4m3, or g in e5m2, clip more than
    `overflow_limit` of their values (fp8 saturates: a few values above the delayed amax are
    normal) or flush more than `underflow_limit` to zero. Out of float16: an activation or
    weight overflows at all (inf, which no loss scale cures), or any tensor flushes more than
    `underflow_limit` (gradient overflow is the loss scaler's to handle)."""

    def fp8_fails(r):
        cell = r[FP8_ROLE_FORMAT[r["tensor"][-1]]]
        return cell["overflow"] > overflow_limit or cell["underflow"] > underflow_limit

    def fp16_fails(r):
        cell = r["float16"]
        return (cell["overflow"] > 0 and not r["tensor"].endswith(".g")) or cell["underflow"] > underflow_limit

    return {
        "fp8": sorted({r["layer"] for r in report_rows if fp8_fails(r)}),
        "float16": sorted({r["layer"] for r in report_rows if fp16_fails(r)}),
    }


def heat_map(report_rows: list[dict], path: Path) -> None:
    """Panels (layers x tensors): log10 absmax, then each format's overflow + underflow fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({r["layer"] for r in report_rows})
    tensors = sorted({r["tensor"] for r in report_rows})
    cell = {(r["layer"], r["tensor"]): r for r in report_rows}

    def grid(value):
        return np.array([[value(cell[layer, t]) for t in tensors] for layer in layers])

    panels = [("log10 |max|", grid(lambda r: np.log10(max(r["absmax"], 1e-30))), "viridis", None)]
    for fmt in REPORT_FORMATS:
        lost = grid(lambda r, f=fmt: r[f]["overflow"] + r[f]["underflow"])
        panels.append((f"{fmt}: overflow + underflow", lost, "magma", (0.0, max(float(lost.max()), 1e-6))))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 0.45 * len(tensors) + 2), 2.2 * len(panels) + 0.3 * len(layers)))
    for ax, (title, values, cmap, limits) in zip(axes, panels):
        image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=limits and limits[0], vmax=limits and limits[1])
        ax.set_title(title, fontsize=9)
        ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers], fontsize=7)
        ax.set_xticks(range(len(tensors)), tensors if ax is axes[-1] else [], rotation=60, ha="right", fontsize=7)
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(config, workdir, steps: int = 5, underflow_limit: float = 0.01, overflow_limit: float = 1e-4, devices=None) -> dict:
    """Collects the statistics, writes numerics.json and numerics.png, returns the report."""
    workdir = Path(workdir)
    collected = collect(config, workdir, steps, devices)
    result = {
        "workdir": str(workdir.absolute()),
        "from_step": collected["step"],
        "steps": steps,
        "precision": config.precision.to_dict(),
        "formats": {name: {"max": float(jnp.finfo(d).max), "smallest_subnormal": float(jnp.finfo(d).smallest_subnormal)} for name, d in REPORT_FORMATS.items()},
        "underflow_limit": underflow_limit,
        "overflow_limit": overflow_limit,
        "keep_out": advice(collected["rows"], underflow_limit, overflow_limit),
        "rows": collected["rows"],
    }
    if jax.process_index() == 0:
        (workdir / "numerics.json").write_text(json.dumps(result, indent=1))
        heat_map(collected["rows"], workdir / "numerics.png")
    return result


def summary(result: dict) -> str:
    lines = [f"{'layer':>5}  {'tensor':<14} {'absmax':>10} {'inf/nan':>8}  " + "  ".join(f"{f + ' over/under':>22}" for f in REPORT_FORMATS)]
    for r in result["rows"]:
        cells = "  ".join(f"{r[f]['overflow']:>10.2e} {r[f]['underflow']:>10.2e}" + " " for f in REPORT_FORMATS)
        lines.append(f"{r['layer']:>5}  {r['tensor']:<14} {r['absmax']:>10.3e} {r['nonfinite']:>8.2e}  {cells}")
    keep = result["keep_out"]
    lines.append(
        "keep out of fp8: " + (f"layers {keep['fp8']} (--config.precision.fp8_skip={','.join(map(str, keep['fp8']))})" if keep["fp8"] else "none")
    )
    lines.append("keep out of float16: " + (f"layers {keep['float16']} (use bfloat16)" if keep["float16"] else "none"))
    if LossScaling.from_config(ml_collections.ConfigDict(result["precision"])).kind == "none":
        lines.append("(gradients are unscaled here: add --config.precision.compute_dtype=float16 to see them under dynamic loss scaling)")
    workdir = Path(result["workdir"])
    lines.append(f"report: {workdir / 'numerics.json'}, heat map: {workdir / 'numerics.png'}")
    return "\n".join(lines)
