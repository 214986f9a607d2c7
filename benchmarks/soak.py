"""Kill-and-restart soak: one run SIGKILLed together with its launcher again and again (a
scheduler's kill), alternately as 2 processes x 4 CPU devices and 1 x 8, each time restarted at
once; then trained to the end and compared with an uninterrupted run, loss by loss.

    .venv/bin/python benchmarks/soak.py --cycles=6 --steps=60 --out=/tmp/soak.json

This process adopts the killed trainers (a subreaper) and does not reap them until the end, as
a container whose PID 1 never reaps: each killed lock holder stays a zombie while the next
restart starts. Prints and writes JSON: restarts refused (the lock), the step each resumed
from, seconds from kill to the first new step, and the final losses against the reference.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ((2, 4), (1, 8))  # (processes, devices each)


def _rows(workdir: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def _last_step(workdir: Path) -> int:
    return max((r["step"] for r in _rows(workdir) if "loss" in r), default=0)


def _command(workdir: Path, corpus: str, steps: int, processes: int, devices: int) -> list[str]:
    train = [sys.executable, "-m", "lm.train", "--config=configs/tiny.py", f"--workdir={workdir}", f"--config.data.path={corpus}",
             f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.checkpoint.every_steps=5",
             "--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.precision.compute_dtype=float32"]
    return [sys.executable, "-m", "lm.launch", f"--processes={processes}", f"--devices_per_process={devices}", "--", *train]


def soak(workdir: Path, corpus: str, cycles: int, steps: int, seed: int) -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: killed trainers become our zombies
    rng = random.Random(seed)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    kills, refused = [], 0
    for cycle in range(cycles):
        processes, devices = LAYOUTS[cycle % 2]
        before = _last_step(workdir)
        target = min(before + rng.randint(3, 9), steps - 1)
        log = open(workdir.parent / f"soak-{cycle}.log", "wb")
        started = time.monotonic()
        run = subprocess.Popen(_command(workdir, corpus, steps, processes, devices), cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        first_step_s = None
        while run.poll() is None and _last_step(workdir) < target:
            if first_step_s is None and _last_step(workdir) > before:
                first_step_s = time.monotonic() - started
            time.sleep(0.1)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        log.close()
        said = (workdir.parent / f"soak-{cycle}.log").read_text(errors="replace")
        refused += "is in use by" in said
        resumed = next((int(line.split("resuming from step ")[1].split()[0]) for line in said.splitlines() if "resuming from step " in line), 0)
        kills.append({"layout": f"{processes}x{devices}", "resumed_from": resumed, "killed_at_step": _last_step(workdir),
                      "start_to_first_step_s": round(first_step_s or float("nan"), 1), "exit": run.returncode})
        print(json.dumps(kills[-1]), flush=True)
    final = subprocess.run(_command(workdir, corpus, steps, 1, 8), cwd=ROOT, env=env, capture_output=True, text=True)
    refused += "is in use by" in final.stdout
    zombies = 0
    while True:  # reap the adopted trainers
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        zombies += 1
    return {"kills": kills, "restarts_refused": refused, "final_exit": final.returncode, "zombies_reaped_at_the_end": zombies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    parser.add_argument("--dir", default="/tmp/meshlm-soak", help="a new directory for the runs")
    parser.add_argument("--out", default=None, help="JSON file for the result")
    args = parser.parse_args()
    base = Path(args.dir)
    if base.exists():
        sys.exit(f"error: --dir={base} exists; pass a new directory")
    base.mkdir(parents=True)
    result = soak(base / "soaked", args.corpus, args.cycles, args.steps, args.seed)
    reference = subprocess.run(_command(base / "straight", args.corpus, args.steps, 1, 8), cwd=ROOT, capture_output=True, text=True,
                               env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    soaked = {r["step"]: r["loss"] for r in _rows(base / "soaked") if "loss" in r}
    straight = {r["step"]: r["loss"] for r in _rows(base / "straight") if "loss" in r}
    steps = sorted(set(soaked) & set(straight))
    result.update(
        reference_exit=reference.returncode, steps_compared=len(steps),
        steps_bitwise_equal=sum(soaked[s] == straight[s] for s in steps),
        max_abs_loss_difference=max((abs(soaked[s] - straight[s]) for s in steps), default=None),
        command=" ".join(sys.argv),
    )
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
