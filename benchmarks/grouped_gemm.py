"""What an MoE layer's grouped matmul costs, by implementation, against one dense GEMM of the same work.

    python benchmarks/grouped_gemm.py [--shape=mixtral|qwen3_30b_a3b | --rows=.. --experts=.. --d=.. --f=..]
                                      [--implementations=xla,pallas] [--xla_ragged_dot_fusion] [--reps=10]

`rows` token-expert pairs (tokens x experts per token), already sorted by expert, multiply their
expert's [d, f] matrix: the grouped GEMM of a dropless MoE layer. Shapes: `mixtral` (16,384 rows,
8 experts of 4096 x 14336), `qwen3_30b_a3b` (65,536 rows, 128 experts of 2048 x 1536: gate and
up side by side). Each implementation of `lm.model.grouped_gemm` (`xla`: `jax.lax.ragged_dot`;
`pallas`: meshlm's kernels) is timed forward and forward + backward (input and weight gradients),
with the rows spread evenly over the experts and skewed (half of them to one expert), beside a
dense [rows, d] x [d, f] GEMM doing the same FLOPs; its results are checked against `ragged_dot`'s.
`--xla_ragged_dot_fusion` sets XLA's `--xla_gpu_experimental_use_ragged_dot_fusion` (cuDNN's
grouped GEMM) for this process, so `xla` measures that instead. Also read from each compiled
program: its custom calls and opcodes. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lm, also without an install

SHAPES = {"mixtral": (16384, 8, 4096, 14336), "qwen3_30b_a3b": (65536, 128, 2048, 1536)}
RAGGED_DOT_FUSION = "--xla_gpu_experimental_use_ragged_dot_fusion=true"


def _best_time(f, args, reps: int, rounds: int = 3) -> float:
    """The best of `rounds` of `reps` calls queued back to back, per call."""
    import jax

    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        out = [f(*args) for _ in range(reps)]
        jax.block_until_ready(out[-1])
        best = min(best, (time.perf_counter() - start) / reps)
        del out
    return best


def lowering(compiled) -> dict:
    """The custom-call targets and the opcodes (fusions counted by kind) of a compiled program."""
    text = compiled.as_text()
    calls = Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    ops = Counter(re.findall(r"=\s*[\w\[\]{},:. ]*?\s([a-z][\w\-]*)\(", text))
    return {"custom_calls": dict(calls), "opcodes": dict(ops.most_common(12))}


def group_sizes(rows: int, experts: int, skewed: bool):
    """Rows per expert: even, or half of them to expert 0 and the rest spread evenly."""
    import numpy as np

    if not skewed:
        sizes = np.full(experts, rows // experts)
    else:
        sizes = np.full(experts, rows // 2 // (experts - 1))
        sizes[0] = 0
    sizes[0] += rows - sizes.sum()
    return sizes.astype(np.int32)


def _max_relative_error(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def measure(rows: int = 16384, experts: int = 8, d: int = 4096, f: int = 14336, reps: int = 10, dtype: str = "bfloat16",
            implementations: tuple[str, ...] = ("xla", "pallas")) -> dict:
    """TFLOP/s of each implementation (forward; forward + both gradients), even and skewed, the
    dense GEMM's, each result's largest error against `ragged_dot`'s relative to its largest value,
    and what each compiled to. An implementation that fails says why, in its entry."""
    import jax
    import jax.numpy as jnp

    from lm.model import expert_matmuls as lm_expert_matmuls
    from lm.model import grouped_gemm

    dt = jnp.dtype(dtype)
    x_md = jax.random.normal(jax.random.key(0), (rows, d), jnp.float32).astype(dt)
    w_edf = (jax.random.normal(jax.random.key(1), (experts, d, f), jnp.float32) / d**0.5).astype(dt)
    w_df = w_edf[0]
    flops = grouped_gemm.flops(rows, d, f)

    def forward(implementation):
        def run(x, w, g):
            table = grouped_gemm.tiles(g, rows) if implementation == "pallas" else None
            return lm_expert_matmuls.grouped_matmul(x, w, g, table, implementation, rows, 0, False)

        return run

    def loss(implementation):
        return lambda x, w, g: forward(implementation)(x, w, g).astype(jnp.float32).sum()

    dense = jax.jit(lambda x, w: x @ w)
    dense_grad = jax.jit(jax.grad(lambda x, w: (x @ w).astype(jnp.float32).sum(), argnums=(0, 1)))
    result = {"shape": {"rows": rows, "experts": experts, "d": d, "f": f, "dtype": dtype}, "flops_forward": flops,
              "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    result["dense_tflops"] = flops / _best_time(dense, (x_md, w_df), reps) / 1e12
    result["dense_fwd_bwd_tflops"] = 3 * flops / _best_time(dense_grad, (x_md, w_df), reps) / 1e12
    reference = {}
    for implementation in implementations:
        entry = result[implementation] = {}
        try:
            fwd, grad = jax.jit(forward(implementation)), jax.jit(jax.grad(loss(implementation), argnums=(0, 1)))
            for name, skewed in (("even", False), ("skewed", True)):
                g = jnp.asarray(group_sizes(rows, experts, skewed))
                entry[f"{name}_tflops"] = flops / _best_time(fwd, (x_md, w_edf, g), reps) / 1e12
                entry[f"{name}_fwd_bwd_tflops"] = 3 * flops / _best_time(grad, (x_md, w_edf, g), reps) / 1e12
                outputs = (fwd(x_md, w_edf, g), *grad(x_md, w_edf, g))
                if not reference.get(name):
                    reference[name] = outputs
                else:  # against the first implementation's (xla: ragged_dot)
                    entry[f"{name}_max_relative_error"] = [_max_relative_error(a, b) for a, b in zip(outputs, reference[name])]
            g = jnp.asarray(group_sizes(rows, experts, False))
            entry["lowering"] = lowering(fwd.lower(x_md, w_edf, g).compile())
            entry["grad_lowering"] = lowering(grad.lower(x_md, w_edf, g).compile())
            entry["vs_dense"] = entry["even_tflops"] / result["dense_tflops"]
        except Exception as e:  # noqa: BLE001 - an implementation this device cannot run is a result
            entry["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a named shape (overrides rows, experts, d, f)")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--f", type=int, default=14336)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--implementations", default="xla,pallas", help="comma-separated; the first is the reference")
    parser.add_argument("--xla_ragged_dot_fusion", action="store_true", help="xla with cuDNN's grouped GEMM (XLA flag)")
    args = parser.parse_args()
    if args.xla_ragged_dot_fusion:  # before jax starts its backend
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {RAGGED_DOT_FUSION}".strip()
    shape = SHAPES[args.shape] if args.shape else (args.rows, args.experts, args.d, args.f)
    result = measure(*shape, args.reps, args.dtype, tuple(args.implementations.split(",")))
    print(f"dense {result['dense_tflops']:8.1f} TFLOP/s forward, {result['dense_fwd_bwd_tflops']:8.1f} with gradients")
    for implementation in args.implementations.split(","):
        entry = result[implementation]
        print(f"{implementation:8s}", entry.get("error") or "  ".join(f"{k} {v:.1f}" for k, v in entry.items() if k.endswith("tflops")))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
