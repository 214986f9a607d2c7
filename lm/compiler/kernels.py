"""The kernels a compiled step launches, read from its optimized HLO: each with its kind, how often
it runs per step, its FLOPs and the HBM bytes it reads and writes (`table`).

A kernel is an instruction of the entry computation or of a computation it runs (a while loop's
body, its known trip count times; a conditional's costliest branch, weighing FLOPs and bytes, or
each branch its share of the runs where the program names the condition with it, or, where it
names a switch with the sets of branches its runs take across the devices, each run's costliest
of its set: `sharding.conditions`): a fusion, a library call
(cuBLAS / cuBLASLt GEMMs incl. fp8, cuDNN attention), a copy or transpose, a collective. Its bytes
come from the kernel's own operands and results, not its inner ops, except where a fusion reads
a slice of an operand (`dynamic-slice` of a layer's weights out of the stacked ones) or updates
one in place (`dynamic-update-slice`): there the slice's bytes count. FLOPs are counted for
GEMMs (2 M N K from the dot's dimensions), meshlm's grouped GEMMs (2 x the rows they are expected
to hold x K x N: `row_kernel_cost`) and cuDNN attention (4 B H Sq Skv D forward, causal at
half, backward 2.5x forward); other kernels count one FLOP per result element. The times are
`lm.compiler.steptime`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import NamedTuple

from lm.compiler.hlo import buffer_bytes, buffers, true_and_false
from lm.compiler.hlo_module import CONTROL, NO_KERNEL, ROW_KERNELS, Instruction, Module, backend_config, config_value, dims_of
from sharding.conditions import branch_sets, share_of

# Workspace buffers of library calls: scratch, not data the kernel streams.
_WORKSPACE = {"s8", "u8"}
# The rows meshlm's kernels over an expert buffer (`ROW_KERNELS`) are expected to hold (the scope around them).
TILE_TABLE_ARRAYS = 5  # the rows kernel's first operands: lm.model.grouped_gemm_kernels.Tiles' per-tile arrays and count
_EXPECTED_ROWS = re.compile(r'op_name="[^"]*/expected_rows_(\d+)/')
# FLOPs a GPU does in the time it moves one HBM byte (H100: about 990 TFLOP/s over 3.35 TB/s): how a
# conditional's branches are weighed against each other (`table`).
RIDGE = 300.0


class Kernel(NamedTuple):
    name: str
    kind: str  # gemm, gemm_fp8, attention, elementwise, reduction, transpose, copy, collective, ...
    count: float  # runs per step (a fraction of a loop's where a named condition picks its branch's share)
    flops: float  # per run
    bytes: float  # HBM bytes read and written per run
    shape: str  # its result type, for a person reading the table
    computation: str
    head_dim: int = 0  # attention: the query's and key's head width (its efficiency depends on it)
    backward: bool = False  # attention: the gradients' kernel


def gemm_flops(module: Module, i: Instruction) -> float:
    """2 x result elements x contracted size, of a cuBLAS call or a fusion around a dot."""
    if i.op == "custom-call":
        numbers = config_value(backend_config(i.rest), "dot_dimension_numbers") or {}
        lhs = dims_of(module.types.get(i.operands[0], ""))
        contracted = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
        result = dims_of(i.type)
    else:
        dot = module.dot_of(i)
        if dot is None:
            return 0.0
        numbers = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.rest)
        lhs = dims_of(module.types.get(dot.operands[0], ""))
        contracted = [int(d) for d in numbers.group(1).split(",") if d] if numbers else []
        result = dims_of(dot.type)
    k = math.prod(lhs[d] for d in contracted if d < len(lhs)) if lhs else 0
    return 2.0 * math.prod(result) * k


class Attention(NamedTuple):
    flops: float
    head_dim: int
    backward: bool


def attention_cost(module: Module, i: Instruction) -> Attention:
    """cuDNN attention: QK^T and AV, 2 B H Sq Skv D each, causal at half; backward 2.5x forward.
    With its head width D (of the queries and keys) and direction, which its speed depends on."""
    backward = "Backward" in i.rest
    if backward:  # (dq, dk, dv, ...): the gradients have the inputs' shapes
        q, k = (dims for _, dims in buffers(i.type)[:2])
    else:
        q, k = (dims_of(module.types.get(o, "")) for o in i.operands[:2])
    if len(q) != 4 or len(k) != 4:
        return Attention(0.0, 0, backward)
    config = backend_config(i.rest)
    numbers = config_value(config, "bmm1_dot_dimension_numbers") or {}
    batch, contracted = numbers.get("lhs_batch_dimensions", ["0", "1"]), numbers.get("lhs_contracting_dimensions", ["3"])
    b_dim, h_dim, d_dim = int(batch[0]), int(batch[1]), int(contracted[0])
    s_dim = ({0, 1, 2, 3} - {b_dim, h_dim, d_dim}).pop()
    forward = 4.0 * q[b_dim] * q[h_dim] * q[s_dim] * k[s_dim] * q[d_dim]
    if config_value(config, "mask_type") == "CAUSAL":
        forward /= 2
    return Attention(2.5 * forward if backward else forward, q[d_dim], backward)


def row_kernel_cost(module: Module, i: Instruction) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one of meshlm's kernels over an expert buffer, from the rows r it is
    expected to hold (the buffer's where no scope says). A grouped GEMM with contracted width k
    and columns n: 2 r k n, and r rows of its row operand and row result plus every group's
    weights (the rows kernel: [m, k] rows x [g, k, n] weights -> [m, n]; the weight gradient:
    [m, k] and [m, n] rows -> [g, k, n]). SwiGLU's: r rows of each [m, f] operand and result.
    A kernel batched by vmap (a pipeline's stages) has leading batch axes on every array: it
    does each batch entry's work."""
    kernel = ROW_KERNELS.search(i.rest).group(1)
    expected = _EXPECTED_ROWS.search(i.rest)
    result = dims_of(i.type) if kernel != "swiglu_rows" else buffers(i.type)[0][1]
    batch = result[: len(result) - (3 if kernel == "grouped_gemm_weight_grad" else 2)]
    strip = lambda arrays: [(dtype, dims[len(batch):]) for dtype, dims in arrays]  # noqa: E731
    result, runs = result[len(batch):], math.prod(batch)
    operands = strip(buffers(module.types.get(o, ""))[0] for o in i.operands)
    rows_in = lambda lhs: min(int(expected.group(1)), lhs[0]) if expected else lhs[0]  # noqa: E731
    if kernel == "swiglu_rows":
        arrays = operands[1:] + strip(buffers(i.type))
        rows = rows_in(arrays[0][1])
        elements = sum(rows * math.prod(dims[1:]) for _, dims in arrays)
        return runs * float(elements), runs * elements * sum(buffer_bytes(f"{arrays[0][0]}[1]"))
    if kernel == "grouped_gemm_rows":  # after the tile table's 5 arrays, (rows, weights) pairs summed
        pairs = operands[TILE_TABLE_ARRAYS:]
        (dtype, lhs), n = pairs[0], result[1]
        rows, size = rows_in(lhs), sum(buffer_bytes(f"{dtype}[1]"))
        k = sum(dims[1] for _, dims in pairs[::2])
        return runs * 2.0 * rows * k * n, runs * size * (rows * k + sum(math.prod(dims) for _, dims in pairs[1::2]) + rows * n)
    (dtype, lhs), (_, rhs) = operands[-2:]
    rows, size = rows_in(lhs), sum(buffer_bytes(f"{dtype}[1]"))
    k, n = lhs[1], rhs[1]
    return runs * 2.0 * rows * k * n, runs * size * (rows * (k + n) + math.prod(result))


def kernel_bytes(module: Module, i: Instruction) -> float:
    """HBM bytes read and written by one run of a kernel (see the module docstring)."""
    reads = [sum(buffer_bytes(module.types.get(o, ""))) for o in i.operands]
    written = [b for (t, _), b in zip(buffers(i.type), buffer_bytes(i.type)) if t not in _WORKSPACE]
    if i.op in ("fusion", "fusion-start") and i.called:
        rows = module.bodies.get(i.called[0], [])
        params = {int(re.match(r"(\d+)", r.rest).group(1)): r.name for r in rows if r.op == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for r in rows:
            for o in r.operands:
                users.setdefault(o, []).append(r)
        root = rows[-1] if rows else None  # the ROOT instruction closes its computation
        roots = [r for r in rows if r.name in root.operands] if root and root.op == "tuple" else [root]
        def through_bitcasts(name: str) -> list[tuple[Instruction, str]]:
            """(user, the name it reads) of `name`, past bitcasts (a layout, no bytes moved)."""
            found = []
            for u in users.get(name, []):
                found += through_bitcasts(u.name) if u.op == "bitcast" else [(u, name)]
            return found

        for index, name in params.items():
            if index >= len(reads):
                continue
            used = through_bitcasts(name)
            if used and all(u.op in ("dynamic-slice", "slice", "gather") and u.operands[0] == via for u, via in used):
                reads[index] = sum(sum(buffer_bytes(u.type)) for u, _ in used)
            elif used and all(u.op == "dynamic-update-slice" and u.operands[0] == via for u, via in used):
                reads[index] = 0  # updated in place: only the update is written
        updated = [r for r in roots if r is not None and r.op == "dynamic-update-slice"]
        if updated and len(updated) == len([r for r in roots if r is not None]):
            written = [sum(buffer_bytes(module.types.get(r.operands[1], ""))) for r in updated]
    elif i.op in ("dynamic-slice", "slice"):
        reads = [sum(written)]
    elif i.op == "dynamic-update-slice":
        update = sum(buffer_bytes(module.types.get(i.operands[1], "")))
        reads, written = [update], [update]
    return float(sum(reads) + sum(written))


def table(hlo: str, seconds: Callable[[Kernel], float] | None = None) -> list[Kernel]:
    """Every kernel of the step, with its runs per step (loops' trip counts applied). `seconds`
    (one run of a kernel; `lm.compiler.steptime` gives its own) weighs a conditional's branches
    against each other; without it, FLOPs and `RIDGE` per byte do."""
    module = Module(hlo)
    counts: dict[tuple[str, str], float] = {}
    found: dict[tuple[str, str], Instruction] = {}

    def walk(computation: str, times: float, seen: tuple[str, ...] = ()):
        for i in module.bodies.get(computation, []):
            if i.op in NO_KERNEL or i.op.endswith("-done"):
                continue
            if i.op == "while":
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', i.rest)
                body = re.search(r"body=%?([\w.\-]+)", i.rest)
                condition = re.search(r"condition=%?([\w.\-]+)", i.rest)
                n = int(trips.group(1)) if trips else 1
                if body and body.group(1) not in seen:
                    walk(body.group(1), times * n, seen + (computation,))
                if condition and condition.group(1) not in seen:
                    walk(condition.group(1), times * (n + 1), seen + (computation,))
                continue
            if i.op in CONTROL:
                listed = re.search(r"branch_computations=\{([^}]*)\}", i.rest)
                branches = (re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed
                            else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", i.rest) or i.called)
                share = share_of(i.rest) if i.op == "conditional" and len(branches) == 2 else None
                if share is not None:  # each branch its share of the runs (sharding.conditions)
                    true, false = true_and_false(i.rest, branches)
                    walk(true, times * share, seen + (computation,))
                    walk(false, times * (1 - share), seen + (computation,))
                    continue
                sets = branch_sets(i.rest) if i.op == "conditional" and listed else None
                if sets:  # each run its costliest branch among those the devices take (sharding.conditions)
                    runs, cost = sum(n for _, n in sets), {b: branch_cost(b, seen + (computation,)) for b in set(branches)}
                    for members, n in sets:
                        walk(max((branches[b] for b in members), key=cost.get), times * n / runs, seen + (computation,))
                    continue
                if branches:  # the costliest branch, as if it ran every time
                    walk(max(branches, key=lambda b: branch_cost(b, seen + (computation,))), times, seen + (computation,))
                continue
            key = (computation, i.name)
            counts[key] = counts.get(key, 0) + times
            found[key] = i

    def branch_cost(computation: str, seen: tuple[str, ...]) -> float:
        """A branch's kernels' seconds, or FLOPs of GEMMs and attention plus `RIDGE` per HBM
        byte: which of a conditional's branches takes longest (the B / W of a zero-bubble slot has
        no more bytes than its F but twice the FLOPs)."""
        nonlocal counts, found
        outer, counts, found = (counts, found), {}, {}
        walk(computation, 1, seen)
        total = 0.0
        for key, count in counts.items():
            k, flops, moved, attention = _cost(module, found[key])
            if seconds is not None:
                total += count * seconds(Kernel(found[key].name, k, count, flops, moved, "", key[0], *attention))
            else:
                total += count * ((flops if k in ("gemm", "gemm_fp8", "attention") else 0.0) + RIDGE * moved)
        counts, found = outer
        return total

    walk(module.entry, 1)
    out = []
    for (computation, name), count in counts.items():
        i = found[(computation, name)]
        k, flops, moved, attention = _cost(module, i)
        out.append(Kernel(name, k, count, flops, moved, i.type.split("{")[0][:80], computation, *attention))
    return out


def _cost(module: Module, i: Instruction) -> tuple[str, float, float, tuple[int, bool]]:
    """A kernel's kind, FLOPs, HBM bytes and (attention) its head width and direction."""
    k = module.kind(i)
    moved, attention = None, (0, False)
    if k in ("gemm", "gemm_fp8"):
        flops = gemm_flops(module, i)
    elif ROW_KERNELS.search(i.rest) and i.op == "custom-call":
        flops, moved = row_kernel_cost(module, i)
    elif k == "attention":
        flops, *attention = attention_cost(module, i)
    else:
        flops = float(sum(math.prod(d) for _, d in buffers(i.type)))
    return k, flops, kernel_bytes(module, i) if moved is None else moved, tuple(attention)


def cost_analysis(executable) -> dict:
    """XLA's own totals (HloCostAnalysis: FLOPs, bytes accessed) for a compiled step, for a
    cross-check. A compile-only GPU executable offers none itself, so its optimized module is
    analysed by the host's CPU client; empty where this jaxlib offers neither."""
    import jax

    analysis = executable.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) and analysis else analysis
    if not analysis:
        try:  # jaxlib's binding, not public API: a cross-check may go missing, never the step
            from jax._src.lib import xla_client

            module = executable.runtime_executable().hlo_modules()[0]
            analysis = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        except Exception:  # noqa: BLE001
            return {}
    return {k: float(analysis[k]) for k in ("flops", "bytes accessed") if k in analysis}
