"""`python -m lm.evaluate`: EleutherAI's lm-eval benchmarks on a run, without exporting it.

    python -m lm.evaluate --workdir=runs/llama --tasks=hellaswag,arc_easy [--limit=100]
    python -m lm.evaluate --workdir=runs/tiny --tasks=my_task --include_path=my_tasks/

Prints lm-eval's table and writes its results as JSON to WORKDIR/lm_eval/step<N>-<tasks>.json
(never over an earlier file). Needs the `eval` extra. The harness is `lm.evaluation.harness`.
"""

from __future__ import annotations

import json

import jax

from lm import cli, paths
from lm.cli import Parser
from lm.config import UserError
from lm.evaluation.harness import evaluate, for_run


def _limit(text: str | None) -> float | int | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"--limit={text}: give a number of examples per task (e.g. 100) or a fraction below 1 (e.g. 0.1)")
    return int(value) if value >= 1 else value


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.evaluate", description="lm-eval benchmarks on a trained run.", with_config=False, distributed=True)
    parser.add_argument("--workdir", required=True, help="the run directory to evaluate")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include_path", default=None, help="a directory of task YAML files (lm-eval's own flag)")
    parser.add_argument("--limit", default=None, help="examples per task (an integer) or a fraction of each")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per forward pass")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks: name at least one task, e.g. --tasks=hellaswag")
    if args.batch_size < 1:
        raise UserError(f"--batch_size={args.batch_size}: use 1 or more")
    include = str(paths.existing_dir(args.include_path, "--include_path")) if args.include_path else None
    limit = _limit(args.limit)
    workdir = paths.existing_run_dir(args.workdir)
    lm, step = for_run(workdir, args.step, args.batch_size)
    results = evaluate(lm, tasks, include, limit)
    if jax.process_index() == 0:
        from lm_eval.utils import make_table

        print(make_table(results))
        out = paths.fresh_file(workdir / "lm_eval" / f"step{step}-{'+'.join(tasks)}.json")
        out.write_text(json.dumps(results, indent=2, default=str))
        print(f"results: {out}")


if __name__ == "__main__":
    cli.run(main)
