"""Progress bars, and final lines that start a line of their own, on terminals, files and pipes.

On a terminal a bar redraws in place (tqdm). Written to a file or a pipe (SLURM's log, `| tee`)
it is a plain line at most every `LINE_EVERY_S` (or $MESHLM_PROGRESS_LINE_S): no carriage-return redraws, so whatever is
written after it (by this process, or by another sharing the log) starts a line of its own.
"""

from __future__ import annotations

import os
import sys
import weakref

LINE_EVERY_S = 30.0
LINE_EVERY_ENV = "MESHLM_PROGRESS_LINE_S"  # another interval (lm.launch sets 5 s when it writes to a terminal)
_terminal_bars: weakref.WeakSet = weakref.WeakSet()


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


class _Lines:
    """The stream tqdm draws to off a terminal: each redraw ('\\r' + the bar) becomes a line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:  # tqdm's clears and the newline it ends with are nothing here
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar(stream=None, **tqdm_args):
    """A tqdm bar on `stream` (default stdout): redrawn in place on a terminal, else lines."""
    from tqdm import tqdm

    stream = stream or sys.stdout
    if is_terminal(stream):
        made = tqdm(file=stream, dynamic_ncols=True, **tqdm_args)
        _terminal_bars.add(made)
        return made
    every = float(os.environ.get(LINE_EVERY_ENV, LINE_EVERY_S))
    return tqdm(file=_Lines(stream), mininterval=every, ncols=100, ascii=True, **tqdm_args)


def say(text: str) -> None:
    """A line on stdout around the open bars."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def final_line(text: str) -> None:
    """The line a command ends with, on stderr, at the start of a line: a bar still open on a
    terminal (an error from inside the loop, a watchdog) has its line ended first."""
    if any(not made.disable for made in list(_terminal_bars)):
        sys.stdout.write("\n")
        sys.stdout.flush()
    sys.stderr.write(" ".join(text.split("\n")) + "\n")
    sys.stderr.flush()
