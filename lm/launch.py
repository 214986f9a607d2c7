"""`python -m lm.launch`: N local processes on loopback, one JAX cluster, for multi-host development.

    python -m lm.launch --processes=2 --devices_per_process=4 -- \
        python -m lm.train --config=configs/tiny.py --workdir=runs/tiny2x4 --config.mesh.fsdp=2

Each process gets `--coordinator=127.0.0.1:PORT --num_processes=N --process_id=i` appended to
the command (the flags `lm.train` and `lm.bench` take, passed on to `jax.distributed`) and that
many fake CPU devices. Output lines are prefixed with `[i]`. If one process fails the others
are stopped; SIGTERM / SIGINT to the launcher is passed on to every process.
"""

from __future__ import annotations

import shutil
import sys

from lm import cli
from lm.cli import Parser
from lm.config import UserError
from lm.training.launcher import launch


def main(argv: list[str]) -> None:
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        raise UserError("give the command after --, e.g. python -m lm.launch --processes=2 -- python -m lm.train ...")
    split = argv.index("--") if "--" in argv else len(argv)
    parser = Parser(prog="python -m lm.launch", description="Run N local processes as one JAX cluster.", with_config=False)
    parser.add_argument("--processes", type=int, default=2, help="number of processes")
    parser.add_argument("--devices_per_process", type=int, default=4, help="fake CPU devices per process")
    args = parser.parse(argv[:split])
    command = argv[split + 1 :]
    if not command or args.processes < 1 or args.devices_per_process < 1:
        raise UserError("need a command after -- and positive --processes / --devices_per_process")
    if shutil.which(command[0]) is None:
        raise UserError(f"the command after -- starts with {command[0]!r}, which is not an executable program; e.g. python -m lm.train ...")
    code = launch(command, args.processes, args.devices_per_process)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    cli.run(main)
