"""Preparing a corpus once, `python -m lm.prepare`: text -> token store (`lm.data.token_store`).

    python -m lm.prepare --config=configs/X.py --out=DIR [--workers=N]

The data source (`data.path`, `data.text_field`, `data.skip_bad_records`; conversations:
`data.format=chat`, `data.loss_on`, `data.chat_template`, `data.truncate` at `train.seq_len`)
and tokenizer (`data.tokenizer`) come from the config, as for training. Units of work (`lm.data.sources`) are
tokenised by N worker processes (default: every core), each writing its own unit's shard
straight to disk: no process holds the corpus or all its tokens. A killed prepare resumes where
it stopped (finished units are kept, the plan must match); a finished store is never rewritten:
preparing into it again only checks that it was made from the same sources and tokenizer.
The tokenising itself is `lm.data.tokenize`; `lm.train` prepares raw text through the same
code, into a cache directory.
"""

from __future__ import annotations

from lm import cli, paths
from lm.data import sources, token_store
from lm.data.chat import chat_format
from lm.data.corpus import tokenizer_for_corpus
from lm.data.tokenize import prepare_store
from lm.errors import UserError


def main(argv: list[str]) -> None:
    parser = cli.Parser(prog="python -m lm.prepare", description="Tokenise a corpus once into a token store.")
    parser.add_argument("--out", required=True, help="the store directory (new, or a prepare to resume)")
    parser.add_argument("--workers", type=int, default=None, help="tokenising processes (default: every core; none under 64 MB of text)")
    args = parser.parse(argv)
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers={args.workers}: use 1 (tokenise in this process) or more")
    d = args.config.data
    if token_store.is_store(d.path):
        raise UserError(f"data.path={d.path} is already a token store; train from it (--config.data.path={d.path})")
    if d.sources:
        raise UserError("lm.prepare makes one store from data.path; prepare each source of data.sources on its own")
    files = sources.corpus_files(d.path)
    chat = chat_format(d, args.config.train.seq_len, d.tokenizer)  # conversations: cut to train.seq_len + 1 tokens
    out = paths.new_or_run_dir(args.out, "--out")
    with paths.held(out, "--out", "lm.prepare"):
        tokenizer = tokenizer_for_corpus(d, out, files)
        finished = token_store.is_store(out)
        store = prepare_store(files, tokenizer, out, workers=args.workers, text_field=d.text_field, skip_bad_records=d.skip_bad_records, chat=chat)
    m = store.manifest
    verb = "already prepared" if finished else "prepared"
    print(f"{verb}: {out}: {m['tokens']:,} tokens in {m['documents']:,} documents, {m['units']} units ({m['dtype']}); counts {m['counts']}")


if __name__ == "__main__":
    cli.run(main)
