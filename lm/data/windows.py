"""A split's training rows, read from a token store: windows of `seq_len + 1` tokens over its
documents one after another (`Split`), or a chat store's conversations packed whole into rows
(`PackedSplit`); and how a store is split into training and validation (`split`)."""

from __future__ import annotations

import numpy as np

from lm.data.token_store import TokenStore
from lm.errors import UserError


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
