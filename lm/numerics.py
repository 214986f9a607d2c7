"""`python -m lm.numerics`: where a number format is about to fail, layer by layer.

    python -m lm.numerics --workdir=runs/shakespeare [--steps=5] [--config.precision.fp8=delayed]

Runs a few training steps (nothing is saved) from the run's latest checkpoint, or from
initialisation when there is none, with every dense matmul in the blocks recording its input
activation (x), weight (w) and output gradient (g): the absolute maximum, and the fractions of
values that would overflow (become inf/nan) or flush to zero in e4m3, e5m2, float16 and
bfloat16 under the scaling in use (fp8: the delayed scales with `precision.fp8=delayed`, else,
as `current` scales them, each tensor's own amax; gradients carry the loss scale). Each figure is the worst over the
steps (after one unrecorded step when the fp8 scales are new). Writes WORKDIR/numerics.json and WORKDIR/numerics.png (heat maps, layers x tensors) and
prints the layers to keep out of fp8 or float16. The config is the run's own (config.json),
with `--config.KEY=VALUE` overrides; a directory without one takes `--config`.
"""

from __future__ import annotations

from lm import cli, paths
from lm import config as lm_config
from lm.cli import Parser
from lm.config import UserError
from lm.training.ranges import report, summary


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.numerics", description="Per-layer number-format report of a run.")
    parser.add_argument("--workdir", required=True, help="the run directory (its config and latest checkpoint)")
    parser.add_argument("--steps", type=int, default=5, help="training steps to observe (not saved)")
    parser.add_argument("--underflow_limit", type=float, default=0.01, help="flush-to-zero fraction that disqualifies a layer")
    parser.add_argument("--overflow_limit", type=float, default=1e-4, help="fp8 clipped fraction that disqualifies a layer")
    args = parser.parse(argv)
    workdir = paths.new_or_run_dir(args.workdir)
    config = args.config
    saved = lm_config.load_run(workdir)
    if saved is not None and not any(a == "--config" or a.startswith("--config=") for a in argv):
        config = lm_config.apply_overrides(saved, args.config_overrides)
    if args.steps <= 0:
        raise UserError(f"--steps must be positive, got {args.steps}")
    print(summary(report(config, workdir, args.steps, args.underflow_limit, args.overflow_limit)))


if __name__ == "__main__":
    cli.run(main)
