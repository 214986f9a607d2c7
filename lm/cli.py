"""Command-line plumbing shared by `python -m lm.*`: config files with `--config.KEY=VALUE`
overrides, and user mistakes printed as one line (exit 2) instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from lm.config import UserError, apply_overrides, load_file


class Parser(argparse.ArgumentParser):
    """argparse whose errors are UserErrors, and which collects `--config.KEY=VALUE` overrides."""

    def __init__(self, *args, with_config: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.with_config = with_config
        if with_config:
            self.add_argument("--config", default="configs/tiny.py", help="recipe file; override keys with --config.KEY=VALUE")

    def error(self, message):
        raise UserError(f"{message} (see --help)")

    def parse(self, argv: list[str]):
        overrides, rest = {}, []
        for arg in argv:
            if self.with_config and arg.startswith("--config."):
                key, eq, value = arg[len("--config.") :].partition("=")
                if not eq:
                    raise UserError(f"{arg}: write overrides as --config.KEY=VALUE")
                overrides[key] = value
            else:
                rest.append(arg)
        args = self.parse_args(rest)
        if self.with_config:
            args.config = apply_overrides(load_file(args.config), overrides)
        return args


def run(main: Callable[[list[str]], None], argv: list[str] | None = None) -> None:
    """Calls `main(argv)`; a UserError or ShardingError ends the process with one line, exit 2."""
    from absl import logging

    import sharding

    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    try:
        main(sys.argv[1:] if argv is None else argv)
    except (UserError, sharding.ShardingError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
