"""The memory-bound passes of a compiled step, counted per step from its optimized HLO (`count`):
what fp8 adds to a step beside its GEMMs, comparable with the same step in bf16.

Counted over `lm.compiler.kernels.table` (loops' trip counts applied), each kernel as forward or
backward by its `op_name` (JAX names the backward pass `transpose(jvp(...))`):

- `quantising`: kernels that write an fp8 array from wider data (a quantising pass; one may also
  write other results), forward / backward;
- `both_layouts`: the tensors those kernels write twice in fp8, transposed (the two layouts an fp8
  weight's forward and input-gradient GEMMs read), counted per tensor and run;
- `amax_reductions`: kernels whose computation reduces with `maximum` (an fp8 scale's amax, or
  anything else taking a maximum: the loss's logits), forward / backward;
- `fp8_transposes`: kernels that read fp8 data and write it again (a transpose or layout copy of
  an fp8 operand: what an fp8 GEMM needs when its operand was written in the other layout);
- `reduction_fusions`: runs of kernels that reduce (XLA's kInput fusions also transpose: those
  that only transpose are not counted);
- `transpose_bytes`: bytes moved by kernels that only transpose (any type: a transposed copy of
  the float32 weights for an fp8 GEMM's layout is one);
- `hbm_bytes`: bytes read and written by all kernels, and `pass_bytes`: by those other than GEMMs
  and attention (the memory-bound work);
- `moe_dispatch` / `moe_combine`: kernels (runs per step) and bytes of a mixture of experts'
  routing data movement: sorting, permuting and exchanging rows; bringing them back and their
  weighted sum (`lm.model.experts`' name scopes, forward and backward).
"""

from __future__ import annotations

import math
import re

from lm.compiler import kernels
from lm.compiler.hlo import buffers
from lm.compiler.hlo_module import Module

BACKWARD = "transpose(jvp"
_FP8 = re.compile(r"\bf8e\w+\[")
_FP8_ARRAY = re.compile(r"\b(f8e\w+)\[([\d,]*)\](\{[\d,]*\})?")
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")
MOE_SCOPES = ("moe_dispatch", "moe_combine")  # lm.model.experts' (not imported: the compiler package reads programs)


def _fp8(types: str) -> bool:
    return bool(_FP8.search(types))


def _both_layouts(types: str) -> int:
    """How many tensors a kernel writes in two fp8 layouts: its fp8 results of one type and size
    laid out apart (dims permuted, or the same dims in another layout) are one tensor's copies for
    two GEMMs; copies alike are tensors of their own (a norm's output quantised for each site that
    reads it, under each one's scale)."""
    copies: dict[tuple, list] = {}
    for t, dims, layout in _FP8_ARRAY.findall(types):
        copies.setdefault((t, math.prod(int(d) for d in dims.split(",") if d)), []).append((dims, layout))
    return sum(len(c) // len(set(c)) for c in copies.values() if len(set(c)) > 1)


def _reduces(module: Module, computation: str, with_max: bool, seen: frozenset = frozenset()) -> bool:
    """Whether `computation` (or one it calls) reduces: at all, or `with_max` with `maximum`."""
    for row in module.bodies.get(computation, []):
        if row.op in ("reduce", "reduce-window") and (fn := _TO_APPLY.search(row.rest)):
            if not with_max or "maximum" in {r.op for r in module.bodies.get(fn.group(1), [])}:
                return True
        if row.op in ("reduce", "reduce-window"):
            continue
        if any(_reduces(module, c, with_max, seen | {computation}) for c in set(row.called) - seen - {computation}):
            return True
    return False


def count(hlo: str) -> dict:
    module = Module(hlo)
    rows = {(c, r.name): r for c, body in module.bodies.items() for r in body}
    out = {"quantising": {"forward": 0, "backward": 0}, "both_layouts": 0, "amax_reductions": {"forward": 0, "backward": 0},
           "fp8_transposes": 0, "reduction_fusions": 0, "transpose_bytes": 0.0, "hbm_bytes": 0.0, "pass_bytes": 0.0,
           **{scope: {"kernels": 0, "bytes": 0.0} for scope in MOE_SCOPES}}
    for k in kernels.table(hlo):
        i = rows[(k.computation, k.name)]
        out["hbm_bytes"] += k.count * k.bytes
        if k.kind in ("gemm", "gemm_fp8", "grouped_gemm", "attention"):
            continue
        out["pass_bytes"] += k.count * k.bytes
        for scope in (s for s in MOE_SCOPES if f"/{s}/" in i.rest):
            out[scope]["kernels"] += k.count
            out[scope]["bytes"] += k.count * k.bytes
        out["transpose_bytes"] += k.count * k.bytes if k.kind == "transpose" else 0
        reduces = bool(i.called) and _reduces(module, i.called[0], with_max=False)
        out["reduction_fusions"] += k.count if reduces else 0
        direction = "backward" if BACKWARD in i.rest else "forward"
        reads_fp8 = any(_fp8(module.types.get(o, "")) for o in i.operands)
        reads_wider = any(math.prod(d) > 1 for o in i.operands for t, d in buffers(module.types.get(o, "")) if not t.startswith("f8"))
        if _fp8(i.type):
            if reads_fp8 and k.kind in ("transpose", "copy"):
                out["fp8_transposes"] += k.count
            elif reads_wider and not reads_fp8:  # (not the zero fill of a buffer)
                out["quantising"][direction] += k.count
                out["both_layouts"] += k.count * _both_layouts(i.type)
        if reduces and _reduces(module, i.called[0], with_max=True):
            out["amax_reductions"][direction] += k.count
    return out


def describe(c: dict) -> str:
    q, a = c["quantising"], c["amax_reductions"]
    line = (f"memory-bound passes per step: {c['reduction_fusions']} reduction fusions, {c['pass_bytes'] / 1e9:.2f} GB "
            f"of {c['hbm_bytes'] / 1e9:.2f} GB HBM traffic ({c['transpose_bytes'] / 1e9:.2f} GB transposing)")
    if moved := [f"{c[s]['kernels']} {s.removeprefix('moe_')} kernels {c[s]['bytes'] / 1e9:.2f} GB" for s in MOE_SCOPES if c[s]["kernels"]]:
        line += "; experts' routing: " + ", ".join(moved)
    if q["forward"] + q["backward"]:
        line += (f"; fp8: {q['forward']} + {q['backward']} quantising (forward + backward; {c['both_layouts']} tensors "
                 f"written in both layouts), {a['forward']} + {a['backward']} max-reductions, {c['fp8_transposes']} transposes of fp8 data")
    return line
