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
import gzip
import io
import json
import sysconfig
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

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
            groups = _parquet_file(f).num_row_groups
            per_unit = max(1, groups * target // size)
            units.extend([Piece(str(f), kind, g, min(g + per_unit, groups))] for g in range(0, groups, per_unit))
        elif kind == "datasets":
            close_small()
            rows = _load_dataset(f).num_rows
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
    elif piece.kind == "jsonl":
        for text in _jsonl(piece, reading):
            yield iter((text,))
    elif piece.kind == "parquet":
        for text in _parquet(piece, reading):
            yield iter((text,))
    else:
        for text in _datasets(piece, reading):
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


def _open_jsonl(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _jsonl(piece: Piece, reading: Reading) -> Iterator[str]:
    """Records of the lines that *start* in [start, stop) (whole file for compressed ones); a
    file that does not decompress is a UserError."""
    path = Path(piece.path)
    try:
        yield from _jsonl_records(path, piece, reading)
    except _read_errors() as e:
        raise UserError(f"{path} cannot be read ({e}); re-compress or remove it") from None


def _read_errors() -> tuple[type[Exception], ...]:
    """What reading a damaged file raises: OSError (BadGzipFile), EOFError (a cut stream),
    zlib.error (corrupt deflate data), zstandard's ZstdError."""
    errors: list[type[Exception]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def _jsonl_lines(path: Path, piece: Piece) -> Iterator[tuple[bytes, int]]:
    """(line, its byte offset) of the non-blank lines that start in [start, stop)."""
    with _open_jsonl(path) as f:
        position = 0
        if piece.start > 0:
            f.seek(piece.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that started before this range belongs to the previous unit
            position = f.tell()
        while piece.stop < 0 or position < piece.stop:
            line = f.readline()
            if not line:
                break
            start, position = position, position + len(line)
            if line.strip():
                yield line, start


def _jsonl_records(path: Path, piece: Piece, reading: Reading) -> Iterator[str]:
    for line, start in _jsonl_lines(path, piece):
        try:
            record = json.loads(line)
            text = record[reading.text_field]
            if not isinstance(text, str):
                raise TypeError(f"field {reading.text_field!r} is {type(text).__name__}, not text")
        except (ValueError, KeyError, TypeError) as e:
            if reading.skip_bad_records:
                reading.counts["bad_records_skipped"] += 1
                continue
            number = _line_number(path, start)
            reason = f"no {reading.text_field!r} field" if isinstance(e, KeyError) else str(e).splitlines()[0]
            raise UserError(
                f"{path}:{number}: not a JSON object with a text field {reading.text_field!r} ({reason}); "
                "fix the line, set data.text_field, or skip such lines with --config.data.skip_bad_records=True"
            ) from None
        yield text


def records(piece: Piece, reading: Reading) -> Iterator[tuple[object, object]]:
    """(record, where it is) of every record of a JSONL, Parquet or `datasets` piece, for
    conversations: a JSONL line's object, a table row's columns as a dict. `where` names the
    file and line (JSONL) or row."""
    path = Path(piece.path)
    if piece.kind == "text":
        raise UserError(f"{path}: data.format=chat reads records (JSONL, Parquet or a datasets directory), not plain text")
    if piece.kind == "jsonl":
        try:
            for line, start in _jsonl_lines(path, piece):
                try:
                    yield json.loads(line), _Where(path, start)
                except ValueError as e:
                    if reading.skip_bad_records:
                        reading.counts["bad_records_skipped"] += 1
                        continue
                    raise UserError(f"{path}:{_line_number(path, start)}: not a JSON object ({str(e).splitlines()[0]})") from None
        except _read_errors() as e:
            raise UserError(f"{path} cannot be read ({e}); re-compress or remove it") from None
        return
    if piece.kind == "parquet":
        import pyarrow

        f = _parquet_file(path)
        stop = f.num_row_groups if piece.stop < 0 else piece.stop
        first_row = sum(f.metadata.row_group(g).num_rows for g in range(piece.start))
        groups = list(range(piece.start, stop))
        if not groups:
            return
        try:
            for batch in f.iter_batches(batch_size=1024, row_groups=groups):
                for row in batch.to_pylist():
                    yield row, f"{path} row {first_row}"
                    first_row += 1
        except (pyarrow.ArrowException, OSError) as e:
            raise _unreadable_parquet(path, e) from None
        return
    ds = _load_dataset(path)
    stop = ds.num_rows if piece.stop < 0 else piece.stop
    for start in range(piece.start, stop, 1024):
        part = ds[start : min(start + 1024, stop)]
        for k, row in enumerate(zip(*part.values())):
            yield dict(zip(part, row)), f"{path} row {start + k}"


class _Where:
    """A JSONL record's place, `path:line`, its line number counted only when shown (in an error)."""

    def __init__(self, path: Path, offset: int):
        self.path, self.offset = path, offset

    def __str__(self) -> str:
        return f"{self.path}:{_line_number(self.path, self.offset)}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _line_number(path: Path, offset: int) -> int:
    """The 1-based line number of the line starting at byte `offset` (counted only on error)."""
    with _open_jsonl(path) as f:
        count, read = 1, 0
        while read < offset:
            block = f.read(min(CHUNK_BYTES, offset - read))
            if not block:
                break
            count += block.count(b"\n")
            read += len(block)
    return count


def _texts(column, reading: Reading, where: str) -> Iterator[str]:
    for text in column:
        if isinstance(text, str):
            yield text
        elif reading.skip_bad_records:
            reading.counts["bad_records_skipped"] += 1
        else:
            raise UserError(f"{where}: a record's {reading.text_field!r} is {type(text).__name__}, not text; skip such records with --config.data.skip_bad_records=True")


def _parquet(piece: Piece, reading: Reading) -> Iterator[str]:
    import pyarrow

    f = _parquet_file(Path(piece.path))
    if reading.text_field not in f.schema_arrow.names:
        raise UserError(f"{piece.path}: no column {reading.text_field!r} (columns: {', '.join(f.schema_arrow.names)}); set data.text_field")
    stop = f.num_row_groups if piece.stop < 0 else piece.stop
    groups = list(range(piece.start, stop))
    if not groups:
        return
    try:
        for batch in f.iter_batches(batch_size=1024, row_groups=groups, columns=[reading.text_field]):
            yield from _texts(batch.column(0).to_pylist(), reading, piece.path)
    except (pyarrow.ArrowException, OSError) as e:
        raise _unreadable_parquet(piece.path, e) from None


def _parquet_file(path: Path):
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise _unreadable_parquet(path, e) from None


def _unreadable_parquet(path, e: Exception) -> UserError:
    return UserError(f"{path} cannot be read as Parquet ({str(e).splitlines()[0]}); rewrite or remove it")


def _load_dataset(path: Path):
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # the library's own errors for a damaged directory
        raise UserError(f"{path} cannot be read by datasets.load_from_disk ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{path} is a DatasetDict without a 'train' split ({', '.join(ds)}); save the split you want with save_to_disk")
        ds = ds["train"]
    return ds


def _datasets(piece: Piece, reading: Reading) -> Iterator[str]:
    ds = _load_dataset(Path(piece.path))
    if reading.text_field not in ds.column_names:
        raise UserError(f"{piece.path}: no column {reading.text_field!r} (columns: {', '.join(ds.column_names)}); set data.text_field")
    stop = ds.num_rows if piece.stop < 0 else piece.stop
    for start in range(piece.start, stop, 1024):
        yield from _texts(ds[start : min(start + 1024, stop)][reading.text_field], reading, piece.path)


def fingerprint(files: list[Path]) -> list[dict]:
    """What the sources were when read: path, size, modification time (a store records them)."""
    return [{"path": str(f.resolve()), "size": _size(f), "mtime_ns": f.stat().st_mtime_ns} for f in files]
