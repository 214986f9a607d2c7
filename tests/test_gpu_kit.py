"""The GPU run kit (benchmarks/gpu.py), rehearsed on one CPU device: every stage of it runs and
lands in its JSON, so a session's few GPU minutes go to measuring, not to debugging the kit."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_module

import lm
from lm.planner import search as plan


@pytest.mark.slow
def test_the_gpu_kit_runs_end_to_end_and_writes_its_json(tmp_path):
    result = run_module("benchmarks.gpu", "--config=configs/tiny.py", f"--out={tmp_path}", "--steps=2", "--matmul_size=128",
                        "--cases=bf16_cudnn_b8,bf16_xla_b8", "--max_batch=16", "--grouped_gemm=256,4,128,128",
                        "--grouped_gemm_reps=1", timeout=900,
                        env_extra={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache")})  # not the kit's /tmp default
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "gpu.json").read_text())
    # Each stored target field is set beside what this device says of it (nothing, on a CPU).
    check = report["device"]["stored_target_check"]
    assert check["target"] == "h100" and check["core_count"] == {"stored": 132, "device": None}
    assert check["cudnn"]["stored"] == "9.8.0" and "nvidia_smi" in report["device"]
    assert all(flops > 0 for flops in report["matmul_peak_flops"].values())
    # The grouped GEMMs (Pallas' in its GPU interpreter here) timed and checked against ragged_dot.
    grouped = report["grouped_gemm_256x4x128x128"]
    assert grouped["xla"]["even_tflops"] > 0 and grouped["pallas"]["skewed_fwd_bwd_tflops"] > 0
    assert max(grouped["pallas"]["skewed_max_relative_error"]) < 2e-2, grouped["pallas"]
    # cuDNN cannot run on a CPU: the case says why, in one line, and the kit goes on.
    failed = report["bf16_cudnn_b8"]
    assert not failed["ok"] and not failed["out_of_memory"] and "model.attention=cudnn needs a GPU target" in failed["error"]
    case = report["bf16_xla_b8"]
    assert case["ok"] and case["compute_dtype"] == "bfloat16" and case["tokens_per_sec"] > 0
    assert sum(n for types, n in case["hlo"]["gemm_operand_types"].items() if types.startswith("bf16 x bf16")) > 0
    assert (tmp_path / "hlo" / "bf16_xla_b8" / "train_step.hlo.txt").stat().st_size > 0  # kept beside gpu.json
    assert case["profile"]["by_kind_ms_per_step"]["gemm"] > 0  # where its step's time went (lm.compiler.profile)
    # The batch sweep (with XLA's attention, the main kernel having failed) doubles from 16 up to
    # --max_batch, then fp8 runs at the largest that fit.
    assert list(report["batch_sweep_bf16_xla"]) == ["16"] and report["batch_sweep_bf16_xla"]["16"]["ok"]
    largest = report["fp8_xla_largest_b16"]
    assert largest["ok"] and largest["fp8"] == "delayed" and largest["tokens_per_step"] == 16 * 128
    assert report["elapsed_s"] > 0
    # The same, as Markdown for PERFORMANCE.md: a row per benchmark, then the profiled case's kinds.
    summary = (tmp_path / "summary.md").read_text()
    assert f"| bf16_xla_b8 | {case['tokens_per_sec']:,.0f} |" in summary and "| bf16_cudnn_b8 | failed: " in summary
    assert "| bf16_xla_b16 |" in summary
    kinds_line = next(line for line in summary.splitlines() if line.startswith("bf16_xla_b8, ms per step by kind (host): "))
    assert "gemm " in kinds_line  # largest first: the order is the host's timing, so it is not asserted


def test_the_gpu_kit_names_its_cases_when_asked_for_an_unknown_one(tmp_path):
    result = run_module("benchmarks.gpu", f"--out={tmp_path}", "--cases=bf16_cudnn_b8,bf16_fast")
    assert result.returncode == 2 and "unknown case(s) bf16_fast; the cases are moe_dropless_cudnn, moe_capacity_cudnn, moe_dense_cudnn, bf16_cudnn_b8_remat_dots" in result.stderr
    assert not (tmp_path / "gpu.json").exists()


def test_gpu_runs_get_a_memory_pool_above_what_the_planner_admits():
    """JAX's own default pool (75% of a GPU) is smaller than the share `lm.plan` lets a layout
    fill: importing meshlm sets the pool (read back through the function jaxlib's GPU client takes
    its options from; no GPU needed), unless the user chose one under either of its two names."""
    probe = ("import lm, os; from jaxlib import xla_client; "
             "print(xla_client.generate_pjrt_gpu_plugin_options().get('memory_fraction'), os.environ.get('XLA_CLIENT_MEM_FRACTION'))")

    def pool(**chosen):
        env = {k: v for k, v in os.environ.items() if not k.endswith("MEM_FRACTION")}
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**env, **chosen}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    assert pool() == [str(lm.GPU_MEMORY_FRACTION)] * 2 and lm.GPU_MEMORY_FRACTION > plan.MEMORY_FRACTION
    assert pool(XLA_PYTHON_CLIENT_MEM_FRACTION="0.6") == ["0.6", "None"]  # the deprecated name, left alone
    assert pool(XLA_CLIENT_MEM_FRACTION="0.5") == ["0.5", "0.5"]
