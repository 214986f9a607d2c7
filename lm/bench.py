"""`python -m lm.bench`: step time, tokens/s, MFU and memory of a config's train step, as JSON.

    python -m lm.bench --config=configs/shakespeare_char.py [--config.KEY=VALUE ...] [--steps=N]

Runs `--warmup` steps (compilation included), then N timed steps, each timed to completion, on
synthetic tokens (speed does not depend on the text), or with `--data` on the config's corpus
through the real input pipeline (prepared into the cache first), each step's time then
including the host's wait for its batch (`data_wait_s`; prefetching should make it ~0), and the
pipeline's own time per global batch measured back to back (`data_time_s`). `--data_only`
measures that alone, without a model (e.g. `llama_1b`-shaped batches on a laptop). The last
stdout line is one JSON object.
"""

from __future__ import annotations

import json
import time

import jax

from lm import cli, paths
from lm.cli import Parser
from lm.compiler import targets
from lm.config import UserError
from lm.planner.compiled import step_report
from lm.training.timing import bench, data_bench


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.bench", description="Time a config's train step; prints JSON.", distributed=True)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    parser.add_argument("--save_hlo", help="directory to write the compiled train step's optimized HLO into")
    parser.add_argument("--profile", help="directory for a JAX profiler trace of 3 more steps; the JSON gains where their time went")
    parser.add_argument("--compile_only", action="store_true", help="compile the step and report its memory, without running it")
    parser.add_argument("--target", choices=sorted(targets.TARGETS), help="with --compile_only: for GPUs of this kind (no GPU needed)")
    parser.add_argument("--devices", type=int, default=8, help="with --target: how many GPUs")
    parser.add_argument("--data", action="store_true", help="feed the steps from the config's corpus through the real input pipeline")
    parser.add_argument("--data_only", action="store_true", help="time the input pipeline alone (no model): host time per global batch")
    args = parser.parse(argv)
    for flag, directory in (("--save_hlo", args.save_hlo), ("--profile", args.profile)):
        if directory:
            paths.new_or_run_dir(directory, flag)  # before compiling, not after
    if args.steps < 1 or args.warmup < 0:
        raise UserError(f"--steps={args.steps} --warmup={args.warmup}: time at least one step, after zero or more warm-up steps")
    if args.target and not args.compile_only:
        raise UserError("--target compiles for a GPU this machine may not have: add --compile_only")
    if args.data_only:
        result = data_bench(args.config, args.steps)
    elif args.compile_only:
        devices = None
        if args.target:
            devices = targets.command_devices("lm.bench", argv, args.target, args.devices)
        start = time.perf_counter()
        _, result = step_report(args.config, devices, save_hlo=args.save_hlo, target=args.target)
        result["compile_wall_s"] = round(time.perf_counter() - start, 3)
    else:
        result = bench(args.config, args.steps, args.warmup, save_hlo=args.save_hlo, with_data=args.data, profile=args.profile)
    if jax.process_index() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    cli.run(main)
