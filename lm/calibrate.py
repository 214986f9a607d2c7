"""`python -m lm.calibrate`: the cost model's constants, fitted once, and its check against the world.

    python -m lm.calibrate --memory --target=h100   # compile small layouts for 8 H100s, fit
    python -m lm.calibrate --memory --platform=cpu  # the same on 8 fake CPU devices
    python -m lm.calibrate --published             # predicted vs published step times (table)
    python -m lm.calibrate --step_time=benchmarks/results/h200_2026-11-27 --target=h200 [--write]

`--memory` compiles the train step of small configurations under a spread of layouts and fits
the coefficients of `lm.planner.memory`'s temporaries terms to XLA's memory analysis (non-negative least
squares), per platform and jax release (XLA's memory use moves between them). The one step-time constant, the matmul efficiency (the share of the
dense peak the model's FLOPs run at), is fitted to one published figure of the same compiler
(`--published --fit`: MaxText's Llama-3-70B bf16 step on 128 H100s); every other row of
`lm/hardware/published.json` is a prediction. Both write `lm/hardware/calibration.json`.

`--step_time` fits the GPU step-time model's constants (`lm.compiler.steptime`) on the kernels
of a stored GPU run (each case's optimized HLO and profiler trace, as `benchmarks/gpu.py` keeps
them), prints each case's in-sample and left-out error, and with `--write` stores them in
`lm/hardware/steptime.json`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lm import cli
from lm.cli import Parser
from lm.compiler import steptime, targets
from lm.config import UserError
from lm.hardware.systems import System
from lm.planner.calibration import (
    CALIBRATION_FILE,
    FIT_ROW,
    compare,
    fit_efficiency,
    fit_memory,
    published_rows,
    table,
)
from lm.planner.memory import calibration, compiler_key


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.calibrate", description="Fit the cost model's constants; compare it with published runs.", with_config=False)
    parser.add_argument("--memory", action="store_true", help="fit the temporaries coefficients from compiles")
    parser.add_argument("--target", choices=sorted(targets.TARGETS), default="h100", help="compile for 8 GPUs of this kind")
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="cpu: compile on 8 fake CPU devices instead")
    parser.add_argument("--published", action="store_true", help="print predicted vs published figures")
    parser.add_argument("--fit", action="store_true", help="with --published: fit the matmul efficiency first")
    parser.add_argument("--step_time", help="a stored GPU run (benchmarks/results/DEVICE_DATE): fit the step-time model on its kernels")
    parser.add_argument("--write", action="store_true", help="with --step_time: store the constants in lm/hardware/steptime.json")
    args = parser.parse(argv)
    if args.step_time:
        runs = Path(args.step_time)
        if not runs.is_dir() or not any((d / "trace.json.gz").exists() for d in runs.iterdir()):
            raise UserError(f"--step_time={args.step_time}: not a directory of stored GPU cases (each with trace.json.gz "
                            "and train_step.hlo.txt.gz, as benchmarks/gpu.py keeps them)")
        report = steptime.refit(runs, args.target)
        print(steptime.describe_refit(report))
        print(json.dumps(report["constants"]))
        if args.write:
            print(f"wrote {steptime.write(report)}")
        return
    if args.write:
        raise UserError("--write stores step-time constants: add --step_time=DIR")
    if not (args.memory or args.published):
        raise UserError("nothing to do: give --memory (fit the memory model from compiles), --published (compare with "
                        "published runs; --fit fits the matmul efficiency first), or both; or --step_time=DIR")
    if args.fit and not args.published:
        raise UserError("--fit fits the matmul efficiency to a published run: add --published")
    constants = calibration()
    if args.memory:
        if args.platform == "gpu":
            devices = targets.command_devices("lm.calibrate", argv, args.target, 8)
        else:
            import jax

            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", 8)
            devices = jax.devices()[:8]
        constants["memory"].setdefault(args.platform, {})[compiler_key()] = fit_memory(devices, args.platform, System.load(args.target))
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
