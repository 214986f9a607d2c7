"""Where a compiled step's time goes: a JAX profiler trace of a few steps, summed per HLO
instruction and per kind of work (GEMMs, attention, elementwise, reductions, collectives...).

`lm.bench --profile=DIR` (and the GPU run kit) traces steps with `jax.profiler.trace`, then
`summary` reads the Perfetto trace it wrote and the step's optimized HLO: each kernel on the
device's streams (on a CPU, each thunk) is added to the time of the instruction it ran for, and
the instruction's kind is read from the HLO. On a GPU, XLA runs the step as CUDA graphs, whose
kernels name only their graph: `attribute` places them by graph node and kernel name (see there).
Streams run side by side, so the kinds' sum can exceed the step's wall time.

`stored` reads a case as the GPU run kit stores it (`benchmarks/results/<device>_<date>/CASE/`:
`train_step.hlo.txt(.gz)` and `trace.json.gz`); `python -m lm.calibrate --step_time=DIR` prints each
case's time by kind beside the step-time model's fit.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

from lm.compiler.hlo_module import NO_KERNEL, Module


def instruction_kinds(hlo: str) -> dict[str, str]:
    """{instruction name: kind} for every instruction of the module (`lm.compiler.hlo_module.kind`)."""
    module = Module(hlo)
    return {i.name: module.kind(i, fp8_apart=False) for rows in module.bodies.values() for i in rows}


def trace_file(directory: str | Path) -> Path:
    """The newest Perfetto trace `jax.profiler.trace(directory, create_perfetto_trace=True)` wrote."""
    found = sorted(Path(directory).glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}/plugins/profile")
    return found[-1]


# Kernels that serve a library call without being its main kernel (not counted as calls):
# cuBLAS's workspace memsets, cuDNN's preprocessing, copies of results.
_HELPER = re.compile(r"^(memset|memcpy)|compute_dot_do_o|convert_dq|reduce_head|splitk", re.IGNORECASE)


# The library a kernel comes from, by its name, and the library an instruction calls.
_LIBRARY_KERNEL = {"cublas": re.compile(r"nvjet|gemm|xmma|cutlass|cublas", re.IGNORECASE),
                   "cudnn": re.compile(r"cudnn|sdpa|fmha", re.IGNORECASE)}


def _library(text: str) -> str | None:
    return next((lib for lib, pattern in _LIBRARY_KERNEL.items() if pattern.search(text)), None)


def schedule(module: Module) -> dict[str, list[tuple[str, str | None]]]:
    """Each computation's instructions that become commands (kernels, library calls, loops; an
    asynchronous pair is one, its start), in the order of the scheduled HLO, each with the library
    it calls (cublas, cudnn or None)."""
    return {comp: [(i.name, _library(target.group(1)) if (target := re.search(r'custom_call_target="([^"]+)"', i.rest)) else None)
                   for i in rows if i.op not in NO_KERNEL and not i.op.endswith("-done")]
            for comp, rows in module.bodies.items()}


def _node(e: dict) -> int | None:
    node = e.get("args", {}).get("cuda_graph_node_id")
    return None if node is None else int(node) & 0xFFFFFFFF  # the graph's id is in the high bits


def attribute(events: list[dict], hlo: str) -> list[tuple[str | None, dict]]:
    """(instruction, event) for each device kernel.

    A kernel outside a CUDA graph names its instruction (`args.hlo_op`). Inside one (XLA's command
    buffers, where `hlo_op` names the buffer) the graph's node number is the command's position in
    its computation's schedule; which computation is voted by the kernels whose names give their
    fusion (XLA names a fusion's kernel after it, '.' written '_'; identical fusions share one
    kernel, named after one of them: of those, the one nearest the node's position is taken). Library kernels (cuBLAS,
    cuDNN, with their memsets) run in a child graph of the command's node, numbered after the
    parent's nodes: each goes to the call to its library nearest the node after the last parent
    node that ran, among those not yet run in this run of the graph. The kinds' totals are exact;
    per instruction, a library kernel can land on a neighbouring call of its library. None where
    nothing matches."""
    module = Module(hlo)
    order = schedule(module)
    where = {name: (comp, i) for comp, commands in order.items() for i, (name, _) in enumerate(commands)}
    by_kernel_name = {name.replace(".", "_"): name for name in where}
    # Identical fusions share one kernel, named after one of them (`deduplicated_name` on the others).
    sharing: dict[str, list[str]] = defaultdict(list)
    for i in (i for rows in module.bodies.values() for i in rows if i.name in where):
        shared = re.search(r'deduplicated_name="([^"]+)"', i.rest)
        sharing[(shared.group(1) if shared else i.name).replace(".", "_")].append(i.name)
    graphs: dict[str, list[dict]] = defaultdict(list)
    out: list[tuple[str | None, dict]] = []
    for e in events:
        graph = e.get("args", {}).get("cuda_graph_id")
        if graph is not None and _node(e) is not None:
            graphs[graph].append(e)
            continue
        op = e.get("args", {}).get("hlo_op")
        out.append((op if op in where else by_kernel_name.get(e["name"].replace(".", "_")), e))
    for members in graphs.values():
        # Its computation: the one most of its named kernels belong to.
        votes = Counter(where[n][0] for e in members if (n := by_kernel_name.get(e["name"].replace(".", "_"))))
        if not votes:
            out.extend((None, e) for e in members)
            continue
        comp = votes.most_common(1)[0][0]
        commands = order[comp]
        # Node numbers and schedule positions differ by an offset that moves along the schedule
        # (a computation split into several buffers numbers each from 0; some instructions become no
        # command): each named kernel of this computation sets it for the kernels after it.
        offset, last = 0, -1
        ran: set[int] = set()  # the library calls placed in this run of the graph
        for e in sorted(members, key=lambda e: e["ts"]):
            node, name = _node(e), by_kernel_name.get(e["name"].replace(".", "_"))
            # Of the fusions sharing this kernel, the one of this computation nearest its node.
            mine = [n for n in sharing.get(e["name"].replace(".", "_"), []) if where[n][0] == comp]
            if mine:
                name = min(mine, key=lambda n: abs(where[n][1] - (node + offset)))
            if name is not None and where[name][0] == comp:
                if node < last:  # the graph's next run
                    ran.clear()
                offset, last = where[name][1] - node, node
                out.append((name, e))
                continue
            library, helper = _library(e["name"]), bool(_HELPER.search(e["name"]))
            if library is None and not helper and node < len(commands) - offset or node == last:
                last = node  # a parent node whose kernel is shared with another computation's fusion
                index = node + offset
            else:  # a library's kernel, in the child graph of the command after the last one run:
                # the call to its library nearest there not yet run (the offset can be a command or
                # two off; adjacent calls, such as q / k / v projections, each run once)
                guess = last + 1 + offset
                calls = [i for i in range(len(commands)) if commands[i][1] == library] if library else []
                index = min(calls, key=lambda i: (not helper and i in ran, abs(i - guess))) if calls else guess
                if library and not helper:
                    ran.add(index)
            out.append((commands[index][0] if 0 <= index < len(commands) else None, e))
    return out


def summary(trace: str | Path, hlo: str, steps: int, top: int = 25) -> dict:
    """Per step: the time of each kind of work and of the `top` instructions, in ms, from a trace
    of `steps` runs of the program whose optimized HLO is `hlo`."""
    events = json.loads(gzip.open(trace).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    kinds = instruction_kinds(hlo)
    on_device = sorted((e for e in events if e.get("ph") == "X" and processes.get(e["pid"], "").startswith("/device:")),
                       key=lambda e: (e["pid"], e.get("tid"), e["ts"]))
    # A GPU's kernels are on its device's streams; the host's events for them (launches) are not
    # work. On a CPU the host's thunks name their instructions.
    if on_device:
        timed = attribute(on_device, hlo)
    else:
        timed = [(e["args"]["hlo_op"], e) for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_op") in kinds]
    per_op, calls, unnamed = defaultdict(float), Counter(), Counter()
    for op, e in timed:
        if op is None:  # a kernel this reader could not place: the largest are shown, not left out
            unnamed[e["name"]] += e.get("dur", 0) / 1e3 / steps
            continue
        per_op[op] += e["dur"] / 1e3 / steps  # us -> ms per step
        if not _HELPER.search(e["name"]):
            calls[op] += 1
    by_kind = defaultdict(float)
    for op, ms in per_op.items():
        by_kind[kinds.get(op, "other")] += ms
    ranked = sorted(per_op.items(), key=lambda item: -item[1])[:top]
    return {
        "steps": steps,
        "source": "device" if on_device else "host",
        "kernel_ms_per_step": round(sum(per_op.values()), 3),
        "by_kind_ms_per_step": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda item: -item[1])},
        "top": [{"op": op, "kind": kinds.get(op, "other"), "ms_per_step": round(ms, 3), "calls_per_step": calls[op] / steps}
                for op, ms in ranked],
        "device_unattributed_ms_per_step": {name: round(ms, 3) for name, ms in unnamed.most_common(10)},
    }


def stored_hlo(directory: Path) -> str:
    """The optimized HLO of a case stored as the GPU run kit keeps it (`train_step.hlo.txt(.gz)`)."""
    for name in ("train_step.hlo.txt", "train_step.hlo.txt.gz"):
        if (directory / name).exists():
            return gzip.open(directory / name).read().decode() if name.endswith(".gz") else (directory / name).read_text()
    raise FileNotFoundError(f"{directory} holds no train_step.hlo.txt(.gz)")


def stored(directory: Path, steps: int = 3, top: int = 25) -> dict:
    """`summary` of a stored case: its HLO and `trace.json.gz` (the GPU run kit traces 3 steps)."""
    if not (directory / "trace.json.gz").exists():
        raise FileNotFoundError(f"{directory} holds no trace.json.gz")
    return summary(directory / "trace.json.gz", stored_hlo(directory), steps, top)
