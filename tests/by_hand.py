"""`lm.train` as two independent processes (4 CPU devices each), started as SLURM would start
them: no launcher watching. On loopback, or as two hosts (`netns.two_hosts`): process i runs on
host i and the coordinator is host 0's address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import FAST, ROOT, UNOPTIMIZED, metrics_rows

CLI_FAST = [f"--config.{k.replace('__', '.')}={v}" for k, v in FAST.items()]


@dataclass
class Ended:
    code: int | None
    log: bytes  # stdout and stderr, as one file (as SLURM writes them)
    at: float  # time.monotonic() when it ended (inf: killed by the harness)

    @property
    def text(self) -> str:
        return self.log.decode(errors="replace")

    def said(self) -> list[str]:
        """Its lines, gloo's own chatter aside."""
        return [line for line in self.text.splitlines() if line.strip() and not line.startswith("[Gloo]")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(corpus, workdir: Path, out_dir: Path, *, hosts=None, victim: int | None = None, fault: str = "",
                  extra: tuple[str, ...] = (), steps: int = 20, during: Callable[[], None] | None = None,
                  timeout_s: float = 400) -> list[Ended]:
    """Runs both to their end; `fault` goes to process `victim` only; `during()` is called every
    0.1 s while either runs (e.g. to cut the link at a step)."""
    coordinator = f"{hosts[0].address if hosts else '127.0.0.1'}:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {UNOPTIMIZED}", JAX_PLATFORMS="cpu")
    args = ["--config=configs/tiny.py", f"--config.data.path={corpus}", f"--workdir={workdir}", *CLI_FAST,
            f"--config.train.steps={steps}", "--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.checkpoint.every_steps=5",
            f"--coordinator={coordinator}", "--num_processes=2", "--peer_timeout_s=10", *extra]
    procs, logs = [], []
    for i in range(2):
        logs.append(open(out_dir / f"{i}.log", "wb+"))
        command = [sys.executable, "-m", "lm.train", *args, f"--process_id={i}", *([fault] if i == victim else [])]
        procs.append(subprocess.Popen([*(hosts[i].run if hosts else []), *command], cwd=ROOT, env=env, stdout=logs[i], stderr=subprocess.STDOUT))
    ended: list[float | None] = [None, None]
    deadline = time.monotonic() + timeout_s
    while None in ended and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        if during is not None:
            during()
        time.sleep(0.1)
    results = []
    for p, log, end in zip(procs, logs, ended):
        if p.poll() is None:
            p.kill()
        p.wait()
        log.seek(0)
        results.append(Ended(p.returncode, log.read(), end or float("inf")))
        log.close()
    return results


def at_step(workdir: Path, step: int, action: Callable[[], None]) -> Callable[[], None]:
    """A `during` that calls `action` once, when `step` is in the run's metrics."""
    done = []

    def check():
        if done or not (workdir / "metrics.jsonl").exists():
            return
        try:
            rows = metrics_rows(workdir)
        except ValueError:  # a line being written
            return
        if any(r.get("step", 0) >= step for r in rows):
            done.append(time.monotonic())
            action()

    check.done = done
    return check
