"""What an MoE layer's grouped matmul costs: `jax.lax.ragged_dot` against one dense GEMM of the same work.

    python benchmarks/grouped_gemm.py [--rows=16384] [--experts=8] [--d=4096] [--f=14336] [--reps=10]

`rows` token-expert pairs (tokens x experts per token), already sorted by expert, multiply their
expert's [d, f] matrix: the grouped GEMM of a dropless MoE layer (Mixtral-8x7B's shapes by
default). Timed forward and forward + backward, with the rows spread evenly over the experts and
skewed (half of them to one expert), beside a dense [rows, d] x [d, f] GEMM that does the same
FLOPs. Also read from the compiled program: what `ragged_dot` lowers to on this backend (the
custom calls and opcodes of its optimized HLO). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter


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


def measure(rows: int = 16384, experts: int = 8, d: int = 4096, f: int = 14336, reps: int = 10, dtype: str = "bfloat16") -> dict:
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    x_md = jax.random.normal(jax.random.key(0), (rows, d), jnp.float32).astype(dt)
    w_edf = (jax.random.normal(jax.random.key(1), (experts, d, f), jnp.float32) / d**0.5).astype(dt)
    w_df = w_edf[0]
    flops = 2 * rows * d * f

    grouped = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g))
    dense = jax.jit(lambda x, w: x @ w)

    def loss_grouped(x, w, g):
        return jax.lax.ragged_dot(x, w, g).astype(jnp.float32).sum()

    def loss_dense(x, w):
        return (x @ w).astype(jnp.float32).sum()

    grouped_grad = jax.jit(jax.grad(loss_grouped, argnums=(0, 1)))
    dense_grad = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))
    result = {"shape": {"rows": rows, "experts": experts, "d": d, "f": f, "dtype": dtype}, "flops_forward": flops}
    result["dense_tflops"] = flops / _best_time(dense, (x_md, w_df), reps) / 1e12
    result["dense_fwd_bwd_tflops"] = 3 * flops / _best_time(dense_grad, (x_md, w_df), reps) / 1e12
    for name, skewed in (("even", False), ("skewed", True)):
        g = jnp.asarray(group_sizes(rows, experts, skewed))
        result[f"ragged_{name}_tflops"] = flops / _best_time(grouped, (x_md, w_edf, g), reps) / 1e12
        result[f"ragged_{name}_fwd_bwd_tflops"] = 3 * flops / _best_time(grouped_grad, (x_md, w_edf, g), reps) / 1e12
    g = jnp.asarray(group_sizes(rows, experts, False))
    result["ragged_lowering"] = lowering(grouped.lower(x_md, w_edf, g).compile())
    result["ragged_grad_lowering"] = lowering(grouped_grad.lower(x_md, w_edf, g).compile())
    result["backend"] = jax.default_backend()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--f", type=int, default=14336)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    result = measure(args.rows, args.experts, args.d, args.f, args.reps, args.dtype)
    for key, value in result.items():
        if key.endswith("tflops"):
            print(f"{key:28s} {value:8.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
