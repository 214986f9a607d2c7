"""The GPU run kit: everything worth measuring on a GPU host, in one go, as JSON.

    python benchmarks/gpu.py [--config=configs/llama_1b.py] [--out=DIR] [--steps=10] [--budget_s=540]

On the first local GPU: the device and software (driver, CUDA, cuDNN, jax), the device's own
target description (to check the one stored for deviceless compiles), measured dense bf16 and
fp8 matmul peaks, then `python -m lm.bench` of the recipe in bf16 and fp8, with cuDNN and with
XLA attention, at several remat policies, and the largest batch that fits (doubling until the
device runs out of memory). Each benchmark runs in its own process (an out-of-memory failure
is a result, not a crash); the compiled HLO of the main cases is read for GEMM operand types
(fp8 or bf16), cuDNN attention calls and collectives (`lm.hlo`). Cases run in priority order until `--budget_s` is spent. Everything goes to
`DIR/gpu.json` as it arrives; the last stdout line is the same JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lm, also without an install
BF16 = ["--config.precision.compute_dtype=bfloat16"]
FP8 = [*BF16, "--config.precision.fp8=delayed"]
# (name, overrides, keep the HLO): in priority order.
CASES = [
    ("bf16_cudnn_b8", [*BF16, "--config.model.attention=cudnn", "--config.train.batch_size=8"], True),
    ("bf16_xla_b8", [*BF16, "--config.model.attention=xla", "--config.train.batch_size=8"], True),
    ("fp8_cudnn_b8", [*FP8, "--config.model.attention=cudnn", "--config.train.batch_size=8"], True),
    ("bf16_cudnn_b8_remat_dots", [*BF16, "--config.model.attention=cudnn", "--config.train.batch_size=8", "--config.model.remat=dots"], False),
    ("bf16_cudnn_b8_remat_none", [*BF16, "--config.model.attention=cudnn", "--config.train.batch_size=8", "--config.model.remat=none"], False),
]


def device_info(out: Path) -> dict:
    import jax
    from jax._src.lib import cuda_versions, xla_client

    info = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()]}
    if cuda_versions is not None:
        info["cudnn"] = cuda_versions.cudnn_get_version()
        info["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
    try:
        target = xla_client.get_topology_for_devices(jax.devices()[:1]).target_config
        (out / "target_config.txtpb").write_text(str(target))
        info["target_config"] = "target_config.txtpb"
    except Exception as e:  # noqa: BLE001 - report what this jaxlib offers, do not stop
        info["target_config_error"] = f"{type(e).__name__}: {e}"
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"], capture_output=True, text=True)
    info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    return info


def matmul_peaks(n: int = 8192, reps: int = 20) -> dict:
    """Dense matmul throughput on this device: bf16 and fp8 (e4m3 x e4m3, bf16 out)."""
    import jax
    import jax.numpy as jnp

    peaks = {}
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float8_e4m3", jnp.float8_e4m3fn)):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
        f(a, b).block_until_ready()
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            f(a, b).block_until_ready()
            best = min(best, time.perf_counter() - start)
        peaks[name] = 2 * n**3 / best
    return peaks


def run_bench(config: str, overrides: list[str], steps: int, timeout: float, hlo_dir: Path | None) -> dict:
    command = [sys.executable, "-m", "lm.bench", f"--config={config}", f"--steps={steps}", *overrides]
    if hlo_dir:
        command.append(f"--save_hlo={hlo_dir}")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    wall = round(time.perf_counter() - start, 1)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        result = {"ok": True, "wall_s": wall, **json.loads(lines[-1])}
        if hlo_dir and (hlo_dir / "train_step.hlo.txt").exists():
            from lm import hlo

            result["hlo"] = hlo.summary((hlo_dir / "train_step.hlo.txt").read_text())
        return result
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line or "RESOURCE_EXHAUSTED" in line]
    out_of_memory = "RESOURCE_EXHAUSTED" in done.stderr or "out of memory" in done.stderr.lower()
    return {"ok": False, "wall_s": wall, "out_of_memory": out_of_memory, "error": (errors or done.stderr.splitlines() or ["?"])[-1][-600:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/llama_1b.py")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_bench"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget_s", type=float, default=540, help="start no new case after this many seconds")
    parser.add_argument("--case_timeout_s", type=float, default=240)
    parser.add_argument("--max_batch", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the largest-batch search wants the device
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "meshlm_jax_cache"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    report: dict = {"config": args.config, "steps": args.steps}

    def save(key, value):
        report[key] = value
        (out / "gpu.json").write_text(json.dumps(report, indent=1))
        print(f"{key}: {json.dumps(value)}", flush=True)

    save("device", device_info(out))
    save("matmul_peak_flops", matmul_peaks())
    hlo_root = Path(tempfile.mkdtemp(prefix="meshlm_hlo_"))
    for name, overrides, keep_hlo in CASES:
        if time.perf_counter() - began > args.budget_s:
            break
        save(name, run_bench(args.config, overrides, args.steps, args.case_timeout_s, hlo_root / name if keep_hlo else None))
    # The largest power-of-two batch that fits, bf16 with cuDNN attention (the recipe's remat).
    batch, fits = 16, {}
    while batch <= args.max_batch and time.perf_counter() - began < args.budget_s:
        result = run_bench(args.config, [*BF16, "--config.model.attention=cudnn", f"--config.train.batch_size={batch}"], args.steps, args.case_timeout_s, None)
        fits[batch] = result
        save("batch_sweep_bf16_cudnn", fits)
        if not result["ok"]:
            break
        batch *= 2
    if time.perf_counter() - began < args.budget_s:
        best = max((b for b, r in fits.items() if r["ok"]), default=8)
        save(f"fp8_cudnn_b{best}", run_bench(args.config, [*FP8, "--config.model.attention=cudnn", f"--config.train.batch_size={best}"], args.steps, args.case_timeout_s, None))
    report["elapsed_s"] = round(time.perf_counter() - began, 1)
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
