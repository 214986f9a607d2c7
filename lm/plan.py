"""`python -m lm.plan`: the best ways to train a config on N GPUs, ranked, from a laptop.

    python -m lm.plan --config=configs/llama_70b.py --gpus=1024 --target=h100 --top=5 [--verify]

Enumerates the layouts the config allows (mesh sizes for data / stage / context / expert / fsdp /
tensor, with the optimizer state over the data replicas (ZeRO-1) where data > 1 without FSDP,
sequence parallelism, remat policy, gradient accumulation or pipeline microbatches and
schedule (`SCHEDULES`, with two chunks per stage where the layers allow), for the config's
global batch), predicts each one's memory per GPU and step time with
`lm.planner.cost`, and prints the K fastest that fit (by predicted tokens/s per GPU), why the others
were dropped, the `lm.train` command line for the first, and a JSON line last. `--verify` compiles the train steps for the target
(deviceless, `lm.compiler.targets`) in rank order and prints XLA's memory per device beside the
prediction, and whether it is within the pool JAX gives a run (`lm.GPU_MEMORY_FRACTION` of the
GPU); a layout over it is dropped and the next one compiled, until K fit (`verified`). The K
are then ranked by the step time the kernel model reads from each compiled program
(`lm.compiler.steptime`, with the cost model's network time for its collectives), both
predictions printed.
"""

from __future__ import annotations

import json
import time

from lm import GPU_MEMORY_FRACTION, cli
from lm.cli import Parser
from lm.compiler import targets
from lm.config import UserError
from lm.hardware.systems import System
from lm.planner.run import run_of
from lm.planner.search import (
    MEMORY_FRACTION,
    describe,
    entry,
    fitting,
    plan,
    smallest_fit,
    train_command,
    verified,
)
from sharding.remat import REMAT


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.plan", description="Rank the layouts of a config on N GPUs by predicted tokens/s per GPU.")
    parser.add_argument("--gpus", type=int, required=True, help="how many GPUs")
    parser.add_argument("--target", choices=sorted(targets.TARGETS), default="h100", help="the GPU kind")
    parser.add_argument("--hosts", type=int, default=0, help="hosts the GPUs are spread over (default: the target's GPUs per host)")
    parser.add_argument("--top", type=int, default=5, help="how many layouts to print")
    parser.add_argument("--memory_gib", type=float, default=0.0, help="plan for this much memory per GPU (default: the target's)")
    parser.add_argument(
        "--memory_fraction", type=float, default=MEMORY_FRACTION,
        help="the share of that memory a layout may fill (headroom for the memory model's error and the allocator)",
    )
    parser.add_argument("--remat", default=",".join(REMAT), help="the remat policies to consider, comma-separated")
    parser.add_argument("--verify", action="store_true", help="compile the top layouts for the target and compare memory")
    args = parser.parse(argv)
    started = time.perf_counter()
    system = System.load(args.target)
    hosts = args.hosts or max(1, -(-args.gpus // system.gpus_per_host))
    if args.gpus < 1 or args.top < 1 or args.hosts < 0 or args.memory_gib < 0:
        raise UserError(f"--gpus={args.gpus} and --top={args.top} must be at least 1, --hosts={args.hosts} and "
                        f"--memory_gib={args.memory_gib} at least 0 (0: the target's)")
    if args.gpus % hosts:
        raise UserError(f"--gpus={args.gpus} does not split evenly over --hosts={hosts}")
    remats = tuple(r for r in args.remat.split(",") if r)
    if not remats:
        raise UserError(f"--remat={args.remat!r} names no remat policy; choose from {', '.join(REMAT)}")
    if unknown := [r for r in remats if r not in REMAT]:
        raise UserError(f"--remat={unknown[0]!r} is not a remat policy; choose from {', '.join(REMAT)}")
    devices = targets.command_devices("lm.plan", argv, args.target, args.gpus, hosts) if args.verify else None
    run = run_of(args.config)
    if not 0 < args.memory_fraction <= 1:
        raise UserError(f"--memory_fraction={args.memory_fraction} must be in (0, 1]")
    device_memory = args.memory_gib * 2**30 or targets.memory_bytes(args.target)
    memory = int(device_memory * args.memory_fraction)
    result = plan(run, args.gpus, system, memory, args.gpus // hosts, remats)
    if not result.ranked:
        found = smallest_fit(run, args.gpus, system, memory, remats)
        where = f"; the smallest GPU count that fits is {found[0]} ({found[1] / 2**30:.1f} GiB per GPU)" if found else ""
        why = ", ".join(f"{reason} {n}" for reason, n in sorted(result.dropped.items()))
        raise UserError(f"no layout of this config fits {args.gpus} {args.target} GPUs ({memory / 2**30:.1f} GiB each; "
                        f"of {result.evaluated} layouts: {why}){where}")
    shown, checked = result.ranked[: args.top], []
    if args.verify:
        pool = GPU_MEMORY_FRACTION * device_memory  # what a run gets
        shown, checked = verified(args.config, result.ranked, args.top, devices, pool, args.target)
        for v in checked:
            verdict = f"within JAX's {pool / 2**30:.2f} GiB pool" if v["fits"] else f"OVER JAX's {pool / 2**30:.2f} GiB pool: dropped"
            print(f"verify {v['layout']}: predicted {v['predicted_bytes']['total'] / 2**30:.2f} GiB, XLA {v['compiled_peak_bytes'] / 2**30:.2f} GiB "
                  f"(model {100 * v['memory_error']:+.1f}%; {verdict})")
            print("  collectives beside compute in XLA's schedule: "
                  + ", ".join(f"{op} {v['collectives_overlapped'].get(op, 0)} of {n}" for op, n in v["collectives"].items()))
            if "step_time_s" in v:
                t = v["tokens_per_s_per_gpu"]
                print(f"  tokens/s per GPU: {t['kernels']:,.0f} by the compiled program's kernels (MFU {100 * v['mfu']['kernels']:.1f}%; "
                      f"lm.compiler.steptime; of its {v['step_time_s']['kernels']:.3f} s step {v['step_time_s']['of_which_network']:.3f} s "
                      f"network), {t['cost_model']:,.0f} by the cost model (MFU {100 * v['mfu']['cost_model']:.1f}%)")
            if v["collective_bytes"]:
                print("  collective GB per step and GPU, model / XLA: "
                      + ", ".join(f"{kind.replace('_', ' ')} {a / 1e9:.1f} / {b / 1e9:.1f}" for kind, (a, b) in v["collective_bytes"].items()))
        if over := sum(not v["fits"] for v in checked):
            result.dropped["over the pool when compiled"] = over
        if not shown:
            raise UserError(f"none of the {len(checked)} fastest layouts that the memory model fits in {memory / 2**30:.1f} GiB compiles "
                            f"within JAX's {pool / 2**30:.2f} GiB pool: lower --memory_fraction (now {args.memory_fraction}) or add GPUs")
    print(describe(result, shown))
    if pricing := shown[0].grouped_gemm_pricing():
        print(pricing)
    command = train_command(args.config_file, args.config_overrides, args.config, shown[0].parallelism)
    print(f"to train with the first: {command}")
    summary = {
        "gpus": args.gpus, "hosts": hosts, "target": args.target, "evaluated": result.evaluated,
        "fitting": fitting(result), "dropped": dict(result.dropped), "top": [entry(c) for c in shown], "train_command": command,
    }
    if args.verify:
        summary["verify"] = checked
    summary["wall_s"] = time.perf_counter() - started
    print(json.dumps(summary))


if __name__ == "__main__":
    cli.run(main)
