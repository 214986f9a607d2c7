"""Text corpus -> tokens -> a Grain pipeline of global batches.

Sources: one text file, a directory or glob of text files, or JSONL with a `text` field; with no
source, this interpreter's own standard-library `.py` files (a code corpus found on every
machine). Tokens are cached once per (corpus, tokenizer) fingerprint. The last `val_fraction`
of the tokens is held out. Training windows of `seq_len + 1` tokens are shuffled from the seed,
reshuffled each epoch, and each process reads only its own rows of every global batch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from lm.config import UserError
from lm.inputs import readable_file

EOS = "<|endoftext|>"


# ---------------------------------------------------------------------------- corpus


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: str | None) -> list[Path]:
    """The files of a corpus, sorted; `path` is a file, a directory, a glob, or None (stdlib)."""
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
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts))
        if not files:
            raise UserError(f"data.path={path!r} is an empty directory; put text files in it")
        return [readable_file(f, "a file under data.path") for f in files]
    raise UserError(f"data.path={path!r} does not exist; pass --config.data.path=FILE|DIR|GLOB (or leave it unset for the built-in corpus)")


def documents(files: list[Path]) -> Iterator[str]:
    """The text of each file, or of each JSONL record's `text` field; binary files are skipped."""
    for f in files:
        if f.suffix == ".jsonl":
            with f.open(encoding="utf-8") as lines:
                for n, line in enumerate(lines, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)["text"]
                        except (json.JSONDecodeError, KeyError, TypeError) as e:
                            raise UserError(f"{f}:{n}: not a JSON object with a 'text' field ({e})") from None
            continue
        raw = f.read_bytes()
        if b"\0" not in raw[:8192]:
            yield raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no files, 256 ids."""

    vocab_size = 256
    fingerprint = "byte"
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

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

    decode = encode


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

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


def train_bpe(docs: Iterator[str], vocab_size: int, path: Path) -> None:
    """A byte-level BPE tokenizer trained on `docs`, saved to `path`."""
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
    tok.train_from_iterator(docs, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)


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
        train_bpe(documents(files), data_config.vocab_size, kept)
        return HFTokenizer(kept)
    if not Path(name).expanduser().exists():
        raise UserError(f"data.tokenizer={name!r} is not 'byte', 'bpe' or an existing tokenizer.json")
    given = HFTokenizer(readable_file(name, "data.tokenizer"))  # parsed before anything is written
    if kept is None:
        return given
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(given.path, kept)
    return HFTokenizer(kept)


# ---------------------------------------------------------------------------- tokens


def cache_dir(data_config) -> Path:
    if data_config.cache_dir:
        return Path(data_config.cache_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshlm"


def corpus_tokens(data_config, tokenizer, files: list[Path]) -> np.ndarray:
    """All tokens of the corpus, tokenised once and cached under a fingerprint of both."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([stats, tokenizer.fingerprint]).encode()).hexdigest()[:24]
    cached = cache_dir(data_config) / f"tokens-{key}.npy"
    if cached.exists():
        return np.load(cached, mmap_mode="r")
    pieces = []
    for doc in documents(files):
        pieces.append(tokenizer.encode(doc))
        if tokenizer.eos_id is not None:
            pieces.append(np.asarray([tokenizer.eos_id], np.int32))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    tokens = tokens.astype(np.uint16 if tokenizer.vocab_size <= 65536 else np.int32)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, cached)
    return tokens


class Windows:
    """Windows of `seq_len + 1` tokens (stride seq_len) over one split of the token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = (len(tokens) - 1) // seq_len

    def rows(self, ids: np.ndarray) -> np.ndarray:
        starts = np.asarray(ids, np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[starts], dtype=np.int32)


def split(tokens: np.ndarray, seq_len: int, val_fraction: float, where: str) -> tuple[Windows, Windows]:
    """(train, validation) windows; the validation tokens are the last `val_fraction`."""
    if len(tokens) == 0:
        raise UserError(f"the corpus at {where} holds no text; point data.path at non-empty text files")
    n_val = int(len(tokens) * val_fraction)
    train, val = Windows(tokens[: len(tokens) - n_val], seq_len), Windows(tokens[len(tokens) - n_val :], seq_len)
    if train.count < 1 or val.count < 1:
        raise UserError(
            f"train.seq_len={seq_len} is longer than the corpus allows ({len(tokens)} tokens at "
            f"{where}, {n_val} held out for validation); lower train.seq_len or use more text"
        )
    return train, val


def prepare(config, workdir: Path):
    """(tokenizer, train windows, validation windows) for a run's config."""
    files = corpus_files(config.data.path)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_for(config.data, workdir, files)
    tokens = corpus_tokens(config.data, tokenizer, files)
    where = config.data.path or f"{default_corpus_root()} (standard library)"
    return (tokenizer, *split(tokens, config.train.seq_len, config.data.val_fraction, where))


# ---------------------------------------------------------------------------- batches


def train_batches(windows: Windows, global_batch: int, seed: int, process_index: int, process_count: int, prefetch: int):
    """A checkpointable iterator of this process's rows [b_local, seq_len + 1] of each global batch.

    Global batch i is the same whatever the process count; process p reads its contiguous
    block of `global_batch // process_count` rows.
    """
    local = global_batch // process_count
    lo = process_index * local
    ds = (
        grain.MapDataset.range(windows.count)
        .shuffle(seed=seed)
        .repeat()
        .batch(global_batch, drop_remainder=True)
        .map(lambda ids: windows.rows(ids[lo : lo + local]))
    )
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)))


def eval_batches(windows: Windows, global_batch: int, num_batches: int, process_index: int, process_count: int) -> list[np.ndarray]:
    """The same validation rows at every evaluation: the first windows in order (wrapping)."""
    local = global_batch // process_count
    lo = process_index * local
    out = []
    for i in range(num_batches):
        ids = (np.arange(global_batch) + i * global_batch) % windows.count
        out.append(windows.rows(ids[lo : lo + local]))
    return out


def nominal_vocab_size(data_config) -> int:
    """The vocabulary size a config implies, without training or reading a corpus."""
    if data_config.tokenizer == "byte":
        return ByteTokenizer.vocab_size
    if data_config.tokenizer == "bpe":
        return data_config.vocab_size
    if data_config.tokenizer == "none":
        return NoTokenizer.vocab_size
    return HFTokenizer(Path(data_config.tokenizer).expanduser()).vocab_size
