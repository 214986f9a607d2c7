"""lm.compiler.profile: a trace's kernel time attributed to the step's HLO instructions and their kinds
(on a GPU-shaped module and trace written here; `tests/test_cli.py` profiles a real CPU step)."""

import gzip
import json

import pytest
from conftest import ROOT

from lm.compiler import profile

# An optimized GPU module in miniature, in the forms the H100's compiler printed (2026-11-26).
HLO = """HloModule jit__train_step

%gemm_fusion_dot.1_computation (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  %dot.1 = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %convert.1 = bf16[64,16]{1,0} convert(%dot.1)
}

%fused_convert (p: f32[64,16]) -> bf16[64,16] {
  %p = f32[64,16]{1,0} parameter(0)
  ROOT %convert.2 = bf16[64,16]{1,0} convert(%p)
}

%fused_reduce (p: bf16[64,16], c: f32[]) -> f32[] {
  %p = bf16[64,16]{1,0} parameter(0)
  %c = f32[] parameter(1)
  %convert.3 = f32[64,16]{1,0} convert(%p)
  ROOT %reduce.1 = f32[] reduce(%convert.3, %c), dimensions={0,1}, to_apply=%max
}

%wrapped_transpose_computation (p: f8e5m2[64,16]) -> f8e5m2[16,64] {
  %p = f8e5m2[64,16]{1,0} parameter(0)
  ROOT %transpose.1 = f8e5m2[16,64]{1,0} transpose(%p), dimensions={1,0}
}

ENTRY %main (x: f8e4m3fn[64,32], w: f8e4m3fn[32,16], g: f8e5m2[64,16], c: f32[]) -> bf16[64,16] {
  %x = f8e4m3fn[64,32]{1,0} parameter(0)
  %w = f8e4m3fn[32,16]{1,0} parameter(1)
  %g = f8e5m2[64,16]{1,0} parameter(2)
  %c = f32[] parameter(3)
  %gemm_fusion_dot.1 = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %cublas-gemm.1 = (f32[64,16]{1,0}, s8[1024]{0}) custom-call(%x, %w, %c, %c), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.1 = f32[64,16]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %wrapped_convert = bf16[64,16]{1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_convert
  %input_reduce_fusion = f32[] fusion(%wrapped_convert, %c), kind=kInput, calls=%fused_reduce
  %wrapped_transpose = f8e5m2[16,64]{1,0} fusion(%g), kind=kInput, calls=%wrapped_transpose_computation
  %fmha = (bf16[64,16]{1,0}, u8[0]{0}) custom-call(%wrapped_convert), custom_call_target="__cudnn$fmhaSoftmax"
  %all-gather-start = bf16[128,16]{1,0} all-gather-start(%wrapped_convert), dimensions={0}
  ROOT %all-gather-done = bf16[128,16]{1,0} all-gather-done(%all-gather-start)
}
"""


def test_each_instruction_gets_the_kind_of_work_it_does():
    kinds = profile.instruction_kinds(HLO)
    assert {op: kinds[op] for op in ("gemm_fusion_dot.1", "cublas-gemm.1", "wrapped_convert", "input_reduce_fusion",
                                     "wrapped_transpose", "fmha", "all-gather-start", "all-gather-done")} == {
        "gemm_fusion_dot.1": "gemm", "cublas-gemm.1": "gemm", "wrapped_convert": "elementwise", "input_reduce_fusion": "reduction",
        "wrapped_transpose": "transpose", "fmha": "attention", "all-gather-start": "collective", "all-gather-done": "collective"}


def write_trace(path, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def kernel(pid, op, dur_us, name="sm90_xmma_gemm"):
    return {"ph": "X", "pid": pid, "tid": 7, "ts": 0, "dur": dur_us, "name": name, "args": {"hlo_op": op, "hlo_module": "jit__train_step"}}


def test_device_kernels_are_summed_per_step_by_instruction_and_kind(tmp_path):
    trace = tmp_path / "perfetto_trace.json.gz"
    write_trace(trace, [
        *(kernel(2, "cublas-gemm.1", 3000) for _ in range(2)),  # two steps
        *(kernel(2, "wrapped_convert", 1000, "loop_convert_fusion") for _ in range(2)),
        kernel(2, "fmha", 4000, "cudnn_flash"),  # one call over the two steps
        kernel(1, "cublas-gemm.1", 99_000, "launch"),  # the host's side of a kernel: not device time
        {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 500, "name": "memcpy", "args": {}},
    ])
    s = profile.summary(trace, HLO, steps=2)
    assert s["source"] == "device"
    assert s["by_kind_ms_per_step"] == {"gemm": 3.0, "attention": 2.0, "elementwise": 1.0}
    assert s["kernel_ms_per_step"] == pytest.approx(6.0)
    assert s["top"][0] == {"op": "cublas-gemm.1", "kind": "gemm", "ms_per_step": 3.0, "calls_per_step": 1.0}
    assert s["device_unattributed_ms_per_step"] == {"memcpy": 0.25}


def test_without_device_events_the_hosts_are_summed(tmp_path):
    trace = tmp_path / "perfetto_trace.json.gz"
    write_trace(trace, [kernel(1, "input_reduce_fusion", 2000, "thunk")])
    s = profile.summary(trace, HLO, steps=1)
    assert s["source"] == "host" and s["by_kind_ms_per_step"] == {"reduction": 2.0}


def test_a_missing_trace_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="plugins/profile"):
        profile.trace_file(tmp_path)


# A real GPU step: `llama_1b` bf16 on one H200 (benchmarks/gpu.py, 2026-11-27), three steps traced.
H200 = ROOT / "benchmarks" / "results" / "h200_2026-11-27"


def stored_case(name):
    hlo = gzip.open(H200 / name / "train_step.hlo.txt.gz").read().decode()
    events = json.loads(gzip.open(H200 / name / "trace.json.gz").read())["traceEvents"]
    step_s = json.loads((H200.parent / "h200_2026-11-27.json").read_text())[name]["step_time_s"]
    return hlo, events, step_s


def test_a_real_gpu_trace_of_cuda_graphs_is_attributed_kernel_by_kernel():
    """XLA runs the step as CUDA graphs: every kernel's `hlo_op` names its command buffer, fusions'
    kernels are named after (one of) their fusions, cuBLAS's and cuDNN's after their libraries.
    Each kernel still lands on an instruction of its kind, and the step's time is all accounted for."""
    hlo, events, step_s = stored_case("bf16_cudnn_b8")
    s = profile.summary(H200 / "bf16_cudnn_b8" / "trace.json.gz", hlo, steps=3)
    assert s["source"] == "device"
    assert s["kernel_ms_per_step"] == pytest.approx(1000 * step_s, rel=0.03)  # one stream: kernels fill the step
    assert sum(s["device_unattributed_ms_per_step"].values()) < 1.0  # of 261 ms: a few memcpys
    assert s["by_kind_ms_per_step"]["gemm"] > 0.5 * 1000 * step_s and s["by_kind_ms_per_step"]["attention"] > 20
    kinds = profile.instruction_kinds(hlo)
    device = [e for e in events if e.get("ph") == "X" and e["pid"] == 1]
    placed = profile.attribute(device, hlo)
    libraries = {"cublas": "gemm", "cudnn": "attention"}
    for op, e in placed:  # every cuBLAS kernel on a GEMM, every cuDNN kernel on an attention call
        library = profile._library(e["name"])
        if library and not profile._HELPER.search(e["name"]) and not e["name"].startswith("gemm_fusion"):
            assert kinds[op] == libraries[library], (e["name"], op)
    # One backward attention call per layer and step (16 layers).
    backward = [t for t in s["top"] if t["op"].startswith("dot_product_attention_bwd")]
    assert [t["calls_per_step"] for t in backward] == [16.0]
    # Negative control: without the graphs' node numbers (kernel names alone), the library
    # kernels, most of the step, are not placed.
    unnumbered = [{**e, "args": {k: v for k, v in e["args"].items() if not k.startswith("cuda_graph")}} for e in device]
    lost = sum(e["dur"] for op, e in profile.attribute(unnumbered, hlo) if op is None) / 3e3
    assert lost > 0.5 * 1000 * step_s
