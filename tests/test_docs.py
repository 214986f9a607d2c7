"""Every command in README.md and docs/ stays true: each `python -m lm.X ...` line of a bash block
is given to that command's own parser (its flags, and its recipe with every `--config.KEY=VALUE`
applied and validated) and stopped there; each `make X` names a target of the Makefile; each
`python benchmarks/X.py` or `python -m benchmarks.X` names a script that exists. (The commands
that run on this machine, `make train` / `lm.train` of the tiny recipe, are run by other tests.)
`docs/performance-log.md` is history: its commands are as they were."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT

from lm import cli
from lm.errors import UserError

PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "performance-log.md")]
_BLOCK = re.compile(r"^```(?:bash|sh)?\n(.*?)^```", re.DOTALL | re.MULTILINE)


def commands(page: Path) -> list[str]:
    """The command lines of a page's bash blocks: continuations joined, comments and optional
    `[...]` parts dropped, environment assignments in front removed."""
    out = []
    for block in _BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s\[[^\]]*\]", "", line.split(" #")[0].split("   #")[0]).strip()
            line = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", line)
            if line and not line.startswith("#"):
                out.append(line)
    return out


def cases():
    for page in PAGES:
        for line in commands(page):
            if re.match(r"(\S*python\S*\s+(-m\s+lm\.|-m\s+benchmarks\.|benchmarks/)|make\s)", line):
                yield pytest.param(line, id=f"{page.name}: {line[:70]}")


class _Parsed(Exception):
    pass


def test_the_pages_have_commands():
    found = {page.name: sum(1 for _ in filter(lambda c: "lm." in c, commands(page))) for page in PAGES}
    assert found["README.md"] >= 4 and found["training.md"] >= 4 and found["scale.md"] >= 3, found


def check(line: str, monkeypatch) -> str:
    """'' where `line` holds, else what is wrong with it."""
    argv = shlex.split(line)
    if argv[0] == "make":
        targets = re.findall(r"^([\w\-.]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        missing = [t for t in argv[1:] if "=" not in t and t not in targets]
        return f"no Makefile target {missing}" if missing else ""
    rest = argv[1:]
    if rest[0] != "-m":  # python benchmarks/X.py
        return "" if (ROOT / rest[0]).is_file() else f"no script {rest[0]}"
    module, args = rest[1], rest[2:]
    if module.startswith("benchmarks."):
        return "" if (ROOT / (module.replace(".", "/") + ".py")).is_file() else f"no script {module}"
    original = cli.Parser.parse

    def parse_and_stop(self, argv, defer_config=False):
        parsed = original(self, argv, defer_config)
        if defer_config and self.with_config:
            from lm.config import apply_overrides

            apply_overrides(parsed.config_base, parsed.config_overrides)
        raise _Parsed

    monkeypatch.setattr(cli.Parser, "parse", parse_and_stop)
    monkeypatch.chdir(ROOT)  # configs/ paths as the pages give them
    try:
        importlib.import_module(module).main(args)
    except _Parsed:
        return ""
    except UserError as e:
        return str(e)
    return "its command did not parse its arguments"


@pytest.mark.parametrize("line", list(cases()))
def test_a_documented_command_parses(line, monkeypatch):
    assert not (problem := check(line, monkeypatch)), f"{line}: {problem}"


@pytest.mark.parametrize("line, fragment", [
    (".venv/bin/python -m lm.train --config=configs/tiny.py --workdir=runs/t --config.train.stepz=3", "stepz"),
    (".venv/bin/python -m lm.plan --config=configs/llama_8b.py --gpus=8 --gpuz=8", "--gpuz"),
    (".venv/bin/python -m lm.layout --config=configs/no_such_recipe.py", "no_such_recipe"),
    ("make trian", "trian"),
    (".venv/bin/python benchmarks/no_such.py", "no_such"),
])
def test_a_stale_command_is_caught(line, fragment, monkeypatch):
    assert fragment in check(line, monkeypatch)
