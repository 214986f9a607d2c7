"""The GPU run kit: everything worth measuring on a GPU host, in one go, as JSON.

    python benchmarks/gpu.py [--config=configs/llama_1b.py] [--out=DIR] [--steps=10] [--budget_s=540]

On the first local GPU: the device and software (driver, CUDA, cuDNN, jax), the device's own
target description (to check the one stored for deviceless compiles), measured dense bf16 and
fp8 matmul peaks, MoE's grouped matmul (`ragged_dot`, `benchmarks/grouped_gemm.py`) against a
dense GEMM, then `python -m lm.bench` of the recipe in bf16 and fp8, with cuDNN and with XLA
attention, at several remat policies, four layers of Llama-3-70B (`configs/llama_70b_layers.py`)
in bf16 and fp8, and the largest batch that fits (doubling until the device runs out of memory). Each benchmark runs in its own process (an out-of-memory failure
is a result, not a crash); the compiled HLO of the main cases is read for GEMM operand types
(fp8 or bf16), cuDNN attention calls and collectives (`lm.compiler.hlo`), and a profiler trace of
three more of their steps says where the time goes, by kind of work and by instruction
(`lm.compiler.profile`). Cases run in priority order
until `--budget_s` is spent. Everything goes to `DIR/gpu.json` as it arrives (each read HLO and
its raw trace to `DIR/hlo/CASE/`, for the step-time model's refit), and at the end a Markdown table of it to `DIR/summary.md`; the last stdout
line is the same JSON.

Where the main attention fails for another reason than memory (cuDNN missing, say), the batch
sweep and the fp8 run at the largest batch use XLA's. Rehearsed on a CPU by the test suite
(`tests/test_gpu_kit.py`: a small `--matmul_size`, the cuDNN case failing as it must there, XLA's
attention for the rest), so the first GPU session's minutes go to measuring, not debugging.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lm, also without an install
# The cases name their layout (remat, one microbatch) rather than take the recipe's, so that they
# stay comparable with the stored runs whatever the recipe becomes; `*_recipe` takes it as it is.
# XLA's own GEMM fusions, as every stored run had them (the recipe's `train.gemm_fusion=auto` takes
# the elementwise work into the GEMMs: its cases say so).
OPERANDS = "--config.train.gemm_fusion=operands"
BF16 = ["--config.precision.compute_dtype=bfloat16", "--config.train.grad_accum=1", OPERANDS]
FULL = "--config.model.remat=full"
FP8 = [*BF16, "--config.precision.fp8=delayed"]
RECIPE = ["--config.precision.compute_dtype=bfloat16"]


def attention(kind: str) -> list[str]:
    return [f"--config.model.attention={kind}"]


# XLA's GEMMs through cuBLAS alone, not Triton's GEMM fusions (MaxText's and NVIDIA's JAX GPU
# settings turn Triton's off): a flag to measure, not yet one meshlm sets.
CUBLAS_ONLY = "--xla_gpu_enable_triton_gemm=false"


# Four layers of Llama-3-70B: its GEMM shapes on one GPU, where fp8 should win (fp8 issue).
WIDE = "configs/llama_70b_layers.py"
# Two layers of Mixtral-8x7B: dropless (the grouped GEMM), capacity 1.25, and a dense model of the
# same active width (2 experts' worth of SwiGLU), each with its kernel profile.
MOE = "configs/mixtral_layers.py"
MOE_DENSE = ["--config.model.num_experts=0", "--config.model.mlp_dim=28672"]


class Case(NamedTuple):
    name: str
    overrides: list[str]
    keep_hlo: bool = False  # read its HLO and profile it (the trace kept beside the HLO)
    xla_flags: str = ""  # added to XLA_FLAGS for its process
    config: str = ""  # another recipe than the kit's --config


def cases(main: str) -> list[Case]:
    """In priority order, with `main` attention (cudnn on a GPU); XLA's attention once beside it
    for comparison. First the MoE proxy (dropless, capacity, dense of the same active width), then
    the step-time model's kernel profiles (remat `dots` and `full` at batch 8, fp8, the recipe's
    batch 64), then the wide proxy in bf16 and fp8."""
    b8 = ["--config.train.batch_size=8"]
    dots = "--config.model.remat=dots"
    compare = [] if main == "xla" else [Case("bf16_xla_b8", [*BF16, *attention("xla"), *b8, FULL], True)]
    return [
        Case(f"moe_dropless_{main}", [*BF16, *attention(main)], True, config=MOE),
        Case(f"moe_capacity_{main}", [*BF16, *attention(main), "--config.model.expert_capacity_factor=1.25"], True, config=MOE),
        Case(f"moe_dense_{main}", [*BF16, *attention(main), *MOE_DENSE], True, config=MOE),
        Case(f"bf16_{main}_b8_remat_dots", [*BF16, *attention(main), *b8, dots], True),
        Case(f"bf16_{main}_b8", [*BF16, *attention(main), *b8, FULL], True),
        Case(f"fp8_{main}_b8", [*FP8, *attention(main), *b8, FULL], True),
        Case(f"bf16_{main}_b64", [*BF16, *attention(main), "--config.train.batch_size=64", FULL], True),
        Case(f"bf16_{main}_recipe", [*RECIPE, *attention(main)], True),  # the recipe's layout as it is
        # The recipe with XLA's own GEMM fusions: what its GEMM fusion v2 gains (or loses) on the
        # device, and, from the two runs' losses on the same batches, that it computes the same.
        Case(f"bf16_{main}_recipe_gemm_fusion_operands", [*RECIPE, *attention(main), OPERANDS], True),
        # A profiled case with the elementwise work inside the GEMMs, for the step-time model's fit.
        Case(f"bf16_{main}_b8_remat_dots_gemm_fusion_elementwise",
             [*BF16, *attention(main), *b8, dots, "--config.train.gemm_fusion=elementwise"], True),
        # Attention at head dim 128 (16 heads, 4 KV heads: the same width and FLOPs) against the recipe's 64.
        Case(f"bf16_{main}_recipe_head_dim_128", [*RECIPE, *attention(main), "--config.model.num_heads=16", "--config.model.num_kv_heads=4"], True),
        Case(f"wide_bf16_{main}", [*BF16, *attention(main)], True, config=WIDE),
        Case(f"wide_fp8_{main}", [*FP8, *attention(main)], True, config=WIDE),
        *compare,
        Case(f"bf16_{main}_b8_remat_none", [*BF16, *attention(main), *b8, "--config.model.remat=none"]),
        Case(f"fp8_{main}_recipe", [*RECIPE, "--config.precision.fp8=delayed", *attention(main)]),  # sites: auto
        Case(f"fp8_{main}_b8_all_sites", [*FP8, *attention(main), *b8, FULL, "--config.precision.fp8_sites=all"]),
        Case(f"fp8_current_{main}_b8", [*BF16, "--config.precision.fp8=current", *attention(main), *b8, FULL]),
        Case(f"bf16_{main}_b8_remat_dots_cublas_only", [*BF16, *attention(main), *b8, dots], xla_flags=CUBLAS_ONLY),
        Case(f"fp8_{main}_b8_cublas_only", [*FP8, *attention(main), *b8, FULL], xla_flags=CUBLAS_ONLY),
    ]


def device_info(out: Path) -> dict:
    import jax
    from jax._src.lib import cuda_versions, xla_client

    info = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()]}
    if cuda_versions is not None:
        info["cudnn"] = cuda_versions.cudnn_get_version()
        info["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
    try:  # the device's own target description, where this jaxlib exposes it (0.10.2 does not)
        target = xla_client.get_topology_for_devices(jax.devices()[:1]).target_config
        (out / "target_config.txtpb").write_text(str(target))
        info["target_config"] = "target_config.txtpb"
    except Exception as e:  # noqa: BLE001 - report what this jaxlib offers, do not stop
        info["target_config_error"] = f"{type(e).__name__}: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except OSError as e:  # not installed in this image: the rest still runs
        info["nvidia_smi"] = f"unavailable: {e}"
    try:
        info["stored_target_check"] = stored_target_check(jax.devices()[0], info)
    except Exception as e:  # noqa: BLE001 - a device that reports something unexpected: say so, go on
        info["stored_target_check_error"] = f"{type(e).__name__}: {e}"
    return info


def stored_target_check(device, info: dict) -> dict:
    """The stored target description the deviceless compiles use (H200 for an H200, else H100)
    field by field against what this device reports (None where it reports nothing)."""
    from lm.compiler import targets

    name = "h200" if "H200" in device.device_kind else "h100"
    text = targets.target_config(name)
    stored = lambda key: re.search(rf"{key}:\s*\"?([\w. ]+)", text).group(1)  # noqa: E731
    smi = (info.get("nvidia_smi", "").splitlines() or [""])[0].split(", ")  # the first GPU's line
    capability = getattr(device, "compute_capability", "")  # e.g. "9.0" on CUDA devices
    fields = {
        "device_description_str": (stored("device_description_str"), device.device_kind),
        "core_count": (int(stored("core_count")), getattr(device, "core_count", None)),
        "compute_capability_major": (int(stored("major")), int(capability.split(".")[0]) if capability else None),
        "device_memory_mib": (int(stored("device_memory_size")) // 2**20, smi[2] if len(smi) == 4 else None),
        "clock_mhz": (round(float(stored("clock_rate_ghz")) * 1000), smi[3] if len(smi) == 4 else None),
        "cudnn": (".".join(re.search(r"dnn_version_info \{\s*major: (\d+)\s*minor: (\d+)\s*patch: (\d+)", text).groups()),
                  info.get("cudnn")),
    }
    return {"target": name, **{k: {"stored": a, "device": b} for k, (a, b) in fields.items()}}


def matmul_peaks(n: int = 8192, reps: int = 20, rounds: int = 3) -> dict:
    """Dense matmul throughput on this device: bf16 and fp8 (e4m3 x e4m3, bf16 out), the best of
    `rounds` of `reps` products queued back to back (one timed call each read 620-712 TFLOP/s
    bf16 on an H100 in two runs: the host's dispatch and sync showed in the time)."""
    import jax
    import jax.numpy as jnp

    peaks = {}
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float8_e4m3", jnp.float8_e4m3fn)):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
        f(a, b).block_until_ready()
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            results = [f(a, b) for _ in range(reps)]
            results[-1].block_until_ready()
            best = min(best, (time.perf_counter() - start) / reps)
            del results
        peaks[name] = 2 * n**3 / best
    return peaks


# The kit's own process (device queries, matmul peaks) must leave the GPU to the benchmark
# processes it starts: JAX's default pool would take lm.GPU_MEMORY_FRACTION of the device for it,
# and every benchmark then ran out of memory (the first GPU run, 2026-11-26). So this process
# allocates only what it uses and frees it at once; the children get the environment as it was.
OWN_POOL = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
CHILD_ENV = dict(os.environ)


def run_bench(config: str, overrides: list[str], steps: int, timeout: float, hlo_dir: Path | None, xla_flags: str = "") -> dict:
    command = [sys.executable, "-m", "lm.bench", f"--config={config}", f"--steps={steps}", *overrides]
    trace_dir = tempfile.mkdtemp(prefix="meshlm_trace_")
    if hlo_dir:  # the main cases: their HLO read, and where their step's time goes (lm.compiler.profile)
        command += [f"--save_hlo={hlo_dir}", f"--profile={trace_dir}"]
    start = time.perf_counter()
    try:
        env = {**CHILD_ENV, "XLA_FLAGS": f"{CHILD_ENV.get('XLA_FLAGS', '')} {xla_flags}".strip()} if xla_flags else CHILD_ENV
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    wall = round(time.perf_counter() - start, 1)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        result = {"ok": True, "wall_s": wall, **json.loads(lines[-1])}
        if hlo_dir and (hlo_dir / "train_step.hlo.txt").exists():
            from lm.compiler import hlo, profile

            result["hlo"] = hlo.summary((hlo_dir / "train_step.hlo.txt").read_text())
            try:  # the raw trace beside the HLO: the step-time model's refit reads its kernels
                shutil.copy(profile.trace_file(trace_dir), hlo_dir / "trace.json.gz")
            except FileNotFoundError as e:
                result["trace_error"] = str(e)
        return result
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line or "RESOURCE_EXHAUSTED" in line]
    out_of_memory = "RESOURCE_EXHAUSTED" in done.stderr or "out of memory" in done.stderr.lower()
    return {"ok": False, "wall_s": wall, "out_of_memory": out_of_memory, "error": (errors or done.stderr.splitlines() or ["?"])[-1][-600:]}


def grouped_gemm_results(shape: str, reps: int, timeout: float) -> dict:
    """benchmarks/grouped_gemm.py at `shape` (a name or rows,experts,d,f) in its own process (the
    GPU left to it), and on GPUs once more with cuDNN's grouped GEMM behind `ragged_dot`."""
    named = ["--shape=" + shape] if "," not in shape else [f"--{k}={v}" for k, v in zip(("rows", "experts", "d", "f"), shape.split(","))]
    results = {}
    variants = {"": []} | ({"cudnn_fusion": ["--implementations=xla", "--xla_ragged_dot_fusion"]} if _on_gpu() else {})
    for variant, extra in variants.items():
        command = [sys.executable, str(ROOT / "benchmarks" / "grouped_gemm.py"), *named, f"--reps={reps}", *extra]
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=CHILD_ENV)
            lines = done.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": (done.stderr.splitlines() or ["?"])[-1][-600:]}
        except subprocess.TimeoutExpired:
            result = {"error": f"timed out after {timeout:.0f} s"}
        if variant:
            results[variant] = result.get("xla", result)
        else:
            results = result | results
    return results


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def summary(report: dict) -> str:
    """The report as Markdown, for PERFORMANCE.md: one row per benchmark, then where each profiled
    case's step time went (milliseconds per step by kind of work)."""
    runs = {name: r for name, r in report.items() if isinstance(r, dict) and "ok" in r}
    for sweep in (k for k in report if k.startswith("batch_sweep_")):
        runs.update({f"{sweep.removeprefix('batch_sweep_')}_b{batch}": r for batch, r in report[sweep].items()})
    gib = lambda b: f"{b / 2**30:.2f}" if b else "?"  # noqa: E731
    lines = [f"`{report['config']}` on {', '.join(report['device'].get('devices', []))} (jax {report['device'].get('jax')})", "",
             "| case | tokens/s | MFU | step (ms) | peak (GiB) | compile (s) | loss on its batches |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        if r["ok"]:
            lines.append(f"| {name} | {r['tokens_per_sec']:,.0f} | {100 * r['mfu']:.1f}% | {1000 * r['step_time_s']:.0f} | "
                         f"{gib(r.get('peak_memory_bytes'))} | {r['compile_time_s']:.1f} | {r.get('synthetic_batches_loss', float('nan')):.4f} |")
        else:
            lines.append(f"| {name} | {'out of memory' if r.get('out_of_memory') else 'failed: ' + r['error'][:80]} | | | | | |")
    for name, r in report.items():
        if name.startswith("grouped_gemm_") and "dense_tflops" in r:
            lines += [f"\n{name} (TFLOP/s forward / with gradients; dense GEMM {r['dense_tflops']:.0f} / {r['dense_fwd_bwd_tflops']:.0f}):"]
            for impl, e in r.items():
                if isinstance(e, dict) and ("even_tflops" in e or "error" in e):
                    lines.append(f"- {impl}: " + (e.get("error", "")[:80] or f"even {e['even_tflops']:.0f} / {e['even_fwd_bwd_tflops']:.0f}, "
                                                  f"skewed {e['skewed_tflops']:.0f} / {e['skewed_fwd_bwd_tflops']:.0f}"))
    for name, r in runs.items():
        if r.get("profile"):
            kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in r["profile"]["by_kind_ms_per_step"].items())
            lines.append(f"\n{name}, ms per step by kind ({r['profile']['source']}): {kinds}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/llama_1b.py")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_bench"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget_s", type=float, default=540, help="start no new case after this many seconds")
    parser.add_argument("--case_timeout_s", type=float, default=240)
    parser.add_argument("--max_batch", type=int, default=128)
    parser.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"), help="the main cases' attention")
    parser.add_argument("--matmul_size", type=int, default=8192, help="n of the n x n x n peak matmuls")
    parser.add_argument("--grouped_gemm", default="mixtral;qwen3_30b_a3b",
                        help="';'-separated shapes of the grouped GEMM benchmark (benchmarks/grouped_gemm.py): names or "
                             "rows,experts,d,f; empty: skip it")
    parser.add_argument("--grouped_gemm_reps", type=int, default=10,
                        help="calls per timed round of the grouped GEMMs (1 for a rehearsal: Pallas' CPU interpreter is slow)")
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all), e.g. for a rehearsal")
    args = parser.parse_args()
    chosen = cases(args.attention)
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {case.name for case in chosen})
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(case.name for case in chosen)}")
        chosen = [case for case in chosen if case.name in wanted]
    CHILD_ENV.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "meshlm_jax_cache"))
    os.environ.update(OWN_POOL)  # before jax starts its GPU backend in this process
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    report: dict = {"config": args.config, "steps": args.steps}

    def save(key, value):
        report[key] = value
        (out / "gpu.json").write_text(json.dumps(report, indent=1))
        print(f"{key}: {json.dumps(value)}", flush=True)

    save("device", device_info(out))
    save("matmul_peak_flops", matmul_peaks(args.matmul_size))
    for shape in filter(None, args.grouped_gemm.split(";")):  # MoE's grouped GEMMs against a dense GEMM of the same work
        save(f"grouped_gemm_{shape.replace(',', 'x')}", grouped_gemm_results(shape, args.grouped_gemm_reps, args.case_timeout_s))
    hlo_root = out / "hlo"  # each case's optimised train step, beside gpu.json
    for case in chosen:
        if time.perf_counter() - began > args.budget_s:
            break
        hlo_dir = hlo_root / case.name if case.keep_hlo else None
        save(case.name, run_bench(case.config or args.config, case.overrides, args.steps, args.case_timeout_s, hlo_dir,
                                  case.xla_flags))
    # The largest power-of-two batch that fits, bf16 with the main attention (the recipe's remat);
    # with XLA's where the main one failed for another reason than memory (cuDNN missing, say).
    headline = report.get(f"bf16_{args.attention}_b8", {"ok": True})  # the first case, if it ran
    kernel = args.attention if headline["ok"] or headline.get("out_of_memory") else "xla"
    batch, fits = 16, {}
    while batch <= args.max_batch and time.perf_counter() - began < args.budget_s:
        sized = [*BF16, *attention(kernel), f"--config.train.batch_size={batch}", FULL]
        result = run_bench(args.config, sized, args.steps, args.case_timeout_s, None)
        fits[batch] = result
        save(f"batch_sweep_bf16_{kernel}", fits)
        if not result["ok"]:
            break
        batch *= 2
    if time.perf_counter() - began < args.budget_s:
        best = max((b for b, r in fits.items() if r["ok"]), default=8)
        largest = [*FP8, *attention(kernel), f"--config.train.batch_size={best}", FULL]
        save(f"fp8_{kernel}_largest_b{best}", run_bench(args.config, largest, args.steps, args.case_timeout_s, None))
    report["elapsed_s"] = round(time.perf_counter() - began, 1)
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    (out / "summary.md").write_text(summary(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
