"""The boundary for paths a user names: each kind is checked where it enters, in one place, so
every command (and every new one) gives the same one-line `UserError` for the same mistake.

Recipe files are `lm.recipe.load_file`'s; data paths `lm.data.sources.corpus_files`'; checkpoints
`lm.program.checkpoint`'s. Here: work directories (a new or resumed run, an existing run to read),
output directories, and readable files (tokenizers, and anything else read whole). Only the
mistakes listed are caught; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from lm.errors import UserError


def new_or_run_dir(path: str | os.PathLike, flag: str = "--workdir") -> Path:
    """A directory a run writes into: absent (it is created later), or a writable directory."""
    p = Path(path).expanduser()
    for parent in [p, *p.parents]:
        if parent.exists():
            if not parent.is_dir():
                what = "is a file" if parent == p else f"lies under {parent}, which is a file"
                raise UserError(f"{flag}={path} {what}; pass a directory (a new one for a new run)")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{flag}={path}: {parent} is not writable; pass a directory you can write to")
            return p
    return p


def new_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """A directory a command creates and fills: absent or empty, never one holding anything."""
    p = new_or_run_dir(path, flag)
    if p.exists() and any(p.iterdir()):
        raise UserError(f"{flag}={path} exists and is not empty; nothing was written: pass a new directory")
    return p


def existing_run_dir(path: str | os.PathLike, flag: str = "--workdir") -> Path:
    """A directory a finished or running meshlm run wrote (it holds config.json)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{flag}={path} does not exist; pass the --workdir you trained in")
    if not p.is_dir():
        raise UserError(f"{flag}={path} is a file, not a run directory; pass the --workdir you trained in")
    if not (p / "config.json").is_file():
        raise UserError(f"{flag}={path} is not a meshlm run (no config.json); pass the --workdir you trained in")
    return p


def readable_file(path: str | os.PathLike, what: str) -> Path:
    """An existing, readable regular file; `what` names it in the message (e.g. data.tokenizer)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{what}={path} does not exist")
    if not p.is_file():
        raise UserError(f"{what}={path} is a directory, not a file")
    if not os.access(p, os.R_OK):
        raise UserError(f"{what}={path} is not readable (permissions)")
    return p
