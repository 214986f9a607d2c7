"""The cost model's constants: the temporaries coefficients fitted to small compiles
(`fit_memory`), the step-time constants fitted to the kernel model's predictions of real recipes'
compiled programs (`kernel_step`, `fit_step_time`), and the predicted-vs-published table.
`python -m lm.calibrate` is its command.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from lm.config import apply_overrides, default_config
from lm.hardware import data_file
from lm.hardware.systems import System
from lm.planner.compiled import step_report
from lm.planner.cost import STEP_TIME_CONSTANTS, Cost
from lm.planner.memory import MEMORY_TERMS
from lm.planner.parallelism import Parallelism
from lm.planner.run import Run, run_of
from lm.recipe import load_file

CALIBRATION_FILE = data_file("calibration.json")
PUBLISHED_FILE = data_file("published.json")
KERNEL_ROWS_FILE = data_file("kernel_rows.json")

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


# The layouts the step-time constants are fitted on: the kernel model's prediction of each
# (`lm.compiler.steptime` on the deviceless compile) against the cost model's formulas. Real
# recipes at their size, a spread of batch, remat and fsdp / tensor / stage layouts.
def _row(config: str, gpus: int, overrides: dict | None = None, **layout) -> dict:
    return {"config": f"configs/{config}.py", "gpus": gpus, "layout": layout, "overrides": overrides or {}}


KERNEL_ROWS = (
    *(_row("llama_1b", 1, remat=r, grad_accum=a) for r, a in (("dots", 4), ("dots", 8), ("full", 2), ("full", 4), ("full", 8),
                                                              ("qkv_proj", 4), ("dots_no_batch", 8))),
    _row("llama_1b", 8, fsdp=8, remat="dots"),
    _row("llama_1b", 8, fsdp=8, remat="full"),
    _row("llama_1b", 8, data=2, tensor=4, remat="full"),
    _row("llama_1b", 8, fsdp=4, tensor=2, remat="dots"),
    _row("llama_1b", 8, tensor=8, sequence_parallel=True, remat="dots_no_batch"),
    _row("llama_8b", 8, fsdp=8, remat="full"),
    _row("llama_8b", 8, fsdp=8, remat="dots_no_batch"),
    _row("llama_8b", 8, {"train.batch_size": 16, "train.seq_len": 4096}, fsdp=8, remat="full"),
    _row("llama_8b", 8, fsdp=4, tensor=2, sequence_parallel=True, remat="full"),
    _row("llama_8b", 8, tensor=8, sequence_parallel=True, remat="full"),
    _row("llama_8b", 8, {"train.batch_size": 16}, stage=2, fsdp=4, remat="full", microbatches=4, schedule="1f1b"),
    _row("llama_70b_layers", 1, remat="full"),
    _row("llama_70b_layers", 1, {"train.batch_size": 2}, remat="qkv_proj"),
    _row("gpt2_124m", 1, remat="dots_no_batch"),
    _row("gpt2_124m", 1, {"train.batch_size": 32}, remat="full"),
    _row("mixtral_8x7b", 64, fsdp=64, remat="dots", grad_accum=2),
    _row("qwen3_30b_a3b", 64, fsdp=64, remat="qkv_proj"),
)


def kernel_row_config(row: dict):
    """A KERNEL_ROWS entry's config: its recipe under its layout and overrides."""
    return apply_overrides(load_file(row["config"]), {**row["overrides"], **Parallelism(**row["layout"]).overrides()})


def kernel_step(row: dict, target: str, devices) -> dict:
    """A KERNEL_ROWS entry compiled for `target` (its `devices`): the kernel model's step time and
    its parts by kind, to store beside the row."""
    _, summary = step_report(kernel_row_config(row), devices, target=target)
    timed = summary["step_time"]
    return {**row, "target": target, "fits": summary["fits"], "kernels_step_s": timed["step_s"], "by_kind_s": timed["by_kind_s"]}


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


def stored_kernel_rows() -> list[dict]:
    """The KERNEL_ROWS as last compiled (`python -m lm.calibrate --kernels`), with the kernel
    model's step time of each."""
    return json.loads(KERNEL_ROWS_FILE.read_text())["rows"]


def kernel_row_cost(row: dict, constants: dict | None = None) -> Cost:
    return Cost(run_of(kernel_row_config(row)), Parallelism(**row["layout"]), System.load(row["target"]), constants=constants)


# Every stored row's cost-model step within this of the kernel model's, where the constants allow
# (`lm.plan` promises 15%; the margin lets the rows move as programs change before a refit).
AGREEMENT = 0.12


def fit_step_time(rows: list[dict], constants: dict) -> dict:
    """The step-time constants (`STEP_TIME_CONSTANTS`) that bring the cost model closest to the
    kernel model on `rows` (those that fit their GPU; their collectives timed by the cost model's
    network terms, as `lm.plan --verify` ranks): non-negative least squares on the relative
    errors with every row's error held within `AGREEMENT` (plain least squares let one row, an
    MoE whose memory-bound work the cost model does not see, pass 15%), the terms the fit leaves
    alone (collectives, the optimizer's traffic) as they are."""
    from scipy.optimize import minimize, nnls

    rows, fitted = [r for r in rows if r["fits"]], constants["step_time"]
    for _ in range(3):  # FSDP's exposed time depends on the compute it hides behind: settle it
        costs = [kernel_row_cost(r, {**constants, "step_time": fitted}) for r in rows]
        # Both without the collectives' time (the kernel model's collective kernels; the cost
        # model's network terms), which the constants do not price.
        y = np.asarray([c.with_network(r["kernels_step_s"], r["by_kind_s"]) - c.network_seconds() for c, r in zip(costs, rows)])
        x = np.asarray([list(c.compute_terms().values()) for c in costs])
        bubble = np.asarray([1 / (1 - c.bubble_fraction()) for c in costs])  # the bubble lasts as the compute does
        rest = np.asarray([c.step_time["total"] - c.step_time["compute"] - c.step_time["bubble"] - c.network_seconds() for c in costs])
        relative = x * bubble[:, None] / y[:, None]
        scale = relative.max(axis=0)
        a, b = relative / scale, 1 - rest / y
        start, _ = nnls(a, b)
        bounded = minimize(lambda f: np.sum((a @ f - b) ** 2), start, jac=lambda f: 2 * a.T @ (a @ f - b), method="SLSQP",
                           bounds=[(0, None)] * len(start),
                           constraints=[{"type": "ineq", "fun": lambda f: AGREEMENT - (a @ f - b), "jac": lambda f: -a},
                                        {"type": "ineq", "fun": lambda f: AGREEMENT + (a @ f - b), "jac": lambda f: a}])
        factors = (bounded.x if bounded.success else start) / scale
        fitted = {k: float(1 / f if k.endswith("efficiency") else f) for k, f in zip(STEP_TIME_CONSTANTS, factors)}
    return fitted


def kernel_table(rows: list[dict], constants: dict | None = None) -> list[dict]:
    """Each stored row's kernel-model step (its collectives the cost model's network terms, as
    `lm.plan --verify` has it) beside the cost model's."""
    out = []
    for r in rows:
        c = kernel_row_cost(r, constants)
        changed = "".join(f", {k.split('.')[-1]}={v}" for k, v in r["overrides"].items())
        name = f"{r['config'].removeprefix('configs/').removesuffix('.py')}{changed} on {r['gpus']}: {c.parallelism.name(c.run.model.num_layers)}"
        kernels = c.with_network(r["kernels_step_s"], r["by_kind_s"])
        out.append({"name": name, "fits": r["fits"], "kernels_s": kernels, "cost_model_s": c.step_time["total"],
                    "error": c.step_time["total"] / kernels - 1})
    return out


def table(constants: dict | None = None) -> str:
    lines = ["| published run | published | predicted | error |", "|---|---|---|---|"]
    for row in published_rows():
        r = compare(row, constants)
        unit = "s/step" if "step_s" in row else "TFLOP/s/GPU" if "tflops_per_gpu" in row else "tokens/s/GPU"
        lines.append(f"| {row['name']} | {r['published']:,.1f} {unit} | {r['predicted']:,.1f} | {100 * r['error']:+.0f}% |")
    return "\n".join(lines)
