"""`python -m lm.generate`: sample from a trained run.

    python -m lm.generate --workdir=runs/tiny --prompt="def " --max_new_tokens=200 \
        --temperature=0.8 --top_k=40
    python -m lm.generate --workdir=runs/imported --prompt_ids=5,17,42 --temperature=0 --print_ids

Decoding keeps a KV cache (`lm.model.sampling`); the run's weights are read by
`lm.program.restore`.
"""

from __future__ import annotations

from lm import cli
from lm.cli import Parser
from lm.config import UserError
from lm.data import tokenizer as lm_tokenizer
from lm.model.sampling import generate_ids
from lm.program.restore import load


def _ids(text: str) -> list[int]:
    try:
        return [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise UserError(f"--prompt_ids={text!r}: write comma-separated token ids, e.g. 5,17,42") from None


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.generate", description="Sample text from a trained run.", with_config=False)
    parser.add_argument("--workdir", required=True, help="the run directory to sample from")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--prompt_ids", default=None, help="token ids to continue, e.g. 5,17,42 (instead of --prompt)")
    parser.add_argument("--print_ids", action="store_true", help="also print the generated ids, space-separated, on the last line")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=40, help="sample among the k likeliest tokens; 0 for all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse(argv)
    _, tokenizer, model = load(args.workdir, args.step)
    if args.prompt_ids is not None and args.prompt:
        raise UserError("give --prompt or --prompt_ids, not both")
    prompt_ids = _ids(args.prompt_ids) if args.prompt_ids is not None else tokenizer.encode(args.prompt or "\n")
    new = generate_ids(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    if not isinstance(tokenizer, lm_tokenizer.NoTokenizer):
        print((args.prompt if args.prompt_ids is None else tokenizer.decode(prompt_ids)) + tokenizer.decode(new))
    if args.print_ids or isinstance(tokenizer, lm_tokenizer.NoTokenizer):
        print(" ".join(map(str, new.tolist())))


if __name__ == "__main__":
    cli.run(main)
