"""What JSONL (also .gz / .zst), Parquet and `datasets` directories hold: each record's text
field (`texts`), or whole records (`records`, conversations), read in the piece's range of lines,
row groups or rows. A damaged file or a bad record is one line naming the file and line or row."""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from lm.errors import UserError

LINE_COUNT_BYTES = 1 << 20  # read this much at a time when counting lines (only for an error)


def texts(piece, reading) -> Iterator[str]:
    """Each record's text (`reading.text_field`) of a JSONL, Parquet or `datasets` piece."""
    if piece.kind == "jsonl":
        yield from _jsonl(piece, reading)
    elif piece.kind == "parquet":
        yield from _parquet(piece, reading)
    else:
        yield from _datasets(piece, reading)


def _open_jsonl(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _jsonl(piece, reading) -> Iterator[str]:
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


def _jsonl_lines(path: Path, piece) -> Iterator[tuple[bytes, int]]:
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


def _jsonl_records(path: Path, piece, reading) -> Iterator[str]:
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


def records(piece, reading) -> Iterator[tuple[object, object]]:
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

        f = parquet_file(path)
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
    ds = load_dataset(path)
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
            block = f.read(min(LINE_COUNT_BYTES, offset - read))
            if not block:
                break
            count += block.count(b"\n")
            read += len(block)
    return count


def _texts(column, reading, where: str) -> Iterator[str]:
    for text in column:
        if isinstance(text, str):
            yield text
        elif reading.skip_bad_records:
            reading.counts["bad_records_skipped"] += 1
        else:
            raise UserError(f"{where}: a record's {reading.text_field!r} is {type(text).__name__}, not text; skip such records with --config.data.skip_bad_records=True")


def _parquet(piece, reading) -> Iterator[str]:
    import pyarrow

    f = parquet_file(Path(piece.path))
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


def parquet_file(path: Path):
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise _unreadable_parquet(path, e) from None


def _unreadable_parquet(path, e: Exception) -> UserError:
    return UserError(f"{path} cannot be read as Parquet ({str(e).splitlines()[0]}); rewrite or remove it")


def load_dataset(path: Path):
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


def _datasets(piece, reading) -> Iterator[str]:
    ds = load_dataset(Path(piece.path))
    if reading.text_field not in ds.column_names:
        raise UserError(f"{piece.path}: no column {reading.text_field!r} (columns: {', '.join(ds.column_names)}); set data.text_field")
    stop = ds.num_rows if piece.stop < 0 else piece.stop
    for start in range(piece.start, stop, 1024):
        yield from _texts(ds[start : min(start + 1024, stop)][reading.text_field], reading, piece.path)
