"""Recipe files: a user's Python file whose `get_config()` returns a config, run and checked
against the schema (`lm.config`) where it enters."""

from __future__ import annotations

from pathlib import Path

import ml_collections

from lm.config import UserError, apply_overrides, assign, default_config


def load_file(path: str) -> ml_collections.ConfigDict:
    """The config returned by `get_config()` in a recipe file, its keys checked against the schema.

    The recipe is the user's own code: an error raised while it runs (a syntax error, an
    exception in `get_config`) is reported as one line naming the file and line, not a traceback.
    """
    import importlib.util
    import traceback

    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise UserError(f"config file {path!r} {what}; pick one in configs/ (e.g. --config=configs/tiny.py)")
    try:
        source = p.read_bytes().decode("utf-8")
        code = compile(source, str(p), "exec")
    except UnicodeDecodeError:
        raise UserError(f"config file {path!r} is not UTF-8 text; a recipe is a Python file defining get_config()") from None
    except (SyntaxError, ValueError) as e:  # ValueError: source with null bytes
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise UserError(f"config file {path!r} is not valid Python{where}: {getattr(e, 'msg', e)}") from None
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"meshlm_config_{p.stem}", loader=None))
    module.__file__ = str(p)  # a recipe may build on another beside it: load_file(Path(__file__).with_name(...))
    try:
        exec(code, module.__dict__)  # noqa: S102 - the user's recipe, run as Python
        get_config = module.__dict__.get("get_config")
        if not callable(get_config):
            raise UserError(f"config file {path!r} defines no get_config(); a recipe returns lm.config.default_config() changed")
        c = get_config()
    except UserError:
        raise
    except Exception as e:  # the user's code failed: say where, in their file
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(p)]
        where = f" at line {frames[-1].lineno}" if frames else ""
        raise UserError(f"config file {path!r} raised {type(e).__name__}{where}: {e}") from None
    if not isinstance(c, ml_collections.ConfigDict):
        raise UserError(f"config file {path!r}: get_config() returned {type(c).__name__}, not an ml_collections.ConfigDict (start from lm.config.default_config())")
    return _onto_schema(c, default_config(), str(path))


def _onto_schema(c, schema: ml_collections.ConfigDict, source: str, prefix: str = "") -> ml_collections.ConfigDict:
    """`c`'s values written onto the (type-safe) schema: a recipe can neither invent keys meshlm
    would ignore nor give a key a value of the wrong type."""
    import difflib

    for key in c.keys():
        if key not in schema:
            close = difflib.get_close_matches(key, list(schema.keys()), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise UserError(f"config file {source!r} sets unknown key {prefix}{key}{hint}")
        if isinstance(schema[key], ml_collections.ConfigDict):
            if not isinstance(c[key], (ml_collections.ConfigDict, dict)):
                raise UserError(f"config file {source!r}: {prefix}{key} must be a group of keys, got {c[key]!r}")
            _onto_schema(c[key], schema[key], source, f"{prefix}{key}.")
            continue
        assign(schema, key, c[key], f"config file {source!r}: {prefix}{key}={c[key]!r}")
    return schema


def load(path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """A recipe file with dotted-key overrides, validated and locked: `load("configs/tiny.py", {"train.steps": 50})`."""
    return apply_overrides(load_file(path), overrides or {})
