"""`python -m lm.layout`: a config's sharding plan and what each device will hold, without training.

    python -m lm.layout --config=configs/llama_1b.py --config.mesh.fsdp=8 --devices=8

Prints every parameter's logical axes, PartitionSpec, global and per-device shape and bytes;
per-device totals for parameters, gradients and optimizer state; and XLA's compiled memory
analysis of the train step on one device. Nothing is allocated: the state is abstract and the
step is only compiled. `--devices=N` plans on N fake CPU devices (a GPU or TPU cluster's mesh
can be checked from a laptop); the last stdout line is the summary as one JSON object.
"""

from __future__ import annotations

import json

import jax

from lm import cli, paths
from lm.cli import Parser
from lm.compiler import targets
from lm.config import UserError
from lm.planner.compiled import describe, step_report


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.layout", description="Print a config's sharding plan and memory per device.")
    parser.add_argument("--devices", type=int, default=0, help="plan on N fake CPU devices (default: the real ones; with --target, 8 GPUs)")
    parser.add_argument("--no_compile", action="store_true", help="skip compiling the train step (faster)")
    parser.add_argument("--target", choices=sorted(targets.TARGETS), help="compile for N GPUs of this kind (no GPU needed)")
    parser.add_argument("--hosts", type=int, default=1, help="with --target: the GPUs are spread over this many hosts")
    parser.add_argument("--save_hlo", help="directory to write the compiled train step's optimized HLO into")
    args = parser.parse(argv)
    if args.save_hlo:
        paths.new_or_run_dir(args.save_hlo, "--save_hlo")  # before compiling, not after
    if args.devices < 0:
        raise UserError(f"--devices={args.devices}: give a number of devices (0: the real ones)")
    devices = None
    if args.target:  # nothing above has asked JAX for devices yet
        devices = targets.command_devices("lm.layout", argv, args.target, args.devices or 8, args.hosts)
    elif args.devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    param_rows, summary = step_report(args.config, devices, compile_step=not args.no_compile, save_hlo=args.save_hlo, target=args.target)
    print(describe(param_rows, summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    cli.run(main)
