"""Every user mistake ends in one line naming the problem and the fix: non-zero exit, no traceback.

The commands run in this process (`lm.cli.run`, as `python -m` runs them: a traceback would fail
the test as an exception), on this process's 8 CPU devices; one runs as a real subprocess."""

import json

import pytest
from conftest import assert_one_line_error, run_cli, run_module

from lm import bench as lm_bench
from lm import calibrate as lm_calibrate
from lm import generate as lm_generate
from lm import launch as lm_launch
from lm import layout as lm_layout
from lm import prepare as lm_prepare
from lm import train as lm_train

TRAIN = ("--config=configs/tiny.py",)


def train_cli(capsys, *argv):
    return run_cli(capsys, lm_train.main, *TRAIN, *argv)


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--config.train.stepz=3"], ["unknown config key --config.train.stepz", "did you mean --config.train.steps"]),
        (["--config.data.path=/no/such/file.txt"], ["does not exist", "--config.data.path"]),
        (["--config.mesh.data=16"], ["needs 16 devices but 8 are available"]),
        (["--config.train.steps=abc"], ["not a valid int"]),
        (["--config.model.attention=cudnn"], ["model.attention=cudnn needs a GPU target (this program is for cpu)", "or xla"]),
        (["--config.model.loss_chunks=3"], ["model.loss_chunks=3 does not divide train.seq_len=128"]),
    ],
    ids=["unknown-key", "missing-data", "mesh-too-large", "bad-value", "cudnn-on-cpu", "loss-chunks"],
)
def test_bad_input(tmp_path, capsys, extra, fragments):
    assert_one_line_error(train_cli(capsys, f"--workdir={tmp_path / 'run'}", *extra), *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_empty_corpus_and_sequence_longer_than_corpus(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(train_cli(capsys, f"--workdir={tmp_path / 'a'}", f"--config.data.path={empty}"), "holds no text")
    short = tmp_path / "short.txt"
    short.write_text("to be or not to be " * 20)
    assert_one_line_error(train_cli(capsys, f"--workdir={tmp_path / 'b'}", f"--config.data.path={short}"), "train.seq_len=128 is longer than the corpus")


def test_batch_not_divisible_by_data_parallel_size(tmp_path, capsys):
    result = train_cli(capsys, f"--workdir={tmp_path}", "--config.train.batch_size=12")
    assert_one_line_error(result, "train.batch_size=12 is not divisible by the data-parallel size 8 (mesh data x expert x fsdp)")


def test_workdir_of_an_incompatible_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"embed_dim": 256}}))
    assert_one_line_error(train_cli(capsys, f"--workdir={tmp_path}"), "incompatible config (model.embed_dim: 256 saved, 128 now", "use a new --workdir")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_generate_without_a_run(tmp_path, capsys):
    assert_one_line_error(run_cli(capsys, lm_generate.main, f"--workdir={tmp_path}"), "not a meshlm run")


@pytest.mark.parametrize(
    "main, argv, fragment",
    [  # each was a traceback (or, for --devices=-2, a silent plan on one device) before
        (lm_bench.main, ["--config=configs/tiny.py", "--steps=0"], "time at least one step"),
        (lm_bench.main, ["--config=configs/tiny.py", "--compile_only", "--target=h100", "--devices=0"], "both must be at least 1"),
        (lm_layout.main, ["--config=configs/tiny.py", "--devices=-2"], "give a number of devices"),
        (lm_prepare.main, ["--config=configs/tiny.py", "--out={file}"], "is a file; pass a directory"),
        (lm_prepare.main, ["--config=configs/tiny.py", "--out={tmp}/store", "--workers=0"], "--workers=0: use 1"),
        (lm_layout.main, ["--config=configs/tiny.py", "--save_hlo={file}"], "--save_hlo={file} is a file"),  # after compiling
        (lm_bench.main, ["--config=configs/tiny.py", "--save_hlo={file}/hlo"], "which is a file"),
        (lm_calibrate.main, [], "nothing to do: give --memory"),  # it did nothing, silently
        (lm_calibrate.main, ["--kernels", "--platform=cpu"], "--kernels compiles for a GPU target (--target); --platform=cpu has no kernel model"),
    ],
    ids=["bench-no-steps", "bench-no-devices", "layout-negative-devices", "prepare-into-a-file", "prepare-no-workers",
         "layout-hlo-into-a-file", "bench-hlo-under-a-file", "calibrate-nothing", "calibrate-kernels-on-cpu"],
)
def test_tool_arguments_with_no_meaning(tmp_path, capsys, main, argv, fragment):
    (tmp_path / "file").write_text("mine")
    argv = [a.format(file=tmp_path / "file", tmp=tmp_path) for a in argv]
    assert_one_line_error(run_cli(capsys, main, *argv), fragment.format(file=tmp_path / "file"))
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and (tmp_path / "file").read_text() == "mine"


def test_launch_help_is_help(capsys):
    result = run_cli(capsys, lm_launch.main, "--help")
    assert result.returncode == 0 and "--devices_per_process" in result.stdout


def test_bench_prints_json_last_and_profiles_where_the_step_spends_its_time(tmp_path):
    result = run_module("lm.bench", "--config=configs/tiny.py", "--steps=2", "--warmup=1", "--config.train.batch_size=4",
                        f"--profile={tmp_path / 'trace'}")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("step_time_s", "tokens_per_sec", "flops_per_token", "mfu", "peak_flops", "peak_flops_source", "peak_memory_bytes"):
        assert key in report
    assert report["tokens_per_sec"] > 0 and 0 < report["mfu"] < 1 and report["peak_flops_source"].startswith("measured")
    # Beside the run's own measured peak, the best this machine has measured: never a higher MFU.
    assert report["reference_peak_flops"] >= report["peak_flops"] and report["mfu_at_reference_peak"] <= report["mfu"]
    assert report["pipeline"] is None and report["remat"] == "none" and isinstance(report["cpu_bf16_units"], bool)
    assert "final_loss" not in report and "synthetic_batches_loss" in report
    # The profile: XLA:CPU's thunks (no device here), attributed to the step's instructions.
    p = report["profile"]
    assert p["source"] == "host" and p["steps"] == 2 and list((tmp_path / "trace").glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert p["by_kind_ms_per_step"]["gemm"] > 0 and p["by_kind_ms_per_step"]["elementwise"] > 0
    assert sum(p["by_kind_ms_per_step"].values()) == pytest.approx(p["kernel_ms_per_step"], abs=0.01)
    assert p["top"] and all(row["ms_per_step"] > 0 for row in p["top"])
