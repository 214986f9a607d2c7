"""Preparation throughput and peak memory of `python -m lm.prepare`, against `datasets.map`.

    python benchmarks/tokenizing.py --dir=/tmp/prep [--mb=256] [--rss_gb=2] [--vocab=32768]

Generates text corpora (files of 8 MB of word salad over a 20k-word vocabulary), trains one
byte-level BPE on a sample, then times, each in its own process:
- `lm.prepare --workers=1` and `--workers=2` on `--mb` of text (tokens/s, peak RSS);
- the baseline a user would reach for: `datasets.load_dataset("text")` (a row per line, which
  suits the tokenizer best) then `.map(tokenize, batched=True, num_proc=2)` with the same
  tokenizer (`encode_batch`);
- `lm.prepare --workers=2` on `--rss_gb` and on 4x that (peak RSS must not grow with the text).
Peak RSS is the largest of the process and its workers (`getrusage(RUSAGE_CHILDREN)` of a
parent of its own). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_PEAK = "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"

_BASELINE = """
import sys, time, datasets
from tokenizers import Tokenizer
files, tokenizer, cache = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
tok = Tokenizer.from_file(tokenizer)
def tokenize(batch):
    return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}
ds = datasets.load_dataset("text", data_files=files, split="train", cache_dir=cache)  # a row per line: the tokenizer's fastest diet
out = ds.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
print(sum(len(x) for x in out.with_format("numpy")["ids"]))
"""


def make_corpus(directory: Path, megabytes: int, seed: int = 0) -> Path:
    if directory.is_dir():
        return directory
    rng = np.random.default_rng(seed)
    vocabulary = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyzéü"), rng.integers(2, 10))) for _ in range(20_000)])
    tmp = directory.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i in range(max(1, megabytes // 8)):
        words = rng.choice(vocabulary, 1_200_000, p=_zipf(len(vocabulary)))
        lines = [" ".join(words[j : j + 12]) for j in range(0, len(words), 12)]
        (tmp / f"part{i:05d}.txt").write_text("\n".join(lines)[: 8 << 20] + "\n")
    tmp.rename(directory)
    return directory


def _zipf(n: int) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1)
    return p / p.sum()


def measured(argv: list[str], env=None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS in MB, stdout) of `argv` in a parent of its own."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK, *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    lines = result.stdout.strip().splitlines()
    return wall, int(lines[-1]) // 1000, "\n".join(lines[:-1])


def prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    wall, peak, _ = measured([sys.executable, "-m", "lm.prepare", f"--out={out}", f"--workers={workers}",
                              f"--config.data.path={corpus}", f"--config.data.tokenizer={tokenizer}"])
    tokens = json.loads((out / "manifest.json").read_text())["tokens"]
    return {"workers": workers, "wall_s": round(wall, 1), "tokens": tokens, "tokens_per_s": round(tokens / wall), "peak_rss_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mb", type=int, default=256, help="corpus for the throughput comparison")
    parser.add_argument("--rss_gb", type=float, default=2.0, help="corpus for the memory check (and 4x it); 0 skips it")
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    root = Path(args.dir)
    small = make_corpus(root / f"corpus-{args.mb}mb", args.mb)
    tokenizer = root / "bpe.json"
    if not tokenizer.exists():
        sys.path.insert(0, str(ROOT))
        from lm.data.tokenizer import train_bpe

        sample = (p.read_text() for p in sorted(small.glob("*.txt"))[:4])
        train_bpe(sample, args.vocab, tokenizer)
    results = {"corpus_mb": args.mb, "vocab": args.vocab, "cores": os.cpu_count()}
    results["lm_prepare"] = [prepare(small, tokenizer, root / "store", w) for w in (1, 2)]
    cache = root / "hf-cache"
    shutil.rmtree(cache, ignore_errors=True)
    files = ",".join(str(p) for p in sorted(small.glob("*.txt")))
    wall, peak, out = measured([sys.executable, "-c", _BASELINE, files, str(tokenizer), str(cache)])
    tokens = int(out.strip().splitlines()[-1])
    results["datasets_map_num_proc_2"] = {"wall_s": round(wall, 1), "tokens": tokens, "tokens_per_s": round(tokens / wall), "peak_rss_mb": peak}
    shutil.rmtree(cache, ignore_errors=True)
    if args.rss_gb:
        rss = []
        for scale in (1, 4):
            mb = int(args.rss_gb * 1024 * scale)
            corpus = make_corpus(root / f"corpus-{mb}mb", mb, seed=scale)
            rss.append({"corpus_mb": mb, **prepare(corpus, tokenizer, root / "store-rss", 2)})
            shutil.rmtree(root / "store-rss", ignore_errors=True)
        results["memory"] = rss
    print(json.dumps(results))


if __name__ == "__main__":
    main()
