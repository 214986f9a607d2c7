"""tokens/s and MFU of one recipe in float32, bf16, float16 (+ dynamic loss scaling) and fp8.

    python benchmarks/formats.py --config=configs/shakespeare_char.py [--rounds=3] [--steps=50] \
        [--formats=float32,bfloat16,float16,fp8] [--config.KEY=VALUE ...]

Each round runs `python -m lm.bench` once per format, in turn (interleaved, so a noisy machine
slows every format alike); the table gives the median over rounds, and the last line is JSON
with every run's result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

FORMATS = {
    "float32": ["--config.precision.compute_dtype=float32"],
    "bfloat16": ["--config.precision.compute_dtype=bfloat16"],
    "float16": ["--config.precision.compute_dtype=float16"],  # loss_scale=auto: dynamic
    "fp8": ["--config.precision.compute_dtype=bfloat16", "--config.precision.fp8=delayed"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args, overrides = parser.parse_known_args()
    root = Path(__file__).resolve().parents[1]
    runs = {name: [] for name in args.formats.split(",")}
    for _ in range(args.rounds):
        for name in runs:
            command = [sys.executable, "-m", "lm.bench", f"--config={args.config}", f"--steps={args.steps}", *FORMATS[name], *overrides]
            out = subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'format':<10} {'tokens/s':>10} {'mfu':>8} {'step ms':>9}  (median of {args.rounds})")
    for name, results in runs.items():
        tps = statistics.median(r["tokens_per_sec"] for r in results)
        mfu = statistics.median(r["mfu"] for r in results)
        step = statistics.median(r["step_time_s"] for r in results)
        print(f"{name:<10} {tps:>10,.0f} {mfu:>8.3f} {step * 1e3:>9.1f}")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
