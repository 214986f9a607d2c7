"""Token stores -> training windows -> Grain iterators of global batches.

`data.path` is a prepared token store (`python -m lm.prepare`) or raw text (files, a directory,
a glob, JSONL, Parquet, a `datasets` directory; unset: this interpreter's standard-library `.py`
files), which is prepared into the cache (`data.cache_dir`) by the same code on first use.
`data.sources` mixes several such paths with weights.

Windows of `seq_len + 1` tokens (stride `seq_len`) run over the concatenation of a split's
documents; validation holds out whole documents (a store of one document holds out its tail).
Window order is shuffled from the seed once per epoch, the same for any process count: global
batch i is the same rows whoever reads them, and each process reads only its own. With
`data.document_masking`, each row also carries segment ids (which document each token is from),
so attention stays inside documents and positions restart at each.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grain
import numpy as np

from lm import cache_home
from lm.config import apply_overrides
from lm.data import sources, token_store
from lm.data.chat import ChatFormat, chat_format, keep_template
from lm.data.token_store import TokenStore
from lm.data.tokenize import prepare_store
from lm.data.tokenizer import HFTokenizer, NoTokenizer, tokenizer_for
from lm.errors import UserError


def cache_dir(data_config) -> Path:
    if data_config.cache_dir:
        return Path(data_config.cache_dir).expanduser()
    return Path(cache_home())


def source_paths(data_config) -> list[tuple[str | None, float]]:
    """(path, weight) of every source: `data.sources`, else `data.path` with weight 1."""
    if not data_config.sources:
        return [(data_config.path, 1.0)]
    pairs = []
    for entry in data_config.sources:
        try:
            path, weight = entry
            weight = float(weight)
        except (TypeError, ValueError):
            raise UserError(f"data.sources entry {entry!r} is not a (path, weight) pair; write e.g. (('web/', 0.7), ('code/', 0.3))") from None
        if not weight > 0:
            raise UserError(f"data.sources weight for {path!r} must be positive, got {weight}")
        pairs.append((str(path), weight))
    return pairs


def store_tokenizer(data_config) -> str | None:
    """The `data.tokenizer` setting that names a prepared store's own tokenizer (its
    tokenizer.json, or byte) when a source is such a store; None when none is."""
    store_path = next((p for p, _ in source_paths(data_config) if token_store.is_store(p)), None)
    if store_path is None:
        return None
    store = TokenStore(store_path)
    if store.tokenizer_path is not None:
        return str(store.tokenizer_path.absolute())
    if store.manifest["tokenizer"] != "byte":
        raise UserError(f"token store {store_path} has no tokenizer.json; prepare it again")
    return "byte"


def with_store_tokenizer(config):
    """`config` with `data.tokenizer` naming a store's own tokenizer when a source is a prepared
    store (what the run's config.json then records, for resuming and `lm.generate`)."""
    setting = store_tokenizer(config.data)
    if setting is None:
        return config
    return apply_overrides(config, {"data.tokenizer": setting})


def tokenizer_for_corpus(data_config, workdir, files: list[Path] | None = None):
    """The tokenizer of a run: a store's own (when a source is a store), else `data.tokenizer`
    (a BPE is trained on `files` into `workdir`)."""
    setting = store_tokenizer(data_config)
    if setting is None:
        return tokenizer_for(data_config, workdir, files)
    return tokenizer_for(_with(data_config, tokenizer=setting), workdir)


def _with(data_config, **changes):
    import ml_collections

    copy = ml_collections.ConfigDict(data_config.to_dict())
    copy.update(changes)
    return copy


def store_for(path: str | None, data_config, tokenizer, progress: bool = True, chat: ChatFormat | None = None) -> TokenStore:
    """The token store of one source: itself, or raw text prepared into the cache (reused).
    `chat`: the source is conversations (`data.format=chat`), prepared so."""
    if token_store.is_store(path):
        store = TokenStore(path)
        if store.manifest["tokenizer"] != tokenizer.fingerprint:
            raise UserError(f"token store {path} was made with another tokenizer than this run's; prepare it again or use its tokenizer")
        if (store.chat is None) != (chat is None):
            held = "conversations" if store.chat is not None else "text"
            raise UserError(f"token store {path} holds {held}; set --config.data.format={'chat' if store.chat is not None else 'text'} or prepare it again")
        if chat is not None and store.chat["loss_on"] != chat.loss_on:
            raise UserError(f"token store {path} was prepared with data.loss_on={store.chat['loss_on']}, not {chat.loss_on}; prepare it again")
        return store
    files = sources.corpus_files(path)
    chat_key = None if chat is None else chat.to_dict()
    key = json.dumps([sources.fingerprint(files), tokenizer.fingerprint, data_config.text_field, data_config.skip_bad_records, chat_key])
    out = cache_dir(data_config) / f"store-{hashlib.sha256(key.encode()).hexdigest()[:24]}"
    return prepare_store(files, tokenizer, out, workers=data_config.workers or None, text_field=data_config.text_field,
                         skip_bad_records=data_config.skip_bad_records, chat=chat, progress=progress)


# ---------------------------------------------------------------------------- windows


class Split:
    """A sequence made of store ranges [start, start + length) one after another, read as
    windows of `seq_len + 1` tokens (stride `seq_len`)."""

    def __init__(self, store: TokenStore, starts: np.ndarray, lengths: np.ndarray, seq_len: int):
        self.store, self.seq_len = store, seq_len
        self.starts, self.lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)  # in the split's own sequence
        self.num_tokens = int(self.offsets[-1])
        self.count = max((self.num_tokens - 1) // seq_len, 0)

    def _read(self, begin: int, end: int) -> np.ndarray:
        out, r = [], int(np.searchsorted(self.offsets, begin, side="right")) - 1
        while begin < end:
            take = min(end, self.offsets[r + 1]) - begin
            at = self.starts[r] + begin - self.offsets[r]
            out.append(self.store.read(at, at + take))
            begin, r = begin + take, r + 1
        return np.concatenate(out)

    def rows(self, ids) -> np.ndarray:
        """Windows `ids` as int32 [n, seq_len + 1]."""
        return np.stack([self._read(i * self.seq_len, i * self.seq_len + self.seq_len + 1) for i in np.asarray(ids, np.int64)])

    def batch(self, ids, document_masking: bool) -> dict:
        """Windows `ids`: {'tokens' [n, seq_len + 1], 'segments' with document masking}."""
        out = {"tokens": self.rows(ids)}
        if document_masking:
            out["segments"] = self.segments(ids)
        return out

    def segments(self, ids) -> np.ndarray:
        """[n, seq_len + 1] int32: which document (numbered from 0 within the row) each token of
        windows `ids` belongs to. A document boundary is one in the store, or a join of two
        ranges of this split."""
        positions = np.asarray(ids, np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        r = np.searchsorted(self.offsets, positions, side="right") - 1
        at = self.starts[r] + positions - self.offsets[r]
        doc = np.searchsorted(self.store.doc_starts, at, side="right") - 1
        key = doc * (len(self.starts) + 1) + r  # a new range is a new segment even within a document
        changes = np.concatenate([np.zeros((len(key), 1), np.int64), (np.diff(key, axis=1) != 0).astype(np.int64)], axis=1)
        return np.cumsum(changes, axis=1).astype(np.int32)


def _held_out(store: TokenStore, val_fraction: float) -> np.ndarray:
    """The validation documents: whole ones picked in a fixed pseudo-random order until they
    hold about `val_fraction` of the tokens (documents larger than that are passed over)."""
    target = int(store.num_tokens * val_fraction)
    held, total = [], 0
    for d in np.random.default_rng(0).permutation(store.num_documents):
        if total + store.doc_lengths[d] <= target:
            held.append(d)
            total += int(store.doc_lengths[d])
        if total >= 0.9 * target:
            break
    mask = np.zeros(store.num_documents, bool)
    mask[held] = True
    return mask


def split(store: TokenStore, seq_len: int, val_fraction: float, where: str, packing: bool = True) -> tuple[Split, Split]:
    """(train, validation): validation is whole documents (`_held_out`); a store where none fits
    (one document) holds out its last tokens instead. A chat store's conversations are packed
    into rows whole (`PackedSplit`); there one held out at least."""
    if store.num_tokens == 0:
        raise UserError(f"the corpus at {where} holds no text; point data.path at non-empty text files")
    held = _held_out(store, val_fraction)
    if store.chat is not None:
        if store.num_documents < 2:
            raise UserError(f"the chat corpus at {where} holds {store.num_documents} conversation(s); training and validation need 2 or more")
        if not held.any() or held.all():
            held[:] = False
            held[-1] = True
        return PackedSplit(store, np.flatnonzero(~held), seq_len, packing), PackedSplit(store, np.flatnonzero(held), seq_len, packing)
    if held.any() and not held.all():
        train = Split(store, *_ranges(store, ~held), seq_len)
        val = Split(store, *_ranges(store, held), seq_len)
    else:
        n_val = max(int(store.num_tokens * val_fraction), 1)
        train = Split(store, [0], [store.num_tokens - n_val], seq_len)
        val = Split(store, [store.num_tokens - n_val], [n_val], seq_len)
    if train.count < 1 or val.count < 1:
        raise UserError(
            f"train.seq_len={seq_len} is longer than the corpus allows ({store.num_tokens} tokens at "
            f"{where}, {val.num_tokens} held out for validation); lower train.seq_len or use more text"
        )
    return train, val


class PackedSplit:
    """Whole conversations packed into rows of `seq_len + 1` tokens, next fit in store order
    (none is split: prepare cut each to a row), the rest of a row padding that is never trained
    and is a segment of its own; `packing=False`: one conversation a row.

    Packing happens once, here, over the split's document lengths, so a row is a fixed set of
    conversations that Grain's shuffled index reads at random, the same for any process count
    (an iterator-level packer, as Grain's, would give neither)."""

    def __init__(self, store: TokenStore, docs: np.ndarray, seq_len: int, packing: bool):
        self.store, self.seq_len, self.docs, self.packing = store, seq_len, np.asarray(docs, np.int64), packing
        lengths = store.doc_lengths[self.docs]
        width = seq_len + 1
        if len(lengths) and lengths.max() > width:
            raise UserError(f"the chat store at {store.directory} holds conversations of up to {int(lengths.max())} tokens, longer than a row "
                            f"(train.seq_len + 1 = {width}); prepare it again at this train.seq_len")
        if packing:
            firsts, used = [0], 0
            for i, n in enumerate(lengths.tolist()):
                if used + n > width:
                    firsts.append(i)
                    used = 0
                used += n
            firsts.append(len(lengths))
            self.firsts = np.asarray(firsts if len(lengths) else [0], np.int64)
        else:
            self.firsts = np.arange(len(lengths) + 1, dtype=np.int64)
        self.count = len(self.firsts) - 1
        self.num_tokens = int(lengths.sum())

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        docs = self.docs[self.firsts[r] : self.firsts[r + 1]]
        starts, lengths = self.store.doc_starts[docs], self.store.doc_lengths[docs]
        width, used = self.seq_len + 1, int(lengths.sum())
        tokens = np.zeros(width, np.int32)
        mask = np.zeros(width, np.uint8)
        at = 0
        for a, n in zip(starts.tolist(), lengths.tolist()):
            tokens[at : at + n], mask[at : at + n] = self.store.read(a, a + n), self.store.read_mask(a, a + n)
            at += n
        segments = np.concatenate([np.repeat(np.arange(len(docs), dtype=np.int32), lengths), np.full(width - used, len(docs), np.int32)])
        return tokens, mask, segments

    def batch(self, ids, document_masking: bool) -> dict:
        """Rows `ids`: {'tokens' [n, seq_len + 1] int32, 'mask' (uint8, 1 where the loss is on
        the token), 'segments' (packed rows)}."""
        tokens, mask, segments = (np.stack(parts) for parts in zip(*(self._row(int(r)) for r in np.asarray(ids, np.int64))))
        out = {"tokens": tokens, "mask": mask}
        if self.packing:
            out["segments"] = segments
        return out


def _ranges(store: TokenStore, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Store ranges covering the kept documents, adjacent ones merged."""
    docs = np.flatnonzero(keep)
    new_run = np.concatenate([[True], np.diff(docs) != 1])
    firsts = docs[new_run]
    ends = np.concatenate([docs[np.flatnonzero(new_run)[1:] - 1], docs[-1:]])
    starts = store.doc_starts[firsts]
    return starts, store.doc_starts[ends] + store.doc_lengths[ends] - starts


# ---------------------------------------------------------------------------- batches


class Corpus:
    """The run's data: tokenizer, and per source its (train, validation) splits and weight."""

    def __init__(self, tokenizer, splits: list[tuple[Split, Split]], weights: list[float], names: list[str], document_masking: bool):
        self.tokenizer, self.splits, self.names, self.document_masking = tokenizer, splits, names, document_masking
        self.weights = list(np.asarray(weights) / np.sum(weights))

    def _rows(self, split: Split | PackedSplit, ids) -> dict:
        return split.batch(ids, self.document_masking)

    def _mixed(self, which: int, shuffle_seed: int | None):
        """A MapDataset of (source, window) over every source, mixed by weight."""
        parts = []
        for s, pair in enumerate(self.splits):
            ds = grain.MapDataset.range(pair[which].count)
            if shuffle_seed is not None:
                ds = ds.shuffle(seed=shuffle_seed + s)
            parts.append(ds.repeat().map(lambda i, s=s: (s, i)))
        return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, self.weights)

    def _gather(self, src: np.ndarray, ids: np.ndarray, which: int, lo: int, hi: int) -> dict:
        """This process's rows [lo, hi) of a global batch of (source, window) pairs, and every
        row's source (for per-source token counts)."""
        mine_src, mine_ids, out = src[lo:hi], ids[lo:hi], {}
        for s in np.unique(mine_src):
            rows = np.flatnonzero(mine_src == s)
            for key, value in self._rows(self.splits[s][which], mine_ids[rows]).items():
                out.setdefault(key, np.zeros((len(mine_ids), *value.shape[1:]), value.dtype))[rows] = value
        out["sources"] = np.asarray(src, np.int32)
        return out

    def train_batches(self, global_batch: int, seed: int, process_index: int, process_count: int, prefetch: int):
        """A checkpointable iterator of this process's part of every global batch: {'tokens'
        [b_local, seq_len + 1], 'segments' (with document masking), 'sources' [global_batch]}."""
        local = global_batch // process_count
        lo = process_index * local
        ds = self._mixed(0, seed).batch(global_batch, drop_remainder=True).map(lambda b: self._gather(*b, 0, lo, lo + local))
        iterator = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)))
        return Batches(iterator, self.names, self.splits[0][0].seq_len)

    def eval_batches(self, global_batch: int, num_batches: int, process_index: int, process_count: int) -> list[dict]:
        """The same validation rows at every evaluation: each source's first windows in order."""
        local = global_batch // process_count
        lo = process_index * local
        ds = self._mixed(1, None)
        out = []
        for i in range(num_batches):
            src, ids = np.asarray([ds[i * global_batch + k] for k in range(global_batch)]).T
            out.append(self._gather(src, ids, 1, lo, lo + local))
        return out


class Batches:
    """The train iterator, counting the tokens each source has given and the batches drawn
    (checkpointed with it); batches whose number is in `skip` are drawn and dropped."""

    def __init__(self, iterator, names: list[str], seq_len: int):
        self.iterator, self.names, self.seq_len = iterator, names, seq_len
        self.counts = np.zeros(len(names), np.int64)
        self.taken = 0  # batches drawn so far: the number of the last one
        self.skip: set[int] = set()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.iterator)
        self.taken += 1
        while self.taken in self.skip:
            batch = next(self.iterator)
            self.taken += 1
        self.counts += np.bincount(batch["sources"], minlength=len(self.names)) * self.seq_len
        return batch

    def get_state(self) -> dict:
        return {"iterator": self.iterator.get_state(), "source_tokens": self.counts.tolist(), "batches_taken": self.taken}

    def set_state(self, state: dict) -> None:
        if "iterator" not in state:  # a checkpoint from before mixtures: the iterator's state alone
            self.iterator.set_state(state)
            return
        self.iterator.set_state(state["iterator"])
        self.counts = np.asarray(state["source_tokens"], np.int64)
        self.taken = state.get("batches_taken", 0)  # checkpoints from before batch numbers: counted from here

    def source_tokens(self) -> dict[str, int]:
        """{'tokens_from/NAME': tokens trained on from that source so far}."""
        return {f"tokens_from/{name}": int(n) for name, n in zip(self.names, self.counts)}


def open_corpus(config, workdir: Path, progress: bool = True) -> Corpus:
    """The run's corpus: tokenizer, sources prepared (or reused) as token stores, and split."""
    d = config.data
    pairs = source_paths(d)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    raw = [p for p, _ in pairs if not token_store.is_store(p)]
    tokenizer = tokenizer_for_corpus(d, workdir, sources.corpus_files(raw[0]) if raw and d.tokenizer == "bpe" else None)
    chat = chat_format(d, config.train.seq_len, d.tokenizer, Path(workdir))
    splits, names = [], []
    for path, _ in pairs:
        store = store_for(path, d, tokenizer, progress, chat)
        where = path or f"{sources.default_corpus_root()} (standard library)"
        splits.append(split(store, config.train.seq_len, d.val_fraction, where, d.get("packing", True)))
        name = Path(path).name if path else "stdlib"
        names.append(name if name not in names else f"{name}.{len(names)}")
    if chat is not None:  # for resuming, lm.generate --chat and exports
        keep_template(chat.template, Path(workdir))
    return Corpus(tokenizer, splits, [w for _, w in pairs], names, d.document_masking)


def nominal_vocab_size(data_config) -> int:
    """The vocabulary size a config implies, without training or reading a corpus."""
    if data_config.tokenizer == "byte":
        return 256
    if data_config.tokenizer == "bpe":
        return data_config.vocab_size
    if data_config.tokenizer == "none":
        return NoTokenizer.vocab_size
    return HFTokenizer(Path(data_config.tokenizer).expanduser()).vocab_size
