"""A directory of safetensors files as `transformers` reads and writes them: one
`model.safetensors`, or shards named by `model.safetensors.index.json`. Read one tensor at a
time through safetensors' numpy API; written one tensor at a time into planned shards, so neither
side holds more than one tensor on the host."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from lm.config import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Reader:
    """Each read maps the file, copies one tensor out and unmaps it again: pages of the file never
    pile up in the process's resident memory (a mapping kept open would hold every page read)."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                    raise TypeError("weight_map is not a map of tensor names to file names")
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{index} is not a safetensors index ({type(e).__name__}); re-save the model with save_pretrained") from None
        elif (directory / SINGLE).is_file():
            with self._open(SINGLE) as f:
                weight_map = {name: SINGLE for name in f.keys()}
        else:
            raise UserError(
                f"{directory} holds no {SINGLE} or {INDEX}: meshlm reads safetensors only "
                "(re-save a PyTorch .bin checkpoint with save_pretrained(..., safe_serialization=True))"
            )
        self.weight_map: dict[str, str] = weight_map

    def _open(self, file: str):
        path = self.directory / file
        if not path.is_file():
            raise UserError(f"{path} is named by {INDEX} but does not exist; the checkpoint is incomplete")
        try:
            return safe_open(str(path), framework="np")
        except Exception as e:  # the library raises its own error types for damaged headers
            raise UserError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        with self._open(self.weight_map[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        """The tensor as numpy holds it; a float8 weight with a block-scale companion
        (`<name>_scale_inv`, DeepSeek-V3's released form) dequantised to float32."""
        with self._open(self.weight_map[name]) as f:
            dtype = f.get_slice(name).get_dtype()
            if dtype not in FLOAT8:
                return f.get_tensor(name)
        weight = self._raw(name, FLOAT8[dtype])
        if f"{name}_scale_inv" not in self:
            raise UserError(f"{self.directory}: tensor {name} is {dtype} without a {name}_scale_inv beside it; meshlm imports "
                            "float8 weights with DeepSeek-V3's block scales only")
        return block_dequantised(weight, self.read(f"{name}_scale_inv"), self._block_size(), name)

    def _block_size(self) -> tuple[int, int]:
        """The float8 weights' scale blocks, from config.json's `quantization_config`."""
        try:
            block = json.loads((self.directory / "config.json").read_text())["quantization_config"]["weight_block_size"]
            rows, cols = (int(b) for b in block)
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"{self.directory}/config.json names no quantization_config.weight_block_size [rows, columns] for its "
                            "float8 weights") from None
        return rows, cols

    def _raw(self, name: str, dtype) -> np.ndarray:
        """A tensor numpy's safetensors reader cannot type (float8), read from the file's bytes."""
        path = self.directory / self.weight_map[name]
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(length))[name]
        start, stop = entry["data_offsets"]
        raw = np.fromfile(path, dtype=np.uint8, count=stop - start, offset=8 + length + start)
        return raw.view(dtype).reshape(entry["shape"])


def block_dequantised(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "") -> np.ndarray:
    """A float8 weight [out, in] times its per-block scales [ceil(out / b0), ceil(in / b1)] (each
    `block` b0 x b1 of weights shares one; DeepSeek's `weight_scale_inv` multiplies), in float32."""
    (rows, cols), (b0, b1) = weight.shape, block
    if scale_inv.shape != (-(-rows // b0), -(-cols // b1)):
        raise UserError(f"{name}_scale_inv has shape {scale_inv.shape}; a {weight.shape} weight in {b0} x {b1} blocks has "
                        f"{(-(-rows // b0), -(-cols // b1))}")
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=0), b1, axis=1)[:rows, :cols]
    return weight.astype(np.float32) * scales


class Writer:
    """Tensors written one at a time, straight into their shard file, in the order `plan` lists
    them ((name, shape, dtype) of each): shard boundaries (at most `max_shard_bytes`, a larger
    tensor alone in its own) and every header are known up front, so nothing is held back.

    Written here rather than with `safetensors.numpy.save_file`, which takes a whole shard as a
    dict and serialises it in memory: the files are the same format, read back by safetensors'
    own reader and by `transformers` in the tests."""

    def __init__(self, directory: Path, plan: list[tuple[str, tuple, np.dtype]], max_shard_bytes: int):
        self.directory = directory
        self.shards: list[list[tuple[str, tuple, np.dtype]]] = [[]]
        size = 0
        for entry in plan:
            nbytes = int(np.prod(entry[1], dtype=np.int64)) * np.dtype(entry[2]).itemsize
            if self.shards[-1] and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(entry)
            size += nbytes
        n = len(self.shards)
        self.names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.order = [entry for shard in self.shards for entry in shard]
        self.position, self.file, self.shard = 0, None, -1

    def add(self, name: str, array: np.ndarray) -> None:
        want_name, shape, dtype = self.order[self.position]
        if (name, tuple(shape), np.dtype(dtype)) != (want_name, array.shape, array.dtype):
            raise ValueError(f"expected {want_name} {shape} {dtype}, got {name} {array.shape} {array.dtype}")
        if self.file is None or self._shard_of(self.position) != self.shard:
            self._start(self._shard_of(self.position))
        self.file.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))  # no copy
        self.position += 1

    def _shard_of(self, position: int) -> int:
        for i, shard in enumerate(self.shards):
            if position < len(shard):
                return i
            position -= len(shard)
        raise ValueError("more tensors than planned")

    def _start(self, shard: int) -> None:
        if self.file is not None:
            self.file.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in self.shards[shard]:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _DTYPES[np.dtype(dtype).name], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.file = open(self._part(shard), "wb")
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.shard = shard

    def _part(self, i: int) -> Path:
        return self.directory / f".part-{i}.safetensors"

    def close(self) -> list[str]:
        """Names the shards (once all are written) and writes the index; returns the file names."""
        if self.position != len(self.order):
            raise ValueError(f"{len(self.order) - self.position} planned tensors were not written")
        self.file.close()
        for i, name in enumerate(self.names):
            os.replace(self._part(i), self.directory / name)
        if len(self.names) > 1:
            weight_map = {entry[0]: name for name, shard in zip(self.names, self.shards) for entry in shard}
            total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d in self.order)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return self.names


_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


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
