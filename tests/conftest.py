"""Every test sees 8 CPU devices; caches and runs go to temporary directories."""

import os

# The tests compile far more than they run: LLVM's optimisations off makes the suite's compiles
# about a quarter faster, in this process and in the commands tests run (`run_module`). The few
# tests that train for minutes do it in a fresh process, through `train_run`, where XLA optimises
# fully (at -O0 they ran twice as long).
# A collective waits for all 8 fake devices' threads; on 2 busy cores one can lag past XLA:CPU's
# 40 s limit, which aborts the process (seen in 1F1B tests while other compiles ran beside the
# suite). A true deadlock still aborts, after 10 minutes, with XLA's "stuck" warnings from 20 s.
# (`import lm` below sizes XLA:CPU's thread pools for the 8 devices: `lm._size_cpu_thread_pools`.)
# XLA:CPU's MLIR fusion emitters run their passes whatever the optimisation level: at -O0 the
# older emitters compile the suite's programs about a quarter faster (jaxlib 0.10, where it was
# measured; an unknown flag would abort XLA), though they are slower at -O2 (PERFORMANCE.md).
from jaxlib import version as _jaxlib  # noqa: E402  (jaxlib alone: no backend starts)

UNOPTIMIZED = "--xla_backend_optimization_level=0" + (" --xla_cpu_use_fusion_emitters=false" if _jaxlib.__version__.startswith("0.10.") else "")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    f" --xla_force_host_platform_device_count=8 {UNOPTIMIZED} --xla_cpu_collective_call_terminate_timeout_seconds=600"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The XLA GPU compiler (make gpu-compiler) on the path, for the deviceless GPU compile checks;
# the CPU stays the only backend this process runs on.
os.environ.setdefault("MESHLM_GPU_COMPILER", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import lm  # noqa: E402,F401  (before anything imports jax: lm/__init__ puts that compiler on the path)

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session", autouse=True)
def _caches(tmp_path_factory):
    """Token stores and compiled programs cached per test process. Every compile is kept (JAX keeps
    those over a second): the suite compiles many programs more than once (a one-device reference
    beside each mesh, the same small model in many tests), and a kept one loads in milliseconds."""
    import jax

    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def shakespeare() -> Path:
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} is absent (the tiny-shakespeare corpus lives in ../shared/data)")
    return SHAKESPEARE


def command_env(optimized: bool = False) -> dict:
    """The environment of a command a test runs: one CPU device (`lm.launch` sets its processes'
    count), compiled at -O0 unless `optimized`."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MESHLM_GPU_COMPILER", "PJRT_NPROC")}
    return env | ({} if optimized else {"XLA_FLAGS": UNOPTIMIZED})


def run_module(*args: str, env_extra: dict | None = None, timeout: int = 600, optimized: bool = False) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repo root with `command_env`, output captured."""
    env = command_env(optimized) | (env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_cli(capsys, main, *argv) -> subprocess.CompletedProcess:
    """`python -m ...` of `main` with `argv`, in-process (as `lm.cli.run` runs it: a traceback
    would fail the calling test as an exception): its exit code and output. `configs/` is the repo's."""
    from lm import cli

    code = 0
    try:
        cli.run(main, [a.replace("=configs/", f"={ROOT}/configs/", 1) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def recipe(name: str = "tiny", **overrides):
    """A locked config from configs/NAME.py with `group__key=value` overrides."""
    from lm.config import apply_overrides
    from lm.recipe import load_file

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


@pytest.fixture(scope="session")
def docs_corpus(small_corpus, tmp_path_factory) -> Path:
    """`small_corpus` cut into 600 documents of 50 to 450 characters (a directory of files):
    short enough that most training windows span several documents."""
    import numpy as np

    directory = tmp_path_factory.mktemp("docs")
    text, start = small_corpus.read_text(), 0
    lengths = np.random.default_rng(0).integers(50, 450, 600)
    for i, n in enumerate(lengths):
        (directory / f"{i:04d}.txt").write_text(text[start : start + n])
        start += n
    return directory


def metrics_rows(workdir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def train_run(workdir: Path, name: str, **overrides) -> list[dict]:
    """`python -m lm.train` of configs/NAME.py with `group__key=value` overrides into `workdir`,
    in a fresh process on one CPU device, fully optimised; its metrics rows."""
    flags = [f"--config.{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    result = run_module("lm.train", f"--config=configs/{name}.py", f"--workdir={workdir}", *flags, optimized=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics_rows(workdir)


def losses(workdir: Path) -> dict[int, float]:
    """Loss per step, the last logged value winning (a resumed run re-logs some steps)."""
    return {r["step"]: r["loss"] for r in metrics_rows(workdir) if "loss" in r}


# A 2-layer float32 model on a small real corpus: fast, and exact across meshes.
FAST = dict(
    model__num_layers=2, model__embed_dim=64, model__num_heads=4, model__num_kv_heads=2, model__mlp_dim=128,
    train__batch_size=8, train__seq_len=32, train__log_every=1, train__eval_every=10, train__eval_batches=2,
    optim__warmup_steps=5, precision__compute_dtype="float32",  # exact comparisons across meshes
)


def fast_config(corpus, **kw):
    return recipe("tiny", data__path=str(corpus), **{**FAST, **kw})


# Random tokens over a 256-id vocabulary; 8 heads / 4 KV heads and mlp 128 divide tensor=4.
SMALL = dict(
    model__num_layers=2, model__embed_dim=64, model__num_heads=8, model__num_kv_heads=4, model__mlp_dim=128,
    train__batch_size=16, train__seq_len=32, optim__warmup_steps=2, precision__compute_dtype="float32",
)
VOCAB = 256


def small_config(mesh: dict, **kw):
    """SMALL on `mesh` (unnamed axes 1, data 1 unless given)."""
    sizes = {"data": 1, **mesh}
    return recipe("tiny", **{**SMALL, **kw}, **{f"mesh__{k}": v for k, v in sizes.items()})


def compiled_train_step(program):
    """`program`'s train step compiled for an abstract batch of its config's shape: what the
    compiler makes of it (HLO, memory), nothing run."""
    import jax
    import numpy as np

    c = program.config
    batch = jax.ShapeDtypeStruct((c.train.batch_size, c.train.seq_len + 1), np.int32, sharding=program.batch_sharding)
    return program.train_step.lower(program.abstract_sharded_state(), batch).compile()


def step_and_gradients(program):
    """`program`'s train step, jitted, returning beside its result the (loss, gradients) it
    computed and applied: the model's backward traced and compiled once, not twice."""
    import sharding

    computed = program._grads

    def step(state, batch):
        seen = []
        program._grads = lambda *args, **kwargs: seen.append(computed(*args, **kwargs)) or seen[-1]
        try:
            return program._train_step(state, batch), (seen[0][0]["loss"], seen[0][1])
        finally:
            del program._grads

    return sharding.jit(step, program.mesh, program.rules)


def run_steps(c, devices=None, steps: int = 5, params_after: int | None = None):
    """Losses of `steps` train steps on fixed random tokens, and the final parameters (or those
    after step `params_after`) on the host."""
    import jax
    import numpy as np

    from lm.program.steps import setup

    program = setup(c, VOCAB, devices)
    rng = np.random.default_rng(0)
    state, out, params = program.init_state(0), [], None
    for step in range(1, steps + 1):
        tokens = rng.integers(0, VOCAB, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)
        state, metrics = program.train_step(state, program.global_batch(tokens))
        out.append(metrics["loss"])
        if step == params_after:
            params = jax.device_get(state.params)
    return np.asarray(jax.device_get(out)), params if params_after else jax.device_get(state.params)


# CI runs the suite twice (.ci/run): a test left unmarked that runs 10 s or more costs that on
# both stacks. Each run names those (timed here, under whatever else ran beside them).
SLOW_S = 10.0
_unmarked_slow: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and "slow" not in report.keywords and report.duration >= SLOW_S:
        _unmarked_slow.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _unmarked_slow:
        terminalreporter.section(f"not marked slow, {SLOW_S:.0f} s or more (pyproject.toml's markers)")
        for seconds, nodeid in sorted(_unmarked_slow, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
