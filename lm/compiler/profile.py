"""Where a compiled step's time goes: a JAX profiler trace of a few steps, summed per HLO
instruction and per kind of work (GEMMs, attention, elementwise, reductions, collectives...).

`lm.bench --profile=DIR` (and the GPU run kit) traces steps with `jax.profiler.trace`, then
`summary` reads the Perfetto trace it wrote and the step's optimized HLO: each event that
names an instruction of the step's module (`args.hlo_op`; on a GPU the kernels on the device's
streams, on a CPU the thunks) is added to that instruction's time, and the instruction's kind is
read from the HLO. Streams run side by side, so the kinds' sum can exceed the step's wall time.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

from lm.compiler.hlo import COLLECTIVES, computations

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")


def kind(op: str, rest: str, fused_ops: set[str] = frozenset()) -> str:
    """The kind of work one optimized-HLO instruction does, from its opcode and attributes (and,
    for a fusion, the opcodes of the computation it calls)."""
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    if op == "custom-call" and target:
        name = target.group(1)
        return "gemm" if "matmul" in name or "gemm" in name else "attention" if "fmha" in name else "custom-call"
    if op == "dot":
        return "gemm"
    if op == "fusion":
        if "dot" in fused_ops or "convolution" in fused_ops:
            return "gemm"
        if fused_ops and fused_ops <= {"transpose", "copy", "bitcast", "parameter", "convert"} and "transpose" in fused_ops:
            return "transpose"
        fusion_kind = re.search(r"kind=k(\w+)", rest)
        return {"Loop": "elementwise", "Input": "reduction", "Output": "elementwise"}.get(fusion_kind.group(1) if fusion_kind else "", "fusion")
    if op.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
        return "collective"
    if op in ("copy", "copy-start", "copy-done", "transpose"):
        return "copy"
    if op in ("dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "pad", "gather", "scatter"):
        return "slicing"
    return "other"


def instruction_kinds(hlo: str) -> dict[str, str]:
    """{instruction name: kind} for every instruction of the module."""
    parsed = {name: [m.groups() for m in map(_INSTRUCTION.match, body) if m] for name, _, body in computations(hlo)}
    # The opcodes each computation holds, those of the computations it calls folded in (nested fusions).
    direct = {name: ({op for _, op, _ in rows}, set(re.findall(r"calls=%?([\w.\-]+)", " ".join(r for _, _, r in rows))))
              for name, rows in parsed.items()}

    def opcodes(name: str, seen: frozenset = frozenset()) -> set[str]:
        ops, called = direct.get(name, (set(), set()))
        return ops.union(*(opcodes(c, seen | {name}) for c in called - seen - {name}))

    kinds = {}
    for rows in parsed.values():
        for name, op, rest in rows:
            called = re.search(r"calls=%?([\w.\-]+)", rest) if op == "fusion" else None
            kinds[name] = kind(op, rest, opcodes(called.group(1)) if called else set())
    return kinds


def trace_file(directory: str | Path) -> Path:
    """The newest Perfetto trace `jax.profiler.trace(directory, create_perfetto_trace=True)` wrote."""
    found = sorted(Path(directory).glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}/plugins/profile")
    return found[-1]


def summary(trace: str | Path, hlo: str, steps: int, top: int = 25) -> dict:
    """Per step: the time of each kind of work and of the `top` instructions, in ms, from a trace
    of `steps` runs of the program whose optimized HLO is `hlo`."""
    events = json.loads(gzip.open(trace).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    kinds = instruction_kinds(hlo)
    timed = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_op") in kinds]
    # A GPU's kernels are on its device's streams; the host's events for them (launches) are not work.
    on_device = [e for e in timed if processes.get(e["pid"], "").startswith("/device:")]
    timed = on_device or timed
    per_op, calls = defaultdict(float), Counter()
    for e in timed:
        per_op[e["args"]["hlo_op"]] += e["dur"] / 1e3 / steps  # us -> ms per step
        calls[e["args"]["hlo_op"]] += 1
    by_kind = defaultdict(float)
    for op, ms in per_op.items():
        by_kind[kinds[op]] += ms
    ranked = sorted(per_op.items(), key=lambda item: -item[1])[:top]
    # What the device ran that names no instruction of the program (a trace format this reader
    # does not know, say): the largest, so a report shows it rather than leaving it out.
    unnamed = Counter()
    for e in events:
        if e.get("ph") == "X" and processes.get(e["pid"], "").startswith("/device:") and e.get("args", {}).get("hlo_op") not in kinds:
            unnamed[e["name"]] += e.get("dur", 0) / 1e3 / steps
    return {
        "steps": steps,
        "source": "device" if on_device else "host",
        "kernel_ms_per_step": round(sum(per_op.values()), 3),
        "by_kind_ms_per_step": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda item: -item[1])},
        "top": [{"op": op, "kind": kinds[op], "ms_per_step": round(ms, 3), "calls_per_step": calls[op] / steps} for op, ms in ranked],
        "device_unattributed_ms_per_step": {name: round(ms, 3) for name, ms in unnamed.most_common(10)},
    }
