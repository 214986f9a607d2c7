"""`python -m lm.calibrate`: the cost model's constants, fitted once, and its check against the world.

    python -m lm.calibrate --memory --target=h100   # compile small layouts for 8 H100s, fit
    python -m lm.calibrate --memory --platform=cpu  # the same on 8 fake CPU devices
    python -m lm.calibrate --kernels --target=h100  # compile the recipes' layouts, store the kernel model's steps
    python -m lm.calibrate --fit                    # fit the step-time constants to the stored steps
    python -m lm.calibrate --published             # predicted vs published step times (table)
    python -m lm.calibrate --step_time=benchmarks/results/h200_2026-11-27 --target=h200 [--write]

`--memory` compiles the train step of small configurations under a spread of layouts and fits
the coefficients of `lm.planner.memory`'s temporaries terms to XLA's memory analysis (non-negative least
squares), per platform and jax release (XLA's memory use moves between them). The step-time
constants (the matmuls' and attention's shares of peak, the memory-bound passes over what the
layers keep and over the logits) are fitted (`--fit`) to the kernel model's predictions
(`lm.compiler.steptime`, itself fitted to GPU profiles) of real recipes under a spread of
layouts, which `--kernels` compiles deviceless and stores in `lm/hardware/kernel_rows.json`, so
the planner's first ranking agrees with what `--verify` compiles; `lm/hardware/published.json`'s
rows are predictions. `--memory` and `--fit` write `lm/hardware/calibration.json`.

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
    KERNEL_ROWS,
    KERNEL_ROWS_FILE,
    compare,
    fit_memory,
    fit_step_time,
    kernel_step,
    kernel_table,
    published_rows,
    stored_kernel_rows,
    table,
)
from lm.planner.memory import calibration, compiler_key


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.calibrate", description="Fit the cost model's constants; compare it with published runs.", with_config=False)
    parser.add_argument("--memory", action="store_true", help="fit the temporaries coefficients from compiles")
    parser.add_argument("--target", choices=sorted(targets.TARGETS), default="h100", help="compile for 8 GPUs of this kind")
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="cpu: compile on 8 fake CPU devices instead")
    parser.add_argument("--published", action="store_true", help="print predicted vs published figures")
    parser.add_argument("--kernels", action="store_true", help="compile the recipes' layouts for --target, store the kernel model's steps")
    parser.add_argument("--fit", action="store_true", help="fit the step-time constants to the stored kernel-model steps")
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
    if not (args.memory or args.kernels or args.fit or args.published):
        raise UserError("nothing to do: give --memory (fit the memory model from compiles), --kernels (compile the recipes' "
                        "layouts for the kernel model), --fit (fit the step-time constants to them), --published (compare "
                        "with published runs), or several; or --step_time=DIR")
    if args.kernels and args.platform != "gpu":
        raise UserError("--kernels compiles for a GPU target (--target); --platform=cpu has no kernel model")
    constants = calibration()
    if args.kernels:
        rows = []
        for row in KERNEL_ROWS:
            rows.append(kernel_step(row, args.target, targets.command_devices("lm.calibrate", argv, args.target, row["gpus"])))
            print(f"{row['config']} on {row['gpus']} {row['layout']}: {rows[-1]['kernels_step_s']:.4f} s by the kernels", flush=True)
        import datetime

        import jax

        about = ("The kernel model's step time (lm.compiler.steptime) of each of lm.planner.calibration.KERNEL_ROWS, compiled "
                 "deviceless for its target: what the cost model's step-time constants are fitted to. Written by "
                 "`python -m lm.calibrate --kernels`.")
        stored = {"_": about, "jax": jax.__version__, "date": datetime.date.today().isoformat(), "rows": rows}
        KERNEL_ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"wrote {KERNEL_ROWS_FILE}")
    if args.memory:
        if args.platform == "gpu":
            devices = targets.command_devices("lm.calibrate", argv, args.target, 8)
        else:
            import jax

            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", 8)
            devices = jax.devices()[:8]
        constants["memory"].setdefault(args.platform, {})[compiler_key()] = fit_memory(devices, args.platform, System.load(args.target))
    if args.fit:
        rows = stored_kernel_rows()
        constants["step_time"] = fit_step_time(rows, constants)
        for r in kernel_table(rows, constants):
            print(f"{r['name']:75s} kernels {1e3 * r['kernels_s']:9.1f} ms  cost model {1e3 * r['cost_model_s']:9.1f} ms  "
                  f"{100 * r['error']:+6.1f}%{'' if r['fits'] else '  (does not fit: not fitted on)'}")
        print(json.dumps(constants["step_time"]))
    if args.memory or args.fit:
        CALIBRATION_FILE.write_text(json.dumps(constants, indent=2) + "\n")
        print(f"wrote {CALIBRATION_FILE}")
    if args.published:
        print(table(constants))
        errors = [abs(compare(r, constants)["error"]) for r in published_rows()]
        print(json.dumps({**constants["step_time"], "max_abs_error": max(errors), "rows": len(errors)}))
    if not all(map(math.isfinite, constants["step_time"].values())):
        raise SystemExit(f"a fitted step-time constant is not finite: {constants['step_time']}")


if __name__ == "__main__":
    cli.run(main)
