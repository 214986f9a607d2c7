"""The step watchdog: a process whose training steps stop completing while it stays alive (a
wedged collective or kernel, a host callback that never returns, a data read on a dead mount)
keeps its heartbeats going, so nothing else would end the job. This one does, on every process:
each writes its Python stacks to `WORKDIR/hang-<process>.txt`, says so in one line, and exits;
the same command then resumes from the last complete checkpoint.

The clock starts at the first completed step (compilation and a restore are not timed) and
stops while the loop evaluates, checkpoints or rolls back (`paused`), and while a debugger traces
the loop. `timeout_s`: None derives
it from the steps seen (`FACTOR` x their median, at least `FLOOR_S`); 0 turns it off.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import jax

import sharding.distributed
from lm import progress

FLOOR_S = 300.0
FACTOR = 10.0
WARM_STEPS = 3  # completed steps before their median is trusted (until then: FLOOR_S)
EXIT_CODE = 4
POLL_S = 1.0
FLAG_POLLS = 5  # polls between looks at the other processes' flags
FLAG = "watchdog"  # raised in the coordination service by a process whose watchdog fired
AGREE_S = 30.0  # how long a firing process waits for the others to write their stacks


def _debugged() -> bool:
    """Whether a debugger traces the main thread (a breakpoint in the loop is not a hang)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_trace is not None:
            return True
        frame = frame.f_back
    return False


class StepWatchdog:
    def __init__(self, timeout_s: float | None, workdir: Path):
        self.fixed = timeout_s
        self.workdir = workdir
        self.doing = "starting"  # what the loop is at, for the hang file
        self._last: float | None = None  # when the last step completed; None: not armed yet
        self._step = 0
        self._intervals: deque[float] = deque(maxlen=100)
        self._paused = 0
        self._stop = threading.Event()
        self._thread = None
        if timeout_s != 0:
            self._thread = threading.Thread(target=self._watch, name="meshlm-watchdog", daemon=True)
            self._thread.start()

    def completed(self, step: int) -> None:
        """The host saw `step` complete on this process's devices."""
        now = time.monotonic()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last, self._step = now, step

    @contextlib.contextmanager
    def paused(self, doing: str):
        """Evaluation, checkpoint writes, restores: not step time (their first calls compile)."""
        self._paused += 1
        self.doing = doing
        try:
            yield
        finally:
            self._paused -= 1
            if self._last is not None:
                self._last = time.monotonic()  # the next interval starts here, not sampled across

    def limit_s(self) -> float:
        if self.fixed:
            return float(self.fixed)
        if len(self._intervals) < WARM_STEPS:
            return FLOOR_S
        return max(FLOOR_S, FACTOR * statistics.median(self._intervals))

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        polls = 0
        while not self._stop.wait(POLL_S):
            polls += 1
            waited = time.monotonic() - self._last if self._last is not None else 0.0
            overdue = self._last is not None and not self._paused and waited > self.limit_s()
            fired_elsewhere = {}
            # Another's watchdog asked only in trouble (a step half its limit late, or a pause that
            # may wait on a stuck peer): one RPC per process every FLAG_POLLS polls, not all the time.
            trouble = self._paused or waited > self.limit_s() / 2
            if not overdue and trouble and polls % FLAG_POLLS == 0 and jax.process_count() > 1:
                with contextlib.suppress(Exception):  # the service gone: JAX's heartbeats end us
                    fired_elsewhere = sharding.distributed.raised_flags(FLAG)
            if (overdue or fired_elsewhere) and not _debugged():
                self._fire(fired_elsewhere)

    def _fire(self, fired_elsewhere: dict[int, str]) -> None:
        me, count, step = jax.process_index(), jax.process_count(), self._step + 1
        waited = time.monotonic() - (self._last or time.monotonic())
        path = self.workdir / f"hang-{me}.txt"
        outcome: list[str] = []  # the error, if writing failed
        writer = threading.Thread(target=self._write_stacks, args=(path, step, waited, outcome), daemon=True)
        writer.start()
        writer.join(10.0)  # a dead mount must not keep the process from ending
        written = path if not writer.is_alive() and not outcome else None
        with contextlib.suppress(Exception):
            if not fired_elsewhere:
                sharding.distributed.raise_flag(FLAG, str(step))
            sharding.distributed.roll_call("watchdog_stacks", AGREE_S)
        if fired_elsewhere:
            first, their_step = min(fired_elsewhere.items())
            why = f"process {first}'s step {their_step} did not complete within {self.limit_s():.0f} s"
        else:
            why = f"step {step} did not complete within {self.limit_s():.0f} s"
        where = f"this process's Python stacks are in {written}" if written else f"{path} could not be written ({outcome[0] if outcome else 'not within 10 s'})"
        progress.final_line(
            f"error: process {me} of {count}: {why} (train.step_timeout_s; it was {self.doing}); {where}. "
            "Run the same command again to resume from the last complete checkpoint"
        )
        if me == 0 and count > 1:
            time.sleep(2.0)  # the coordinator last, so the others end by their own line, not by its loss
        os._exit(EXIT_CODE)

    def _write_stacks(self, path: Path, step: int, waited: float, outcome: list[str]) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [
            f"process {jax.process_index()} of {jax.process_count()}, pid {os.getpid()}: step {step} not complete "
            f"{waited:.1f} s after step {self._step} (limit {self.limit_s():.1f} s); the loop was {self.doing}",
            f"median step {statistics.median(self._intervals):.3f} s over {len(self._intervals)} steps" if self._intervals else "no step timed yet",
            "",
        ]
        frames = sys._current_frames()
        frames.pop(threading.get_ident(), None)  # this writer
        for ident, frame in sorted(frames.items(), key=lambda item: item[0] != threading.main_thread().ident):
            lines.append(f"thread {names.get(ident, ident)}:")
            lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
            lines.append("")
        try:
            path.write_text("\n".join(lines))
        except OSError as e:
            outcome.append(e.strerror or str(e))
