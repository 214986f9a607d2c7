"""The cost model's constants: the temporaries coefficients fitted to small compiles
(`fit_memory`), the matmul efficiency fitted to one published run (`fit_efficiency`), and the
predicted-vs-published table. `python -m lm.calibrate` is its command.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from lm.config import apply_overrides, default_config
from lm.hardware import data_file
from lm.hardware.systems import System
from lm.planner.compiled import step_report
from lm.planner.cost import Cost
from lm.planner.memory import MEMORY_TERMS
from lm.planner.parallelism import Parallelism
from lm.planner.run import Run, run_of
from lm.recipe import load_file

CALIBRATION_FILE = data_file("calibration.json")
PUBLISHED_FILE = data_file("published.json")
FIT_ROW = "maxtext-llama3-70b-bf16-128"  # the published row the matmul efficiency is fitted to

# Small models (different shapes, so the terms are not collinear) and the layouts they are
# compiled under: every remat policy, each parallelism, accumulation and every pipeline schedule.
MODELS = (
    {"model.num_layers": 4, "model.embed_dim": 256, "model.num_heads": 8, "model.num_kv_heads": 4, "model.mlp_dim": 768,
     "data.vocab_size": 8192, "train.seq_len": 256, "train.batch_size": 32},
    {"model.num_layers": 2, "model.embed_dim": 512, "model.num_heads": 8, "model.num_kv_heads": 2, "model.mlp_dim": 1536,
     "data.vocab_size": 16384, "train.seq_len": 512, "train.batch_size": 16},
    {"model.num_layers": 2, "model.embed_dim": 1024, "model.num_heads": 16, "model.num_kv_heads": 8, "model.mlp_dim": 2816,
     "data.vocab_size": 8192, "train.seq_len": 512, "train.batch_size": 16},
)
LAYOUTS = (
    *(Parallelism(fsdp=8, remat=r) for r in ("none", "full", "dots", "dots_no_batch", "qkv_proj")),
    Parallelism(data=8, remat="full"),
    Parallelism(data=2, fsdp=4, remat="dots"),
    Parallelism(fsdp=4, tensor=2, remat="full"),
    Parallelism(fsdp=4, tensor=2, sequence_parallel=True, remat="dots_no_batch"),
    Parallelism(context=2, fsdp=4, remat="full"),
    Parallelism(fsdp=8, remat="full", grad_accum=2),
    Parallelism(stage=2, fsdp=4, remat="full", microbatches=2, schedule="gpipe"),
    Parallelism(stage=2, fsdp=4, remat="full", microbatches=4, schedule="1f1b"),
    Parallelism(stage=4, fsdp=2, remat="full", microbatches=8, schedule="1f1b"),
    Parallelism(stage=4, data=2, remat="dots_no_batch", microbatches=4, schedule="gpipe"),
    Parallelism(stage=2, tensor=2, fsdp=2, sequence_parallel=True, remat="full", microbatches=8, schedule="1f1b"),
    Parallelism(stage=2, tensor=2, data=2, remat="dots_no_batch", microbatches=4, schedule="gpipe"),
    Parallelism(stage=2, fsdp=4, remat="dots_no_batch", microbatches=4, schedule="1f1b", pipeline_remat="none"),
    Parallelism(stage=4, fsdp=2, remat="full", microbatches=8, schedule="1f1b", pipeline_remat="none"),
    Parallelism(stage=2, tensor=2, data=2, remat="dots", microbatches=4, schedule="1f1b", repeats=2, pipeline_remat="none"),
    Parallelism(stage=2, fsdp=4, remat="full", microbatches=4, schedule="1f1b_per_stage"),
    Parallelism(stage=2, fsdp=4, remat="dots_no_batch", microbatches=4, schedule="1f1b_per_stage", pipeline_remat="none"),
    Parallelism(data=2, context=2, tensor=2, remat="full"),
    Parallelism(fsdp=2, tensor=4, remat="dots_no_batch"),
    Parallelism(tensor=8, sequence_parallel=True, remat="dots_no_batch"),
    Parallelism(fsdp=2, tensor=4, sequence_parallel=True, remat="full"),
    # Many passes of one or two sequences each: what the smallest-memory layouts are.
    Parallelism(fsdp=2, tensor=4, remat="full", grad_accum=8),
    Parallelism(fsdp=2, tensor=4, sequence_parallel=True, remat="full", grad_accum=8),
    Parallelism(data=2, tensor=4, remat="full", grad_accum=8),  # gradients whole on each device, added in place
    Parallelism(data=2, tensor=4, sequence_parallel=True, remat="full", grad_accum=8),
    Parallelism(data=4, tensor=2, remat="dots_no_batch", grad_accum=4),
    Parallelism(fsdp=8, remat="dots_no_batch", grad_accum=2),
    Parallelism(stage=2, tensor=4, remat="full", microbatches=16, schedule="1f1b"),
    Parallelism(stage=2, tensor=4, sequence_parallel=True, remat="full", microbatches=16, schedule="1f1b_per_stage"),
    Parallelism(stage=2, tensor=2, data=2, remat="full", microbatches=8, schedule="gpipe"),
    # ZeRO-1: the optimizer state, and the gradients the update takes, spread over the replicas.
    Parallelism(data=8, remat="full", optimizer_over_data=True),
    Parallelism(data=2, fsdp=4, remat="dots", optimizer_over_data=True),
    Parallelism(data=4, tensor=2, remat="dots_no_batch", grad_accum=4, optimizer_over_data=True),
    Parallelism(stage=2, tensor=2, data=2, remat="full", microbatches=4, schedule="1f1b", optimizer_over_data=True),
)


def small_config(model: dict, layout: Parallelism):
    base = {"data.tokenizer": "bpe", "model.scan_layers": True, "precision.compute_dtype": "bfloat16", **model}
    return apply_overrides(default_config(), {**base, **layout.overrides()})


def compiled_temp_bytes(config, devices) -> int:
    _, summary = step_report(config, devices)
    return summary["compiled_train_step_per_device"]["temp_bytes"]


def fit_memory(devices, platform: str, system: System) -> dict:
    """Coefficients of the temporaries terms (and a constant) fitted to XLA's memory analysis."""
    from scipy.optimize import nnls

    rows, measured, names = [], [], []
    for model in MODELS:
        for layout in (lay for lay in LAYOUTS if model["model.num_layers"] % (lay.stage * lay.repeats) == 0 and model["model.num_kv_heads"] % lay.tensor == 0):
            config = small_config(model, layout)
            terms = Cost(run_of(config), layout, system, platform).memory_terms()
            rows.append([terms[k] for k in MEMORY_TERMS] + [1.0])
            measured.append(compiled_temp_bytes(config, devices))
            names.append(f"{model['model.embed_dim']}/{layout.name(model['model.num_layers'])}")
    x, y = np.asarray(rows), np.asarray(measured, float)
    # Relative errors are what matter (small and large layouts alike): each row divided by its
    # measurement; columns scaled to be comparable.
    relative = x / y[:, None]
    scale = relative.max(axis=0)
    coefficients, _ = nnls(relative / scale, np.ones_like(y))
    coefficients /= scale
    predicted = x @ coefficients
    for name, p, m in zip(names, predicted, y):
        print(f"{name:60s} XLA {m / 2**20:9.2f} MiB  model {p / 2**20:9.2f} MiB  {100 * (p / m - 1):+6.1f}%")
    print(f"worst temporaries error: {100 * np.max(np.abs(predicted / y - 1)):.1f}%")
    return dict(zip((*MEMORY_TERMS, "constant"), (float(c) for c in coefficients)))


def published_rows() -> list[dict]:
    return json.loads(PUBLISHED_FILE.read_text())["rows"]


@functools.cache
def row_run(config_file: str, overrides: str) -> Run:
    """The cost model's view of a published row's config (`overrides` as JSON), built once."""
    config = apply_overrides(load_file(config_file), json.loads(overrides))
    return run_of(config)


def row_cost(row: dict, constants: dict | None = None) -> Cost:
    run = row_run(row["config"], json.dumps(row.get("overrides", {}), sort_keys=True))
    return Cost(run, Parallelism(**row["layout"]), System.load(row.get("target", "h100")), constants=constants)


def compare(row: dict, constants: dict | None = None) -> dict:
    """One published figure beside the prediction, in the figure's own unit."""
    c = row_cost(row, constants)
    step = c.step_time["total"]
    if "step_s" in row:
        published, predicted = row["step_s"], step
    else:  # tokens/s per GPU, or TFLOP/s per GPU counted by the publisher's FLOPs per token
        published, predicted = row.get("tokens_per_s_per_gpu"), c.tokens_per_s_per_gpu()
        if "tflops_per_gpu" in row:
            published, predicted = row["tflops_per_gpu"], predicted * row["publisher_flops_per_token"] / 1e12
    return {"name": row["name"], "published": published, "predicted": predicted, "error": predicted / published - 1, "step_s": step}


def fit_efficiency(constants: dict) -> float:
    """The matmul efficiency that makes the FIT_ROW prediction equal its published figure
    (step time is nearly inverse in it: a few fixed-point steps)."""
    row = next(r for r in published_rows() if r["name"] == FIT_ROW)
    efficiency = constants["matmul_efficiency"]
    for _ in range(20):
        result = compare(row, {**constants, "matmul_efficiency": efficiency})
        efficiency *= result["predicted"] / result["published"]
    return efficiency


def table(constants: dict | None = None) -> str:
    lines = ["| published run | published | predicted | error |", "|---|---|---|---|"]
    for row in published_rows():
        r = compare(row, constants)
        unit = "s/step" if "step_s" in row else "TFLOP/s/GPU" if "tflops_per_gpu" in row else "tokens/s/GPU"
        lines.append(f"| {row['name']} | {r['published']:,.1f} {unit} | {r['predicted']:,.1f} | {100 * r['error']:+.0f}% |")
    return "\n".join(lines)
