"""Per-GPU memory of recipes on GPU targets, from the real XLA GPU compiler with no GPU present.

    python benchmarks/gpu_memory.py [--target=h100] [--remat=none,dots,full]

Runs `python -m lm.layout --target=...` for each (recipe, GPU count, mesh, remat) of the grid
below and prints a markdown table (state = parameters + gradients + optimizer state, from the
sharding rules; temporaries and the peak estimate from the compiled step's memory analysis;
whether it fits the target's memory), then every result as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = [  # recipe, GPUs, mesh overrides
    ("llama_1b", 1, {"data": 1}),
    ("llama_1b", 8, {"data": 1, "fsdp": 8}),
    ("llama_8b", 8, {"data": 1, "fsdp": 8}),
    ("llama_8b", 8, {"data": 1, "fsdp": 4, "tensor": 2}),
]


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--remat", default="none,dots,full")
    args, extra = parser.parse_known_args()
    rows = []
    for recipe, gpus, mesh in GRID:
        for remat in args.remat.split(","):
            command = [sys.executable, "-m", "lm.layout", f"--config=configs/{recipe}.py", f"--target={args.target}",
                       f"--devices={gpus}", f"--config.model.remat={remat}", *(f"--config.mesh.{k}={v}" for k, v in mesh.items()), *extra]
            start = time.perf_counter()
            out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                print(f"{recipe} {mesh} {remat}: failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
                continue
            summary = json.loads(out.stdout.strip().splitlines()[-1])
            summary.update(recipe=recipe, remat=remat, compile_wall_s=round(time.perf_counter() - start, 1))
            rows.append(summary)
    print(f"| recipe | GPUs | mesh | remat | params + grads + Adam (GiB) | temporaries (GiB) | peak estimate (GiB) | fits one {args.target} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        compiled, mesh = r["compiled_train_step_per_device"], {k: v for k, v in r["mesh"].items() if v > 1} or {"data": 1}
        print(f"| {r['recipe']} | {r['devices']} | {mesh} | {r['remat']} | {gib(r['per_device']['total_state_bytes'])} | "
              f"{gib(compiled['temp_bytes'])} | {gib(compiled['peak_estimate_bytes'])} | {'yes' if r['fits'] else 'no'} |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
