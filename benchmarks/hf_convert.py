"""Wall time and peak RSS of importing and exporting a ~1B-parameter Hugging Face checkpoint.

    python benchmarks/hf_convert.py --dir=/tmp/hf1b [--param_dtype=float32]

Makes (once, in --dir/hf) a randomly initialised Llama-3.2-1B-shaped model with `transformers`
(1.24B parameters, tied embeddings), saved in bfloat16 safetensors (needs the test extra: torch,
transformers); then runs `python -m lm.convert from_hf` and `to_hf --dtype=bfloat16` as a user
would, each in its own process, reading its peak RSS from `/usr/bin/time`-style rusage. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
)


def make_model(directory: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.tie_weights()  # to_empty gave the head storage of its own
    model.save_pretrained(directory)


# Runs the command given as its arguments and prints that child's peak RSS (kB) last: rusage of
# children is a maximum over all of them, so each measurement gets a parent of its own.
_PEAK = "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"


def measured(argv: list[str]) -> dict:
    """Wall seconds and peak RSS (GB) of `python ARGV` in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MESHLM_GPU_COMPILER")}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    peak_kb = int(result.stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(peak_kb / 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="scratch directory (the model is made once and kept)")
    parser.add_argument("--param_dtype", default="float32", help="the imported run's master-weight dtype")
    args = parser.parse_args()
    root = Path(args.dir)
    hf = root / "hf"
    if not (hf / "config.json").exists():
        make_model(hf)
    for path in (root / "run", root / "out"):
        shutil.rmtree(path, ignore_errors=True)
    file_gb = sum(p.stat().st_size for p in hf.glob("*.safetensors")) / 1e9
    results = {"checkpoint_gb_bf16": round(file_gb, 2), "param_dtype": args.param_dtype}
    results["import"] = measured(["-m", "lm.convert", "from_hf", f"--hf={hf}", f"--workdir={root / 'run'}",
                                  f"--config.precision.param_dtype={args.param_dtype}"])
    results["export"] = measured(["-m", "lm.convert", "to_hf", f"--workdir={root / 'run'}", f"--out={root / 'out'}", "--dtype=bfloat16"])
    results["params_gb_in_memory"] = round(file_gb * (2 if args.param_dtype == "float32" else 1), 2)  # the run's master weights
    print(json.dumps(results))


if __name__ == "__main__":
    main()
