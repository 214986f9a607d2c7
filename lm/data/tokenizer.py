"""Tokenizers: bytes (no files), a BPE trained on the corpus, or any Hugging Face
`tokenizer.json`; `none` for a run that works on token ids only. Each has `encode`,
`encode_batch`, `decode`, `vocab_size`, `eos_id` and a `fingerprint` (what a token store was
made with). Light on purpose: `lm.prepare`'s worker processes import it, never JAX."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lm.data.sources import Reading, documents, plan_units
from lm.errors import UserError
from lm.paths import readable_file

EOS = "<|endoftext|>"



class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no files, 256 ids."""

    vocab_size = 256
    fingerprint = "byte"
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save_hf(self, path: Path) -> None:
        """The same tokenizer as a Hugging Face tokenizer.json: a byte-level BPE without merges,
        whose id for each byte is the byte's value (for exported models)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(str(path))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what byte-level BPE vocabularies hold)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spare = (256 + n for n in range(256))
    return {b: chr(b if b in kept else next(spare)) for b in range(256)}


class NoTokenizer:
    """A run without a tokenizer (a Hugging Face checkpoint imported without tokenizer.json):
    token ids only (`lm.generate --prompt_ids`)."""

    vocab_size = 0  # the model's vocabulary comes from model.vocab_size
    fingerprint = "none"
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        raise UserError(
            "this run has no tokenizer (data.tokenizer=none: imported without tokenizer.json), so text cannot be "
            "encoded; pass --config.data.tokenizer=path/to/tokenizer.json, or token ids (lm.generate --prompt_ids)"
        )

    decode = encode_batch = encode


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = path
        try:
            text = path.read_bytes().decode("utf-8")
            self.tokenizer = Tokenizer.from_str(text)
        except Exception as e:  # UnicodeDecodeError, or the library's own parse errors (plain Exception)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"{path} is not a Hugging Face tokenizer.json ({reason}); pass one saved by `tokenizers` or 'byte' / 'bpe'") from None
        self.vocab_size = self.tokenizer.get_vocab_size()
        if self.vocab_size < 1:
            raise UserError(f"{path} holds an empty vocabulary; pass a trained tokenizer.json")
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.eos_id = self.tokenizer.token_to_id(EOS)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many texts at once (the library's Rust side spreads them over threads)."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # fast: no offsets
        return [np.asarray(e.ids, dtype=np.int32) for e in encode(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, each token's first character in `text`), no special tokens added (a chat
        template writes its own)."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int32), np.asarray([a for a, _ in encoding.offsets], dtype=np.int64).reshape(-1)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


def train_bpe(texts: Iterator[str], vocab_size: int, path: Path) -> None:
    """A byte-level BPE tokenizer trained on `texts` (streamed), saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)


def load_tokenizer(spec: str):
    """'byte' or the path of a tokenizer.json (how `lm.prepare` hands a tokenizer to a worker)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(Path(spec))


def tokenizer_for(data_config, workdir: str | os.PathLike | None, files: list[Path] | None = None):
    """The run's tokenizer; a trained or given tokenizer.json is kept in the workdir and reused."""
    name = data_config.tokenizer
    if name == "byte":
        return ByteTokenizer()
    if name == "none":
        return NoTokenizer()
    kept = Path(workdir) / "tokenizer.json" if workdir is not None else None
    if kept is not None and kept.exists():
        return HFTokenizer(kept)
    if name == "bpe":
        if kept is None or files is None:
            raise UserError("a BPE tokenizer is trained into the workdir; pass --workdir")
        reading = Reading(data_config.text_field, data_config.skip_bad_records)
        texts = (text for unit in plan_units(files) for piece in unit for doc in documents(piece, reading) for text in doc)
        train_bpe(texts, data_config.vocab_size, kept)
        return HFTokenizer(kept)
    if not Path(name).expanduser().exists():
        raise UserError(f"data.tokenizer={name!r} is not 'byte', 'bpe' or an existing tokenizer.json")
    given = HFTokenizer(readable_file(name, "data.tokenizer"))  # parsed before anything is written
    if kept is None:
        return given
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(given.path, kept)
    return HFTokenizer(kept)


