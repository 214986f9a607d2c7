"""Sources, the token store (lm.prepare), splits, batches, mixtures, document masking."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, run_cli
from ml_collections import ConfigDict

from lm import prepare
from lm.config import UserError
from lm.data import corpus, sources, token_store, tokenize
from lm.data.tokenizer import ByteTokenizer, tokenizer_for


def data_config(**kw):
    return ConfigDict({"tokenizer": "byte", "vocab_size": 300, "cache_dir": None, "text_field": "text", "skip_bad_records": False, **kw})


def texts_of(path, **reading):
    """Every document's text, in order."""
    r = sources.Reading(**reading)
    return ["".join(doc) for unit in sources.plan_units(sources.corpus_files(str(path))) for piece in unit for doc in sources.documents(piece, r)]


def make_corpus(directory, files=24, size=250_000, seed=0):
    """`files` text files of about `size` bytes of word salad (multi-byte characters included)."""
    rng = np.random.default_rng(seed)
    words = np.array(["the", "quick", "brown", "fox", "jumps", "über", "lazy", "dog", "naïve", "café", "→", "\n"])
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (directory / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, size // 5)) + "\n")
    return directory


def test_every_source_kind_round_trips(tmp_path):
    import datasets
    import zstandard

    records = ["gamma", "délta\nwith lines", "epsilon"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha ")
    (tmp_path / "d" / "b.txt").write_text("beta")
    assert texts_of(tmp_path / "d") == ["alpha ", "beta"]
    assert [f.name for f in sources.corpus_files(str(tmp_path / "d" / "*.txt"))] == ["a.txt", "b.txt"]
    lines = "".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(records)).encode()
    (tmp_path / "c.jsonl").write_bytes(lines)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    for name in ("c.jsonl", "c.jsonl.gz", "c.jsonl.zst"):
        assert texts_of(tmp_path / name, text_field="body") == records
    ds = datasets.Dataset.from_dict({"body": records})
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    assert texts_of(tmp_path / "c.parquet", text_field="body") == records
    assert texts_of(tmp_path / "saved", text_field="body") == records
    # Through the store and back, with the byte tokenizer.
    store = tokenize.prepare_store(sources.corpus_files(str(tmp_path / "saved")), ByteTokenizer(), tmp_path / "store", workers=1, text_field="body", progress=False)
    assert [bytes(store.read(s, s + n).astype(np.uint8)).decode() for s, n in zip(store.doc_starts, store.doc_lengths)] == records
    default = sources.corpus_files(None)
    assert len(default) > 100 and all(f.suffix == ".py" for f in default)


def test_large_jsonl_is_split_into_byte_ranges_at_line_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "unit_bytes", lambda total: 1000)
    records = [f"record {i} " + "x" * (i % 37) for i in range(500)]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    units = sources.plan_units([tmp_path / "big.jsonl"])
    assert len(units) > 10
    assert texts_of(tmp_path / "big.jsonl") == records


def test_binary_skipped_invalid_utf8_replaced_and_counted(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "good.txt").write_text("fine text\n")
    (tmp_path / "c" / "image.bin").write_bytes(b"\x89PNG\0\0\0binary")
    (tmp_path / "c" / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    store = tokenize.prepare_store(sources.corpus_files(str(tmp_path / "c")), ByteTokenizer(), tmp_path / "s", workers=1, progress=False)
    assert store.manifest["counts"] == {"binary_files_skipped": 1, "invalid_utf8": 1}
    assert store.num_documents == 2 and "caf\ufffd au lait" in bytes(store.read(0, store.num_tokens).astype(np.uint8)).decode()


def test_malformed_jsonl_is_one_line_naming_file_and_line_or_skipped(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"txt": 1}\nnot json\n')
    with pytest.raises(UserError, match=r"bad.jsonl:4: not a JSON object with a text field 'text'"):
        texts_of(tmp_path / "bad.jsonl")
    assert texts_of(tmp_path / "bad.jsonl", skip_bad_records=True) == ["ok", "fine"]
    result = run_cli(capsys, prepare.main, f"--out={tmp_path / 'store'}", f"--config.data.path={tmp_path / 'bad.jsonl'}")
    assert_one_line_error(result, "bad.jsonl:4:")
    result = run_cli(capsys, prepare.main, f"--out={tmp_path / 'store2'}", f"--config.data.path={tmp_path / 'bad.jsonl'}", "--config.data.skip_bad_records=True")
    assert result.returncode == 0, result.stderr
    assert token_store.TokenStore(tmp_path / "store2").manifest["counts"] == {"bad_records_skipped": 2}


def test_damaged_compressed_and_parquet_files_are_one_line(tmp_path, capsys):
    """Each of these ended in a traceback from gzip, zlib, zstandard or pyarrow."""
    import zstandard

    packed = gzip.compress(b'{"text": "some text, again and again"}\n' * 200)
    flipped = bytearray(packed)
    flipped[40:60] = bytes(20)
    damaged = {
        "not.jsonl.gz": b"plain text, not gzip",
        "cut.jsonl.gz": packed[: len(packed) // 2],
        "flipped.jsonl.gz": bytes(flipped),
        "bad.jsonl.zst": zstandard.ZstdCompressor().compress(b'{"text": "x"}\n' * 100)[:-8] + bytes(8),
        "bad.parquet": b"PAR1 not a parquet file PAR1",
    }
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
        result = run_cli(capsys, prepare.main, f"--out={tmp_path / ('out-' + name)}", f"--config.data.path={tmp_path / name}")
        assert_one_line_error(result, f"{tmp_path / name} cannot be read")


def test_bad_inputs_are_one_line(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("x")
    (tmp_path / "t.txt").write_text("some text\n" * 100)
    cases = [
        ([f"--config.data.path={tmp_path / 'missing'}"], "does not exist"),
        (["--config.data.path=" + str(tmp_path / "nothing*.txt")], "matches no files"),
        ([f"--config.data.path={tmp_path / 't.txt'}", f"--out={tmp_path / 'taken'}"], "is not a token store"),
        ([f"--config.data.path={tmp_path / 't.txt'}", "--config.data.tokenizer=nope.json"], "data.tokenizer='nope.json'"),
    ]
    for argv, fragment in cases:
        if not any(a.startswith("--out=") for a in argv):
            argv = [*argv, f"--out={tmp_path / 'out'}"]
        assert_one_line_error(run_cli(capsys, prepare.main, *argv), fragment)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]


def test_bpe_is_trained_saved_in_workdir_and_reused(tmp_path, small_corpus):
    cfg = data_config(tokenizer="bpe", vocab_size=300)
    files = sources.corpus_files(str(small_corpus))
    tok = tokenizer_for(cfg, tmp_path, files)
    assert (tmp_path / "tokenizer.json").exists() and tok.vocab_size == 300
    text = "def main():\n    return 42\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text)
    again = tokenizer_for(cfg, tmp_path, None)  # reused: no corpus needed
    assert again.fingerprint == tok.fingerprint
    loaded = tokenizer_for(data_config(tokenizer=str(tmp_path / "tokenizer.json")), tmp_path / "other", None)
    assert loaded.fingerprint == tok.fingerprint and (tmp_path / "other" / "tokenizer.json").exists()


def _store_bytes(directory):
    """Every (non-hidden) file of a store, by name: its bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if not p.name.startswith(".")}


def test_one_and_four_workers_give_byte_identical_stores(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", files=24, size=250_000)  # 6 MB: 6 units of 1 MB
    (corpus / "doc000.bin").write_bytes(b"\0\1\2 binary")
    (corpus / "doc001.latin1").write_bytes("na\xefve\n".encode("latin-1"))
    files = sources.corpus_files(str(corpus))
    one = tokenize.prepare_store(files, ByteTokenizer(), tmp_path / "one", workers=1, progress=False)
    tokenize.prepare_store(files, ByteTokenizer(), tmp_path / "four", workers=4, progress=False)
    assert one.manifest["units"] >= 4 and one.num_documents == 25
    assert _store_bytes(tmp_path / "one") == _store_bytes(tmp_path / "four")
    assert one.manifest["counts"] == {"binary_files_skipped": 1, "invalid_utf8": 1}
    assert one.dtype == np.uint8 and one.num_tokens == sum(f.stat().st_size for f in files if f.suffix == ".txt") + len("na\ufffdve\n".encode())
    # A finished store is never rewritten: preparing into it again checks it and returns it.
    stamp = (tmp_path / "one" / "manifest.json").stat().st_mtime_ns
    tokenize.prepare_store(files, ByteTokenizer(), tmp_path / "one", workers=2, progress=False)
    assert (tmp_path / "one" / "manifest.json").stat().st_mtime_ns == stamp
    (corpus / "doc000.txt").write_text("changed")
    with pytest.raises(UserError, match="was prepared from other sources"):
        tokenize.prepare_store(sources.corpus_files(str(corpus)), ByteTokenizer(), tmp_path / "one", workers=1, progress=False)


def test_a_damaged_store_shard_is_one_line_naming_it(tmp_path, capsys):
    """Each shard's CRC-32 is recorded when it is prepared and checked when a run opens the
    store: a flipped byte (same size) and a truncated shard are each one line naming the shard."""
    from lm import train as lm_train

    files = sources.corpus_files(str(make_corpus(tmp_path / "corpus", files=4, size=50_000)))
    store = tokenize.prepare_store(files, ByteTokenizer(), tmp_path / "store", workers=1, progress=False)
    shard = tmp_path / "store" / "00000.tokens"
    assert store.manifest["crc32"] == [int((tmp_path / "store" / "00000.crc32").read_text())]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    train = [f"--config.data.path={tmp_path / 'store'}", f"--workdir={tmp_path / 'run'}", "--config.train.steps=1"]
    assert_one_line_error(run_cli(capsys, lm_train.main, *train), f"{shard} does not match the checksum its store recorded")
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data[:-7]))
    assert_one_line_error(run_cli(capsys, lm_train.main, *train), f"{shard} holds {len(data) - 7} tokens but its index says {len(data)}")
    shard.write_bytes(bytes(data))
    assert token_store.TokenStore(tmp_path / "store").num_tokens == len(data)  # restored: opens again


@pytest.mark.slow
def test_killed_prepare_resumes_to_the_same_store(tmp_path, small_corpus):
    """SIGKILL the parent and its workers mid-way; running again finishes the same store."""
    corpus = make_corpus(tmp_path / "corpus", files=32, size=400_000, seed=1)  # 13 MB, BPE: seconds
    tok_cfg = ["--config.data.tokenizer=bpe", "--config.data.vocab_size=512", f"--config.data.path={corpus}"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MESHLM_GPU_COMPILER")}
    command = [sys.executable, "-m", "lm.prepare", "--workers=2", *tok_cfg]
    subprocess.run([*command, f"--out={tmp_path / 'whole'}"], cwd=ROOT, env=env, check=True, capture_output=True)
    out = tmp_path / "killed"
    out.mkdir()
    (out / "tokenizer.json").write_bytes((tmp_path / "whole" / "tokenizer.json").read_bytes())  # the same BPE
    process = subprocess.Popen([*command, f"--out={out}"], cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob("*.docs.npy")) and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    done = len(list(out.glob("*.docs.npy")))
    assert not (out / "manifest.json").exists() and 0 < done < token_store.TokenStore(tmp_path / "whole").manifest["units"]
    subprocess.run([*command, f"--out={out}"], cwd=ROOT, env=env, check=True, capture_output=True)
    assert _store_bytes(out) == _store_bytes(tmp_path / "whole")


# ---------------------------------------------------------------------------- splits and batches


def corpus_of(tmp_path, seq_len=16, document_masking=False, docs=40, paths=None, weights=None):
    """A Corpus over `docs` text files of counting digits (each document distinct)."""
    if paths is None:
        d = tmp_path / "docs"
        d.mkdir(exist_ok=True)
        for i in range(docs):
            (d / f"{i:03d}.txt").write_text("".join(chr(65 + (i + j) % 26) for j in range(50 + 7 * i)))
        paths = [str(d)]
    config = ConfigDict({
        "data": {**data_config(cache_dir=str(tmp_path / "cache")).to_dict(), "path": None, "sources": tuple(zip(paths, weights or [1.0] * len(paths))),
                 "val_fraction": 0.1, "document_masking": document_masking, "workers": 1},
        "train": {"seq_len": seq_len},
    })
    return corpus.open_corpus(config, tmp_path / "run", progress=False)


def take(it, n):
    return [next(it) for _ in range(n)]


def test_validation_holds_out_whole_documents(tmp_path):
    corpus = corpus_of(tmp_path)
    train, val = corpus.splits[0]
    store = train.store
    starts = set(store.doc_starts.tolist())
    ends = set((store.doc_starts + store.doc_lengths).tolist())
    for split in (train, val):
        assert set(split.starts.tolist()) <= starts and set((split.starts + split.lengths).tolist()) <= ends
    held = set().union(*(range(s, s + n) for s, n in zip(val.starts, val.lengths)))
    kept = set().union(*(range(s, s + n) for s, n in zip(train.starts, train.lengths)))
    assert not held & kept and len(held | kept) == store.num_tokens
    assert 0.05 < len(held) / store.num_tokens <= 0.1


def test_global_order_is_the_same_for_any_process_count_and_resumes_across_counts(tmp_path):
    corpus = corpus_of(tmp_path)
    whole = take(corpus.train_batches(8, seed=3, process_index=0, process_count=1, prefetch=2), 6)
    for count in (2, 4):
        parts = [take(corpus.train_batches(8, 3, p, count, 0), 6) for p in range(count)]
        for i in range(6):
            np.testing.assert_array_equal(np.concatenate([parts[p][i]["tokens"] for p in range(count)]), whole[i]["tokens"])
    assert whole[0]["tokens"].shape == (8, 17)
    other_seed = take(corpus.train_batches(8, 4, 0, 1, 0), 6)
    assert any((a["tokens"] != b["tokens"]).any() for a, b in zip(whole, other_seed))
    # Resume: the state after 3 batches of a 1-process run, restored into 2 processes.
    it = corpus.train_batches(8, 3, 0, 1, 2)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # as saved in a checkpoint
    resumed = []
    for p in range(2):
        fresh = corpus.train_batches(8, 3, p, 2, 2)
        fresh.set_state(state)
        resumed.append(take(fresh, 3))
    for i in range(3):
        np.testing.assert_array_equal(np.concatenate([resumed[0][i]["tokens"], resumed[1][i]["tokens"]]), whole[3 + i]["tokens"])
    ev = corpus.eval_batches(8, 2, 0, 1)
    ev_parts = [corpus.eval_batches(8, 2, p, 2) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([ev_parts[0][1]["tokens"], ev_parts[1][1]["tokens"]]), ev[1]["tokens"])


def test_mixture_proportions_and_counts(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, letter in ((a, "a"), (b, "b")):
        d.mkdir()
        for i in range(10):
            (d / f"{i}.txt").write_text(letter * 400)
    corpus = corpus_of(tmp_path, paths=[str(a), str(b)], weights=[0.7, 0.3])
    schedule = corpus._mixed(0, 5)
    picks = np.asarray([schedule[i][0] for i in range(10_000 * 8)])
    share = np.bincount(picks, minlength=2) / len(picks)
    assert abs(share[0] - 0.7) < 0.01 and abs(share[1] - 0.3) < 0.01
    again = corpus_of(tmp_path, paths=[str(a), str(b)], weights=[0.7, 0.3])._mixed(0, 5)
    assert all(again[i] == schedule[i] for i in range(0, 80_000, 997))
    it = corpus.train_batches(8, 5, 0, 1, 0)
    batches = take(it, 50)
    for batch in batches:  # every row holds its source's text
        rows = batch["tokens"]
        for row, source in zip(rows, batch["sources"]):
            assert set(row.tolist()) == {ord("ab"[source])}
    counts = it.source_tokens()
    assert counts == {"tokens_from/a": 16 * int(sum((bt["sources"] == 0).sum() for bt in batches)), "tokens_from/b": 16 * int(sum((bt["sources"] == 1).sum() for bt in batches))}


def test_document_masking_segments_and_positions(tmp_path):
    corpus = corpus_of(tmp_path, seq_len=64, document_masking=True)
    batch = next(corpus.train_batches(8, 0, 0, 1, 0))
    tokens, segments = batch["tokens"], batch["segments"]
    # Each file is a run of consecutive letters: a segment change is exactly where the run breaks.
    breaks = ((tokens[:, 1:] - tokens[:, :-1]) % 26) != 1
    assert (breaks == (segments[:, 1:] != segments[:, :-1])).all() and breaks.any()
    from lm.model.transformer import segment_positions

    positions = np.asarray(segment_positions(segments))
    assert (positions[segments != np.roll(segments, 1, axis=1)] == 0).all() and positions.max() <= 64


def test_random_windows_never_cross_out_of_range(tmp_path):
    corpus = corpus_of(tmp_path, seq_len=8)
    train, val = corpus.splits[0]
    for split in (train, val):
        rows = split.rows(np.arange(split.count))
        assert rows.shape == (split.count, 9) and rows.min() >= 65 and rows.max() < 65 + 26


def test_prepare_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak RSS (the largest of lm.prepare and its workers) for 4x the text stays within 10%
    (benchmarks/tokenizing.py measures the same at 2 GB and 8 GB with a BPE: PERFORMANCE.md)."""
    peak = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MESHLM_GPU_COMPILER")}
    peaks = []
    for n in (16, 64):
        corpus = make_corpus(tmp_path / f"c{n}", files=4 * n, size=250_000, seed=n)
        command = [sys.executable, "-m", "lm.prepare", f"--out={tmp_path / f's{n}'}", "--workers=2", f"--config.data.path={corpus}"]
        result = subprocess.run([sys.executable, "-c", peak, *command], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        peaks.append(int(result.stdout.strip().splitlines()[-1]) * 1024)
        assert token_store.TokenStore(tmp_path / f"s{n}").num_tokens > n * 900_000
    print(f"peak RSS: {peaks[0] / 2**20:.0f} MiB for 16 MB, {peaks[1] / 2**20:.0f} MiB for 64 MB")
    assert peaks[1] <= 1.1 * peaks[0] and max(peaks) < 1.5 * 2**30
