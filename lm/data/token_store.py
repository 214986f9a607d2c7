"""The prepared token store: a directory of shards, memory-mapped for reading.

    DIR/manifest.json         format version, tokenizer fingerprint, sources (path, size, mtime),
                              token and document counts, what reading skipped; written last: a
                              store with a manifest is finished
    DIR/plan.json             the units of work (written first; a resumed prepare must match it)
    DIR/tokenizer.json        the tokenizer, when it is a tokenizers one
    DIR/NNNNN.tokens          unit NNNNN's token ids, raw, in the smallest dtype that holds the
                              vocabulary (uint8 / uint16 / uint32)
    DIR/NNNNN.mask            chat stores: one byte per token, 1 where the loss is on it
    DIR/NNNNN.docs.npy        its documents' lengths (int64), renamed into place last: a unit
                              with this file is done
    DIR/NNNNN.counts.json     what reading the unit skipped or replaced
    DIR/NNNNN.crc32           the CRC-32 of its .tokens file, gathered into the manifest too:
                              a store's shards are checked against it whenever a run opens it

Megatron-LM's `.bin` / `.idx` pairs and Levanter's cache are the same idea; this keeps numpy's
formats so a store is inspectable with `np.memmap` / `np.load` alone.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from lm.errors import UserError

FORMAT = "meshlm-token-store"
VERSION = 1
MANIFEST, PLAN = "manifest.json", "plan.json"


def token_dtype(vocab_size: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocabulary of {vocab_size} ids")


def is_store(path: str | os.PathLike | None) -> bool:
    return path is not None and (Path(path).expanduser() / MANIFEST).is_file()


def unit_name(index: int) -> str:
    return f"{index:05d}"


def unit_done(directory: Path, index: int) -> bool:
    return (directory / f"{unit_name(index)}.docs.npy").is_file()


class UnitWriter:
    """One unit's tokens appended document by document, then committed atomically."""

    def __init__(self, directory: Path, index: int, dtype: np.dtype, with_mask: bool = False):
        self.directory, self.name, self.dtype = directory, unit_name(index), dtype
        self.tmp = directory / f".{self.name}.tokens.tmp"
        self.file = open(self.tmp, "wb")
        self.mask_tmp = directory / f".{self.name}.mask.tmp"
        self.mask_file = open(self.mask_tmp, "wb") if with_mask else None
        self.lengths: list[int] = []
        self.tokens = self.current = self.crc32 = 0

    def write(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """More tokens of the current document (and, in a chat store, their loss mask)."""
        if self.mask_file is not None:
            self.mask_file.write(np.asarray(mask, np.uint8).tobytes())
        data = np.asarray(ids, self.dtype).tobytes()
        self.file.write(data)
        self.crc32 = zlib.crc32(data, self.crc32)
        self.current += len(ids)

    def end_document(self, eos: list[np.ndarray]) -> None:
        """Closes the current document (after `eos`, the separator, if any); empty ones vanish."""
        if self.current:
            for ids in eos:
                self.write(ids)
            self.lengths.append(self.current)
            self.tokens += self.current
        self.current = 0

    def commit(self, counts: dict) -> None:
        self.file.close()
        if self.mask_file is not None:
            self.mask_file.close()
            os.replace(self.mask_tmp, self.directory / f"{self.name}.mask")
        os.replace(self.tmp, self.directory / f"{self.name}.tokens")
        (self.directory / f"{self.name}.counts.json").write_text(json.dumps(counts, sort_keys=True))
        (self.directory / f"{self.name}.crc32").write_text(str(self.crc32))
        tmp = self.directory / f".{self.name}.docs.tmp.npy"
        np.save(tmp, np.asarray(self.lengths, np.int64))
        os.replace(tmp, self.directory / f"{self.name}.docs.npy")  # the unit's done marker, last


def _crc32(path: Path) -> int:
    """CRC-32 of a shard file, read in 16 MiB pieces (about 1 s per GB; not through the memory
    map, whose touched pages would stay in the process's resident memory)."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            crc = zlib.crc32(piece, crc)
    return crc


def unit_crc32(directory: Path, index: int) -> int | None:
    """The checksum a unit was committed with (None for units written before checksums)."""
    path = directory / f"{unit_name(index)}.crc32"
    return int(path.read_text()) if path.is_file() else None


class TokenStore:
    """A finished store, memory-mapped: `read(start, stop)` of the global token sequence (the units
    concatenated), and every document's global [start, start + length)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        manifest_path = self.directory / MANIFEST
        if not manifest_path.is_file():
            raise UserError(f"{self.directory} is not a finished token store (no {MANIFEST}); run python -m lm.prepare to finish it")
        try:
            self.manifest = json.loads(manifest_path.read_text())
            if self.manifest.get("format") != FORMAT:
                raise ValueError("not a token store manifest")
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{manifest_path} is not a meshlm token store manifest ({e}); prepare the data again into a new directory") from None
        if self.manifest.get("version") != VERSION:
            raise UserError(f"{self.directory} is a version {self.manifest.get('version')} store; this meshlm reads version {VERSION}: prepare it again")
        self.dtype = np.dtype(self.manifest["dtype"])
        self.chat = self.manifest.get("chat")  # how conversations were prepared; None: text
        self.units, self.masks = [], []
        lengths = []
        crcs = self.manifest.get("crc32") or [None] * self.manifest["units"]  # stores prepared before checksums: sizes only
        for i in range(self.manifest["units"]):
            name = unit_name(i)
            path = self.directory / f"{name}.tokens"
            size = path.stat().st_size // self.dtype.itemsize if path.is_file() else -1
            docs = np.load(self.directory / f"{name}.docs.npy")
            if size != int(docs.sum()):
                raise UserError(f"{path} holds {size} tokens but its index says {int(docs.sum())}: the store is damaged; prepare it again")
            unit = np.memmap(path, self.dtype, mode="r") if size else np.zeros(0, self.dtype)
            if crcs[i] is not None and _crc32(path) != crcs[i]:
                raise UserError(f"{path} does not match the checksum its store recorded when it was prepared (changed bytes on disk): "
                                "the store is damaged; prepare it again")
            self.units.append(unit)
            lengths.append(docs)
            if self.chat is not None:
                mask_path = self.directory / f"{name}.mask"
                if (mask_path.stat().st_size if mask_path.is_file() else -1) != size:
                    raise UserError(f"{mask_path} does not hold one loss-mask byte per token: the store is damaged; prepare it again")
                self.masks.append(np.memmap(mask_path, np.uint8, mode="r") if size else np.zeros(0, np.uint8))
        self.doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(self.doc_lengths)[:-1]]).astype(np.int64)
        self.unit_starts = np.concatenate([[0], np.cumsum([len(u) for u in self.units])]).astype(np.int64)
        self.num_tokens = int(self.unit_starts[-1])
        self.num_documents = len(self.doc_lengths)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole store as int32 (crossing units as needed)."""
        return self._read(self.units, start, stop).astype(np.int32)

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """A chat store's loss mask over tokens [start, stop), uint8."""
        return self._read(self.masks, start, stop)

    def _read(self, arrays, start: int, stop: int) -> np.ndarray:
        out, first = [], int(np.searchsorted(self.unit_starts, start, side="right")) - 1
        for u in range(first, len(arrays)):
            lo, hi = self.unit_starts[u], self.unit_starts[u + 1]
            if lo >= stop:
                break
            a, b = max(start, lo) - lo, min(stop, hi) - lo
            if b > a:
                out.append(arrays[u][a:b])
        return np.concatenate(out) if out else np.zeros(0, arrays[0].dtype if arrays else np.int32)

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.directory / "tokenizer.json"
        return path if path.is_file() else None
