"""Every test sees 8 CPU devices; caches and runs go to temporary directories."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def shakespeare() -> Path:
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} is absent (the tiny-shakespeare corpus lives in ../shared/data)")
    return SHAKESPEARE


def run_module(*args: str, env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repo root on one CPU device, output captured."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def recipe(name: str = "tiny", **overrides):
    """A locked config from configs/NAME.py with `group__key=value` overrides."""
    from lm.config import apply_overrides, load_file

    text = {k.replace("__", "."): v if isinstance(v, str) else repr(v) for k, v in overrides.items()}
    return apply_overrides(load_file(str(ROOT / "configs" / f"{name}.py")), text)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """About 300 KB of real text (Python sources of a few stdlib packages), one file."""
    import json as json_module
    import logging as logging_module

    sources = [Path(json_module.__file__).parent, Path(logging_module.__file__).parent]
    text = "\n".join(p.read_text() for d in sources for p in sorted(d.glob("*.py")))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text)
    return path


def metrics_rows(workdir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
