"""Token stores -> training windows -> Grain iterators of global batches.

`data.path` is a prepared token store (`python -m lm.prepare`) or raw text (files, a directory,
a glob, JSONL, Parquet, a `datasets` directory; unset: this interpreter's standard-library `.py`
files), which is prepared into the cache (`data.cache_dir`) by the same code on first use.
`data.sources` mixes several such paths with weights.

Rows (`lm.data.windows`): windows of `seq_len + 1` tokens (stride `seq_len`) over the
concatenation of a split's documents, or a chat store's conversations packed whole; validation
holds out whole documents (a store of one document holds out its tail). Row order is shuffled from the seed once per epoch, the same for any process count: global
batch i is the same rows whoever reads them, and each process reads only its own. With
`data.document_masking`, each row also carries segment ids (which document each token is from),
so attention stays inside documents and positions restart at each; a chat store's rows carry
their loss mask.
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
from lm.data.windows import PackedSplit, Split, split
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
