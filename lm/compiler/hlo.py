"""Reading XLA's optimized HLO text: what a compiled program really runs.

`gemms` lists every matrix multiply (a `dot` inside a GEMM fusion, or a cuBLAS / cuBLASLt call)
with its operand, accumulation and result element types; `custom_calls` and `collectives` count
what a program calls and communicates, `overlapped_collectives` which collectives the schedule
runs beside compute, `collective_traffic` the bytes they move in one step (the cost model's
check). Used by the GPU readiness checks (`tests/test_gpu_compile.py`),
`lm.layout --target`'s report and `lm.plan --verify`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from sharding.conditions import share_of

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?([a-z0-9]+)\[[^\]]*\]")
_PARAMETER = re.compile(r"([\w.\-]+):\s*\(?([a-z0-9]+)\[")
_CALL = re.compile(r"=\s*\(?([a-z0-9]+)\[[^=]*?\s(dot|custom-call)\(([^)]*)\)")
# (ragged-all-to-all: the rows it moves are data-dependent; counted as instructions, not bytes.)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")


class Gemm(NamedTuple):
    lhs: str  # element type, e.g. bf16, f8e4m3fn
    rhs: str
    out: str
    accumulation: str  # the dot algorithm's accumulation type where one is named, else `out`
    kind: str  # dot (in a fusion) or the custom-call target
    computation: str
    op_name: str  # the JAX operation it came from (metadata), e.g. .../btd,dhk->bthk/dot_general


def computations(hlo: str) -> list[tuple[str, str, list[str]]]:
    """(name, header, body lines) of each computation in the module."""
    out, name, header, body = [], None, "", []
    for line in hlo.splitlines():
        if line and not line[0].isspace() and "{" in line and ("(" in line or line.startswith("ENTRY")):
            if name is not None:
                out.append((name, header, body))
            header = line
            name = line.replace("ENTRY", "").split("(")[0].strip().lstrip("%").split()[0]
            body = []
        elif name is not None:
            body.append(line)
    if name is not None:
        out.append((name, header, body))
    return out


def gemms(hlo: str) -> list[Gemm]:
    found = []
    for name, header, body in computations(hlo):
        types = dict(_PARAMETER.findall(header.split("->")[0]))
        for line in body:
            m = _INSTRUCTION.match(line)
            if m:
                types[m.group(1)] = m.group(2)
        for line in body:
            m = _CALL.search(line)
            if not m:
                continue
            out_type, op, operands = m.groups()
            names = [o.strip().split()[-1].lstrip("%") for o in operands.split(",") if o.strip()]
            if op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                if not target or "matmul" not in target.group(1) and "gemm" not in target.group(1):
                    continue
                kind = target.group(1)
            else:
                kind = "dot"
            if len(names) >= 2:
                op_name = re.search(r'op_name="([^"]*)"', line)
                algorithm = re.search(r"algorithm=dot_[a-z0-9]+_[a-z0-9]+_([a-z0-9]+)", line)
                accumulation = algorithm.group(1) if algorithm else out_type
                found.append(Gemm(types.get(names[0], "?"), types.get(names[1], "?"), out_type, accumulation, kind, name,
                                  op_name.group(1) if op_name else ""))
    return found


def summary(hlo: str) -> dict:
    """What a compiled program runs, as plain data: GEMM operand types, custom calls, collectives."""
    return {
        "gemm_operand_types": dict(Counter(f"{g.lhs} x {g.rhs} -> {g.out}" + (f" (accumulating {g.accumulation})" if g.accumulation != g.out else "") for g in gemms(hlo))),
        "custom_calls": dict(custom_calls(hlo)),
        "collectives": dict(collectives(hlo)),
        "collectives_overlapped": dict(overlapped_collectives(hlo)),
        "collective_bytes": {f"{op} over {n}": b for (op, n), b in collective_traffic(hlo).items()},
    }


def save(hlo: str, directory: str) -> Path:
    """Writes a train step's optimized HLO as DIRECTORY/train_step.hlo.txt."""
    path = Path(directory) / "train_step.hlo.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hlo)
    return path


def custom_calls(hlo: str) -> Counter:
    return Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))


def collectives(hlo: str) -> Counter:
    """How many of each collective the program runs (async `-start` forms counted once)."""
    return Counter(m for m in re.findall(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo))


_ASYNC_START = re.compile(r"%([\w.\-]+)\s*=.*?\s(" + "|".join(COLLECTIVES) + r")-start\(")
_ASYNC_DONE = re.compile(r"\s(?:" + "|".join(COLLECTIVES) + r")-done\(%([\w.\-]+)")
# The long kernels a collective can hide behind: GEMMs (cuBLAS, cuBLASLt, GEMM fusions, Pallas
# Mosaic GPU kernels: meshlm's grouped GEMMs) and cuDNN calls (attention), not the short
# elementwise fusions around them.
_HEAVY_KERNEL = re.compile(r'custom_call_target="(?:__cublas|__cudnn|mosaic_gpu)|kind=kCustom.*(?:gemm|triton)|\s(?:dot|convolution)\(')


def overlapped_collectives(hlo: str) -> Counter:
    """Per collective, how many asynchronous ones have a GEMM or cuDNN call scheduled between
    their start and done: the ones the latency-hiding scheduler overlaps with compute. In a
    scheduled module each computation's text is its order of execution, so a synchronous
    collective, or a start with its done next to it, is exposed. (Counted per instruction: one
    in a loop body runs once per iteration.)"""
    overlapped = Counter()
    for _, _, body in computations(hlo):
        in_flight = {}  # start's name -> [collective, kernels seen since]
        for line in body:
            if start := _ASYNC_START.search(line):
                in_flight[start.group(1)] = [start.group(2), 0]
            elif done := _ASYNC_DONE.search(line):
                op, kernels = in_flight.pop(done.group(1), ("", 0))
                if op and kernels:
                    overlapped[op] += 1
            elif _HEAVY_KERNEL.search(line):
                for pending in in_flight.values():
                    pending[1] += 1
    return overlapped


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}
_BUFFER = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s(all-gather|reduce-scatter|all-reduce|all-to-all)(-start)?\(")


def buffers(types: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, shape) of each array in an HLO type: one array, or a tuple of them."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _BUFFER.findall(types)]


def buffer_bytes(types: str) -> list[int]:
    return [_BYTES[t] * math.prod(dims) for t, dims in buffers(types)]


def _group_size(line: str) -> int:
    """Devices in each replica group of a collective (0: not stated)."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\S+\))?\s*\{([^}]*)\}", line):  # named mesh axes
        sizes = {k.strip(" '"): int(v) for k, v in (pair.split("=") for pair in m.group(1).split(","))}
        return math.prod(sizes[a.strip(" '")] for a in m.group(2).split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):  # iota: [groups, size]
        return int(m.group(1))
    if m := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
        return len(m.group(1).split(","))
    return 0


def _collective_bytes(line: str) -> tuple[tuple[str, int], int] | None:
    """((op, replica group size), bytes) that one instruction moves on each device, if it is an
    all-gather (its result), reduce-scatter (its operand), all-reduce or all-to-all (its result);
    combined collectives count all their buffers."""
    if not (m := _COLLECTIVE.match(line)):
        return None
    types, op, start = m.groups()
    sizes = buffer_bytes(types)
    # Asynchronous, the result holds the operands and the results; XLA 0.10's all-reduce-start
    # held only its results, later XLAs' hold both, as `((operands...), results...)`.
    if start and (op != "all-reduce" or types.startswith("((")):
        half = len(sizes) // 2
        sizes = sizes[:half] if op == "reduce-scatter" else sizes[half:]
    n = _group_size(line)
    if op == "reduce-scatter" and not start:  # the result is one share of the operand
        sizes = [b * n for b in sizes]
    return (op, n), sum(sizes)


def true_and_false(text: str, branches: list[str]) -> tuple[str, str]:
    """A two-way conditional's true and false computations, from its instruction's text: named
    so, or by index (`lax.cond`'s index is its predicate, its branches false then true)."""
    true = re.search(r"true_computation=%?([\w.\-]+)", text)
    false = re.search(r"false_computation=%?([\w.\-]+)", text)
    return (true.group(1), false.group(1)) if true and false else (branches[1], branches[0])


def collective_traffic(hlo: str) -> Counter:
    """{(op, replica group size): bytes per step}: what each all-gather, reduce-scatter and
    all-reduce moves on each device (`_collective_bytes`), a while loop's body counted its known
    trip count times, called computations (fusions, async wrappers) once per call, and of a
    conditional's branches the costliest, as if it ran every time: an upper bound, exact where
    one branch is the rule (`optax.apply_if_finite`'s update); a condition named with its share
    of true runs (`sharding.conditions`: the pipelines' ends) each branch by its share."""
    module = {name: (header, body) for name, header, body in computations(hlo)}
    memo: dict[str, Counter] = {}

    def traffic(name: str) -> Counter:
        if name in memo:
            return memo[name]
        total = Counter()
        for line in module.get(name, ("", []))[1]:
            if found := _collective_bytes(line):
                total[found[0]] += found[1]
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line) if " while(" in line else None
            for callee in re.findall(r"(?:body|calls|to_apply)=%?([\w.\-]+)", line):
                times = int(trips.group(1)) if trips and f"body=%{callee}" in line else 1
                for key, b in traffic(callee).items():
                    total[key] += times * b
            listed = re.search(r"branch_computations=\{([^}]*)\}", line)
            branches = re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
            share = share_of(line) if " conditional(" in line and len(branches) == 2 else None
            if share is not None:  # each branch its share of the runs (sharding.conditions)
                taken, other = true_and_false(line, branches)
                for key, b in traffic(taken).items():
                    total[key] += share * b
                for key, b in traffic(other).items():
                    total[key] += (1 - share) * b
            elif branches:
                total += max((traffic(b) for b in branches), key=lambda t: sum(t.values()))
        memo[name] = total
        return total

    entry = next(name for name, (header, _) in module.items() if header.startswith("ENTRY"))
    return traffic(entry)


def collective_buffers(hlo: str, op: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, shape) of every result of `op` (e.g. all-gather) in an HLO module's text;
    for the asynchronous form (`op-start`, whose result is a tuple of operands and results,
    possibly combined from many collectives) every buffer in that tuple."""
    buffers = []
    for line in hlo.splitlines():
        m = re.search(rf"=\s*(.*?)\s{op}(?:-start)?\(", line)
        if m:
            buffers += [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", m.group(1))]
    return buffers


def collective_shapes(hlo: str, op: str) -> list[tuple[int, ...]]:
    """The shapes of `collective_buffers`."""
    return [shape for _, shape in collective_buffers(hlo, op)]


def loop_bodies(hlo: str) -> dict[str, str]:
    """{computation name: its text} of every while-loop body (a `lax.scan` over layers is one)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    return {name: "\n".join([header, *body]) for name, header, body in computations(hlo) if name in bodies}
