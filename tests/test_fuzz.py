"""Property-based fuzzing of every input boundary: random overrides (keys, values, types) through
the command-line parser, validation, the typed spec and the mesh checks; random bytes as a
recipe, a tokenizer and a corpus. Either the input is accepted or a one-line user error is
raised (`UserError` / `ShardingError`); any other exception is a bug and fails the test.

Profiles: `ci` (the default: 300 cases per test, a few seconds) and `slow` (4,000 per test, set
MESHLM_FUZZ_PROFILE=slow; show what was tried with --hypothesis-show-statistics). While it was
written the slow profile ran 4,000 override cases (about 2% accepted, 97% refused with a
UserError, 0.4% with a ShardingError) and 4,000 byte strings per input kind. It found two
defects, both fixed where the input enters: an override key holding a newline echoed into a
two-line error; `--config.KEY=None` for a key with no "unset" meaning passed the type check and
ended in a TypeError traceback inside validation. The other boundary checks (non-finite and
out-of-range numbers, recipe files that are not UTF-8 / not Python / raise / return the wrong
type, tokenizer files the library cannot parse) were written first, from reading the code;
the fuzzer found nothing further in them.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_collections
import pytest
from conftest import ROOT
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import sharding
from lm.cli import Parser
from lm.config import UserError, default_config
from lm.data import corpus as lm_data
from lm.data.sources import corpus_files
from lm.data.tokenize import prepare_store
from lm.data.tokenizer import ByteTokenizer, tokenizer_for
from lm.program.mesh_checks import check_batch_split
from lm.program.spec import RunSpec
from lm.recipe import load_file

settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("MESHLM_FUZZ_PROFILE", "ci"))

USER_ERRORS = (UserError, sharding.ShardingError)


def _keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for key, value in c.items():
        out += _keys(value, f"{prefix}{key}.") if isinstance(value, ml_collections.ConfigDict) else [f"{prefix}{key}"]
    return out


KEYS = _keys(default_config())
# Values as a user types them: numbers of every kind, words, literals, and the edges.
EDGES = ["nan", "inf", "-inf", "1e400", "-1", "0", "0.0", "1", "2", "-0", "None", "True", "False", "()", "[]", "{}",
         "(('embed', 'fsdp'),)", "(('embed', 'nope'),)", "((1, 2),)", "byte", "bpe", "auto", "dynamic", "delayed", "0,-1", "7,x", ""]
VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.integers(min_value=-(2**40), max_value=2**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
OVERRIDES = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=15)), VALUES, max_size=4)


def preflight(argv: list[str]) -> None:
    """What a command does with its arguments before any data or compilation: parse the command
    line, validate and lock the config, parse the spec (tokenizer vocabulary included), build the
    mesh on this process's 8 devices and check the batch split."""
    args = Parser(prog="fuzz").parse(argv)
    spec = RunSpec.parse(args.config, lm_data.nominal_vocab_size(args.config.data))
    check_batch_split(spec, sharding.make_mesh(spec.mesh, jax.devices()))


@given(OVERRIDES)
def test_random_overrides_are_accepted_or_a_user_error(overrides):
    argv = [f"--config={ROOT}/configs/tiny.py", *(f"--config.{k}={v}" for k, v in overrides.items())]
    try:
        preflight(argv)
        event("accepted")
    except USER_ERRORS as e:
        event(f"refused: {type(e).__name__}")
        assert str(e) and "\n" not in str(e).strip(), str(e)  # one line


@contextlib.contextmanager
def _written(data: bytes, name: str) -> Iterator[Path]:
    """`data` in a file `name`, in a directory removed after the case (300 cases per test)."""
    with tempfile.TemporaryDirectory(prefix="meshlm-fuzz-") as directory:
        path = Path(directory) / name
        path.write_bytes(data)
        yield path


BYTES = st.one_of(st.binary(max_size=600), st.text(max_size=300).map(str.encode))


@pytest.mark.filterwarnings("ignore::SyntaxWarning")  # random source such as `x is 1` warns as it compiles
@given(BYTES)
def test_random_bytes_as_a_recipe(data):
    with _written(data, "recipe.py") as path:
        try:
            c = load_file(str(path))
            assert isinstance(c, ml_collections.ConfigDict)
        except UserError as e:
            assert "\n" not in str(e).strip()


@given(BYTES)
def test_random_bytes_as_a_tokenizer(data):
    with _written(data, "tokenizer.json") as path:
        try:
            assert tokenizer_for(ml_collections.ConfigDict({"tokenizer": str(path)}), None).vocab_size >= 1
        except UserError as e:
            assert "\n" not in str(e).strip()


@given(BYTES)
def test_random_bytes_as_a_corpus(data):
    with _written(data, "corpus.txt") as path:
        try:
            store = prepare_store(corpus_files(str(path)), ByteTokenizer(), path.parent / "store", workers=1, progress=False)
            lm_data.split(store, 8, 0.1, str(path))
        except UserError as e:
            assert "\n" not in str(e).strip()
