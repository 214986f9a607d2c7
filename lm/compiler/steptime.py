"""A GPU step's time predicted from its compiled program, kernel by kernel (`predict`).

Each kernel of `lm.compiler.kernels.table` takes a roofline time plus a launch overhead:

    max(FLOPs / (peak of its number format x efficiency of its kind),
        bytes / (HBM bandwidth x memory efficiency)) + overhead

with the target's peak (`lm.hardware.peaks`) and bandwidth (its description), and one efficiency
per kind of compute (bf16 GEMMs, fp8 GEMMs, grouped GEMMs), cuDNN attention's forward and backward
at head widths 64 and 128 (between them interpolated in log2 of the width, beyond them the
nearest's: on the H200's traces the forward runs at 0.34 of peak at width 64 and 0.45 at 128, the
backward at 0.27 and 0.33), one for memory, one overhead: nine constants (the grouped GEMM's the
dense GEMM's until a run with one fits it), fitted on the per-kernel times of real GPU traces (`fit`; `python -m lm.calibrate
--step_time=DIR --target=NAME --write` rewrites `lm/hardware/steptime.json` from a run stored in
`benchmarks/results/`). Kernels run one after another on one stream (XLA's GPU steps do, as
their traces show), so the step is their sum; collectives are timed as memory traffic here (one
device; the planner's network model times them across devices). `Fp8SiteChoice` uses the same
constants to decide, per fp8 site, whether fp8 pays (`precision.fp8_sites=auto`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from lm.compiler import kernels as lm_kernels
from lm.compiler import profile, targets
from lm.hardware import data_file
from lm.hardware.peaks import PEAK_FLOPS

CONSTANTS_FILE = "steptime.json"
COMPUTE_KINDS = ("gemm", "gemm_fp8", "grouped_gemm", "attention")
# The head widths attention's efficiency is fitted at (a constant per width and direction).
ATTENTION_WIDTHS = (64, 128)
ATTENTION = tuple(f"attention{'_backward' if back else ''}_{w}" for back in (False, True) for w in ATTENTION_WIDTHS)
NAMES = ("gemm", "gemm_fp8", "grouped_gemm", *ATTENTION, "memory", "overhead_s")


class Device(NamedTuple):
    bf16_flops: float
    fp8_flops: float
    bandwidth: float  # HBM bytes/s


def device(target: str) -> Device:
    text = targets.target_config(target)
    name = re.search(r'device_description_str:\s*"([^"]+)"', text).group(1)
    family = next(f for f, _ in PEAK_FLOPS if f in name)
    bandwidth = float(re.search(r"memory_bandwidth:\s*(\d+)", text).group(1))
    return Device(PEAK_FLOPS[(family, "bfloat16")], PEAK_FLOPS[(family, "float8")], bandwidth)


UNFITTED_GROUPED = "no stored GPU run has meshlm's grouped GEMM yet: the dense GEMM's efficiency stands in"


def constants() -> dict[str, float]:
    return json.loads(data_file(CONSTANTS_FILE).read_text())["constants"]


def unfitted() -> dict[str, str]:
    """The constants no GPU run has fitted yet, and what stands in for each."""
    return json.loads(data_file(CONSTANTS_FILE).read_text()).get("unfitted", {})


def _attention_weights(head_dim: int, backward: bool) -> dict[str, float]:
    """The attention constants a kernel of this head width and direction is priced by, each with
    its weight: linear in log2 of the width between the fitted widths, the nearest beyond them."""
    lo, hi = ATTENTION_WIDTHS
    at = (math.log2(min(max(head_dim or lo, lo), hi)) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    prefix = "attention_backward" if backward else "attention"
    return {name: w for name, w in ((f"{prefix}_{lo}", 1.0 - at), (f"{prefix}_{hi}", at)) if w > 0}


def efficiency(k: lm_kernels.Kernel, c: dict[str, float]) -> float:
    """A compute kernel's share of its number format's peak."""
    if k.kind == "attention":
        return sum(w * c[name] for name, w in _attention_weights(k.head_dim, k.backward).items())
    return c[k.kind]


def kernel_seconds(k: lm_kernels.Kernel, dev: Device, c: dict[str, float]) -> float:
    """One run of one kernel."""
    memory = k.bytes / (dev.bandwidth * c["memory"])
    if k.kind in COMPUTE_KINDS:
        peak = dev.fp8_flops if k.kind == "gemm_fp8" else dev.bf16_flops
        return max(k.flops / (peak * efficiency(k, c)), memory) + c["overhead_s"]
    return memory + c["overhead_s"]


class Prediction(NamedTuple):
    step_s: float
    rows: list[dict]  # one per kernel, largest first: name, kind, count, shape, flops, bytes, seconds per step, share

    def top(self, n: int = 15) -> list[dict]:
        return self.rows[:n]

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.rows:
            out[r["kind"]] = out.get(r["kind"], 0.0) + r["seconds_per_step"]
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def predict(hlo: str, target: str, c: dict[str, float] | None = None) -> Prediction:
    c = c or constants()
    dev = device(target)
    rows = []
    for k in lm_kernels.table(hlo, lambda k: kernel_seconds(k, dev, c)):
        seconds = k.count * kernel_seconds(k, dev, c)
        rows.append({"name": k.name, "kind": k.kind, "count": k.count, "shape": k.shape, "flops_per_run": k.flops,
                     "bytes_per_run": k.bytes, "seconds_per_step": seconds})
    step = sum(r["seconds_per_step"] for r in rows)
    rows.sort(key=lambda r: -r["seconds_per_step"])
    for r in rows:
        r["share"] = r["seconds_per_step"] / step if step else 0.0
    return Prediction(step, rows)


# ---- fp8 where it pays (precision.fp8_sites=auto) ----

# Bytes per element an fp8 site's tensor costs beyond its GEMMs: its amax read (2), the quantising
# pass (read 2, write 1) and the copy in the other layout a backward GEMM takes (read 1, write 1).
FP8_PASS_BYTES = 7
FP8_PASS_LAUNCHES = 9  # three passes for each of x, w and g
# An input another site quantises too (q / k / v, gate / up): XLA writes every site's fp8 copies of
# it, both layouts, from one pass (seen in the compiled programs), so this site adds its writes alone.
FP8_SHARED_INPUT_BYTES = 2


def gemm_dims(spec: str, x_shape: tuple, w_shape: tuple) -> tuple[int, int, int]:
    """(M, K, N) of `einsum(spec, x, w)`: x's free axes, the contracted ones, w's free axes."""
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    size = {**dict(zip(xs, x_shape)), **dict(zip(ws, w_shape))}
    prod = lambda letters: int(np.prod([size[a] for a in letters])) if letters else 1  # noqa: E731
    return prod([a for a in xs if a not in ws]), prod([a for a in xs if a in ws and a not in out]), prod([a for a in ws if a not in xs])


def fp8_site_seconds(m: int, k: int, n: int, dev: Device, c: dict[str, float], shared_input: bool = False) -> tuple[float, float]:
    """(bf16, fp8) seconds of one site's three GEMMs (forward, dx, dw) on one device, fp8 with
    its extra passes over x [m, k], w [k, n] and g [m, n]; `shared_input`: x's passes are
    another site's, this one adds its copies' writes."""
    memory = dev.bandwidth * c["memory"]

    def gemm(a, b, d, flops, efficiency, in_bytes):
        return max(2 * a * b * d / (flops * efficiency), (in_bytes * (a * b + b * d) + 2 * a * d) / memory) + c["overhead_s"]

    shapes = ((m, k, n), (m, n, k), (k, m, n))
    bf16 = sum(gemm(*s, dev.bf16_flops, c["gemm"], 2) for s in shapes)
    x_bytes = FP8_SHARED_INPUT_BYTES if shared_input else FP8_PASS_BYTES
    passes = (x_bytes * m * k + FP8_PASS_BYTES * (k * n + m * n)) / memory + FP8_PASS_LAUNCHES * c["overhead_s"]
    return bf16, sum(gemm(*s, dev.fp8_flops, c["gemm_fp8"], 1) for s in shapes) + passes


@dataclasses.dataclass(eq=False)
class Fp8SiteChoice:
    """`precision.fp8_sites=auto`: a block matmul runs in fp8 only where the model predicts its
    fp8 GEMMs plus their extra passes faster than its bf16 GEMMs on `target`, per device (the
    tokens split `tokens_split` ways, the weights `weight_split` ways). Called with each site's
    einsum and global shapes as it is traced; `decisions` keeps what it chose, and why."""

    target: str
    tokens_split: int = 1
    weight_split: int = 1
    decisions: dict = dataclasses.field(default_factory=dict)

    def __call__(self, spec: str, x_shape: tuple, w_shape: tuple, shared_input: bool = False) -> bool:
        m, k, n = gemm_dims(spec, tuple(x_shape), tuple(w_shape))
        m = max(1, m // self.tokens_split)
        n = max(1, n // self.weight_split)
        bf16, fp8 = fp8_site_seconds(m, k, n, device(self.target), constants(), shared_input)
        site = f"{spec} {list(x_shape)} x {list(w_shape)}" + (" (input shared)" if shared_input else "")
        self.decisions[site] = {"fp8": fp8 < bf16, "bf16_s": bf16, "fp8_s": fp8, "mkn": [m, k, n]}
        return fp8 < bf16


# ---- fitting on real traces ----

class Sample(NamedTuple):
    kind: str
    flops: float
    bytes: float
    runs: int
    seconds_per_step: float  # measured
    head_dim: int = 0  # attention's, as `lm.compiler.kernels.Kernel`
    backward: bool = False

    def kernel(self) -> lm_kernels.Kernel:
        return lm_kernels.Kernel("", self.kind, 1, self.flops, self.bytes, "", "", self.head_dim, self.backward)

    def group(self) -> str:
        """What the fit totals it under: its kind, or the attention constant that prices most of it."""
        if self.kind != "attention":
            return self.kind
        weights = _attention_weights(self.head_dim, self.backward)
        return max(weights, key=weights.get)


def samples(case_dir: Path, steps: int = 3) -> list[Sample]:
    """Each kernel of a stored GPU case (its optimized HLO and trace, as `benchmarks/gpu.py`
    keeps them) with its measured time (`lm.compiler.profile`)."""
    hlo = profile.stored_hlo(case_dir)
    measured = {t["op"]: t["ms_per_step"] / 1e3 for t in profile.summary(case_dir / "trace.json.gz", hlo, steps, top=10**9)["top"]}
    # Every kernel of the table, so that the fit sees what `predict` sees; one the trace did not
    # place (a few, small) counts as measured 0.
    return [Sample(k.kind, k.flops, k.bytes, k.count, measured.get(k.name, 0.0), k.head_dim, k.backward) for k in lm_kernels.table(hlo)]


def _predicted(s: list[Sample], dev: Device, c: dict[str, float]) -> np.ndarray:
    return np.array([x.runs * kernel_seconds(x.kernel(), dev, c) for x in s])


def _partner(name: str) -> str:
    """The same direction's constant at the other fitted width."""
    lo, hi = ATTENTION_WIDTHS
    stem, width = name.rsplit("_", 1)
    return f"{stem}_{lo if int(width) == hi else hi}"


def unfitted_attention(seen: set[str]) -> dict[str, str]:
    """The attention constants no kernel of the runs fitted, each with what stands in for it: the
    same direction's constant at the other width."""
    return {name: f"no stored GPU run has attention at head width {name.rsplit('_', 1)[1]}: {_partner(name)} stands in"
            for name in ATTENTION if name not in seen and _partner(name) in seen}


def fit(cases: list[list[Sample]], dev: Device, rounds: int = 4) -> dict[str, float]:
    """The nine constants that minimise the squared errors of every case's kind totals (attention's
    by direction and head width), as fractions of its step (the per-instruction attribution of a
    trace is exact by kind, not always by instruction), by coordinate search on a grid."""
    grids = {"gemm": np.linspace(0.3, 1.0, 71), "gemm_fp8": np.linspace(0.2, 1.0, 81), "grouped_gemm": np.linspace(0.1, 1.0, 91),
             **{name: np.linspace(0.1, 1.0, 91) for name in ATTENTION}, "memory": np.linspace(0.3, 1.0, 71),
             "overhead_s": np.linspace(0.0, 10e-6, 51)}
    c = {"gemm": 0.8, "gemm_fp8": 0.6, "grouped_gemm": 0.8, **{name: 0.5 for name in ATTENTION}, "memory": 0.8, "overhead_s": 2e-6}
    # Per case, once: each group's kernels (a mask), their measured total, and the step.
    totals = []
    for case in cases:
        groups, measured = np.array([x.group() for x in case]), np.array([x.seconds_per_step for x in case])
        totals.append([(groups == group, measured[groups == group].sum()) for group in set(groups)] + [measured.sum()])

    def loss(trial):
        total = 0.0
        for case, (*by_kind, step) in zip(cases, totals):
            predicted = _predicted(case, dev, trial)
            total += sum(((predicted[mask].sum() - measured) / step) ** 2 for mask, measured in by_kind)  # each step weighs alike
        return total

    seen = {x.group() for case in cases for x in case}
    for _ in range(rounds):
        for name in NAMES:
            if name in ("gemm_fp8", "grouped_gemm", *ATTENTION) and name not in seen:
                continue
            best = min(grids[name], key=lambda v: loss({**c, name: float(v)}))
            c[name] = round(float(best), 6)
    if "grouped_gemm" not in seen:  # no grouped GEMM measured: the dense GEMM's (`unfitted`)
        c["grouped_gemm"] = c["gemm"]
    for name in unfitted_attention(seen):
        c[name] = c[_partner(name)]
    return c


def step_error(case: list[Sample], dev: Device, c: dict[str, float]) -> tuple[float, float]:
    """(measured, predicted) seconds per step: the kernels' sums."""
    return sum(x.seconds_per_step for x in case), float(_predicted(case, dev, c).sum())


def refit(results_dir: Path, target: str) -> dict:
    """Fit on every stored case under `results_dir`, and each case left out in turn."""
    dirs = sorted(d for d in results_dir.iterdir() if (d / "trace.json.gz").exists())
    cases = [samples(d) for d in dirs]
    dev = device(target)
    c = fit(cases, dev)
    # The step's wall time as the run kit measured it, where its JSON sits beside the directory.
    report = results_dir.with_suffix(".json")
    walls = json.loads(report.read_text()) if report.exists() else {}
    rows = []
    for i, d in enumerate(dirs):
        held_out = fit(cases[:i] + cases[i + 1:], dev)
        kernels_s, in_sample = step_error(cases[i], dev, c)
        _, out_of_sample = step_error(cases[i], dev, held_out)
        measured = walls.get(d.name, {}).get("step_time_s", kernels_s)
        by_kind = profile.stored(d)["by_kind_ms_per_step"]
        rows.append({"case": d.name, "measured_s": measured, "kernels_s": kernels_s, "measured_by_kind_ms": by_kind, "in_sample_s": in_sample,
                     "left_out_s": out_of_sample, "in_sample_error": in_sample / measured - 1,
                     "left_out_error": out_of_sample / measured - 1})
    seen = {x.group() for case in cases for x in case}
    unfitted = {**({} if "grouped_gemm" in seen else {"grouped_gemm": UNFITTED_GROUPED}), **unfitted_attention(seen)}
    return {"constants": c, "unfitted": unfitted, "fitted_on": f"{results_dir.name} (target {target})", "cases": rows,
            "refit": f"python -m lm.calibrate --step_time={results_dir} --target={target} --write"}


def describe_refit(report: dict) -> str:
    """Each case's measured step, the fit's prediction in and out of sample, and where its
    measured kernel time went by kind."""
    lines = []
    for r in report["cases"]:
        lines.append(f"{r['case']:28s} measured {1e3 * r['measured_s']:8.1f} ms  in-sample {1e3 * r['in_sample_s']:8.1f} "
                     f"({100 * r['in_sample_error']:+.1f}%)  left out {1e3 * r['left_out_s']:8.1f} ({100 * r['left_out_error']:+.1f}%)")
        lines.append("    measured ms by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in r["measured_by_kind_ms"].items()))
    return "\n".join(lines)


def write(report: dict) -> Path:
    path = data_file(CONSTANTS_FILE)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
