"""An optimized HLO module read as computations of instructions (`Module`): each instruction's
name, result type, opcode and the rest of its line, what it calls, and the kind of kernel it
launches (`kind`). `lm.compiler.kernels` costs them; `lm.compiler.profile` names them.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from lm.compiler.hlo import COLLECTIVES, buffers, computations

_LINE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
# Instructions that launch no kernel of their own; loops and branches run their computations'.
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "add-dependency",
             "opt-barrier", "partition-id", "replica-id"}
CONTROL = {"while", "conditional", "call"}
# meshlm's kernels over an expert buffer's rows (lm.model.grouped_gemm, lm.model.swiglu_rows),
# named in a Pallas call's op_name.
ROW_KERNELS = re.compile(r'op_name="[^"]*/(grouped_gemm_rows|grouped_gemm_weight_grad|swiglu_rows)/')


class Instruction(NamedTuple):
    name: str
    type: str
    op: str
    rest: str

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.rest.split(")")[0])

    @property
    def called(self) -> list[str]:
        return re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", self.rest)


def kind(op: str, rest: str, fused_ops: set[str] = frozenset()) -> str:
    """The kind of work one optimized-HLO instruction does, from its opcode and attributes (and,
    for a fusion, the opcodes of the computation it calls)."""
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    if op == "custom-call" and target:
        name = target.group(1)
        if name.startswith("mosaic_gpu") and (row_kernel := ROW_KERNELS.search(rest)):
            return "elementwise" if row_kernel.group(1) == "swiglu_rows" else "grouped_gemm"
        return "gemm" if "matmul" in name or "gemm" in name else "attention" if "fmha" in name else "custom-call"
    if op == "dot":
        return "gemm"
    if op in ("fusion", "fusion-start"):
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


class Module:
    """An optimized HLO module's computations, instructions and result types."""

    def __init__(self, hlo: str):
        self.bodies: dict[str, list[Instruction]] = {}
        self.entry = ""
        for name, header, body in computations(hlo):
            self.bodies[name] = [Instruction(*m.groups()) for m in map(_LINE.match, body) if m]
            if header.startswith("ENTRY"):
                self.entry = name
        self.types = {i.name: i.type for rows in self.bodies.values() for i in rows}
        self._ops: dict[str, set[str]] = {}

    def opcodes(self, computation: str, seen: frozenset = frozenset()) -> set[str]:
        """The opcodes a computation holds, those of the computations it calls folded in."""
        if computation not in self._ops:
            rows = self.bodies.get(computation, [])
            ops = {i.op for i in rows}
            for i in rows:
                for callee in set(i.called) - seen - {computation}:
                    ops |= self.opcodes(callee, seen | {computation})
            self._ops[computation] = ops
        return self._ops[computation]

    def kind(self, i: Instruction, fp8_apart: bool = True) -> str:
        fused = self.opcodes(i.called[0]) if i.op in ("fusion", "fusion-start") and i.called else set()
        k = kind(i.op, i.rest, fused)
        return "gemm_fp8" if fp8_apart and k == "gemm" and self.fp8_gemm(i) else k

    def fp8_gemm(self, i: Instruction) -> bool:
        if i.op == "custom-call":
            return "$f8" in i.rest or any(self.types.get(o, "").startswith("f8") for o in i.operands[:2])
        dot = self.dot_of(i)
        return dot is not None and any(self.types.get(o, "").lstrip("(").startswith("f8") for o in dot.operands[:2])

    def dot_of(self, i: Instruction) -> Instruction | None:
        for callee in i.called:
            for row in self.bodies.get(callee, []):
                if row.op == "dot":
                    return row
                if row.called and (found := self.dot_of(row)):
                    return found
        return None


def dims_of(type_: str) -> tuple[int, ...]:
    """The shape of a type's (first) array."""
    found = buffers(type_)
    return found[0][1] if found else ()


def backend_config(rest: str) -> dict:
    """An instruction's `backend_config` JSON (its spacing and key order differ between XLA
    versions), {} where it has none."""
    at = rest.find("backend_config=")
    if at < 0:
        return {}
    try:
        return json.JSONDecoder().raw_decode(rest[at + len("backend_config="):])[0]
    except ValueError:
        return {}


def config_value(config: dict, key: str):
    """The first value under `key` anywhere in a nested backend config."""
    if key in config:
        return config[key]
    for value in config.values():
        if isinstance(value, dict) and (found := config_value(value, key)) is not None:
            return found
    return None
