"""JAX's fatal distributed-runtime errors as one line: a process that reads another's stderr.

    python stderr_guard.py PROCESS_INDEX PROCESS_COUNT COORDINATOR START_S   (started by `distributed.initialize`)

When a process of a JAX cluster is lost, JAX's coordination client ends every survivor from a
C++ thread: an error record, a `LOG(FATAL)` ("Terminating process because the JAX distributed
service detected fatal errors ...") with a stack trace, then abort(). Nothing in the dying
process can replace that (jaxlib 0.10's missed-heartbeat callback throws std::bad_cast when set
from Python), so its stderr runs through this process, which outlives it: lines pass through
unchanged, the coordination service's error records are held back a few seconds, and when the
fatal record arrives everything after it is replaced by one line naming the lost process, or by
nothing if the process had already said its own final line (`error: ...`, e.g. its step watchdog's).
Standard library only: it must start in a blink and never fail.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys

FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
# An absl log record's first line: severity, date, time, thread, file:line].
RECORD = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([\w.]+):\d+\]")
HELD_FILES = (b"coordination_service", b"preemption_sync_manager", b"client.h")
HOLD_S = 3.0


def lost_processes(text: str, me: int) -> list[int] | None:
    """The processes JAX's fatal status names as gone; None if it names none."""
    unhealthy = re.search(r"stopped sending heartbeats\):\s*\n((?:.*\d.*\n?)+?)(?:\S*[A-Za-z]{3}|\Z)", text)
    if unhealthy:
        listed = unhealthy.group(1)
        found = re.findall(r"task:(\d+)", listed) or re.findall(r"\d+", listed)
        return sorted({int(p) for p in found if int(p) != me}) or None
    if "Failed to send RPC to coordination service" in text or "leader task" in text:
        return [0]
    if "CoordinationService/Heartbeat" in text:  # this process's heartbeats no longer reach the coordinator
        return [0]
    return None


def verdict(fatal_text: str, me: int, count: int, coordinator: str = "?", start_s: str = "?") -> str:
    if "CoordinationService/RegisterTask" in fatal_text:
        return (f"error: process {me} of {count}: the coordinator at {coordinator} did not answer within {start_s} s; "
                "start process 0 there (its host and port as this host reaches them, in --coordinator) and the others within that time")
    lost = lost_processes(fatal_text, me)
    if lost is None:
        status = fatal_text.split("absl::Status:", 1)[-1].strip().splitlines()
        return f"error: process {me} of {count}: the JAX distributed service ended it: {status[0] if status else 'unknown error'}"
    names = ", ".join("0 (the coordinator)" if p == 0 else str(p) for p in lost)
    return (
        f"error: lost process {names} of {count} (it stopped answering: killed, crashed, frozen, its host down or the network to it cut); "
        f"process {me} stopped too. Start all {count} processes again: they resume from the last complete checkpoint"
    )


def main(argv: list[str]) -> None:
    me, count, coordinator, start_s = int(argv[1]), int(argv[2]), argv[3], argv[4]
    source, out = sys.stdin.buffer, sys.stdout.buffer
    fd = source.fileno()
    held: list[bytes] = []  # coordination-service records (and their continuation lines) not yet shown
    fatal: list[bytes] | None = None
    said_final = False  # the process wrote its own `error:` line: JAX's abort after it adds nothing
    pending = b""
    while True:
        timeout = HOLD_S if held and fatal is None else None
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:  # no fatal record followed: the held records were only news
            out.write(b"".join(held))
            out.flush()
            held = []
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in (raw + b"\n" for raw in lines):
            if fatal is not None:
                fatal.append(line)
                continue
            if FATAL in line:
                fatal = [line]
                continue
            record = RECORD.match(line)
            if record and any(name in record.group(1) for name in HELD_FILES):
                held.append(line)
            elif held and not record and not line.startswith(b"[Gloo]"):
                held.append(line)  # a continuation of the held record
            else:
                out.write(b"".join(held) + line)
                held = []
                said_final = said_final or line.startswith(b"error: ")
        out.flush()
    if fatal is None:
        out.write(b"".join(held) + pending)
    elif not said_final:
        line = verdict(b"".join(fatal).decode(errors="replace"), me, count, coordinator, start_s)
        out.write(("\n" if os.isatty(out.fileno()) else "").encode() + line.encode() + b"\n")  # off a progress bar
    out.flush()


if __name__ == "__main__":
    # SIGINT / SIGTERM sent to the whole process group are the trainer's to handle; this process
    # ends when the trainer's stderr closes, after passing on all it wrote.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    main(sys.argv)
