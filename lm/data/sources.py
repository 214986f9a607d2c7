"""Where text comes from, read in streaming pieces: plain text files (each file one document),
JSONL (also .gz / .zst compressed) with a configurable text field, Parquet (pyarrow) and
directories saved by `datasets.Dataset.save_to_disk` (read with `datasets`).

A corpus is cut into *units* of work from the file list and sizes alone (never from the number
of workers), so any number of `lm.prepare` workers produce the same units and the same store.
Nothing reads a whole file: text streams in chunks split after a newline, JSONL line by line,
Parquet and Arrow in record batches.
"""

from __future__ import annotations

import dataclasses
import glob
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from lm.data import records
from lm.errors import UserError
from lm.paths import readable_file

CHUNK_BYTES = 1 << 20  # text is read and tokenised this much at a time
JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd")


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass(frozen=True)
class Piece:
    """A part of one source: a whole file, a byte range of an uncompressed JSONL file, row
    groups of a Parquet file, or rows of a `datasets` directory. [start, stop) in those units."""

    path: str
    kind: str  # text | jsonl | parquet | datasets
    start: int = 0
    stop: int = -1


def is_datasets_dir(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def corpus_files(path: str | None) -> list[Path]:
    """The files of a corpus, sorted; `path` is a file, a directory, a glob, or None (stdlib).
    A `datasets` directory is one entry (the directory)."""
    if path is None:
        root = default_corpus_root()
        skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
        return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    if any(ch in path for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file())
        if not files:
            raise UserError(f"data.path={path!r} matches no files; check the pattern")
        return [readable_file(f, "a file matched by data.path") for f in files]
    p = Path(path).expanduser()
    if p.is_file():
        return [readable_file(p, "data.path")]
    if is_datasets_dir(p):
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts))
        if not files:
            raise UserError(f"data.path={path!r} is an empty directory; put text files in it")
        return [readable_file(f, "a file under data.path") for f in files]
    raise UserError(f"data.path={path!r} does not exist; pass --config.data.path=FILE|DIR|GLOB (or leave it unset for the built-in corpus)")


def _kind(path: Path) -> str:
    name = path.name.lower()
    if path.is_dir():
        return "datasets"
    if name.endswith(JSONL):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def unit_bytes(total: int) -> int:
    """Work-unit size: about 64 units for a mid-sized corpus, 1 MB to 256 MB each."""
    return min(max(total // 64, 1 << 20), 256 << 20)


def plan_units(files: list[Path]) -> list[list[Piece]]:
    """The corpus as units of work (lists of pieces), from the files and their sizes alone."""
    target = unit_bytes(sum(_size(f) for f in files))
    units: list[list[Piece]] = []
    small, small_bytes = [], 0

    def close_small():
        nonlocal small, small_bytes
        if small:
            units.append(small)
        small, small_bytes = [], 0

    for f in files:
        kind, size = _kind(f), _size(f)
        if kind == "jsonl" and f.name.lower().endswith(".jsonl") and size > target:
            close_small()
            units.extend([Piece(str(f), kind, start, min(start + target, size))] for start in range(0, size, target))
        elif kind == "parquet" and size > target:
            close_small()
            groups = records.parquet_file(f).num_row_groups
            per_unit = max(1, groups * target // size)
            units.extend([Piece(str(f), kind, g, min(g + per_unit, groups))] for g in range(0, groups, per_unit))
        elif kind == "datasets":
            close_small()
            rows = records.load_dataset(f).num_rows
            per_unit = max(1, rows * target // max(size, 1))
            units.extend([Piece(str(f), kind, r, min(r + per_unit, rows))] for r in range(0, rows, per_unit))
        else:
            small.append(Piece(str(f), kind))
            small_bytes += size
            if small_bytes >= target:
                close_small()
    close_small()
    return units


# ---------------------------------------------------------------------------- reading


@dataclasses.dataclass
class Reading:
    """How a source is read, and what reading it found (counted into the store's manifest)."""

    text_field: str = "text"
    skip_bad_records: bool = False
    chat: dict | None = None  # data.format=chat: the ChatFormat (lm.data.chat) as a dict
    counts: Counter = dataclasses.field(default_factory=Counter)


def documents(piece: Piece, reading: Reading) -> Iterator[Iterator[str]]:
    """Each document of `piece`, as an iterator over its text in chunks (one chunk unless it is a
    large text file)."""
    if piece.kind == "text":
        doc = _text_file(Path(piece.path), reading)
        if doc is not None:
            yield doc
    else:
        for text in records.texts(piece, reading):
            yield iter((text,))


def _decode(raw: bytes, reading: Reading) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        reading.counts["invalid_utf8"] += 1  # chunks with invalid bytes, replaced by U+FFFD
        return raw.decode("utf-8", errors="replace")


def _text_file(path: Path, reading: Reading) -> Iterator[str] | None:
    """The file's text in chunks split after a newline (a newline byte never sits inside a UTF-8
    sequence, so every chunk decodes on its own), or None for a binary file."""
    with path.open("rb") as f:
        head = f.read(8192)
    if b"\0" in head:
        reading.counts["binary_files_skipped"] += 1
        return None

    def chunks():
        with path.open("rb") as f:
            carry = b""
            while True:
                block = f.read(CHUNK_BYTES)
                if not block:
                    break
                block = carry + block
                cut = block.rfind(b"\n") + 1
                if cut == 0:
                    carry = block
                    continue
                carry = block[cut:]
                yield _decode(block[:cut], reading)
            if carry:
                yield _decode(carry, reading)

    return chunks()


def fingerprint(files: list[Path]) -> list[dict]:
    """What the sources were when read: path, size, modification time (a store records them)."""
    return [{"path": str(f.resolve()), "size": _size(f), "mtime_ns": f.stat().st_mtime_ns} for f in files]
