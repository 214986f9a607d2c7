"""N local processes on loopback, one JAX cluster, supervised (the library of `python -m lm.launch`).

    python -m lm.launch --processes=2 --devices_per_process=4 -- \\
        python -m lm.train --config=configs/tiny.py --workdir=runs/tiny2x4 --config.mesh.fsdp=2

Each process gets `--coordinator=127.0.0.1:PORT --num_processes=N --process_id=i` appended to
the command (the flags `lm.train` and `lm.bench` take, passed on to `jax.distributed`) and that
many fake CPU devices. Output lines are prefixed with `[i]`. If one process fails the others
are stopped; SIGTERM / SIGINT to the launcher is passed on to every process.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time

from lm import progress


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    if sys.stdout.isatty():  # the bars reach a terminal as lines through this process: more often
        env.setdefault(progress.LINE_EVERY_ENV, "5")
    return env


def launch(command: list[str], processes: int, devices_per_process: int, grace_s: float = 10.0) -> int:
    """Runs `command` as `processes` cooperating processes; returns the first non-zero exit code (or 0)."""
    port = _free_port()
    env = _child_env(devices_per_process)
    children = [
        subprocess.Popen(
            [*command, f"--coordinator=127.0.0.1:{port}", f"--num_processes={processes}", f"--process_id={i}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
        )
        for i in range(processes)
    ]

    def forward(signum, frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(children, grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(children: list[subprocess.Popen], grace_s: float) -> int:
    """Prefixes output until every process ends; stops the rest when one fails."""
    selector = selectors.DefaultSelector()
    pending = {}
    for i, child in enumerate(children):
        selector.register(child.stdout, selectors.EVENT_READ, i)
        pending[i] = b""
    open_streams, failed, deadline = len(children), None, None
    while open_streams:
        for key, _ in selector.select(timeout=0.5):
            i = key.data
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                chunk = b"\n" if pending[i] else b""
            # Each piece (a line; a '\r' redraw from a program that draws them) passed on as it comes, prefixed.
            *pieces, pending[i] = re.split(rb"(?<=[\r\n])", pending[i] + chunk)
            for piece in pieces:
                _write(i, piece)
        codes = [c.poll() for c in children]
        if failed is None and any(code not in (None, 0) for code in codes):
            failed = next(code for code in codes if code not in (None, 0))
            deadline = time.monotonic() + grace_s
            for child in children:
                if child.poll() is None:
                    child.terminate()
        if deadline is not None and time.monotonic() > deadline:
            for child in children:
                if child.poll() is None:
                    child.kill()
    codes = [c.wait() for c in children]
    return failed if failed is not None else next((c for c in codes if c), 0)


def _write(i: int, line: bytes) -> None:
    sys.stdout.buffer.write(f"[{i}] ".encode() + line)
    sys.stdout.flush()
