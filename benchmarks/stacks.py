"""`lm.bench` on several Python / jax environments side by side, in one run.

    python benchmarks/stacks.py [--pythons=.venv/bin/python,.venv312/bin/python]
                                [--configs=configs/tiny.py,configs/shakespeare_char.py] [--rounds=3] [--steps=20]

Each (config, compute dtype float32 / bfloat16, environment) is benchmarked `rounds` times, the
environments interleaved within a round so that the machine's drift falls on all alike; the
median tokens/s of each, and each environment's Python and jax, go to the last stdout line as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")


def stack(python: str) -> str:
    code = "import sys, jax; print(f'Python {sys.version.split()[0]}, jax {jax.__version__}')"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()


def bench(python: str, config: str, dtype: str, steps: int) -> float:
    command = [python, "-m", "lm.bench", f"--config={config}", f"--steps={steps}", f"--config.precision.compute_dtype={dtype}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pythons", default=".venv/bin/python,.venv312/bin/python")
    parser.add_argument("--configs", default="configs/tiny.py,configs/shakespeare_char.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    pythons, configs = args.pythons.split(","), args.configs.split(",")
    stacks = {python: stack(python) for python in pythons}
    runs: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.rounds):
        for config in configs:
            for dtype in DTYPES:
                for python in pythons:
                    runs.setdefault((config, dtype, python), []).append(bench(python, config, dtype, args.steps))
    rows = [{"config": c, "compute_dtype": d, "stack": stacks[p], "tokens_per_sec": statistics.median(t), "runs": t}
            for (c, d, p), t in runs.items()]
    for row in rows:
        print(f"{row['config']:32s} {row['compute_dtype']:9s} {row['stack']:32s} {row['tokens_per_sec']:>10,.0f} tokens/s")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
