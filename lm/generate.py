"""`python -m lm.generate`: sample from a trained run.

    python -m lm.generate --workdir=runs/tiny --prompt="def " --max_new_tokens=200 \
        --temperature=0.8 --top_k=40
    python -m lm.generate --workdir=runs/imported --prompt_ids=5,17,42 --temperature=0 --print_ids
    python -m lm.generate --workdir=runs/sft --chat="What is a mesh?" --temperature=0

`--chat` renders one user turn with the run's chat template (`lm.data.chat`: the run's own copy,
`data.chat_template`, or the tokenizer's) and its generation prompt, and prints the answer up to
the template's end-of-turn marker.

Decoding keeps a KV cache (`lm.model.sampling`); the run's weights are read by
`lm.program.restore`.
"""

from __future__ import annotations

from lm import cli
from lm.cli import Parser
from lm.config import UserError
from lm.data import chat
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
    parser.add_argument("--chat", default=None, help="a user message, rendered with the run's chat template; the answer is printed")
    parser.add_argument("--print_ids", action="store_true", help="also print the generated ids, space-separated, on the last line")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=40, help="sample among the k likeliest tokens; 0 for all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse(argv)
    if sum(x is not None and x != "" for x in (args.prompt, args.prompt_ids, args.chat)) > 1:
        raise UserError("give one of --prompt, --prompt_ids or --chat")
    config, tokenizer, model = load(args.workdir, args.step)
    if args.chat is not None:
        _chat(args, config, tokenizer, model)
        return
    prompt_ids = _ids(args.prompt_ids) if args.prompt_ids is not None else tokenizer.encode(args.prompt or "\n")
    new = generate_ids(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    if not isinstance(tokenizer, lm_tokenizer.NoTokenizer):
        print((args.prompt if args.prompt_ids is None else tokenizer.decode(prompt_ids)) + tokenizer.decode(new))
    if args.print_ids or isinstance(tokenizer, lm_tokenizer.NoTokenizer):
        print(" ".join(map(str, new.tolist())))


def _chat(args, config, tokenizer, model) -> None:
    """One user turn rendered by the template; the answer printed up to its end of turn."""
    template = chat.load_template(config.data.chat_template, config.data.tokenizer, args.workdir)
    text = template.render([{"role": "user", "content": args.chat}], add_generation_prompt=True, where="--chat")
    prompt_ids = tokenizer.encode_with_offsets(text)[0] if hasattr(tokenizer, "encode_with_offsets") else tokenizer.encode(text)
    new = generate_ids(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.seed).tolist()
    marker = template.end_of_turn
    stop = tokenizer.encode_with_offsets(marker)[0].tolist() if hasattr(tokenizer, "encode_with_offsets") else []
    if len(stop) == 1 and stop[0] in new:  # the end-of-turn token: the answer ends before it
        new = new[: new.index(stop[0])]
    answer = tokenizer.decode(new)
    print(answer[: answer.find(marker)] if marker in answer else answer)
    if args.print_ids:
        print(" ".join(map(str, new)))


if __name__ == "__main__":
    cli.run(main)
