import json

import numpy as np
import pytest
from ml_collections import ConfigDict

from lm import data
from lm.config import UserError


def data_config(**kw):
    return ConfigDict({"tokenizer": "byte", "vocab_size": 300, "cache_dir": None, **kw})


def test_sources_file_directory_glob_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha ")
    (tmp_path / "d" / "b.txt").write_text("beta")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n" + json.dumps({"text": "delta"}) + "\n")
    assert list(data.documents(data.corpus_files(str(tmp_path / "d")))) == ["alpha ", "beta"]
    assert [f.name for f in data.corpus_files(str(tmp_path / "d" / "*.txt"))] == ["a.txt", "b.txt"]
    assert list(data.documents(data.corpus_files(str(tmp_path / "c.jsonl")))) == ["gamma", "delta"]
    default = data.corpus_files(None)
    assert len(default) > 100 and all(f.suffix == ".py" for f in default)


def test_bad_sources_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        data.corpus_files(str(tmp_path / "missing.txt"))
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(UserError, match="bad.jsonl:1: not a JSON object with a 'text' field"):
        list(data.documents([tmp_path / "bad.jsonl"]))
    with pytest.raises(UserError, match="holds no text"):
        data.split(np.zeros(0, np.int32), 8, 0.1, "x")
    with pytest.raises(UserError, match="train.seq_len=64 is longer than the corpus allows"):
        data.split(np.arange(100), 64, 0.1, "x")


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    assert tok.decode(tok.encode("héllo\n")) == "héllo\n"


def test_bpe_is_trained_saved_in_workdir_and_reused(tmp_path, small_corpus):
    cfg = data_config(tokenizer="bpe", vocab_size=300)
    files = data.corpus_files(str(small_corpus))
    tok = data.tokenizer_for(cfg, tmp_path, files)
    assert (tmp_path / "tokenizer.json").exists() and tok.vocab_size == 300
    text = "def main():\n    return 42\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text)
    again = data.tokenizer_for(cfg, tmp_path, None)  # reused: no corpus needed
    assert again.fingerprint == tok.fingerprint
    loaded = data.tokenizer_for(data_config(tokenizer=str(tmp_path / "tokenizer.json")), tmp_path / "other", None)
    assert loaded.fingerprint == tok.fingerprint and (tmp_path / "other" / "tokenizer.json").exists()


def test_tokens_are_cached_by_fingerprint(tmp_path, small_corpus):
    cfg = data_config(cache_dir=str(tmp_path / "cache"))
    files = data.corpus_files(str(small_corpus))
    first = data.corpus_tokens(cfg, data.ByteTokenizer(), files)
    cached = list((tmp_path / "cache").glob("tokens-*.npy"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    second = data.corpus_tokens(cfg, data.ByteTokenizer(), files)
    np.testing.assert_array_equal(first, second)
    assert cached[0].stat().st_mtime_ns == stamp and len(first) == small_corpus.stat().st_size


def windows(n=10_000, seq_len=16):
    return data.split(np.arange(n) % 60000, seq_len, 0.1, "test")


def test_train_and_validation_windows_do_not_overlap():
    train, val = windows()
    train_tokens = set(train.rows(np.arange(train.count)).ravel().tolist())
    val_tokens = set(val.rows(np.arange(val.count)).ravel().tolist())
    assert train_tokens and val_tokens and not train_tokens & val_tokens


def take(it, n):
    return [next(it) for _ in range(n)]


def test_same_seed_same_batches_and_windows_of_seq_len_plus_one():
    train, _ = windows()
    a = take(data.train_batches(train, 8, seed=3, process_index=0, process_count=1, prefetch=2), 5)
    b = take(data.train_batches(train, 8, seed=3, process_index=0, process_count=1, prefetch=0), 5)
    c = take(data.train_batches(train, 8, seed=4, process_index=0, process_count=1, prefetch=0), 5)
    assert a[0].shape == (8, 17)
    np.testing.assert_array_equal(a[0][:, 1:], a[0][:, :-1] + 1)  # contiguous text
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert any((x != z).any() for x, z in zip(a, c))


def test_restored_iterator_gives_the_same_next_batch():
    train, _ = windows()
    it = data.train_batches(train, 8, 0, 0, 1, prefetch=2)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # as saved in a checkpoint
    expected = next(it)
    fresh = data.train_batches(train, 8, 0, 0, 1, prefetch=2)
    fresh.set_state(state)
    np.testing.assert_array_equal(next(fresh), expected)


def test_each_process_reads_its_own_rows_of_the_global_batch():
    train, val = windows()
    whole = take(data.train_batches(train, 8, 0, 0, 1, 0), 3)
    parts = [take(data.train_batches(train, 8, 0, p, 2, 0), 3) for p in range(2)]
    for i in range(3):
        np.testing.assert_array_equal(np.concatenate([parts[0][i], parts[1][i]]), whole[i])
    ev = data.eval_batches(val, 8, 2, 0, 1)
    ev_parts = [data.eval_batches(val, 8, 2, p, 2) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([ev_parts[0][1], ev_parts[1][1]]), ev[1])
