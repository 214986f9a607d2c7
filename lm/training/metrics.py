"""What a run reports while it trains: the peak its MFU divides by, tokens/s, MFU and
perplexity per log interval (`StepRate`), and where rows go (`MetricsWriter`: JSONL and
TensorBoard). The FLOPs a token costs are `lm.model.flops`'s."""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lm import cache_home
from lm.hardware.peaks import PEAK_FLOPS
from lm.model import moe


def peak_dtype(precision) -> str:
    """The dtype a config's matmuls peak in: float8 with fp8 on an accelerator (on CPU fp8 is
    emulated with compute-dtype matmuls), else the compute dtype."""
    if precision.fp8 != "off" and jax.default_backend() != "cpu":
        return "float8"
    return precision.compute_dtype


@functools.cache
def peak_flops(dtype: str = "float32") -> tuple[float, str]:
    """(FLOP/s per device, where the figure came from): a table, or a measured matmul on CPU."""
    device = jax.devices()[0]
    for (kind, table_dtype), flops in PEAK_FLOPS.items():
        if kind in device.device_kind and table_dtype == dtype:
            return flops, f"table: {device.device_kind} {dtype}"
    n = 1024
    a = jnp.ones((n, n), dtype)
    # Accumulating in float32, as the model's matmuls do (a bf16-output dot is slower on CPU).
    matmul = jax.jit(lambda a: (jnp.dot(a, a, preferred_element_type=jnp.float32) * 1e-3).astype(dtype))
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(20):  # the best of many: this is a peak, and shared CPUs are noisy
        start = time.perf_counter()
        out = a
        for _ in range(4):
            out = matmul(out)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * n**3 / best, f"measured: {n}x{n} {dtype} matmul on {device.device_kind}"


def reference_peak_flops(dtype: str, measured: float) -> tuple[float, str]:
    """(FLOP/s, source): a table's peak where the device is in it, else the best peak measured on
    this machine so far (kept in the cache, per device kind and dtype, `measured` included): a
    stable figure, where one measurement moves with whatever else the machine is doing."""
    kind = jax.devices()[0].device_kind
    if any(k in kind and d == dtype for k, d in PEAK_FLOPS):
        return measured, "table"
    path = Path(cache_home()) / "peak_flops.json"
    try:
        seen = json.loads(path.read_text())
    except (OSError, ValueError):
        seen = {}
    key = f"{kind} {dtype}"
    best = max(float(seen.get(key, 0.0)), measured)
    if best > seen.get(key, 0.0):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**seen, key: best}))
        except OSError:
            pass  # a read-only cache: the figure is this run's
    return best, f"best measured on this machine ({path})"


def cpu_bf16_units() -> bool:
    """Whether this x86 CPU multiplies bfloat16 in hardware (AMX or AVX-512 BF16): where it does
    not, the recipes' bfloat16 matmuls are slower than float32 on the CPU."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("amx_bf16", "avx512_bf16"))


def peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: an early or diverged loss must not overflow


class StepRate:
    """Turns the metrics of the steps since the last log into one row: means, tokens/s, MFU."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float, moe_layer_ids: tuple[int, ...] = ()):
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.moe_layer_ids = moe_layer_ids  # the model's index of each mixture-of-experts layer
        self.restart()

    def restart(self) -> None:
        self.since = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (spent on something other than training steps) out of the rate."""
        self.since += seconds

    def row(self, step: int, host_metrics: list[dict]) -> dict:
        now = time.perf_counter()
        step_time = (now - self.since) / len(host_metrics)
        self.since = now
        # Means over the steps whose update was applied (skipped non-finite steps would make them NaN).
        applied = [m for m in host_metrics if np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])] or host_metrics
        loss = float(np.mean([m["loss"] for m in applied]))
        return {
            "step": step,
            "loss": loss,
            "perplexity": perplexity(loss),
            "grad_norm": float(np.mean([m["grad_norm"] for m in applied])),
            "skipped_steps": int(host_metrics[-1].get("skipped_steps", 0)),
            "lr": float(host_metrics[-1]["lr"]),
            "tokens_per_sec": self.tokens_per_step / step_time,
            "step_time_s": step_time,
            "mfu": self.flops_per_token * self.tokens_per_step / step_time / self.peak_flops,
        } | ({"loss_scale": float(host_metrics[-1]["loss_scale"])} if "loss_scale" in host_metrics[-1] else {}) | (
            {"mtp_loss": float(np.mean([m["mtp_loss"] for m in applied]))} if "mtp_loss" in host_metrics[-1] else {}) | (
            # A loss mask (chat): the tokens the loss was on in this row's steps; `loss` is their mean.
            {"trained_tokens": int(sum(m["trained_tokens"] for m in host_metrics))} if "trained_tokens" in host_metrics[-1] else {}) | (
            moe.metric_rows(np.mean([m["moe"] for m in applied], axis=0), self.moe_layer_ids) if "moe" in host_metrics[-1] else {}
        )


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without PyTorch. tensorboardX imports torch where it
    is installed, to accept its tensors: 1.2 s and 180 MB more for every run (meshlm writes
    floats). Importing torch fails meanwhile (tensorboardX takes that as "not installed"), unless
    this process has imported it already."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends metrics rows to WORKDIR/metrics.jsonl and TensorBoard event files in WORKDIR/tb (and,
    given a `tracker`, a W&B run: `lm.training.tracking`)."""

    def __init__(self, workdir: Path, enabled: bool = True, tracker=None):
        self.enabled = enabled
        self.path = workdir / "metrics.jsonl"
        self.tb_dir = workdir / "tb"
        self.tracker = tracker
        if enabled:
            self._tb = _summary_writer_class()(str(self.tb_dir))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, row["step"])
            elif isinstance(value, list):  # per-expert loads: one histogram, not a scalar per expert
                self._tb.add_histogram(key, np.asarray(value, np.float64), row["step"])
        if self.tracker:
            self.tracker.log(row)

    def close(self) -> None:
        if self.enabled:
            self._tb.close()
        if self.tracker:
            self.tracker.close()
