"""`python -m lm.convert`: Hugging Face checkpoints in and out.

    python -m lm.convert from_hf --hf=DIR --workdir=RUN [--config=configs/finetune_llama.py] [--config.mesh.fsdp=4 ...]
    python -m lm.convert to_hf --workdir=RUN --out=DIR [--dtype=bfloat16] [--max_shard_size=5GB] [--adapter]

Import reads `config.json` (the architecture, `lm.hf.format`), `tokenizer.json` and the safetensors,
checks every tensor's presence and shape before writing anything, and places each parameter
straight into its sharding on the run's mesh (`jax.make_array_from_callback`): a process reads
only the slices its own devices hold, one checkpoint tensor at a time. The run directory gets
config.json, tokenizer.json, the checkpoint's own config (`hf_config.json`, for export) and a
step-0 checkpoint of the weights alone, which `lm.train` starts from (fresh optimizer state) and
`lm.generate` samples from. Export gathers one tensor at a time and writes shard by shard.
"""

from __future__ import annotations

from lm import cli, paths
from lm import config as lm_config
from lm.cli import Parser
from lm.config import UserError
from lm.hf.checkpoint import export_hf, import_hf, say


def main(argv: list[str]) -> None:
    command = argv[0] if argv else None
    if command not in ("from_hf", "to_hf"):
        raise UserError("usage: python -m lm.convert from_hf --hf=DIR --workdir=RUN | to_hf --workdir=RUN --out=DIR (see --help of each)")
    if command == "from_hf":
        parser = Parser(
            prog="python -m lm.convert from_hf", description="Import a Hugging Face checkpoint as a meshlm run.",
            distributed=True, default_config=lambda args: lm_config.default_config(),
        )
        parser.add_argument("--hf", required=True, help="a Hugging Face model directory (config.json, safetensors, tokenizer.json)")
        parser.add_argument("--workdir", required=True, help="the new run directory")
        args = parser.parse(argv[1:], defer_config=True)
        with paths.held(paths.new_or_run_dir(args.workdir), "--workdir", "lm.convert from_hf"):
            workdir = import_hf(args.hf, args.workdir, args.config_base, args.config_overrides)
        say(f"imported {args.hf} -> {workdir} (step-0 checkpoint in {workdir / 'checkpoints'}); train with: python -m lm.train --workdir={workdir}")
        return
    parser = Parser(prog="python -m lm.convert to_hf", description="Export a meshlm run as a Hugging Face model.", with_config=False,
                    distributed=True)
    parser.add_argument("--workdir", required=True, help="the run to export")
    parser.add_argument("--out", required=True, help="the new model directory")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the run's parameter dtype)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run's adapters alone, in PEFT's format (default: merged into the weights)")
    args = parser.parse(argv[1:])
    out = export_hf(args.workdir, args.out, args.dtype, args.max_shard_size, args.step, adapter=args.adapter)
    say(f"exported {args.workdir} -> {out}")


if __name__ == "__main__":
    cli.run(main)
