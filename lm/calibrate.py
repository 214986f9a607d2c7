"""`python -m lm.calibrate`: the cost model's constants, fitted once, and its check against the world.

    python -m lm.calibrate --memory --target=h100   # compile small layouts for 8 H100s, fit
    python -m lm.calibrate --memory --platform=cpu  # the same on 8 fake CPU devices
    python -m lm.calibrate --published             # predicted vs published step times (table)

`--memory` compiles the train step of small configurations under a spread of layouts and fits
the coefficients of `lm.cost`'s temporaries terms to XLA's memory analysis (non-negative least
squares), per platform. The one step-time constant, the matmul efficiency (the share of the
dense peak the model's FLOPs run at), is fitted to one published figure of the same compiler
(`--published --fit`: MaxText's Llama-3-70B bf16 step on 128 H100s); every other row of
`configs/targets/published.json` is a prediction. Both write `configs/targets/calibration.json`.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np

from lm import cli, cost, targets
from lm.cli import Parser
from lm.config import UserError, apply_overrides, default_config
from lm.cost import Cost, Layout, System
from lm.recipe import load_file

CALIBRATION_FILE = cost.TARGETS_DIR / "calibration.json"
PUBLISHED_FILE = cost.TARGETS_DIR / "published.json"
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
    *(Layout(fsdp=8, remat=r) for r in ("none", "full", "dots", "dots_no_batch", "qkv_proj")),
    Layout(data=8, remat="full"),
    Layout(data=2, fsdp=4, remat="dots"),
    Layout(fsdp=4, tensor=2, remat="full"),
    Layout(fsdp=4, tensor=2, sequence_parallel=True, remat="dots_no_batch"),
    Layout(context=2, fsdp=4, remat="full"),
    Layout(fsdp=8, remat="full", grad_accum=2),
    Layout(stage=2, fsdp=4, remat="full", microbatches=2, schedule="gpipe"),
    Layout(stage=2, fsdp=4, remat="full", microbatches=4, schedule="1f1b"),
    Layout(stage=4, fsdp=2, remat="full", microbatches=8, schedule="1f1b"),
    Layout(stage=4, data=2, remat="dots_no_batch", microbatches=4, schedule="gpipe"),
    Layout(stage=2, tensor=2, fsdp=2, sequence_parallel=True, remat="full", microbatches=8, schedule="1f1b"),
    Layout(stage=2, tensor=2, data=2, remat="dots_no_batch", microbatches=4, schedule="gpipe"),
    Layout(stage=2, fsdp=4, remat="dots_no_batch", microbatches=4, schedule="1f1b", pipeline_remat="none"),
    Layout(stage=4, fsdp=2, remat="full", microbatches=8, schedule="1f1b", pipeline_remat="none"),
    Layout(stage=2, tensor=2, data=2, remat="dots", microbatches=4, schedule="1f1b", repeats=2, pipeline_remat="none"),
    Layout(stage=2, fsdp=4, remat="full", microbatches=4, schedule="1f1b_per_stage"),
    Layout(stage=2, fsdp=4, remat="dots_no_batch", microbatches=4, schedule="1f1b_per_stage", pipeline_remat="none"),
    Layout(data=2, context=2, tensor=2, remat="full"),
    Layout(fsdp=2, tensor=4, remat="dots_no_batch"),
    Layout(tensor=8, sequence_parallel=True, remat="dots_no_batch"),
    Layout(fsdp=2, tensor=4, sequence_parallel=True, remat="full"),
    # Many passes of one or two sequences each: what the smallest-memory layouts are.
    Layout(fsdp=2, tensor=4, remat="full", grad_accum=8),
    Layout(fsdp=2, tensor=4, sequence_parallel=True, remat="full", grad_accum=8),
    Layout(data=2, tensor=4, remat="full", grad_accum=8),  # gradients whole on each device, added in place
    Layout(data=2, tensor=4, sequence_parallel=True, remat="full", grad_accum=8),
    Layout(data=4, tensor=2, remat="dots_no_batch", grad_accum=4),
    Layout(fsdp=8, remat="dots_no_batch", grad_accum=2),
    Layout(stage=2, tensor=4, remat="full", microbatches=16, schedule="1f1b"),
    Layout(stage=2, tensor=4, sequence_parallel=True, remat="full", microbatches=16, schedule="1f1b_per_stage"),
    Layout(stage=2, tensor=2, data=2, remat="full", microbatches=8, schedule="gpipe"),
    # ZeRO-1: the optimizer state, and the gradients the update takes, spread over the replicas.
    Layout(data=8, remat="full", optimizer_over_data=True),
    Layout(data=2, fsdp=4, remat="dots", optimizer_over_data=True),
    Layout(data=4, tensor=2, remat="dots_no_batch", grad_accum=4, optimizer_over_data=True),
    Layout(stage=2, tensor=2, data=2, remat="full", microbatches=4, schedule="1f1b", optimizer_over_data=True),
)


def small_config(model: dict, layout: Layout):
    base = {"data.tokenizer": "bpe", "model.scan_layers": True, "precision.compute_dtype": "bfloat16", **model}
    return apply_overrides(default_config(), {**base, **layout.overrides()})


def compiled_temp_bytes(config, devices) -> int:
    from lm.layout import layout as compile_layout

    _, summary = compile_layout(config, devices)
    return summary["compiled_train_step_per_device"]["temp_bytes"]


def fit_memory(devices, platform: str, system: System) -> dict:
    """Coefficients of the temporaries terms (and a constant) fitted to XLA's memory analysis."""
    from scipy.optimize import nnls

    rows, measured, names = [], [], []
    for model in MODELS:
        for layout in (lay for lay in LAYOUTS if model["model.num_layers"] % (lay.stage * lay.repeats) == 0 and model["model.num_kv_heads"] % lay.tensor == 0):
            config = small_config(model, layout)
            terms = Cost(cost.run_of(config), layout, system, platform).memory_terms()
            rows.append([terms[k] for k in cost.MEMORY_TERMS] + [1.0])
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
    return dict(zip((*cost.MEMORY_TERMS, "constant"), (float(c) for c in coefficients)))


def published_rows() -> list[dict]:
    return json.loads(PUBLISHED_FILE.read_text())["rows"]


@functools.cache
def row_run(config_file: str, overrides: str) -> cost.Run:
    """The cost model's view of a published row's config (`overrides` as JSON), built once."""
    config = apply_overrides(load_file(str(cost.TARGETS_DIR.parents[1] / config_file)), json.loads(overrides))
    return cost.run_of(config)


def row_cost(row: dict, constants: dict | None = None) -> Cost:
    run = row_run(row["config"], json.dumps(row.get("overrides", {}), sort_keys=True))
    return Cost(run, Layout(**row["layout"]), System.load(row.get("target", "h100")), constants=constants)


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


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.calibrate", description="Fit the cost model's constants; compare it with published runs.", with_config=False)
    parser.add_argument("--memory", action="store_true", help="fit the temporaries coefficients from compiles")
    parser.add_argument("--target", choices=sorted(targets.TARGETS), default="h100", help="compile for 8 GPUs of this kind")
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="cpu: compile on 8 fake CPU devices instead")
    parser.add_argument("--published", action="store_true", help="print predicted vs published figures")
    parser.add_argument("--fit", action="store_true", help="with --published: fit the matmul efficiency first")
    args = parser.parse(argv)
    if not (args.memory or args.published):
        raise UserError("nothing to do: give --memory (fit the memory model from compiles), --published (compare with "
                        "published runs; --fit fits the matmul efficiency first), or both")
    if args.fit and not args.published:
        raise UserError("--fit fits the matmul efficiency to a published run: add --published")
    constants = cost.calibration()
    if args.memory:
        if args.platform == "gpu":
            devices = targets.command_devices("lm.calibrate", argv, args.target, 8)
        else:
            import jax

            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", 8)
            devices = jax.devices()[:8]
        constants["memory"][args.platform] = fit_memory(devices, args.platform, System.load(args.target))
    if args.published and args.fit:
        constants["matmul_efficiency"] = fit_efficiency(constants)
        print(f"matmul efficiency fitted to {FIT_ROW}: {constants['matmul_efficiency']:.4f}")
    if args.memory or args.fit:
        CALIBRATION_FILE.write_text(json.dumps(constants, indent=2) + "\n")
        print(f"wrote {CALIBRATION_FILE}")
    if args.published:
        print(table(constants))
        errors = [abs(compare(r, constants)["error"]) for r in published_rows()]
        print(json.dumps({"matmul_efficiency": constants["matmul_efficiency"], "max_abs_error": max(errors), "rows": len(errors)}))
    if not math.isfinite(constants["matmul_efficiency"]):
        raise SystemExit("the fitted matmul efficiency is not finite")


if __name__ == "__main__":
    cli.run(main)
