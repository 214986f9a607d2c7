"""Every path a user names is checked where it enters: each command, each path argument, each
way to get it wrong gives exit 2 and one line naming the input, and an existing run is untouched."""

import hashlib
import json

import pytest
from conftest import FAST, ROOT, assert_one_line_error, fast_config, run_cli

from lm import bench as lm_bench
from lm import generate as lm_generate
from lm import launch as lm_launch
from lm import layout as lm_layout
from lm import numerics as lm_numerics
from lm import train as lm_train
from lm.training.loop import train

GARBAGE = bytes(range(256)) * 4  # not UTF-8, a NUL byte early: no text, no JSON, no Python
FAST_ARGS = [f"--config.{k.replace('__', '.')}={v}" for k, v in FAST.items()]


def assert_error(result, *fragments):
    assert_one_line_error(result, *fragments)
    assert result.returncode == 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_corpus):
    """A finished two-step run (config.json, tokenizer-free byte run, checkpoints, metrics)."""
    import jax

    work = tmp_path_factory.mktemp("run")
    train(fast_config(small_corpus, train__steps=2), work, jax.devices()[:1])
    return work


def snapshot(directory) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


def make(tmp_path, kind: str):
    """A path of one bad kind: missing, a directory, an empty file, a file of garbage bytes."""
    path = tmp_path / f"bad-{kind}"
    if kind == "dir":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(GARBAGE)
    return path


# The three reported tracebacks.

def test_a_recipe_with_a_syntax_error(tmp_path, capsys):
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text("from lm.config import default_config\n\ndef get_config(:\n    return default_config()\n")
    assert_error(run_cli(capsys, lm_train.main, f"--config={recipe}", f"--workdir={tmp_path / 'w'}"),
                 "my_recipe.py", "is not valid Python (line 3)")


def test_a_workdir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert_error(run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={tmp_path / 'notes.txt'}"),
                 "--workdir=", "notes.txt is a file")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_tokenizer_path_that_is_not_a_tokenizer(tmp_path, capsys, small_corpus):
    (tmp_path / "vocab.json").write_text('{"not": "a tokenizer"}')
    result = run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={tmp_path / 'w'}",
                     f"--config.data.path={small_corpus}", f"--config.data.tokenizer={tmp_path / 'vocab.json'}")
    assert_error(result, "vocab.json is not a Hugging Face tokenizer.json")
    assert not (tmp_path / "w" / "tokenizer.json").exists()  # nothing was copied in


# Every command and path argument, every bad kind.

RECIPE = {"missing": "does not exist", "dir": "is a directory", "empty": "defines no get_config()", "garbage": "is not UTF-8 text"}
DATA = {"missing": "does not exist", "dir": "is an empty directory", "empty": "holds no text", "garbage": "holds no text"}
TOKENIZER = {"missing": "is not 'byte', 'bpe' or an existing tokenizer.json", "dir": "is a directory, not a file",
             "empty": "is not a Hugging Face tokenizer.json", "garbage": "is not a Hugging Face tokenizer.json"}
RUN = {"missing": "does not exist", "dir": "is not a meshlm run (no config.json)", "empty": "is a file, not a run directory",
       "garbage": "is a file, not a run directory"}
NEW_RUN = {"empty": "is a file; pass a directory", "garbage": "is a file; pass a directory"}

CASES = [
    *[(lm_train.main, "--config", kind, text) for kind, text in RECIPE.items()],
    *[(lm_bench.main, "--config", kind, text) for kind, text in RECIPE.items()],
    *[(lm_layout.main, "--config", kind, text) for kind, text in RECIPE.items()],
    *[(lm_numerics.main, "--config", kind, text) for kind, text in RECIPE.items()],
    *[(lm_train.main, "--config.data.path", kind, text) for kind, text in DATA.items()],
    *[(lm_train.main, "--config.data.tokenizer", kind, text) for kind, text in TOKENIZER.items()],
    *[(lm_generate.main, "--workdir", kind, text) for kind, text in RUN.items()],
    *[(lm_train.main, "--workdir", kind, text) for kind, text in NEW_RUN.items()],
    *[(lm_numerics.main, "--workdir", kind, text) for kind, text in NEW_RUN.items()],
]


@pytest.mark.parametrize("main, flag, kind, fragment", CASES, ids=[f"{m.__module__}-{f}-{k}" for m, f, k, _ in CASES])
def test_every_path_argument(tmp_path, capsys, small_corpus, main, flag, kind, fragment):
    args = {"--config": "configs/tiny.py"}  # each command's good arguments, then the bad one
    if main in (lm_train.main, lm_numerics.main, lm_generate.main):
        args["--workdir"] = str(tmp_path / "work")
    if main is lm_train.main:
        args["--config.data.path"] = str(small_corpus)
    if main is lm_generate.main:
        del args["--config"]
    args[flag] = str(make(tmp_path, kind))
    assert_error(run_cli(capsys, main, *(f"{k}={v}" for k, v in args.items())), fragment)


def test_a_run_directory_is_left_byte_for_byte_as_it_was(tmp_path, capsys, run_dir, small_corpus):
    before = snapshot(run_dir)
    same = [f"--config={ROOT}/configs/tiny.py", f"--workdir={run_dir}", f"--config.data.path={small_corpus}", *FAST_ARGS]
    for bad, fragment in [
        (f"--config.data.path={make(tmp_path, 'garbage')}", "holds no text"),
        (f"--config.data.tokenizer={make(tmp_path, 'empty')}", "incompatible config (data.tokenizer: 'byte' saved"),
        (f"--config.data.path={tmp_path / 'missing'}", "does not exist"),
        ("--config.optim.lr=-1", "optim.lr must be positive"),
        ("--config.model.embed_dim=96", "incompatible config"),
    ]:
        assert_error(run_cli(capsys, lm_train.main, *same, bad), fragment)
    garbage_recipe = make(tmp_path, "garbage")
    assert_error(run_cli(capsys, lm_numerics.main, f"--workdir={run_dir}", f"--config={garbage_recipe}"), "is not UTF-8 text")
    assert_error(run_cli(capsys, lm_generate.main, f"--workdir={run_dir}", "--step=7"), "no checkpoint of step 7", "it holds steps 2")
    assert snapshot(run_dir) == before


def test_a_damaged_run_config_and_a_missing_program(tmp_path, capsys):
    (tmp_path / "config.json").write_bytes(GARBAGE)
    assert_error(run_cli(capsys, lm_generate.main, f"--workdir={tmp_path}"), "config.json is not a meshlm run config")
    (tmp_path / "config.json").write_text(json.dumps({"train": {"steps": "many"}}))
    assert_error(run_cli(capsys, lm_generate.main, f"--workdir={tmp_path}"), "config.json is not a meshlm run config")
    assert_error(run_cli(capsys, lm_launch.main, "--processes=2", "--", str(tmp_path / "no-such-program")), "not an executable program")


@pytest.mark.parametrize("key, value, fragment", [
    ("optim.lr", "0", "optim.lr must be positive"),
    ("optim.b2", "1.0", "optim.b2 must be in [0, 1)"),
    ("optim.eps", "1e400", "optim.eps must be a finite number"),
    ("optim.clip_norm", "-0.5", "optim.clip_norm must be zero or positive"),
    ("optim.min_lr_ratio", "2", "optim.min_lr_ratio must be in [0, 1]"),
    ("precision.loss_scale", "inf", "loss_scale='inf' is not one of"),
    ("data.val_fraction", "nan", "not a valid float"),
    ("train.steps", "1.5", "not a valid int"),
    ("train.gemm_fusion", "triton", "train.gemm_fusion='triton' is not one of operands, elementwise, auto"),
])
def test_numeric_overrides_out_of_range(tmp_path, capsys, key, value, fragment):
    assert_error(run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={tmp_path}", f"--config.{key}={value}"), fragment)
    assert not any(tmp_path.iterdir())


def test_recipes_that_fail_in_the_users_own_code(tmp_path, capsys):
    cases = {
        "raises.py": ("def get_config():\n    return 1 / 0\n", "raised ZeroDivisionError at line 2"),
        "wrong_type.py": ("def get_config():\n    return {'train': {}}\n", "returned dict, not an ml_collections.ConfigDict"),
        "unknown_key.py": ("from lm.config import default_config\ndef get_config():\n    c = default_config()\n    c.train.stepz = 3\n    return c\n",
                           "sets unknown key train.stepz; did you mean train.steps?"),
        "assigns_badly.py": ("from lm.config import default_config\ndef get_config():\n    c = default_config()\n    c.train.steps = 'ten'\n    return c\n",
                             "raised TypeError at line 4"),
        "bad_type.py": ("import ml_collections\nfrom lm.config import default_config\ndef get_config():\n    d = default_config().to_dict()\n"
                        "    d['train']['steps'] = 'ten'\n    return ml_collections.ConfigDict(d)\n", "train.steps='ten' is not a valid int"),
    }
    for name, (text, fragment) in cases.items():
        (tmp_path / name).write_text(text)
        assert_error(run_cli(capsys, lm_layout.main, f"--config={tmp_path / name}", "--no_compile"), name, fragment)
