"""Command-line plumbing shared by `python -m lm.*`: config files with `--config.KEY=VALUE`
overrides, and user mistakes printed as one line (exit 2) instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import ml_collections

import sharding.distributed
from lm import cache_home, progress
from lm.config import UserError, apply_overrides
from lm.recipe import load_file


class Parser(argparse.ArgumentParser):
    """argparse whose errors are UserErrors, and which collects `--config.KEY=VALUE` overrides."""

    def __init__(
        self,
        *args,
        with_config: bool = True,
        distributed: bool = False,
        default_config: Callable[[argparse.Namespace], ml_collections.ConfigDict] | None = None,
        **kwargs,
    ):
        """`default_config(args)`: the config when no --config is given (default configs/tiny.py)."""
        super().__init__(*args, **kwargs)
        self.with_config = with_config
        self.distributed = distributed
        self.default_config = default_config or (lambda args: load_file("configs/tiny.py"))
        if with_config:
            self.add_argument("--config", default=None, help="recipe file (default: configs/tiny.py); override keys with --config.KEY=VALUE")
        if distributed:
            group = self.add_argument_group("several processes (default: from SLURM / Open MPI / Kubernetes, else one)")
            group.add_argument("--coordinator", help="host:port of process 0's coordination service")
            group.add_argument("--num_processes", type=int, help="how many processes take part")
            group.add_argument("--process_id", type=int, help="this process's index, 0 .. num_processes-1")
            group.add_argument(
                "--peer_timeout_s", type=int, default=120,
                help="a process silent this long (hung, frozen, host down) ends the job (default 120)",
            )
            group.add_argument(
                "--interface",
                help="network interface (or its address) that reaches the other hosts (default: $GLOO_SOCKET_IFNAME, "
                     "else the one that routes to the coordinator)",
            )

    def error(self, message):
        raise UserError(f"{message} (see --help)")

    def parse(self, argv: list[str], defer_config: bool = False):
        """The arguments; `args.config` the recipe with the overrides applied and validated, or with
        `defer_config`, `args.config_base` (the recipe alone) for the command to finish."""
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
        if self.distributed:  # before the config: nothing may touch JAX's devices first
            try:
                sharding.distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.peer_timeout_s, args.interface)
            except ValueError as e:
                raise UserError(str(e)) from None
        if self.with_config:
            args.config_overrides, args.config_file = overrides, args.config
            base = load_file(args.config) if args.config else self.default_config(args)
            if defer_config:
                args.config_base = base
            else:
                args.config = apply_overrides(base, overrides)
        return args


def use_compilation_cache() -> None:
    """JAX's persistent compilation cache in `$XDG_CACHE_HOME/meshlm/xla`, unless
    JAX_COMPILATION_CACHE_DIR names another (JAX_ENABLE_COMPILATION_CACHE=false: none): a run
    resumed after preemption, a re-run or a benchmark loads the programs it compiled before.
    Programs that compile in under a second are not kept (JAX's default); nothing is evicted."""
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(Path(cache_home()) / "xla"))


def run(main: Callable[[list[str]], None], argv: list[str] | None = None) -> None:
    """Calls `main(argv)` with compiled programs cached across runs (`use_compilation_cache`); a
    UserError or ShardingError ends the process with one line, exit 2."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    use_compilation_cache()
    try:
        main(sys.argv[1:] if argv is None else argv)
    except (UserError, sharding.ShardingError) as e:
        progress.final_line(f"error: {e}")  # one line, always, at the start of a line
        sys.exit(getattr(e, "exit_code", 2))
