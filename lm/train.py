"""`python -m lm.train`: train (or resume) a run.

    python -m lm.train --config=configs/tiny.py --workdir=runs/tiny [--config.train.steps=100]

Running the same command again with the same workdir resumes from its latest checkpoint. The
host loop is `lm.training.loop`; the compiled program it drives, `lm.program.steps`.
"""

from __future__ import annotations

import argparse

import jax

from lm import cli, paths
from lm import config as lm_config
from lm.cli import Parser
from lm.program.faults import Faults
from lm.recipe import load_file
from lm.training.loop import train


def _default_config(args):
    """Without --config: the workdir's own config when it holds a run (resume as it was
    trained, e.g. an imported model), else configs/tiny.py."""
    saved = lm_config.load_run(paths.new_or_run_dir(args.workdir))
    return saved if saved is not None else load_file("configs/tiny.py")


def main(argv: list[str]) -> None:
    parser = Parser(
        prog="python -m lm.train",
        description="Train (or resume) a language model.",
        distributed=True,
        default_config=_default_config,
    )
    parser.add_argument("--workdir", required=True, help="run directory: checkpoints, metrics, tokenizer")
    for flag in ("kill_at_step", "kill_during_save_at_step", "stall_at_step"):
        parser.add_argument(f"--debug_{flag}", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug_stall_s", type=float, default=float("inf"), help=argparse.SUPPRESS)
    parser.add_argument("--debug_nonfinite_steps", default="", help=argparse.SUPPRESS)
    args = parser.parse(argv)
    faults = Faults(
        kill_at_step=args.debug_kill_at_step,
        kill_during_save_at_step=args.debug_kill_during_save_at_step,
        nonfinite_steps=tuple(int(s) for s in args.debug_nonfinite_steps.split(",") if s),
        stall_at_step=args.debug_stall_at_step,
        stall_s=args.debug_stall_s,
    )
    with paths.held(args.workdir, "--workdir", "lm.train", leader=jax.process_index() == 0):
        train(args.config, args.workdir, faults=faults)


if __name__ == "__main__":
    cli.run(main)
