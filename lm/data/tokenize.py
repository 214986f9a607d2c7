"""Tokenising a corpus once into a token store (`lm.data.token_store`): units of work tokenised
by worker processes (`python -m lm.data.tokenize JOB k n`, no JAX), each writing its own shard;
resumable, and a finished store never rewritten (`prepare_store`). `python -m lm.prepare` is
its command; `lm.train` prepares raw text through the same code, into a cache directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from lm import paths
from lm import progress as lm_progress
from lm.data import records, sources, token_store
from lm.data.chat import ChatFormat, keep_template
from lm.data.sources import Piece, Reading
from lm.data.tokenizer import ByteTokenizer, load_tokenizer
from lm.errors import UserError

ENCODE_CHARS = 1 << 22  # text handed to the tokenizer per batch (its Rust side is parallel)
IN_PROCESS_BYTES = 64 << 20  # less text than this is quicker to tokenise than to start workers for
PIECE_CHARS = 1 << 16  # longer texts are cut (at a line start) into pieces about this long
_LINE_START = re.compile(r"\n(?=\S)")


def _cut(text: str) -> list[str]:
    """`text` in pieces of about PIECE_CHARS, cut after a newline that starts a non-blank line.

    The tokenizer's parallelism is per text, and it is several times slower on one megabyte-long
    text than on the same text in pieces. There a byte-level BPE's pre-tokenizer always has a
    boundary, so the pieces tokenise as the whole would (a different pre-tokenizer may differ
    at a cut; the cuts depend on the text alone, never on the workers).
    """
    if len(text) <= 2 * PIECE_CHARS:
        return [text]
    pieces, start = [], 0
    while len(text) - start > 2 * PIECE_CHARS:
        found = _LINE_START.search(text, start + PIECE_CHARS)
        if found is None:
            break
        pieces.append(text[start : found.end()])
        start = found.end()
    pieces.append(text[start:])
    return pieces


def _spec(tokenizer) -> str:
    """How a worker process rebuilds the tokenizer: 'byte' or a tokenizer.json path."""
    return "byte" if isinstance(tokenizer, ByteTokenizer) else str(tokenizer.path)


def prepare_unit(directory: Path, index: int, pieces: list[Piece], tokenizer, reading: Reading) -> tuple[int, int, int]:
    """Tokenises one unit into its shard; returns (index, tokens, documents)."""
    reading = Reading(reading.text_field, reading.skip_bad_records, reading.chat)  # this unit's own counts
    dtype = token_dtype_for(tokenizer)
    writer = token_store.UnitWriter(directory, index, dtype, with_mask=reading.chat is not None)
    if reading.chat is not None:
        _prepare_conversations(writer, pieces, tokenizer, reading)
        return index, writer.tokens, len(writer.lengths)
    eos = [np.asarray([tokenizer.eos_id], np.int32)] if tokenizer.eos_id is not None else []
    batch: list[tuple[int, str | None]] = []  # (document number, text chunk or None at its end)
    size = 0

    def flush():
        texts = [text for _, text in batch if text is not None]
        encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
        for _, text in batch:
            if text is None:
                writer.end_document(eos)
            else:
                writer.write(next(encoded))
        batch.clear()

    doc = 0
    for piece in pieces:
        for chunks in sources.documents(piece, reading):
            for text in (piece for chunk in chunks for piece in _cut(chunk)):
                batch.append((doc, text))
                size += len(text)
                if size >= ENCODE_CHARS:
                    flush()
                    size = 0
            batch.append((doc, None))
            doc += 1
    flush()
    writer.commit(dict(reading.counts))
    return index, writer.tokens, len(writer.lengths)


def _prepare_conversations(writer: token_store.UnitWriter, pieces: list[Piece], tokenizer, reading: Reading) -> None:
    """A chat unit: each record rendered and tokenised whole with its loss mask, one document
    each (no separator: the template writes its own turns' ends)."""
    chat = ChatFormat.from_dict(reading.chat)
    for piece in pieces:
        for record, where in records.records(piece, reading):
            try:
                encoded = chat.encode_record(record, tokenizer, where, reading.counts)
            except UserError:
                if not reading.skip_bad_records:
                    raise
                reading.counts["bad_records_skipped"] += 1
                continue
            if encoded is not None:
                writer.write(*encoded)
                writer.end_document([])
    writer.commit(dict(reading.counts))


def token_dtype_for(tokenizer) -> np.dtype:
    return token_store.token_dtype(tokenizer.vocab_size)


def _worker(job_path: str, k: int, n: int) -> None:
    """Worker k of n (`python -m lm.data.tokenize JOB k n`): units k, k + n, ... of the job."""
    job = json.loads(Path(job_path).read_text())
    tokenizer, reading = load_tokenizer(job["tokenizer"]), Reading(job["text_field"], job["skip_bad_records"], job["chat"])
    for index, pieces in job["units"][k::n]:
        prepare_unit(Path(job["out"]), index, [Piece(**p) for p in pieces], tokenizer, reading)


def _start_workers(out: Path, units, todo: list[int], tokenizer, reading: Reading, workers: int) -> list[subprocess.Popen]:
    """Worker processes started as programs of their own (`python -m lm.data.tokenize`), not
    by `multiprocessing`, whose children re-run the caller's main module (a script without a
    `__main__` guard would start over in every worker). Each tokenises on one thread: the
    tokenizers library would otherwise start a thread per core in every worker (15% slower on
    2 cores, measured); a single worker, in-process, keeps the library's threads."""
    job = out / ".job.json"
    job.write_text(json.dumps({
        "out": str(out), "tokenizer": _spec(tokenizer), "text_field": reading.text_field,
        "skip_bad_records": reading.skip_bad_records, "chat": reading.chat, "units": [[i, [vars(p) for p in units[i]]] for i in todo],
    }))
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    n = min(workers, len(todo))
    return [
        subprocess.Popen([sys.executable, "-m", "lm.data.tokenize", str(job), str(k), str(n)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for k in range(n)
    ]


def prepare_store(files: list[Path], tokenizer, out: str | os.PathLike, *, workers: int | None = None, text_field: str = "text",
                  skip_bad_records: bool = False, chat: ChatFormat | None = None, progress: bool = True) -> token_store.TokenStore:
    """The token store of `files` under `tokenizer` in `out`: made, resumed, or (finished
    already) checked and returned as it is. With `chat`, records are conversations, each
    token stored with its loss mask."""
    out = Path(out).expanduser()
    plan = {
        "format": token_store.FORMAT,
        "version": token_store.VERSION,
        "tokenizer": tokenizer.fingerprint,
        "sources": sources.fingerprint(files),
        "text_field": text_field,
        "skip_bad_records": skip_bad_records,
        "chat": None if chat is None else chat.to_dict(),
    }
    if token_store.is_store(out):
        store = token_store.TokenStore(out)
        _check_same(out, store.manifest, plan)
        return store
    units = sources.plan_units(files)
    plan["units"] = [[vars(p) for p in unit] for unit in units]
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / token_store.PLAN
    fresh = not plan_path.is_file()
    if not fresh:
        _check_same(out, json.loads(plan_path.read_text()), plan)
    else:
        if any(p.name not in ("tokenizer.json", paths.LOCK_FILE) for p in out.iterdir()):  # a BPE may have been trained into it
            raise UserError(f"{out} exists and is not a token store; nothing was written: pass a new --out")
        if getattr(tokenizer, "path", None) and Path(tokenizer.path).resolve() != (out / "tokenizer.json").resolve():
            (out / "tokenizer.json").write_bytes(Path(tokenizer.path).read_bytes())
        if chat is not None:
            keep_template(chat.template, out)
        plan_path.write_text(json.dumps(plan))
    todo = [i for i in range(len(units)) if not token_store.unit_done(out, i)]
    try:
        _run(out, units, todo, tokenizer, Reading(text_field, skip_bad_records, plan["chat"]), workers, progress)
    except UserError:
        if fresh:  # bad input found on this store's first prepare: what it wrote goes (kept when resuming)
            _remove_unfinished(out)
        raise
    return _finish(out, plan, len(units), tokenizer)


def _remove_unfinished(out: Path) -> None:
    """A store's files removed after its first prepare failed on bad input (the directory held
    nothing else: `prepare_store` checked), the directory too unless a holder's lock is in it."""
    for path in out.iterdir():
        if path.name != paths.LOCK_FILE and path.is_file():
            path.unlink()
    with contextlib.suppress(OSError):
        out.rmdir()


def _check_same(out: Path, saved: dict, plan: dict) -> None:
    for key in ("tokenizer", "sources", "text_field", "skip_bad_records", "chat"):
        if saved.get(key) != plan[key]:
            raise UserError(
                f"{out} was prepared from other {key.replace('_', ' ')} than these (sources changed on disk, or another "
                "tokenizer or setting); it is left as it is: prepare into a new directory"
            )


def _run(out: Path, units, todo: list[int], tokenizer, reading: Reading, workers: int | None, progress: bool) -> None:
    sizes = [sum(sources._size(Path(p.path)) for p in unit) for unit in units]
    bar = lm_progress.bar(total=sum(sizes), initial=sum(sizes) - sum(sizes[i] for i in todo), unit="B", unit_scale=True,
                          disable=not progress, desc="tokenising")
    start, tokens = time.perf_counter(), 0

    def done(index: int) -> None:
        nonlocal tokens
        tokens += int(np.load(out / f"{token_store.unit_name(index)}.docs.npy").sum())
        bar.update(sizes[index])
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)

    if workers is None:  # as many as cores, unless there is too little text to be worth starting them
        workers = 1 if sum(sizes[i] for i in todo) < IN_PROCESS_BYTES else os.cpu_count() or 1
    if workers <= 1 or len(todo) <= 1:
        try:
            for i in todo:
                prepare_unit(out, i, units[i], tokenizer, reading)
                done(i)
        finally:
            bar.close()  # its line ended before an error's
        return
    processes, waiting = _start_workers(out, units, todo, tokenizer, reading, workers), set(todo)
    try:
        while waiting:
            for i in sorted(i for i in waiting if token_store.unit_done(out, i)):
                waiting.discard(i)
                done(i)
            failed = next((p for p in processes if p.poll() not in (None, 0)), None)
            if failed is not None:
                lines = [line for line in failed.stderr.read().splitlines() if line.strip()]
                message = lines[-1].removeprefix("error: ") if lines else f"exit code {failed.returncode}"
                raise UserError(f"a tokenising worker failed: {message}")
            if all(p.poll() == 0 for p in processes) and waiting:
                raise RuntimeError(f"workers finished without units {sorted(waiting)}")
            time.sleep(0.05)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.wait()
        bar.close()


def _finish(out: Path, plan: dict, num_units: int, tokenizer) -> token_store.TokenStore:
    counts, tokens, documents = {}, 0, 0
    for i in range(num_units):
        name = token_store.unit_name(i)
        for key, value in json.loads((out / f"{name}.counts.json").read_text()).items():
            counts[key] = counts.get(key, 0) + value
        lengths = np.load(out / f"{name}.docs.npy")
        tokens, documents = tokens + int(lengths.sum()), documents + len(lengths)
    manifest = {
        **{k: v for k, v in plan.items() if k != "units"},
        "vocab_size": tokenizer.vocab_size,
        "dtype": token_dtype_for(tokenizer).name,
        "units": num_units,
        "tokens": tokens,
        "documents": documents,
        "counts": counts,
    }
    crcs = [token_store.unit_crc32(out, i) for i in range(num_units)]
    if None not in crcs:  # a prepare resumed over units written before checksums: sizes only
        manifest["crc32"] = crcs
    tmp = out / f".{token_store.MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / token_store.MANIFEST)
    return token_store.TokenStore(out)


if __name__ == "__main__":  # a worker started by _start_workers: no config, no JAX
    try:
        _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
