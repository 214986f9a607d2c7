"""A directory of safetensors files as `transformers` reads and writes them: one
`model.safetensors`, or shards named by `model.safetensors.index.json`. Read one tensor at a
time through safetensors' memory-mapped numpy API; written shard by shard, so neither side holds
more than one tensor (reading) or one shard (writing) on the host."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from lm.config import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Reader:
    def __init__(self, directory: Path):
        self.directory = directory
        self._files: dict = {}
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{index} is not a safetensors index ({type(e).__name__}); re-save the model with save_pretrained") from None
        elif (directory / SINGLE).is_file():
            weight_map = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            raise UserError(
                f"{directory} holds no {SINGLE} or {INDEX}: meshlm reads safetensors only "
                "(re-save a PyTorch .bin checkpoint with save_pretrained(..., safe_serialization=True))"
            )
        self.weight_map: dict[str, str] = weight_map

    def _open(self, file: str):
        opened = self._files
        if file not in opened:
            path = self.directory / file
            if not path.is_file():
                raise UserError(f"{path} is named by {INDEX} but does not exist; the checkpoint is incomplete")
            try:
                opened[file] = safe_open(str(path), framework="np")
            except Exception as e:  # the library raises its own error types for damaged headers
                raise UserError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return opened[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        return self._open(self.weight_map[name]).get_tensor(name)


class Writer:
    """Tensors added one at a time, written in shards of at most `max_shard_bytes` (a tensor
    larger than that gets a shard of its own), named as `transformers` names them."""

    def __init__(self, directory: Path, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self.pending and sum(a.nbytes for a in self.pending.values()) + array.nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(array)
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        save_file(self.pending, str(self._part(len(self.shards))), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending = {}

    def _part(self, i: int) -> Path:
        return self.directory / f".part-{i}.safetensors"

    def close(self) -> list[str]:
        """Writes what is pending, names the shards, writes the index; returns the file names."""
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(self._part(i), self.directory / name)
        if n > 1:
            weight_map = {tensor: name for name, tensors in zip(names, self.shards) for tensor in tensors}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes (as `transformers`' max_shard_size)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            number = upper[: -len(unit)]
            break
    else:
        number, factor = upper, 1
    try:
        size = int(float(number) * factor)
    except ValueError:
        size = 0
    if size <= 0:
        raise UserError(f"--max_shard_size={text!r} is not a size; write e.g. 5GB, 500MB or a number of bytes")
    return size
