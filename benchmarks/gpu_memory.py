"""Per-device memory of recipes on GPU targets, from the real XLA GPU compiler with no GPU present.

    python benchmarks/gpu_memory.py [--target=h100|cpu] [--remat=none,dots,full] [--grid=recipes|context|pipeline|pipeline_residuals]

Runs `python -m lm.layout` (`--target=...`, or on fake CPU devices with `--target=cpu`) for each
(recipe, device count, overrides) of a grid below and each remat policy, and prints a markdown
table (state = parameters + gradients + optimizer state, from the sharding rules; temporaries and
the peak estimate from the compiled step's memory analysis; whether it fits the target's memory),
then every result as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lm.compiler.targets import TARGETS

ROOT = Path(__file__).resolve().parents[1]
# llama_1b's rows keep the layout they were measured in (remat `full`, one microbatch), not the
# recipe's (`dots`, 4 microbatches since 2026-11-27).
FULL_ONE = {"model.remat": "full", "train.grad_accum": 1}
GRIDS = {  # recipe, devices, config overrides
    "recipes": [
        ("llama_1b", 1, {"mesh.data": 1, **FULL_ONE}),
        ("llama_1b", 8, {"mesh.data": 1, "mesh.fsdp": 8, **FULL_ONE}),
        ("llama_8b", 8, {"mesh.data": 1, "mesh.fsdp": 8}),
        ("llama_8b", 8, {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}),
    ],
    # Long context: one sequence per `context` group of devices (the least a layout can hold),
    # so each device holds seq_len / context tokens.
    "context": [
        ("llama_1b", 8, {"train.seq_len": length, "train.batch_size": 8 // c, "mesh.data": 1, "mesh.fsdp": 8 // c, "mesh.context": c, **FULL_ONE})
        for length in (8192, 32768, 131072)
        for c in (1, 2, 4, 8)
    ],
    # Pipeline schedules at a fixed microbatch of 2 sequences: M = 4 ... 32 microbatches.
    "pipeline": [
        ("llama_1b", 8, {"mesh.data": 1, "mesh.stage": 4, "mesh.fsdp": 2, "train.batch_size": 4 * m, "pipeline.microbatches": m,
                         "pipeline.schedule": schedule, "pipeline.repeats": repeats, **FULL_ONE})
        for schedule, repeats in (("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("1f1b", 2), ("1f1b_per_stage", 1))
        for m in (4, 8, 16, 32)
    ],
    # 1F1B recomputing each tick (pipeline.remat full) or keeping its residuals (none; per-stage:
    # balanced slots, llama_1b's 4 layers per stage halve).
    "pipeline_residuals": [
        ("llama_1b", 8, {"mesh.data": 1, "mesh.stage": 4, "mesh.fsdp": 2, "train.batch_size": 4 * m, "pipeline.microbatches": m,
                         "pipeline.schedule": schedule, "pipeline.remat": kept, **FULL_ONE})
        for schedule in ("1f1b", "1f1b_per_stage")
        for kept in ("full", "none")
        for m in (8, 32)
    ],
}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100", choices=["cpu", *sorted(TARGETS)], help="a GPU target, or cpu: fake CPU devices")
    parser.add_argument("--remat", default="none,dots,full")
    parser.add_argument("--grid", default="recipes", choices=sorted(GRIDS))
    args, extra = parser.parse_known_args()
    rows = []
    for recipe, devices, overrides in GRIDS[args.grid]:
        for remat in args.remat.split(","):
            target = [] if args.target == "cpu" else [f"--target={args.target}"]
            command = [sys.executable, "-m", "lm.layout", f"--config=configs/{recipe}.py", *target, f"--devices={devices}",
                       f"--config.model.remat={remat}", *(f"--config.{k}={v}" for k, v in overrides.items()), *extra]
            start = time.perf_counter()
            out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                print(f"{recipe} {overrides} {remat}: failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
                continue
            summary = json.loads(out.stdout.strip().splitlines()[-1])
            summary.update(recipe=recipe, remat=remat, overrides=overrides, compile_wall_s=round(time.perf_counter() - start, 1))
            rows.append(summary)
    print(f"| recipe | devices | overrides | mesh | remat | params + grads + Adam (GiB) | temporaries (GiB) | peak estimate (GiB) | fits one {args.target} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        compiled, mesh = r["compiled_train_step_per_device"], {k: v for k, v in r["mesh"].items() if v > 1} or {"data": 1}
        shape = " ".join(f"{k.split('.')[-1]}={v}" for k, v in r["overrides"].items() if not k.startswith("mesh.")) or "-"
        print(f"| {r['recipe']} | {r['devices']} | {shape} | {mesh} | {r['remat']} | {gib(r['per_device']['total_state_bytes'])} | "
              f"{gib(compiled['temp_bytes'])} | {gib(compiled['peak_estimate_bytes'])} | { {True: 'yes', False: 'no'}.get(r.get('fits'), '-')} |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
